"""Predicted step time of a job: what each rank computes, traced on fake tensors, priced at the
rates `shardwise calibrate` measured, plus its collectives from the cost model.

    compute     every operator of forward and backward (and of the optimizer's step) costs
                op_overhead + FLOPs / flop_rate + bytes touched / bytes_rate (FLOPs by torch's
                FlopCounterMode, bytes: each operator's inputs and outputs)
    collectives bytes / bandwidth per kind, and per call the calibrated wait after the compute
                before it (ranks that share cores arrive at different times and must be
                woken: wait_s + wait_per_compute x the compute between collectives)
    sharing     compute takes the longer of this rank's critical path at the rate of a rank
                alone, and all ranks' work over the machine's concurrency (ranks that share
                cores take turns)
    schedules   a pipeline runs m + S - 1 slots of its slowest stage's micro-batch (the
                bubble); tensor parallel computes 1/t of the FLOPs and bytes of the whole model
                (its replicated norms and residuals are small beside the split layers)

On a CPU the collectives compete with compute for the same cores, so nothing is hidden: their
time adds to the step's. Strategies whose extra work the trace cannot see (gradient codecs'
compression, ZeRO's flat copies) are priced by what they communicate only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from shardwise import costs as cost_model
from shardwise.activations import TrainingPass, fake_state, stepped_optimizer
from shardwise.section import StrategySection

KIND = {  # how each recorded op is priced: which calibrated collective it behaves like
    "all_reduce": "all_reduce",
    "broadcast": "all_reduce",
    "reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "send": "send",
    "gossip": "send",
    "ring_all_reduce": "send",
}


@dataclass
class Work:
    """What some compute does: operator calls, FLOPs and bytes touched."""

    ops: int = 0
    flops: float = 0.0
    bytes: float = 0.0

    def scaled(self, factor: float) -> Work:
        return Work(self.ops, self.flops * factor, self.bytes * factor)

    def seconds(self, cal: dict) -> float:
        return (
            self.ops * cal["op_overhead_s"]
            + self.flops / cal["flop_rate"]
            + self.bytes / cal["bytes_rate"]
        )


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


def trace(run, prepare=None) -> Work:
    """The operators, FLOPs and bytes of `run(prepared)` on fake tensors, where `prepare()`
    (not counted) makes what it starts from."""
    with FakeTensorMode():
        prepared = prepare() if prepare is not None else None
        flops, operators = FlopCounterMode(display=False), _Operators()
        with flops, operators:
            run(prepared)
    return Work(operators.work.ops, float(flops.get_total_flops()), operators.work.bytes)


def training_work(job: cost_model.Job, samples: int, layers=None, before=()) -> Work:
    """Forward and backward of `samples` through `layers` (default: the whole model) and the
    loss; with `before` (a pipeline's earlier stages), from their output and without the loss
    unless these layers end the model."""
    modules = [job.model] if layers is None else list(layers)
    last = layers is None or modules[-1] is cost_model.pipeline_layers(job.model)[-1]
    step = TrainingPass(modules, job.loss_fn if last else None)

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


def optimizer_work(numels: list[int], optimizer: str) -> Work:
    """One optimizer step (not the first, which also makes the state) over tensors of
    `numels` elements."""
    return trace(lambda opt: opt.step(), lambda: stepped_optimizer(numels, optimizer))


def comm_seconds(costs: cost_model.Costs, cal: dict, compute_s: float) -> float:
    """Bytes over each kind's bandwidth, and for every collective call the calibrated wait
    after the compute before it (the step's compute spread evenly over its collectives). A
    pipeline's messages are waited for in its schedule, priced by the bubble instead."""
    rates = cal.get("collectives", {})
    seconds, calls = 0.0, 0.0
    for op, nbytes in costs.comm.items():
        fit = rates.get(KIND.get(op, "all_reduce"))
        if fit is not None:
            seconds += nbytes / fit["bandwidth"]
        if op != "send":
            calls += costs.calls.get(op, 1)
    calls += 1  # the trainer's all-reduce of the loss and flags
    segment = compute_s / calls
    return seconds + calls * (cal.get("wait_s", 0.0) + cal.get("wait_per_compute", 0.0) * segment)


def predict_step(job: cost_model.Job, strategy: StrategySection, cal: dict) -> dict[str, float]:
    """Seconds per step by part (compute with the optimizer, the bubble, comm) and the total.

    Compute is the longer of two bounds: this rank's critical path at the rate of a rank
    alone (a pipeline's m + S - 1 slots of its slowest stage), and every rank's work over the
    machine's concurrency (ranks that share cores wait for one another)."""
    costs = cost_model.predict(job, strategy)
    n = job.world_size
    replicas, tp, pp = cost_model.mesh_sizes(strategy, n)
    samples = job.global_batch // replicas
    if pp > 1:
        m = strategy.microbatches
        layers, starts = cost_model.pipeline_stages(job, pp, getattr(strategy, "split", None))
        bounds = [*starts, len(layers)]
        stages = [layers[bounds[s] : bounds[s + 1]] for s in range(pp)]
        micro = [
            training_work(job, samples // m, stage, layers[: bounds[s]]).seconds(cal)
            for s, stage in enumerate(stages)
        ]
        steps = [
            optimizer_work(
                [p.numel() for layer in stage for p in layer.parameters()], job.optimizer
            ).seconds(cal)
            for stage in stages
        ]
        path = (m + pp - 1) * max(micro) + steps[0]
        everyone = replicas * sum(m * t + o for t, o in zip(micro, steps, strict=True))
        ideal = m * max(micro) + steps[0]
    else:
        work = training_work(job, samples).scaled(1 / tp).seconds(cal)
        optimizer = optimizer_work(costs.optimizer_numels, job.optimizer).seconds(cal)
        path = ideal = work + optimizer
        everyone = n * path
    compute = max(path, everyone / cal.get("concurrency", 1))
    parts = {
        "compute": min(ideal, compute),
        "sharing": compute - min(ideal, compute),  # waiting for cores and pipeline slots
        "comm": comm_seconds(costs, cal, compute) if n > 1 else 0.0,
    }
    parts["total"] = sum(parts.values())
    return parts
