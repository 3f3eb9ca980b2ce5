"""Relaxed synchronisation: talk less often (local SGD), to fewer peers (gossip), or only when
the replicas have drifted apart (adaptive). Approximate by design; each is tested against its
mathematical definition.

- `LocalSGD(period=H)`: every rank steps on its own gradients; every H steps the parameters are
  averaged (Stich 2019; Lin et al. 2020's post-local SGD adds `warmup_steps` of fully
  synchronous steps first). `beta` < 1 mixes: new = beta * average + (1 - beta) * local.
- `Gossip(topology)`: after each local step a rank averages with its neighbours only, through
  point-to-point messages, with a doubly stochastic mixing matrix (Lian et al. 2017, D-PSGD):
  the mean over ranks is preserved and the replicas contract towards it. `global_every=K`
  adds a global average every K steps (hybrid).
- `AdaptiveSync(threshold)`: local steps; the replicas are averaged when any rank's relative
  drift since the last average, ||x - x_sync|| / ||x_sync||, passes `threshold` (all ranks
  agree through one all-reduce of the largest drift).

Optimizer state (momentum, Adam's moments) stays local in all of them.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise import comm, runtime
from shardwise.runtime import Runtime
from shardwise.strategies.base import Strategy, WrappedModel
from shardwise.strategies.ddp import broadcast_module_state


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def set_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def average_params(model: nn.Module, beta: float = 1.0) -> None:
    """All ranks: x <- beta * mean_r(x_r) + (1 - beta) * x."""
    local = flat_params(model)
    mean = local.clone()
    comm.all_reduce(mean)
    mean.div_(runtime.current().world_size)
    set_flat_params(model, mean if beta == 1.0 else beta * mean + (1 - beta) * local)


def average_grads(model: nn.Module) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat)
    flat.div_(runtime.current().world_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class RelaxedModel(WrappedModel):
    """The model plus a record of the steps at which replicas were averaged globally."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.steps = 0
        self.sync_steps: list[int] = []


class _Relaxed(Strategy):
    """Shared plumbing: broadcast at wrap, then `after_step` runs after every optimizer step."""

    def wrap(self, model: nn.Module, runtime: Runtime) -> RelaxedModel:
        broadcast_module_state(model)
        return RelaxedModel(model)

    def make_optimizer(self, model, optimizer_cls, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = optimizer_cls(model.module.parameters(), **kwargs)
        inner, strategy = optimizer.step, self

        def step(_optimizer, closure=None):
            strategy.before_step(model)
            loss = inner(closure)
            model.steps += 1
            strategy.after_step(model)
            return loss

        optimizer.step = types.MethodType(step, optimizer)  # bound: LR schedulers wrap it
        return optimizer

    def before_step(self, model: RelaxedModel) -> None:
        pass

    def after_step(self, model: RelaxedModel) -> None:
        raise NotImplementedError

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The average of the replicas (they differ between synchronisations)."""
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        for value in state.values():
            if value.is_floating_point():
                comm.all_reduce(value)
                value.div_(runtime.current().world_size)
        return state


@dataclass
class LocalSGD(_Relaxed):
    period: int = 4
    warmup_steps: int = 0
    beta: float = 1.0

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"LocalSGD period must be >= 1, got {self.period}")
        if not 0 < self.beta <= 1:
            raise ValueError(f"LocalSGD beta must be in (0, 1], got {self.beta}")

    def before_step(self, model: RelaxedModel) -> None:
        if model.steps < self.warmup_steps:  # post-local SGD: synchronous at first
            average_grads(model.module)

    def after_step(self, model: RelaxedModel) -> None:
        if model.steps > self.warmup_steps and (model.steps - self.warmup_steps) % self.period == 0:
            average_params(model.module, self.beta)
            model.sync_steps.append(model.steps)


def neighbours(topology: str, rank: int, world: int) -> list[int]:
    """Peers a rank exchanges with; every topology here is symmetric (j in N(i) iff i in N(j))."""
    if world == 1:
        return []
    if topology == "ring":
        return sorted({(rank - 1) % world, (rank + 1) % world})
    if topology == "torus":
        rows = int(math.sqrt(world))
        while world % rows:
            rows -= 1
        cols = world // rows
        r, c = divmod(rank, cols)
        peers = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c}
        peers |= {r * cols + (c - 1) % cols, r * cols + (c + 1) % cols}
        return sorted(peers - {rank})
    if topology == "exponential":  # peers at distance 2^k both ways (Assran et al. 2019)
        peers = set()
        hop = 1
        while hop < world:
            peers |= {(rank + hop) % world, (rank - hop) % world}
            hop *= 2
        return sorted(peers - {rank})
    raise ValueError(f"topology must be 'ring', 'torus' or 'exponential', got {topology!r}")


@dataclass
class Gossip(_Relaxed):
    topology: str = "ring"
    global_every: int | None = None
    _peers: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        neighbours(self.topology, 0, 4)  # validates the name
        if self.global_every is not None and self.global_every < 1:
            raise ValueError(f"global_every must be >= 1, got {self.global_every}")

    def wrap(self, model: nn.Module, runtime: Runtime) -> RelaxedModel:
        self._peers = neighbours(self.topology, runtime.rank, runtime.world_size)
        return super().wrap(model, runtime)

    def mixing_weight(self) -> float:
        """Uniform weights 1/(d+1) over self and d peers. Every rank has the same degree in
        these topologies, so the matrix is symmetric with unit row sums: doubly stochastic."""
        return 1.0 / (len(self._peers) + 1)

    def after_step(self, model: RelaxedModel) -> None:
        if self.global_every and model.steps % self.global_every == 0:
            average_params(model.module)
            model.sync_steps.append(model.steps)
            return
        mine = flat_params(model.module)
        theirs = [torch.empty_like(mine) for _ in self._peers]
        comm.exchange(
            [(mine, p) for p in self._peers],
            list(zip(theirs, self._peers, strict=True)),
            op="gossip",
        )
        mixed = (mine + sum(theirs)) * self.mixing_weight()
        set_flat_params(model.module, mixed)


@dataclass
class AdaptiveSync(_Relaxed):
    threshold: float = 0.01
    drift_history: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.threshold <= 0:
            raise ValueError(f"threshold must be > 0, got {self.threshold}")

    def wrap(self, model: nn.Module, runtime: Runtime) -> RelaxedModel:
        wrapped = super().wrap(model, runtime)
        self._anchor = flat_params(model)  # the replicas agree here: the first reference
        return wrapped

    def after_step(self, model: RelaxedModel) -> None:
        current = flat_params(model.module)
        drift = ((current - self._anchor).norm() / self._anchor.norm().clamp_min(1e-12)).reshape(1)
        comm.all_reduce(drift, op=torch.distributed.ReduceOp.MAX)
        self.drift_history.append(drift.item())
        if drift.item() > self.threshold:
            average_params(model.module)
            model.sync_steps.append(model.steps)
            self._anchor = flat_params(model.module)


def Hybrid(local: str = "gossip", global_every: int = 8, topology: str = "ring") -> _Relaxed:
    """Cheap local synchronisation every step, a global average every `global_every` steps:
    gossip with neighbours (`local='gossip'`), or none at all (`local='none'`, which is local
    SGD with period `global_every`)."""
    if local == "gossip":
        return Gossip(topology=topology, global_every=global_every)
    if local == "none":
        return LocalSGD(period=global_every)
    raise ValueError(f"Hybrid local must be 'gossip' or 'none', got {local!r}")
