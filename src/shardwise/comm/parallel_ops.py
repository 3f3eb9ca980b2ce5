"""Autograd functions that communicate, for tensor parallel (Megatron-LM, Shoeybi et al. 2019).

    f = copy_to_parallel      identity forward, all-reduce of the input gradient backward
    g = reduce_from_parallel  all-reduce forward, identity backward

`gather_split` reassembles a tensor split over ranks (`Split` says how), and
`vocab_parallel_cross_entropy` / `vocab_parallel_argmax` work on logits split over the
vocabulary without ever gathering them (a max, a sum of exponentials and the target logit are
all-reduced: a few floats per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.comm.collectives import (
    ProcessGroup,
    all_gather_into_tensor,
    all_reduce,
    group_size,
)
from shardwise.comm.flat import split_bounds


# ---- f and g -----------------------------------------------------------
class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Autograd may hand the same gradient tensor to several consumers (residual branches):
        # reduce a copy, never it.
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


# A group of one rank holds the whole layer: f and g are the identity both ways (no autograd
# node, no copy, no call), so a tensor-parallel model at tp=1 runs as the plain one.
def copy_to_parallel(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromParallel.apply(x, group)


# ---- how a dimension is split ------------------------------------------------------------------
@dataclass
class Split:
    """Dimension `dim` of a full tensor, made of `chunks` equal blocks (q, k, v for a fused
    projection), each block cut into `parts` slices; rank r holds slice r of every block."""

    dim: int
    size: int
    parts: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.size % self.chunks:
            raise ValueError(f"size {self.size} is not {self.chunks} equal blocks")
        self.block = self.size // self.chunks
        self.bounds = split_bounds(self.block, self.parts)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        start, end = self.bounds[rank]
        blocks = full.split(self.block, dim=self.dim)
        return torch.cat([b.narrow(self.dim, start, end - start) for b in blocks], dim=self.dim)

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `take` over all ranks' pieces."""
        per_rank = [p.split(p.shape[self.dim] // self.chunks, dim=self.dim) for p in pieces]
        blocks = [torch.cat([r[c] for r in per_rank], dim=self.dim) for c in range(self.chunks)]
        return torch.cat(blocks, dim=self.dim)


def gather_split(local: torch.Tensor, split: Split, group: ProcessGroup | None) -> torch.Tensor:
    """All ranks' slices (possibly of unequal sizes) reassembled into the full tensor."""
    moved = local.detach().movedim(split.dim, 0).contiguous()
    longest = max(e - s for s, e in split.bounds) * split.chunks
    padded = torch.zeros((longest, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    padded[: moved.shape[0]] = moved
    out = moved.new_empty((split.parts * longest, *moved.shape[1:]))
    all_gather_into_tensor(out.view(-1), padded.view(-1), group=group)
    pieces = [
        out[r * longest : r * longest + (e - s) * split.chunks].movedim(0, split.dim)
        for r, (s, e) in enumerate(split.bounds)
    ]
    return split.assemble(pieces)


class _GatherFromParallel(torch.autograd.Function):
    """All ranks' slices of the last dimension, concatenated; backward keeps this rank's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: Split, rank: int, group) -> torch.Tensor:
        ctx.bounds = split.bounds[rank]
        return gather_split(x, split, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        start, end = ctx.bounds
        return grad[..., start:end], None, None, None


def gather_from_parallel(x: torch.Tensor, split: Split, rank: int, group) -> torch.Tensor:
    """All ranks' slices of `split.dim`, concatenated; backward keeps this rank's slice."""
    if group_size(group) == 1:
        return x  # (the one slice is the whole)
    return _GatherFromParallel.apply(x, split, rank, group)


# ---- loss and prediction from vocabulary-sharded logits ----------------------------------------
IGNORE_INDEX = -100  # F.cross_entropy's default: a padded target costs no loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, group):
        logits = logits.float()
        top = logits.max(dim=-1).values
        all_reduce(top, group=group, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)  # softmax is shift-invariant; this keeps exp finite
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        all_reduce(total, group=group)
        inside = (target >= start) & (target < start + logits.shape[-1])
        local = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        all_reduce(picked, group=group)  # exactly one rank contributes each target logit
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        softmax, local, inside = ctx.saved_tensors
        # d(-log softmax_target)/d logits = softmax - onehot(target); the onehot lives on one rank.
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -inside.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, start: int, group: ProcessGroup | None
) -> torch.Tensor:
    """Mean cross-entropy from this rank's vocabulary slice [start, start + V_local) of the
    logits (any leading shape); equals `F.cross_entropy` on the gathered logits, targets equal
    to `IGNORE_INDEX` (padding) left out of the mean as there."""
    flat, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if group_size(group) == 1:  # the whole vocabulary: torch's own fused loss
        return F.cross_entropy(flat.float(), target, ignore_index=IGNORE_INDEX)
    losses = _VocabParallelCrossEntropy.apply(flat, target, start, group)
    counts = target != IGNORE_INDEX  # an ignored target lies in no rank's slice: loss log(sum)
    return (losses * counts).sum() / counts.sum()


def vocab_parallel_argmax(logits: torch.Tensor, start: int, group) -> torch.Tensor:
    """argmax over the whole vocabulary from sharded logits (ties: the lowest index)."""
    values, index = logits.max(dim=-1)
    size = group_size(group)
    both = torch.stack([values.float(), (index + start).float()]).contiguous()
    out = torch.empty((size, *both.shape), dtype=both.dtype, device=both.device)
    all_gather_into_tensor(out.view(-1), both.view(-1), group=group)
    best = out[:, 0].argmax(dim=0, keepdim=True)  # first maximum = lowest rank = lowest index
    return out[:, 1].gather(0, best).squeeze(0).long()
