"""The `sw.*` calls of a training loop: `prepare` applies a strategy; the others forward to the
`DistributedModel` it returned (a plain module counts as one replica of itself)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.distributed import runtime
from shardwise.distributed.runtime import WATCHDOG_ENV, Runtime
from shardwise.distributed.same_everywhere import check_same_everywhere, describe_options
from shardwise.faults.watchdog import Watchdog
from shardwise.nn.meta_init import ParameterSource, buffers_to, has_meta_parameters
from shardwise.strategies.accumulation import accumulated_step, local_gradients
from shardwise.strategies.base import DistributedModel, DistributedOptimizer, Strategy


def _script_watchdog(rt: Runtime) -> None:
    """Under `shardwise run --hang-timeout`, a user's script gets the trainer's watchdog: a hang,
    or a rank that left early, ends every rank with a report naming it (on stderr)."""
    if WATCHDOG_ENV in os.environ and rt.world_size > 1:
        timeout = float(os.environ[WATCHDOG_ENV])
        runtime.attach(Watchdog(rt.rank, rt.world_size, timeout, report_dir=None).start())


runtime.on_init(_script_watchdog)  # (every way into a job, not only `sw.init`)
init = runtime.init  # `sw.init`


def prepare(
    model: nn.Module,
    strategy: Strategy,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    source: ParameterSource | None = None,
    **optimizer_kwargs: Any,
) -> tuple[DistributedModel, DistributedOptimizer]:
    """Move `model` to this rank's device, apply `strategy`, and build its optimizer.

    Every rank must call this with the same model architecture (it is collective). A model
    built inside `sw.empty_parameters()` (parameters on the meta device) takes its values from
    `source` (e.g. `sw.HFWeights(dir)`), each rank reading only what it keeps.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a shardwise strategy (e.g. sw.DDP()), got {strategy!r}")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    rt = init()  # the existing runtime, or a world of one
    if strategy.every_rank_prepares:
        # (before anything sized by the model is made: a segment of shared memory, say; and
        # before any rank refuses alone, leaving the others in a collective)
        shared = _what_every_rank_shares(model, strategy)
        check_same_everywhere(shared, "sw.prepare: the model or strategy", None, rt.device)
    if next(model.parameters(), None) is None:
        raise ValueError(f"the model ({type(model).__name__}) has no parameters: nothing to train")
    if has_meta_parameters(model):
        if source is None:
            raise ValueError(
                "the model's parameters are on the meta device: pass source=... (where their "
                "values are, e.g. sw.HFWeights(dir))"
            )
        buffers_to(model, rt.device)  # (the parameters stay on the meta device until read)
        wrapped = strategy.wrap_from(model, rt, source)
    elif source is not None:  # (it was ignored: the model trained from its own values)
        raise ValueError(
            "source= gives the values of parameters on the meta device; this model's are made "
            "already (build it inside sw.empty_parameters() to read them from the source)"
        )
    else:
        wrapped = strategy.wrap(model.to(rt.device), rt)
    return wrapped, wrapped.make_optimizer(optimizer, **optimizer_kwargs)


def _what_every_rank_shares(model: nn.Module, strategy: Strategy) -> list[str]:
    """What every rank's `prepare` must hold alike: the strategy's options, and the model's
    parameters and buffers (names, dtypes, shapes, which train)."""
    lines = [f"strategy {describe_options(strategy)}"]
    for name, p in model.named_parameters():
        frozen = "" if p.requires_grad else " (frozen)"
        lines.append(
            f"parameter {name!r} {str(p.dtype).removeprefix('torch.')}{list(p.shape)}{frozen}"
        )
    for name, b in model.named_buffers():
        lines.append(f"buffer {name!r} {str(b.dtype).removeprefix('torch.')}{list(b.shape)}")
    return lines


