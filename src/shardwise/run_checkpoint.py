"""Checkpoints of a training run that resume it exactly, on the same ranks.

Every `train.checkpoint_every` steps each rank saves everything its next step depends on: its
model's and optimizer's `state_dict()` (the strategy's whole training state: shards, moments,
loss scale, codec residuals, counters), the LR scheduler, the step and its random generators
(torch, CUDA, Python, NumPy). The data position follows from the step: each step consumes one
batch of this rank's shard, in a seeded order.

Layout: `RUN_DIR/checkpoints/step-000000030/` with `rank{r}.safetensors` (tensors) and
`rank{r}.json` (everything else) per rank, and `manifest.json` (step, world size, strategy,
SHA-256 of every file). The files are written into a hidden temporary directory, fsynced, the
manifest last, and the directory is renamed into place: a checkpoint directory either is
complete or does not exist, and a kill during a save leaves the previous one intact. The newest
`train.keep_checkpoints` are kept. Nothing is unpickled: tensors come from safetensors, the rest
from JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from shardwise import comm
from shardwise.checkpoint import sha256_file
from shardwise.strategies.base import DistributedModel

FORMAT = "shardwise-run-checkpoint-v1"
PREFIX = "step-"


class RunCheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- one rank's state as tensors + JSON ----------------------------------------------------------
def _split(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` with every tensor moved into `tensors` (replaced by {"tensor": key})."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": prefix}
    if isinstance(value, dict):
        return {"dict": [[k, _split(v, f"{prefix}/{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [_split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"cannot checkpoint a {type(value).__name__} at {prefix}")


def _join(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `_split`."""
    ((kind, value),) = node.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {k: _join(v, tensors) for k, v in value}
    if kind in ("list", "tuple"):
        items = [_join(v, tensors) for v in value]
        return tuple(items) if kind == "tuple" else items
    return value


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_state(model: DistributedModel, optimizer, scheduler, step: int) -> dict[str, Any]:
    numpy_state = list(np.random.get_state())
    numpy_state[1] = numpy_state[1].tolist()  # a uint32 array: JSON's list of ints
    rng = {**rng_state(), "numpy": numpy_state}
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng,
    }


# ---- save ----------------------------------------------------------------------------------------
def save(
    run_dir: Path, step: int, model: DistributedModel, optimizer, scheduler, keep: int
) -> Path:
    """Collective: every rank writes its state, rank 0 the manifest, then renames into place."""
    rt = model.runtime
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"{PREFIX}{step:09d}", root / f".{PREFIX}{step:09d}.tmp"
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
        tmp.mkdir(parents=True)
    comm.barrier(rt.group)
    tensors: dict[str, torch.Tensor] = {}
    meta = _split(rank_state(model, optimizer, scheduler, step), "s", tensors)
    save_file(tensors, str(tmp / f"rank{rt.rank}.safetensors"))
    (tmp / f"rank{rt.rank}.json").write_text(json.dumps(meta))
    for name in (f"rank{rt.rank}.safetensors", f"rank{rt.rank}.json"):
        _fsync_path(tmp / name)
    comm.barrier(rt.group)
    if rt.is_main:
        files = [f"rank{r}.{ext}" for r in range(rt.world_size) for ext in ("safetensors", "json")]
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": rt.world_size,
            "strategy": model.checkpoint_name(),
            "sha256": {name: sha256_file(tmp / name) for name in files},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        _fsync_path(tmp / "manifest.json")
        _fsync_path(tmp)
        shutil.rmtree(final, ignore_errors=True)  # (a checkpoint of this step from a dead attempt)
        os.replace(tmp, final)
        _fsync_path(root)
        for old in complete(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier(rt.group)
    return final


# ---- find and load -------------------------------------------------------------------------------
def complete(root: Path) -> list[Path]:
    """Checkpoint directories with a manifest, oldest first (temporary ones are not)."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "manifest.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def _check(directory: Path, world_size: int, strategy: str) -> dict[str, Any]:
    """The manifest, after every file's checksum and the run's shape were checked."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        files, step = manifest["sha256"], int(manifest["step"])
        saved_world, saved_strategy = int(manifest["world_size"]), manifest["strategy"]
    except (ValueError, KeyError, TypeError) as e:
        raise RunCheckpointError(f"{directory / 'manifest.json'}: malformed ({e})") from None
    if manifest.get("format") != FORMAT or not isinstance(files, dict):
        raise RunCheckpointError(f"{directory / 'manifest.json'}: not a run checkpoint")
    if saved_world != world_size or saved_strategy != strategy:
        raise RunCheckpointError(
            f"{directory}: saved by {saved_strategy} on {saved_world} ranks, "
            f"this run is {strategy} on {world_size}"
        )
    for name, expected in files.items():
        path = directory / name
        if Path(name).name != name or not path.is_file() or sha256_file(path) != expected:
            raise RunCheckpointError(f"checkpoint file missing or corrupt (checksum): {path}")
    return {"step": step}


def newest(run_dir: Path, world_size: int, strategy: str) -> tuple[Path, int] | None:
    """The newest checkpoint this run can resume from; broken ones are skipped, each with a
    one-line warning naming the file."""
    for directory in reversed(complete(Path(run_dir) / "checkpoints")):
        try:
            return directory, _check(directory, world_size, strategy)["step"]
        except RunCheckpointError as e:
            print(f"shardwise: skipping a checkpoint: {e}", flush=True)
    return None


def load(directory: Path, model: DistributedModel, optimizer, scheduler) -> int:
    """Restore this rank's state from a checkpoint `newest` returned; returns its step."""
    rank = model.runtime.rank
    tensors = load_file(str(directory / f"rank{rank}.safetensors"))
    state = _join(json.loads((directory / f"rank{rank}.json").read_text()), tensors)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])
