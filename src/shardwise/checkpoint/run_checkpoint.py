"""Checkpoints of a training run that resume it exactly, on the same or another number of ranks.

Every `train.checkpoint_every` steps each rank saves everything its next step depends on: its
model's and optimizer's `state_dict()` (the strategy's whole training state: shards, moments,
loss scale, codec residuals, counters), the LR scheduler, the step, its random generators
(torch, CUDA, Python, NumPy) and the data position (epoch, seed, samples of the epoch consumed).
Strategies whose state reshards also write it in `reshardable.py`'s format, so that
the run can resume on another number of ranks.

Layout: `RUN_DIR/checkpoints/step-000000030/` with `rank{r}.safetensors` (tensors) and
`rank{r}.json` (everything else) per rank, `sharded/` (the reshardable part, with its own
manifest) and `manifest.json` (step, world size, strategy, SHA-256 of every file, and the job:
the model's parameter names and shapes, the optimizer, the strategy's section, which a resume
checks before it starts any rank). Saving (`run_saver.py`) copies the state (the only stall of
training) and writes it from a background thread: into a hidden temporary directory, fsynced,
the manifest last, and the directory is renamed into place. A checkpoint directory either is
complete or does not exist, and a kill during a save leaves the previous one intact. The newest
`train.keep_checkpoints` are kept. Nothing is unpickled: tensors come from safetensors, the rest
from JSON.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shardwise.checkpoint import state_tree
from shardwise.checkpoint.reshardable import (
    CheckpointError,
    check_optimizer,
    read_full_state,
    read_manifest,
    sha256_file,
)
from shardwise.strategies.base import EXTRA, DistributedModel, unprefixed

FORMAT = "shardwise-run-checkpoint-v2"
PREFIX = "step-"
MAX_WORLD = 2**20  # (ranks a manifest may name: each a file name listed)
SHARDED = "sharded"  # the subdirectory with the reshardable part, in reshardable.py's format


class RunCheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file."""


class JobMismatch(RunCheckpointError):
    """A whole checkpoint saved by another job (model, optimizer or strategy)."""


def job_signature(model: torch.nn.Module, optimizer: str, strategy: str) -> dict[str, Any]:
    """What a checkpoint records of the job that saved it, and what resuming it needs: the
    unsplit model's parameter names and shapes, the optimizer's name (`optim.name`) and the
    strategy's section (`strategy.name`)."""
    params = [[name, list(p.shape)] for name, p in model.named_parameters()]
    return {"model": params, "optimizer": optimizer, "strategy": strategy}


def job_mismatch(saved: Any, job: dict[str, Any]) -> str | None:
    """How `job` differs from the job a checkpoint recorded (None: it does not). A record that
    is malformed is a `RunCheckpointError`: a damaged checkpoint, which a resume falls back
    from, not another job's, which it refuses."""
    try:
        theirs = {str(name): [int(n) for n in shape] for name, shape in saved["model"]}
        their_optimizer, their_strategy = str(saved["optimizer"]), str(saved["strategy"])
    except (KeyError, TypeError, ValueError):
        raise RunCheckpointError("its record of the job is malformed") from None
    if their_strategy != job["strategy"]:
        return f"strategy {their_strategy!r} saved it, this config has {job['strategy']!r}"
    if their_optimizer != job["optimizer"]:
        return f"optimizer {their_optimizer!r} saved it, this config has {job['optimizer']!r}"
    mine = dict(job["model"])
    for name, shape in mine.items():
        if name not in theirs:
            return f"another model: it has no parameter {name} (this config's is {shape})"
        if theirs[name] != shape:
            return f"another model: its {name} is {theirs[name]}, this config's is {shape}"
    if extra := sorted(theirs.keys() - mine.keys()):
        return f"another model: this config's has no parameter {extra[0]}"
    return None


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
    python, numpy = _generator_states(state)
    torch.set_rng_state(state["torch"])
    random.setstate(python)
    np.random.set_state(numpy)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _generator_states(state: dict[str, Any]) -> tuple[tuple, tuple]:
    """Python's and numpy's generator states as their `setstate` takes them, each tried on a
    generator of its own first: a malformed one raises before any generator (or, called by
    `check_rank_state`, anything else) changes."""
    version, internal, gauss = state["python"]
    python = (version, tuple(internal), gauss)
    random.Random().setstate(python)
    name, keys, pos, has_gauss, cached = state["numpy"]
    numpy = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    np.random.RandomState().set_state(numpy)
    torch.Generator().set_state(state["torch"])
    return python, numpy


