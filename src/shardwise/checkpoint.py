"""Checkpoints: the final model as one safetensors file, and sharded, reshardable training state.

Sharded checkpoints (`save_checkpoint` / `load_checkpoint`): each rank writes only what it holds
(`rank{r}.safetensors`: its slice of every flat unit of parameters and optimizer state), then
rank 0 writes `manifest.json` (layout: which parameters each unit holds, their shapes, shard
sizes; world size; SHA-256 of every file). Every file is written to a temporary name and renamed,
and the manifest comes last, so a directory with a manifest is complete. Loading rebuilds each
parameter's full tensor (and each optimizer-state tensor) from the shards, then the loading
strategy takes its own slices: the world size and even the strategy may differ (4 -> 2, ZeRO-3 ->
DDP). `export_checkpoint` turns a sharded checkpoint into plain fp32 weights, no process group.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shardwise import comm
from shardwise.strategies.base import DistributedModel

FORMAT = "shardwise-sharded-v1"


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint; the message says which file."""


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write to a temporary sibling, fsync, then rename: a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_model(directory: Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Save `state` (a full state dict) and `meta` under `directory`; returns the weights path."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    weights = directory / "model.safetensors"
    _atomic(weights, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _atomic(directory / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=2)))
    return weights


def load_model(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(
    model: DistributedModel, optimizer: torch.optim.Optimizer, directory: str | Path, step: int = 0
) -> None:
    """Collective: every rank writes its shard; rank 0 then writes the manifest.

    Beside the reshardable per-parameter state, each rank writes its strategy state (the
    model's `extra_state()`: codec residuals, counters, loss scale), restored when the
    checkpoint is loaded by the same strategy on as many ranks."""
    directory = Path(directory)
    rt = model.runtime
    layout, tensors = model.checkpoint_shard(optimizer)
    directory.mkdir(parents=True, exist_ok=True)
    if tensors is not None:  # strategies with replicated state write from rank 0 only
        _write_tensors(directory / f"rank{rt.rank}.safetensors", tensors)
    extra = model.extra_state()  # the same keys on every rank
    if extra:
        _write_tensors(directory / f"extra{rt.rank}.safetensors", extra)
    comm.barrier(rt.group)
    if rt.is_main:
        files = [f"rank{r}.safetensors" for r in range(layout["num_shards"])]
        extra_files = [f"extra{r}.safetensors" for r in range(rt.world_size)] if extra else []
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": rt.world_size,
            **layout,
            "sha256": {name: sha256_file(directory / name) for name in files},
            "strategy_state_sha256": {name: sha256_file(directory / name) for name in extra_files},
        }
        _atomic(directory / "manifest.json", lambda p: p.write_text(json.dumps(manifest)))
    comm.barrier(rt.group)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    _atomic(path, lambda p: save_file(cpu, str(p)))


def _verified(path: Path, expected: str) -> dict[str, torch.Tensor]:
    if not path.is_file() or sha256_file(path) != expected:
        raise CheckpointError(f"checkpoint file missing or corrupt (checksum): {path}")
    return load_file(str(path))


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise CheckpointError(f"not a complete shardwise checkpoint (no manifest): {directory}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt checkpoint manifest {path}: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


def read_full_state(directory: str | Path) -> tuple[dict, dict, int]:
    """Full per-parameter tensors: (params, optimizer state per parameter, step)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    shards = [_verified(directory / name, sha) for name, sha in manifest["sha256"].items()]
    params = {k.removeprefix("buffer/"): v for k, v in shards[0].items() if k.startswith("buffer/")}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for i, unit in enumerate(manifest["units"]):
        keys = {k.split("/", 1)[1] for k in shards[0] if k.startswith(f"unit{i}/")}
        for key in sorted(keys):
            pieces = [s[f"unit{i}/{key}"] for s in shards]
            if pieces[0].dim() == 0:  # a scalar (Adam's step): the same on every shard
                for name, _ in unit["params"]:
                    states.setdefault(name, {})[key] = pieces[0]
                continue
            flat = torch.cat(pieces)
            offset = 0
            for name, shape in unit["params"]:
                n = int(torch.Size(shape).numel())
                full = flat[offset : offset + n].view(shape).clone()
                offset += n
                if key == "param":
                    params[name] = full
                else:
                    states.setdefault(name, {})[key] = full
    return params, states, manifest["step"]


def load_checkpoint(
    model: DistributedModel, optimizer: torch.optim.Optimizer, directory: str | Path
) -> int:
    """Load a sharded checkpoint saved at any world size; returns its step."""
    params, states, step = read_full_state(directory)
    model.load_full_state(optimizer, params, states)
    _load_strategy_state(model, Path(directory))
    return step


def _load_strategy_state(model: DistributedModel, directory: Path) -> None:
    """This rank's strategy state, where the same strategy saved it on as many ranks; it
    cannot be resharded (a codec's residual is one rank's), so elsewhere it starts afresh."""
    manifest = read_manifest(directory)
    files = manifest.get("strategy_state_sha256", {})
    rt = model.runtime
    same = (
        manifest["strategy"] == model.checkpoint_name() and manifest["world_size"] == rt.world_size
    )
    if files and same:
        name = f"extra{rt.rank}.safetensors"
        model.load_extra_state(_verified(directory / name, files[name]))
    elif files and rt.is_main:
        print(
            f"shardwise: {directory}: strategy state of {manifest['strategy']} on "
            f"{manifest['world_size']} ranks not restored here (it starts afresh)",
            flush=True,
        )


def export_checkpoint(directory: str | Path, out: str | Path) -> Path:
    """Consolidate a checkpoint into one safetensors file of full fp32 weights."""
    directory = Path(directory)
    if (directory / "model.safetensors").is_file() and not (directory / "manifest.json").exists():
        weights = load_model(directory)  # a final checkpoint is already consolidated
    else:
        weights, _, _ = read_full_state(directory)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic(out, lambda p: save_file(weights, str(p), metadata={"format": "pt"}))
    return out
