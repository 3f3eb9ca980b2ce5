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

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from shardwise import comm
from shardwise.arguments import whole_number
from shardwise.comm.flat import flatten, unflatten
from shardwise.distributed.runtime import Runtime
from shardwise.strategies.base import DistributedModel, Strategy
from shardwise.strategies.ddp import broadcast_module_state
from shardwise.strategies.section import StrategySection, check_options


def flat_params(model: nn.Module) -> torch.Tensor:
    return flatten(list(model.parameters()))


@torch.no_grad()
def set_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    for p, value in zip(model.parameters(), unflatten(flat, list(model.parameters())), strict=True):
        p.copy_(value)


def weighted_mean(flat: torch.Tensor, weight: float, runtime: Runtime) -> torch.Tensor | None:
    """Σ_r weight_r flat_r / Σ_r weight_r over the ranks of `runtime`, the weights in the same
    all-reduce, summed in float32 at least (a 16-bit model's values times tens of thousands of
    samples would overflow); None where no rank weighs anything."""
    dtype = torch.promote_types(flat.dtype, torch.float32)
    packed = torch.cat([flat.to(dtype) * weight, flat.new_tensor([weight], dtype=dtype)])
    comm.all_reduce(packed, group=runtime.group)
    total = packed[-1].item()
    return None if total == 0 else packed[:-1].div_(total)


@torch.no_grad()
def average_params(model: nn.Module, runtime: Runtime, beta: float, weight: float) -> None:
    """All ranks of `runtime`: x <- beta * mean_r(x_r) + (1 - beta) * x, the mean weighing rank
    r by its `weight` (left as they are where no rank weighs anything)."""
    local = flat_params(model)
    mean = weighted_mean(local, weight, runtime)
    if mean is not None:
        set_flat_params(model, mean if beta == 1.0 else beta * mean + (1 - beta) * local)


@torch.no_grad()
def average_grads(model: nn.Module, runtime: Runtime, weight: float) -> None:
    """Every trainable parameter's gradient becomes the mean over the ranks, rank r's weighed
    by its `weight` (its samples: each gradient is a mean over them), a rank that made none
    counting zero (as DDP's `find_unused_parameters`); one that no rank made stays None.
    Whether a rank made one travels in the same all-reduce (as a weighed 1 or 0)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    made = flatten(grads).new_tensor([float(p.grad is not None) for p in params])
    mean = weighted_mean(torch.cat([flatten(grads), made]), weight, runtime)
    if mean is None:  # (no rank weighs anything: nothing to average)
        return
    values, anyone = mean[: -len(params)], mean[-len(params) :].tolist()
    for p, g, value, made_somewhere in zip(
        params, grads, unflatten(values, grads), anyone, strict=True
    ):
        if made_somewhere:
            p.grad = g.copy_(value)


class RelaxedModel(DistributedModel):
    """Replicas that step on their own gradients; `synchronise` (after every optimizer step)
    decides when and how they meet. Records the steps of global averages in `sync_steps`.

    Each replica weighs in an average by the samples it trained on since the replicas last
    met (declared by `sw.train_step`; 1 where nothing is declared), in the same all-reduce: uneven
    batches average as the global batch does (period 1 with plain SGD: exactly), at no cost in
    messages. A step dropped after its batch was declared (`zero_grad` without a step, as a
    non-finite step is) does not count."""

    def __init__(self, module: nn.Module, runtime: Runtime) -> None:
        super().__init__(module, runtime)
        self.steps = 0
        self.sync_steps: list[int] = []
        self.declared = 0  # this step's samples, until it is applied or dropped
        self.samples: int | None = None  # applied since the replicas last met
        broadcast_module_state(module, group=runtime.group)

    def declare_batch(self, samples: int, total: int | None = None) -> None:
        self.declared += whole_number("samples", samples)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.declared = 0  # (a step dropped: its samples were not trained on)
        super().zero_grad(set_to_none=set_to_none)

    def weight(self) -> float:
        """This replica's weight in a meeting now."""
        return 1.0 if self.samples is None else float(self.samples)

    def after_step(self) -> None:
        if self.declared:
            self.samples = (self.samples or 0) + self.declared
        self.declared = 0
        self.steps += 1
        if self.runtime.world_size > 1:  # (one replica is its own average: nothing to meet)
            self.synchronise()

    def synchronise(self) -> None:
        raise NotImplementedError

    def average(self, beta: float = 1.0, weight: float | None = None) -> None:
        """The replicas' average, each weighed by `weight` (default: its samples since the
        replicas last met); they then start counting again."""
        weight = self.weight() if weight is None else weight
        average_params(self.module, self.runtime, beta, weight)
        self.samples = None
        self.sync_steps.append(self.steps)

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"steps": torch.tensor(self.steps)}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.steps = int(state["steps"])

    def shared_extra_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"steps": state["steps"]}  # (every rank counts the same steps)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The replicas' average, weighed as their next meeting would weigh them (they differ
        between meetings)."""
        state = super().full_state_dict()
        for value in state.values():
            if value.is_floating_point() and (mean := self.weighted(value)) is not None:
                value.copy_(mean.view_as(value))
        return state

    def weighted(self, value: torch.Tensor) -> torch.Tensor | None:
        return weighted_mean(value.reshape(-1), self.weight(), self.runtime)

    def checkpoint_shard(
        self, optimizer: torch.optim.Optimizer, every_rank: bool = False
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """A save holds the replicas' average (collective): the model the run's evaluation
        scores, `full_state_dict` returns and an export should carry; the optimizer state is
        rank 0's (it stays local between averages). An elastic job's in-memory snapshot
        (`every_rank`) keeps each rank's own replica, to go on from exactly."""
        if every_rank or self.runtime.world_size == 1:
            return super().checkpoint_shard(optimizer, every_rank)
        average = self.full_state_dict()  # (every rank takes part)
        layout, tensors = super().checkpoint_shard(optimizer)
        if tensors is not None:
            for i, (name, _) in enumerate(self.module.named_parameters()):
                tensors[f"unit{i}/param"] = average[name].reshape(-1)
            for key in tensors:
                if key.startswith("buffer/") and key.removeprefix("buffer/") in average:
                    tensors[key] = average[key.removeprefix("buffer/")]
        return layout, tensors

    @contextlib.contextmanager
    def weights_for_evaluation(self) -> Iterator[None]:
        """The replicas' average, the model the run ends with (each rank scored its own
        drifted replica on its shard of the test set: a mix of models), this rank's back after."""
        own = {k: v.clone() for k, v in self.module.state_dict().items()}
        self.module.load_state_dict(self.full_state_dict())
        try:
            yield
        finally:
            self.module.load_state_dict(own)


