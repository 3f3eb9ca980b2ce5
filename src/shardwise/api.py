"""`prepare` and `full_state_dict`: the two calls that apply a strategy and undo it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise import runtime
from shardwise.strategies.base import Strategy

_STRATEGY_ATTR = "_shardwise_strategy"


def prepare(
    model: nn.Module,
    strategy: Strategy,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    **optimizer_kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Move `model` to this rank's device, apply `strategy`, and build its optimizer.

    Every rank must call this with the same model architecture (it is collective).
    """
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a shardwise strategy (e.g. sw.DDP()), got {strategy!r}")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    rt = runtime.current() if runtime._runtime is not None else runtime.init()
    wrapped = strategy.wrap(model.to(rt.device), rt)
    setattr(wrapped, _STRATEGY_ATTR, strategy)
    return wrapped, strategy.make_optimizer(wrapped, optimizer, **optimizer_kwargs)


def strategy_of(model: nn.Module) -> Strategy | None:
    return getattr(model, _STRATEGY_ATTR, None)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The complete single-process state dict on every rank, whatever the strategy."""
    strategy = strategy_of(model)
    if strategy is None:
        return dict(model.state_dict())
    return strategy.full_state_dict(model)


def train_step(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> torch.Tensor:
    """Forward, loss and backward of one batch, whatever the strategy; returns the loss.

    For most strategies this is `loss_fn(model(inputs), targets).backward()`. A pipeline runs
    its whole schedule (every micro-batch through every stage); tensor parallel computes the
    loss from vocabulary-sharded logits. The loss returned is the batch's, on every rank.
    """
    strategy = strategy_of(model)
    if strategy is None:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss.detach()
    return strategy.train_step(model, inputs, targets, loss_fn)


def parallel_loss(model: nn.Module, loss_fn: Callable) -> Callable:
    """The loss function to apply to this model's outputs: `loss_fn` itself, except where the
    outputs are split over ranks (tensor parallel's vocabulary-sharded logits)."""
    strategy = strategy_of(model)
    return loss_fn if strategy is None else strategy.adapt_loss(model, loss_fn)


def predict(model: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension of the model's output, also when it is split over ranks."""
    strategy = strategy_of(model)
    return output.argmax(-1) if strategy is None else strategy.predict(model, output)


def data_shard(model: nn.Module) -> tuple[int, int]:
    """(replicas, index) for the data loader: ranks that split one model share a batch."""
    strategy = strategy_of(model)
    if strategy is None:
        rt = runtime.current()
        return rt.world_size, rt.rank
    return strategy.data_shard(model)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm before.

    Correct for every strategy: where ranks hold disjoint gradient shards (ZeRO), the squared
    norms of all shards on all ranks are summed; replicated gradients (DDP) need no message.
    Same formula as `torch.nn.utils.clip_grad_norm_`.
    """
    strategy = strategy_of(model)
    if strategy is None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = strategy.local_grads(model)
    total_norm = strategy.grad_square_sum(model).sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))  # offloaded gradients: on the CPU
    return total_norm
