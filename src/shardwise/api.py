"""`prepare` and `full_state_dict`: the two calls that apply a strategy and undo it."""

from __future__ import annotations

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


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm before.

    Correct for every strategy: where ranks hold disjoint gradient shards (ZeRO), the squared
    norms of all shards on all ranks are summed; replicated gradients (DDP) need no message.
    Same formula as `torch.nn.utils.clip_grad_norm_`.
    """
    from shardwise import comm

    strategy = strategy_of(model)
    if strategy is None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = strategy.local_grads(model)
    device = grads[0].device if grads else runtime.current().device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += g.detach().float().pow(2).sum()
    if strategy.grads_are_sharded():
        comm.all_reduce(squares)
    total_norm = squares.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total_norm
