"""Gradient accumulation: one optimizer step over K micro-batches, communicating once.

A rank's batch of the step is cut along its first dimension into K micro-batches (as equal as
they go: 5 samples into 2 are 3 and 2). Each runs forward and backward in turn, and the
gradients add up in place; only the last backward synchronises. The update is the one the
whole batch would give, because each micro-batch's loss is weighed by its share of the rank's
batch: micro-batch i holds n_i of the rank's n samples (or real target tokens, for a per-token
loss), its loss is a mean over those n_i, so Σ_i (n_i / n) ∇loss_i is the gradient of the
rank's mean loss, whatever the sizes. The strategy then weighs the rank by n of the step's N
(`batch_share.py`), declared once, before the first backward: the update is the mean over the
global batch, as without accumulation.

What "only the last backward synchronises" means is the strategy's: a model whose backward
reduces gradients (DDP, ZeRO 1-3, a mesh's data axis) has `no_sync()`, and the micro-batches
before the last run inside it. One whose backward sends no gradient (tensor parallel: its
all-reduces carry activations, needed by every micro-batch; local SGD, gossip, adaptive and the
parameter server's worker, which meet after the optimizer step) simply accumulates. A pipeline
refuses: its schedule already accumulates over `microbatches`, so K more is `microbatches * K`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from shardwise.arguments import whole_number
from shardwise.strategies.base import DistributedModel, LossFn
from shardwise.strategies.batch_share import batch_samples

Count = Callable[[Any], int]  # a (micro-)batch's samples, from its targets


def check_accumulate(micro_batches: int, batch_sizes: list[int] | None = None) -> None:
    """`micro_batches` is a whole number >= 1 and every rank's batch (`batch_sizes`, where known)
    splits into that many micro-batches of at least one sample; else one-line ValueError."""
    whole_number("accumulate", micro_batches, least=1)
    for rank, size in enumerate(batch_sizes or []):
        if size < micro_batches:
            raise ValueError(
                f"accumulate={micro_batches}: data-parallel rank {rank}'s batch of {size} samples "
                f"cannot be split into {micro_batches} micro-batches (batch sizes "
                f"{batch_sizes}): lower accumulate or raise the batch size"
            )


def accumulated_step(
    model: DistributedModel,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    micro_batches: int,
    count: Count | None = None,
    total: int | None = None,
) -> torch.Tensor:
    """Forward and backward of the batch in `micro_batches` pieces, gradients synchronised
    once; returns the batch's loss (the micro-batches' losses weighed by their samples).
    `count(targets)`: a piece's samples (default: its first dimension; e.g. its real tokens);
    `total`: the step's over every replica (None: summed by the strategy)."""
    check_accumulate(micro_batches)
    pieces = split_batch(inputs, targets, micro_batches)
    counts = [batch_samples(x) if count is None else count(y) for x, y in pieces]
    whole = sum(counts)
    if whole == 0:
        raise ValueError("accumulate: the batch holds no samples to train on")
    loss_of = model.adapt_loss(loss_fn)  # (tensor parallel's: from vocabulary slices)
    # This rank's whole batch, declared once for the synchronising backward, before the first:
    # a SyncBatchNorm's backward in every micro-batch weighs the ranks by it too.
    model.declare_batch(whole, total)
    losses = []
    for i, ((x, y), n) in enumerate(zip(pieces, counts, strict=True)):
        last = i == micro_batches - 1
        with contextlib.nullcontext() if last else local_gradients(model):
            part = loss_of(model(x), y) * (n / whole)
            if n == 0:  # (a mean over no token is NaN: a piece of padding weighs nothing)
                part = part.nan_to_num(0.0, 0.0, 0.0)
            part.backward()
        losses.append(part.detach())
    return sum(losses)


def local_gradients(model: DistributedModel) -> contextlib.AbstractContextManager[None]:
    """The backward passes inside keep their gradients local: the strategy's `no_sync()`, or
    nothing to hold back where its backward sends no gradient. A pipeline's `no_sync` refuses
    (one line): its schedule accumulates over its own micro-batches."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


def split_batch(inputs: Any, targets: Any, parts: int) -> list[tuple[Any, Any]]:
    """(inputs, targets) cut along the first dimension into `parts` pieces as equal as they go
    (the first ones one sample larger); a tensor, or a dict, list or tuple of them."""
    n = batch_samples(inputs)
    if n < parts:
        raise ValueError(
            f"accumulate={parts}: a batch of {n} samples cannot be split into {parts} "
            "micro-batches: lower accumulate or raise the batch size"
        )
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    cut_inputs, cut_targets = _cut(inputs, sizes, n), _cut(targets, sizes, n)
    return list(zip(cut_inputs, cut_targets, strict=True))


def _cut(batch: Any, sizes: list[int], n: int) -> list[Any]:
    if batch is None:
        return [None] * len(sizes)
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] != n:
            raise ValueError(
                f"accumulate: cannot split a tensor of shape {tuple(batch.shape)} into "
                f"micro-batches: every tensor of the batch needs its {n} samples first"
            )
        return list(batch.split(sizes))
    if isinstance(batch, dict):
        columns = {key: _cut(value, sizes, n) for key, value in batch.items()}
        return [{key: parts[i] for key, parts in columns.items()} for i in range(len(sizes))]
    if isinstance(batch, (list, tuple)):
        columns = [_cut(value, sizes, n) for value in batch]
        return [type(batch)(parts[i] for parts in columns) for i in range(len(sizes))]
    raise ValueError(f"accumulate: cannot split a batch of {type(batch).__name__}")