def check_rank_state(state: Any, scheduler) -> None:
    """What a rank's saved state must hold, checked before anything is restored from it (a
    refused checkpoint leaves the model as it was, where the model's and optimizer's own
    loads do not refuse it)."""
    if not isinstance(state, dict):
        raise ValueError(f"its rank state is a {type(state).__name__}, not a mapping")
    needed = ["model", "optimizer", "rng", "step", "data"] + (["scheduler"] if scheduler else [])
    if missing := [key for key in needed if key not in state]:
        raise ValueError(f"its rank state has no {missing[0]!r}")
    _generator_states(state["rng"])
    int(state["step"])


def remove_partial(run_dir: Path) -> None:
    """Drop what killed saves left (hidden temporary directories); before a job's first save."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for leftover in root.glob(f".{PREFIX}*.tmp*"):
            shutil.rmtree(leftover, ignore_errors=True)


# ---- find and load -------------------------------------------------------------------------------
def complete(root: Path) -> list[Path]:
    """Checkpoint directories with a manifest, oldest first (temporary ones are not)."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "manifest.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


@dataclass(frozen=True)
class Found:
    """A checkpoint this run can resume from."""

    directory: Path
    step: int
    world_size: int  # the world it was saved on; another one means resharding


def check(
    directory: Path, world_size: int, strategy: str | None, job: dict[str, Any] | None = None
) -> Found:
    """After every file's checksum and the run's shape were checked: its world size, and, where
    given, its strategy (the model's `checkpoint_name()`) and `job` (`job_signature`; a
    checkpoint older than that record is checked by loading it)."""
    path = directory / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        files, step = manifest["sha256"], manifest["step"]
        saved_world, saved_strategy = manifest["world_size"], manifest["strategy"]
        reshardable = manifest["reshardable"]
    except (ValueError, KeyError, TypeError) as e:
        raise RunCheckpointError(f"{path}: malformed ({e})") from None
    except RecursionError:  # (JSON nested deeper than Python parses)
        raise RunCheckpointError(f"{path}: malformed (nested too deep)") from None
    if manifest.get("format") != FORMAT or not isinstance(files, dict):
        raise RunCheckpointError(f"{path}: not a run checkpoint")
    if not all(isinstance(v, int) and v >= 0 for v in (step, saved_world)):
        raise RunCheckpointError(f"{path}: step and world_size must be whole numbers")
    if saved_world > MAX_WORLD:  # (its file names are listed next, one per rank)
        raise RunCheckpointError(f"{path}: world_size {saved_world} is past {MAX_WORLD}")
    expected = {f"rank{r}.{ext}" for r in range(saved_world) for ext in ("safetensors", "json")}
    if set(files) != expected:
        raise RunCheckpointError(f"{path}: lists {sorted(files)}, expected {sorted(expected)}")
    if job is not None and "job" in manifest:
        try:
            why = job_mismatch(manifest["job"], job)
        except RunCheckpointError as e:
            raise RunCheckpointError(f"{path}: malformed ({e})") from None
        if why:
            raise JobMismatch(f"{directory} was saved by another job: {why}")
    if strategy is not None and saved_strategy != strategy:
        raise RunCheckpointError(f"{directory}: saved by {saved_strategy}, this run is {strategy}")
    if saved_world != world_size and not reshardable:
        raise RunCheckpointError(
            f"{directory}: saved on {saved_world} ranks by a strategy whose state does not "
            f"reshard; this run has {world_size}"
        )
    for name, digest in files.items():
        if sha256_file(directory / name) != digest:
            raise RunCheckpointError(f"checkpoint file corrupt (checksum): {directory / name}")
    # (the checksums cover the rank files, not the manifest; a resume goes on from the step
    # the ranks saved, whatever the manifest says)
    if (saved := _saved_step(directory)) != step:
        raise RunCheckpointError(
            f"{directory}: its manifest says step {step}, its ranks' state step {saved} "
            "(an edited manifest)"
        )
    if saved_world != world_size:
        read_manifest(directory / SHARDED)  # its own files are checked when they are read
    return Found(directory, step, saved_world)


