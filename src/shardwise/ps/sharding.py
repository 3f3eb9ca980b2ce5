"""Which server owns which parameters: equal bytes each.

A model's tensors differ in size by orders of magnitude (one 512x512 matrix against biases of
a few hundred values), so dealing whole tensors out, round-robin or even largest-first, can
leave one server with most of the bytes and so most of the traffic. As in ps-lite and BytePS,
the parameters are instead laid end to end as one flat vector (in the model's order) and cut
into S ranges of equal length: each server owns one range, whatever the tensors' sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm.flat import flatten, split_bounds


@dataclass(frozen=True)
class ShardPlan:
    """[start, end) of each server's range in the flat parameter vector."""

    total: int
    bounds: list[tuple[int, int]]

    @property
    def servers(self) -> int:
        return len(self.bounds)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b] for a, b in self.bounds]


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def plan_shards(model: nn.Module, servers: int) -> ShardPlan:
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    total = sum(p.numel() for p in trainable(model))
    return ShardPlan(total=total, bounds=split_bounds(total, servers))


def flat_values(tensors: list[torch.Tensor]) -> torch.Tensor:
    return flatten(tensors, torch.float32)


def signature(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the trainable parameters: what a worker and the servers must share."""
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


def describe_mismatch(
    expected: list[tuple[str, tuple[int, ...]]], got: list[tuple[str, tuple[int, ...]]]
) -> str | None:
    """One line naming the first difference between two signatures, or None if they match."""
    want, have = dict(expected), dict(got)
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    if missing:
        return f"parameter {missing[0]!r} is missing from the worker's model"
    if extra:
        return f"the worker's model has an unknown parameter {extra[0]!r}"
    for name, shape in want.items():
        if have[name] != shape:
            return (
                f"parameter {name!r} has shape {list(have[name])}, the servers hold {list(shape)}"
            )
    return None