class LocalSGDModel(RelaxedModel):
    def __init__(self, module: nn.Module, runtime: Runtime, options: LocalSGD) -> None:
        super().__init__(module, runtime)
        self.options = options
        self.paced_by_rounds = False
        self.grads_averaged = False  # (this step's, in the warm-up)

    def settle_gradients(self) -> None:
        """Post-local SGD's first steps are synchronous: the gradients are averaged once per
        backward, weighed by this step's samples, before anything reads them (clipping by
        their norm, or the step)."""
        if self.steps < self.options.warmup_steps and not self.grads_averaged:
            if self.runtime.world_size > 1:
                average_grads(self.module, self.runtime, float(self.declared or 1))
            self.grads_averaged = True

    def before_step(self) -> bool:
        self.settle_gradients()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads_averaged = False  # (the next backward's are averaged again)
        super().zero_grad(set_to_none=set_to_none)

    def after_step(self) -> None:
        synchronous = self.grads_averaged
        self.grads_averaged = False
        super().after_step()
        if synchronous:  # (the replicas met in this step's gradients: they count afresh)
            self.samples = None

    def synchronise(self) -> None:
        if self.paced_by_rounds:  # the work queue's rounds decide: `end_round`
            return
        since_warmup = self.steps - self.options.warmup_steps
        if since_warmup > 0 and since_warmup % self.options.period == 0:
            self.average(self.options.beta)

    def pace_by_rounds(self) -> None:
        """Average at the end of each work-queue round (`data.mode: queue`) instead of every
        `period` steps: ranks that pull their data take as many local steps as their speed
        allows, so their step counts differ."""
        if self.options.warmup_steps:
            raise ValueError("local SGD with a work queue has no synchronous warm-up steps")
        self.paced_by_rounds = True

    def end_round(self, samples: int) -> None:
        """The end of a work-queue round: the replicas are averaged (with `beta`), each
        weighted by the samples it trained on in the round, so a rank that took more chunks
        counts for more and one that took none for nothing."""
        self.average(self.options.beta, weight=float(samples))


@dataclass(frozen=True)
class LocalSGD(Strategy):
    period: int = 4
    warmup_steps: int = 0
    beta: float = 1.0

    def __post_init__(self) -> None:
        check_options(self, LocalSGDConfig)

    def wrap(self, model: nn.Module, runtime: Runtime) -> LocalSGDModel:
        return LocalSGDModel(model, runtime, self)


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