def _saved_step(directory: Path) -> Any:
    """The step rank 0 saved (its state tree's top-level `step`, read without its tensors)."""
    path = directory / "rank0.json"
    try:
        tree = json.loads(path.read_text())
        return dict(tree["dict"])["step"]["value"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise RunCheckpointError(f"{path}: malformed (no step)") from None


def newest(
    run_dir: Path,
    world_size: int,
    strategy: str,
    warn: bool = True,
    job: dict[str, Any] | None = None,
) -> Found | None:
    """The newest checkpoint this run can resume from; broken ones are skipped, each with a
    one-line warning naming the file (with `warn`)."""
    for directory in reversed(complete(Path(run_dir) / "checkpoints")):
        try:
            return check(directory, world_size, strategy, job)
        except (RunCheckpointError, CheckpointError, OSError) as e:
            if warn:
                print(f"shardwise: skipping a checkpoint: {e}", flush=True)
    return None


def resumable(run_dir: Path, world_size: int, job: dict[str, Any]) -> Found | None:
    """Before a resume starts any rank (nothing in `run_dir` is written): the checkpoint it will
    resume from, checked against `job` (`job_signature`) and its number of ranks; None where
    the run has none. A `RunCheckpointError` where it was saved by another job, or where none
    of the run's checkpoints can be resumed from (the first reason named)."""
    existing = complete(Path(run_dir) / "checkpoints")
    reasons = []
    for directory in reversed(existing):
        try:
            return check(directory, world_size, None, job)
        except JobMismatch:
            raise
        except (RunCheckpointError, CheckpointError, OSError) as e:
            reasons.append(str(e))  # a damaged one: the ranks fall back to the one before
    if existing:
        raise RunCheckpointError(
            f"none of the {len(existing)} checkpoints in {run_dir} can be resumed from "
            f"({reasons[0]}); move them away to start afresh"
        )
    return None


def _rank_state(directory: Path, rank: int) -> dict[str, Any]:
    tensors = load_file(str(directory / f"rank{rank}.safetensors"))
    return state_tree.join(json.loads((directory / f"rank{rank}.json").read_text()), tensors)


def load(found: Found, model: DistributedModel, optimizer, scheduler) -> dict[str, Any]:
    """Restore this rank's state; returns {"step", "data"} (the data position to go on from).

    On the world it was saved on, everything is restored exactly. On another one, the model
    and optimizer come from the reshardable part, the schedule, step and data position from
    rank 0's state, and what belongs to one rank alone (codec residuals, random generators of
    dropped ranks) starts afresh. A checkpoint that does not fit the model or optimizer (one
    older than the job record in its manifest) is a `RunCheckpointError`, in one line."""
    try:
        return _load(found, model, optimizer, scheduler)
    except (
        RuntimeError,
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        OverflowError,
        RecursionError,
        SafetensorError,  # (edited files whose checksums were edited to match)
    ) as e:
        # torch's messages list every missing key over several lines: one, cut short
        named = isinstance(e, (RuntimeError, ValueError))  # (a KeyError's is only the key)
        message = " ".join((str(e) if named else f"{type(e).__name__}: {e}").split())
        if len(message) > 300:
            message = message[:297] + "..."
        raise RunCheckpointError(
            f"{found.directory} does not fit this run's model or optimizer ({message})"
        ) from None


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict`, and a `ValueError` where the saved groups lack a setting
    this optimizer needs (another optimizer saved them: torch loads them, and the first step
    fails)."""
    needed = [set(group) for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keys in zip(optimizer.param_groups, needed, strict=True):
        if missing := sorted(keys - set(group)):
            raise ValueError(f"its optimizer has no {missing[0]!r}: another optimizer saved it")


def _load(found: Found, model: DistributedModel, optimizer, scheduler) -> dict[str, Any]:
    rank = model.runtime.rank
    if found.world_size == model.runtime.world_size:
        state = _rank_state(found.directory, rank)
        check_rank_state(state, scheduler)
        model.load_state_dict(state["model"])
        _load_optimizer(optimizer, state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        return {"step": int(state["step"]), "data": state["data"]}
    state = _rank_state(found.directory, min(rank, found.world_size - 1))
    check_rank_state(state, scheduler)
    check_optimizer(found.directory / SHARDED, optimizer)
    params, states, _ = read_full_state(found.directory / SHARDED)
    model.load_full_state(optimizer, params, states)
    # What every rank of the saved run held alike (counters, the loss scale), from the rank
    # state read: the rest of a strategy's state was one rank's own, and starts afresh.
    if shared := model.shared_extra_state(unprefixed(EXTRA, state["model"])):
        model.load_extra_state(shared)
    if scheduler is not None:
        load_schedule(scheduler, optimizer, state["scheduler"])
    if rank < found.world_size:
        set_rng_state(state["rng"])
    else:  # a rank the saved run did not have
        own_generators(int(state["step"]), rank)
    return {"step": int(state["step"]), "data": state["data"]}


def load_schedule(scheduler, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """The schedule's state, and its current rate in the optimizer's groups (where they were
    not restored with it: state resharded to another world). Its position is the saved one's,
    its base rates this job's: on another number of ranks, `optim.scale_lr` makes them for
    another global batch (every rate so far scales with its base: torch's schedules'
    multiply it)."""
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    saved_lrs = scheduler.base_lrs
    ratios = [new / old if old else 1.0 for new, old in zip(base_lrs, saved_lrs, strict=True)]
    scheduler.base_lrs = base_lrs
    scheduler._last_lr = [lr * r for lr, r in zip(scheduler.get_last_lr(), ratios, strict=True)]
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


def own_generators(step: int, rank: int) -> None:
    """Random generators of this rank's own, not a copy of another's: for a rank the saved
    state did not have (a resume on more ranks, an elastic job's replacement)."""
    seed = 1_000_003 * step + rank
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
