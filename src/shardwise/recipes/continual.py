"""Starting a run from another run's checkpoint, in the three ways users keep confusing:

    resume    the same run going on: model, optimizer, LR schedule, random generators and the
              data position as saved; the step count goes on from the checkpoint's
    continue  weights and optimizer state (Adam's moments and step count) from the checkpoint;
              a fresh LR schedule, data position and step count (new data, a new phase)
    finetune  weights only: a fresh optimizer, schedule, data position and step count

    model, opt = sw.prepare(build_model(), sw.ZeRO(stage=3))
    step, data = sw.start_from("runs/pretrain", model, opt, "continue", grow_vocab=True)

`resume` takes any checkpoint a run saved (exact on its own number of ranks, resharded on
others); `continue` and `finetune` read the checkpoint's reshardable full state, so any strategy
on any number of ranks may start from it (`finetune` takes a final `checkpoint/` as well). The
checkpoint is a run directory (its newest complete checkpoint) or one checkpoint's directory.

Vocabulary growth (`grow_vocab`): a parameter whose saved first dimension is smaller than the
model's, all else equal (an embedding, a tied or untied output layer, its bias), keeps its saved
rows and their optimizer moments bit for bit; new rows are drawn from a normal distribution with
the old rows' mean and covariance (Hewitt, 2021: new tokens start among the old ones, not at
the origin or far from it), a new bias entry is the old entries' mean, and the new rows'
moments are zero. The draw is seeded per tensor: every rank makes the same rows.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Literal

import torch

from shardwise.arguments import whole_number
from shardwise.checkpoint import run_checkpoint
from shardwise.checkpoint.reshardable import (
    check_optimizer,
    check_paired,
    full_weights,
    read_full_state,
)
from shardwise.checkpoint.run_checkpoint import SHARDED, Found, RunCheckpointError

Mode = Literal["resume", "continue", "finetune"]
MODES = ("resume", "continue", "finetune")


def start_from(
    checkpoint: str | Path,
    model,
    optimizer: torch.optim.Optimizer,
    mode: Mode,
    *,
    scheduler=None,
    grow_vocab: bool = False,
    seed: int = 0,
) -> tuple[int, dict[str, Any] | None]:
    """Load `checkpoint` into what `sw.prepare` returned, the `mode` way (every rank calls it
    alike). Returns the step to go on from and, for `resume`, the `extra` saved with it (the
    data position); (0, None) for the other two. A `RunCheckpointError` in one line where the
    checkpoint cannot start this model."""
    if mode not in MODES:
        raise ValueError(f"start mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_paired(model, optimizer)
    path = Path(checkpoint)
    if not path.exists():
        raise RunCheckpointError(f"start from {path}: no such checkpoint or run directory")
    if mode == "resume":
        if grow_vocab:
            raise ValueError("grow_vocab changes the model: 'continue' or 'finetune', not 'resume'")
        found = _run_checkpoint(path, model.runtime.world_size)
        restored = run_checkpoint.load(found, model, optimizer, scheduler)
        return restored["step"], restored["data"]
    shapes = model.full_shapes()
    if mode == "continue":
        found = _run_checkpoint(path, model.runtime.world_size)
        check_optimizer(found.directory / SHARDED, optimizer)
        params, states, _ = read_full_state(found.directory / SHARDED)
    else:
        params, states = _weights(path), {}
    params, states = fit_to(params, states, shapes, grow_vocab, seed, where=path)
    model.load_full_state(optimizer, params, states)
    return 0, None


def _run_checkpoint(path: Path, world_size: int) -> Found:
    """The checkpoint `path` names: a run directory's newest complete one, or itself."""
    candidates = run_checkpoint.complete(path / "checkpoints") or [path]
    directory = candidates[-1]
    if not (directory / "manifest.json").is_file():
        raise RunCheckpointError(
            f"start from {path}: not a run's checkpoint (no manifest.json); a final checkpoint "
            "holds weights only: start it with mode finetune"
        )
    return run_checkpoint.check(directory, world_size, None)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Full weights from a run directory (its newest checkpoint, else its final one), one
    checkpoint, or a final checkpoint."""
    if saved := run_checkpoint.complete(path / "checkpoints"):
        return full_weights(saved[-1])
    if (path / "checkpoint").is_dir():
        return full_weights(path / "checkpoint")
    return full_weights(path)


def fit_to(
    params: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    shapes: dict[str, torch.Size],
    grow_vocab: bool,
    seed: int,
    where: Path | str = "the checkpoint",
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The saved tensors checked against the model's names and shapes, grown where allowed."""
    missing = sorted(set(shapes) - set(params))
    if missing:
        raise RunCheckpointError(
            f"start from {where}: it has no {missing[0]!r} ({len(missing)} of the model's "
            "tensors missing): a checkpoint of another model"
        )
    params, states = dict(params), dict(states)
    for name in sorted(shapes):
        saved, wanted = params[name].shape, shapes[name]
        if saved == wanted:
            continue
        grows = len(saved) == len(wanted) >= 1 and saved[1:] == wanted[1:] and saved[0] < wanted[0]
        if not (grow_vocab and grows):
            hint = " (a larger vocabulary: grow_vocab: true)" if grows else ""
            raise RunCheckpointError(
                f"start from {where}: {name} is {tuple(saved)} there, {tuple(wanted)} in this "
                f"model{hint}"
            )
        # (a generator per tensor: a pipeline stage grows its own tensors as one process would)
        mixed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63  # (what manual_seed takes)
        generator = torch.Generator().manual_seed(mixed)
        params[name] = grow_rows(params[name], wanted[0], generator)
        states[name] = {
            key: _zero_rows(value, wanted[0]) if value.shape == saved else value
            for key, value in states.get(name, {}).items()
        }
    return params, states


def grow_rows(old: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """`old` with rows appended up to `rows`: drawn from N(mean, covariance) of the old rows
    (a vector's new entries: the old entries' mean). The old rows are the old tensor's bits."""
    if not isinstance(old, torch.Tensor):
        raise TypeError(f"grow_rows: old must be a tensor, got {type(old).__name__}")
    if old.dim() == 0 or old.shape[0] == 0:
        raise ValueError(f"grow_rows: needs rows to draw from, got a tensor of {tuple(old.shape)}")
    added = whole_number("grow_rows: rows", rows, least=old.shape[0]) - old.shape[0]
    flat = old.reshape(old.shape[0], -1).double()
    mean = flat.mean(0)
    if old.dim() == 1 or old.shape[0] < 2:
        new = mean.expand(added, -1)
    else:
        covariance = torch.cov(flat.T).reshape(flat.shape[1], flat.shape[1])
        # (a tiny ridge: old rows fewer than their width leave the covariance singular)
        ridge = 1e-8 * covariance.diagonal().mean().clamp_min(1e-30)
        factor = torch.linalg.cholesky(covariance + ridge * torch.eye(len(mean), dtype=flat.dtype))
        noise = torch.randn(added, flat.shape[1], generator=generator, dtype=flat.dtype)
        new = mean + noise @ factor.T
    return torch.cat([old, new.to(old.dtype).reshape(added, *old.shape[1:])])


def _zero_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    added = value.new_zeros(rows - value.shape[0], *value.shape[1:])
    return torch.cat([value, added])