def _distributed(model: nn.Module) -> DistributedModel:
    if isinstance(model, DistributedModel):
        return model
    return DistributedModel(model, runtime.current_or_alone())  # one replica of itself


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The complete single-process state dict on every rank, whatever the strategy."""
    return _distributed(model).full_state_dict()


def train_step(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable,
    samples: int | Callable[[Any], int] | None = None,
    total: int | None = None,
    accumulate: int = 1,
) -> torch.Tensor:
    """Forward, loss and backward of one batch, whatever the strategy; returns the loss.

    For most strategies this is `loss_fn(model(inputs), targets).backward()`. A pipeline runs
    its whole schedule (every micro-batch through every stage); tensor parallel computes the
    loss from vocabulary-sharded logits. The loss returned is the batch's, on every rank.

    Batches may differ in size between ranks: data parallel weighs each rank's gradient by its
    share of the step's samples, so the update is the mean over the global batch. `samples`
    defaults to the batch's first dimension (pass a token count for a per-token loss over
    sequences of unequal length, or a function that counts them from the targets); `total`,
    the step's samples over all replicas, is summed by a small collective when not given (a
    loader that plans every rank's batch knows it).

    `accumulate=K` cuts the batch into K micro-batches along its first dimension and runs
    forward and backward on each in turn, synchronising gradients once, in the last backward
    (`strategies/accumulation.py`): the gradient of the whole batch, with the activations of
    one micro-batch. A per-token loss then passes `samples` as a function of the targets, so
    that each micro-batch can be weighed by its own count. A pipeline refuses (raise its
    `microbatches` instead).
    """
    if accumulate == 1:
        count = samples(targets) if callable(samples) else samples
        return _distributed(model).train_step(inputs, targets, loss_fn, count, total)
    if samples is not None and not callable(samples):
        raise ValueError(
            f"train_step(accumulate={accumulate}): samples={samples!r} counts the whole batch; "
            "pass a function of a micro-batch's targets that counts its samples instead"
        )
    return accumulated_step(
        _distributed(model), inputs, targets, loss_fn, accumulate, samples, total
    )


def declare_batch(model: nn.Module, samples: int, total: int | None = None) -> None:
    """For loops that call `loss.backward()` themselves: this rank's batch holds `samples` of
    the step's `total` (None: summed over the replicas). Call it on every rank before the
    backward that synchronises gradients; `sw.train_step` does it for you. Accumulating by
    hand (the backward passes before the last inside `model.no_sync()`), declare the rank's
    whole batch once, before the first backward (a SyncBatchNorm weighs the ranks by it in
    each), with each micro-batch's loss multiplied by its share of the rank's batch."""
    _distributed(model).declare_batch(samples, total)


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """For loops that accumulate gradients themselves: backward passes inside this context
    keep their gradients local (no communication), whatever the strategy; the next backward
    outside synchronises the sum. Where a strategy's backward sends no gradient (a plain
    module, tensor parallel, local SGD, gossip, a parameter-server worker) there is nothing to
    hold back. `sw.train_step(..., accumulate=K)` does all of it for you."""
    return local_gradients(_distributed(model))


def parallel_loss(model: nn.Module, loss_fn: Callable) -> Callable:
    """The loss function to apply to this model's outputs: `loss_fn` itself, except where the
    outputs are split over ranks (tensor parallel's vocabulary-sharded logits)."""
    return _distributed(model).adapt_loss(loss_fn)


def predict(model: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension of the model's output, also when it is split over ranks."""
    return _distributed(model).predict(output)


def data_shard(model: nn.Module) -> tuple[int, int]:
    """(replicas, index) for the data loader: ranks that split one model share a batch."""
    return _distributed(model).data_shard()


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm before.

    Correct for every strategy: where ranks hold disjoint gradient shards (ZeRO), the squared
    norms of all shards on all ranks are summed; replicated gradients (DDP) need no message.
    Same formula as `torch.nn.utils.clip_grad_norm_` (which a plain module gets).
    """
    if not isinstance(model, DistributedModel):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return model.clip_grad_norm_(max_norm)
