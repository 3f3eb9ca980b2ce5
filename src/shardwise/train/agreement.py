"""What every rank must agree on after a step, in one tiny all-reduce: the loss averaged over the
global batch, which ranks were sent a signal to stop, which saw a non-finite value, and whether
replacements wait to join (an elastic job's rank 0 asks the store)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from shardwise.faults.nonfinite import bad_ranks_of, local_slot


class Agreement(NamedTuple):
    loss: float  # mean over the global batch (of the ranks whose loss is finite)
    stopped_by: dict[int, int]  # rank -> the signal it was sent
    bad_ranks: dict[int, str]  # rank -> 'loss' or 'gradient' (the update is skipped)
    joiners: int = 0  # replacements waiting to join


def agree_step(
    rt,
    local_loss: torch.Tensor,
    count: int,
    grads_finite: bool,
    stop_signal: int,
    reduce: Callable[[torch.Tensor], None],
    joiners: int = 0,
) -> Agreement:
    """After backward: `count` is what this rank's loss is a mean over (samples or tokens);
    `reduce` the all-reduce (a fault may wrap it); `joiners`: replacements this rank saw
    waiting (rank 0 alone looks)."""
    value = local_loss.item()
    finite = math.isfinite(value)
    t = torch.zeros(4 + rt.world_size, dtype=torch.float64, device=rt.device)
    t[0], t[1] = value * count if finite else 0.0, count if finite else 0
    t[2] = stop_signal > 0  # (summed: how many ranks were sent one)
    t[3] = joiners
    # Each rank's own slot: its non-finite flag (0, 1 or 2: `bad_ranks_of`) plus 4 x the
    # signal it was sent (a whole number far below 2**53: exact in float64).
    t[4 + rt.rank] = local_slot(finite, grads_finite) + 4 * stop_signal
    reduce(t)
    loss = (t[0] / t[1]).item() if t[1] > 0 else float("nan")
    slots = [round(f) for f in t[4:].tolist()]
    stopped_by = signalled(slots, 4) if t[2] > 0 else {}
    return Agreement(loss, stopped_by, bad_ranks_of(slots), round(t[3].item()))


def agree_round(
    rt, loss_sum: float, samples: int, stop_signal: int, reduce: Callable[[torch.Tensor], None]
) -> tuple[float, int, dict[int, int]]:
    """After a work-queue round: the loss over every sample of the round, how many samples the
    ranks trained on, and who was sent a signal."""
    totals = torch.zeros(2 + rt.world_size, dtype=torch.float64, device=rt.device)
    totals[0], totals[1] = loss_sum, samples
    totals[2 + rt.rank] = stop_signal  # (each rank's slot: the signal it was sent)
    reduce(totals)
    slots = [round(f) for f in totals[2:].tolist()]
    return (totals[0] / totals[1]).item(), int(totals[1].item()), signalled(slots, 1)


def signalled(slots: list[int], unit: int) -> dict[int, int]:
    """rank -> the signal it was sent, from each rank's slot of an agreement (signal x unit)."""
    return {r: f // unit for r, f in enumerate(slots) if f // unit}
