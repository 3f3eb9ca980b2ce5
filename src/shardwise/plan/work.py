"""What a rank computes in a step, traced on fake tensors: operator calls, FLOPs (torch's
FlopCounterMode) and bytes touched (each operator's inputs and outputs), and the seconds that
work takes at calibrated rates (`Compute`, the bounds `steptime.predict_step` weighs).

    compute     every operator of forward and backward, of the optimizer's step and of the
                trainer's check that the gradients are finite costs op_overhead + FLOPs /
                flop_rate + bytes touched / bytes_rate; reading the batch, sample_read_s per
                sample
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from shardwise.faults.nonfinite import all_finite
from shardwise.plan.activations import TrainingPass, fake_state, stepped_optimizer
from shardwise.plan.costs import CostJob, Costs
from shardwise.strategies.pipeline_stages import pipeline_layers
from shardwise.strategies.section import StrategySection


@dataclass
class Work:
    """What some compute does: operator calls, FLOPs and bytes touched."""

    ops: int = 0
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.ops + other.ops, self.flops + other.flops, self.bytes + other.bytes)

    def times(self, k: int) -> Work:
        """This work done `k` times."""
        return Work(self.ops * k, self.flops * k, self.bytes * k)

    def seconds(self, cal: dict) -> float:
        return (
            self.ops * cal["op_overhead_s"]
            + self.flops / cal["flop_rate"]
            + self.bytes / cal["bytes_rate"]
        )


@dataclass(frozen=True)
class Compute:
    """A step's compute in seconds, as the bounds `steptime.predict_step` takes the longer of."""

    path: float  # this rank's critical path, at the rates of a rank alone
    ideal: float  # the busiest rank's own work, waiting for nothing
    everyone: float  # every rank's work, at the rates they work at together


class _Operators(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.work = Work()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        touched = tree_leaves((args, kwargs or {}, out))
        self.work.ops += 1
        self.work.bytes += sum(
            t.numel() * t.element_size() for t in touched if isinstance(t, torch.Tensor)
        )
        return out


def trace(run: Callable[[Any], object], prepare: Callable[[], Any] | None = None) -> Work:
    """The operators, FLOPs and bytes of `run(prepared)` on fake tensors, where `prepare()`
    (not counted) makes what it starts from."""
    with FakeTensorMode():
        prepared = prepare() if prepare is not None else None
        flops, operators = FlopCounterMode(display=False), _Operators()
        with flops, operators:
            run(prepared)
    return Work(operators.work.ops, float(flops.get_total_flops()), operators.work.bytes)


def training_work(
    job: CostJob,
    samples: int,
    layers: Sequence[nn.Module] | None = None,
    before: Sequence[nn.Module] = (),
    with_backward: bool = True,
) -> Work:
    """Forward and backward of `samples` through `layers` (default: the whole model) and the
    loss; with `before` (a pipeline's earlier stages), from their output and without the loss
    unless these layers end the model. With `with_backward` False, the forward only."""
    modules = [job.model] if layers is None else list(layers)
    last = layers is None or modules[-1] is pipeline_layers(job.model)[-1]
    step = TrainingPass(modules, job.loss_fn if last else None, with_backward=with_backward)

    def prepare():
        x, y = job.batch(samples)
        with torch.no_grad():
            for module in before:
                x = functional_call(module, fake_state(module, None), (x,))
        if before:
            x = x.detach().requires_grad_(x.is_floating_point())
        return x, y, fake_state(step, None)

    def run(prepared) -> None:
        x, y, state = prepared
        functional_call(step, state, (x, y))

    return trace(run, prepare)


def after_backward_work(numels: Sequence[int], optimizer: str) -> Work:
    """What a rank computes between backward and the next step on tensors of `numels`
    elements: the trainer's check that the gradients are finite, and one optimizer step (not
    the first, which also makes the state)."""
    return _after_backward_work(tuple(numels), optimizer)


# (a function of its arguments alone, which the strategies the planner weighs mostly share)
@functools.lru_cache(maxsize=64)
def _after_backward_work(numels: tuple[int, ...], optimizer: str) -> Work:
    checked = trace(all_finite, lambda: [torch.empty(n) for n in numels])
    return checked + trace(lambda opt: opt.step(), lambda: stepped_optimizer(numels, optimizer))


def reading(samples: int, rates: dict) -> float:
    """Seconds to read and collate a batch of `samples`."""
    return samples * rates.get("sample_read_s", 0.0)


def replica_compute(
    job: CostJob, samples: int, numels: list[int], cal: dict, shared: dict | None
) -> Compute:
    """A rank that runs its model's whole step at once: forward and backward of `samples`
    through `job`'s model, the finite check and optimizer step on tensors of `numels`
    elements, and reading the batch; each of the job's ranks does as much (at the `shared`
    rates, where ranks compute at once on cores of their own). Under accumulation, forward
    and backward run once per micro-batch (priced as `accumulate` of the largest)."""
    micro = job.micro(samples)
    traced = job.traced(("work", micro), lambda: training_work(job, micro))
    traced = traced.times(job.accumulate) + after_backward_work(numels, job.optimizer)
    path = traced.seconds(cal) + reading(samples, cal)
    alike = path if shared is None else traced.seconds(shared) + reading(samples, shared)
    return Compute(path, path, job.world_size * alike)


def data_parallel_compute(
    job: CostJob, strategy: StrategySection, costs: Costs, cal: dict, shared: dict | None
) -> Compute:
    """A data-parallel rank's step (DDP, ZeRO, the relaxed strategies): its share of the global
    batch through the whole model, and the optimizer on the tensors it steps."""
    samples = job.global_batch // job.world_size
    return replica_compute(job, samples, costs.optimizer_numels, cal, shared)