class GossipModel(RelaxedModel):
    def __init__(self, module: nn.Module, runtime: Runtime, options: Gossip) -> None:
        super().__init__(module, runtime)
        self.options = options
        self.peers = neighbours(options.topology, runtime.rank, runtime.world_size)

    def mixing_weight(self) -> float:
        """Uniform weights 1/(d+1) over self and d peers. Every rank has the same degree in
        these topologies, so the matrix is symmetric with unit row sums: doubly stochastic."""
        return 1.0 / (len(self.peers) + 1)

    def synchronise(self) -> None:
        every = self.options.global_every
        if every and self.steps % every == 0:
            self.average()
            return
        mine = flat_params(self.module)
        theirs = [torch.empty_like(mine) for _ in self.peers]
        comm.exchange(
            [(mine, p) for p in self.peers],
            list(zip(theirs, self.peers, strict=True)),
            group=self.runtime.group,
            op="gossip",
        )
        set_flat_params(self.module, (mine + sum(theirs)) * self.mixing_weight())


@dataclass(frozen=True)
class Gossip(Strategy):
    topology: str = "ring"
    global_every: int | None = None

    def __post_init__(self) -> None:
        check_options(self, GossipConfig)

    def wrap(self, model: nn.Module, runtime: Runtime) -> GossipModel:
        return GossipModel(model, runtime, self)


class AdaptiveSyncModel(RelaxedModel):
    def __init__(self, module: nn.Module, runtime: Runtime, threshold: float) -> None:
        super().__init__(module, runtime)
        self.threshold = threshold
        self.anchor = flat_params(module)  # the replicas agree here: the first reference
        self.drift_history: list[float] = []

    def synchronise(self) -> None:
        current = flat_params(self.module)
        drift = ((current - self.anchor).norm() / self.anchor.norm().clamp_min(1e-12)).reshape(1)
        comm.all_reduce(drift, group=self.runtime.group, op=torch.distributed.ReduceOp.MAX)
        self.drift_history.append(drift.item())
        if drift.item() > self.threshold:
            self.average()
            self.anchor = flat_params(self.module)

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {**super().extra_state(), "anchor": self.anchor}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        super().load_extra_state(state)
        self.anchor = state["anchor"].to(self.runtime.device, copy=True)

    def shared_extra_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # (the replicas agreed at the anchor: the parameters of the last averaging)
        return {**super().shared_extra_state(state), "anchor": state["anchor"]}


@dataclass(frozen=True)
class AdaptiveSync(Strategy):
    threshold: float = 0.01

    def __post_init__(self) -> None:
        check_options(self, AdaptiveSyncConfig)

    def wrap(self, model: nn.Module, runtime: Runtime) -> AdaptiveSyncModel:
        return AdaptiveSyncModel(model, runtime, self.threshold)


def Hybrid(local: str = "gossip", global_every: int = 8, topology: str = "ring") -> Strategy:
    """Cheap local synchronisation every step, a global average every `global_every` steps:
    gossip with neighbours (`local='gossip'`), or none at all (`local='none'`, which is local
    SGD with period `global_every`)."""
    if local == "gossip":
        return Gossip(topology=topology, global_every=global_every)
    if local == "none":
        return LocalSGD(period=global_every)
    raise ValueError(f"Hybrid local must be 'gossip' or 'none', got {local!r}")


class LocalSGDConfig(StrategySection):
    name: Literal["local_sgd"] = Field("local_sgd", description="the parallelism strategy")
    period: int = Field(4, ge=1, description="local steps between parameter averages")
    warmup_steps: int = Field(0, ge=0, description="fully synchronous steps first (post-local)")
    beta: float = Field(1.0, gt=0, le=1, description="new = beta * average + (1-beta) * local")

    def build(self, world_size: int, run_dir: Path) -> LocalSGD:
        return LocalSGD(**self.options())


class GossipConfig(StrategySection):
    name: Literal["gossip"] = Field("gossip", description="the parallelism strategy")
    topology: Literal["ring", "torus", "exponential"] = Field("ring", description="peers")
    global_every: int | None = Field(
        None, ge=1, description="hybrid: a global average every K steps"
    )

    def build(self, world_size: int, run_dir: Path) -> Gossip:
        return Gossip(**self.options())


class AdaptiveSyncConfig(StrategySection):
    name: Literal["adaptive"] = Field("adaptive", description="the parallelism strategy")
    threshold: float = Field(0.01, gt=0, description="relative drift that triggers an average")

    def build(self, world_size: int, run_dir: Path) -> AdaptiveSync:
        return AdaptiveSync(**self.options())
