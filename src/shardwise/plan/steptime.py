"""Predicted step time of a job: what each rank computes, traced on fake tensors, priced at the
rates `shardwise calibrate` measured, plus its collectives from the cost model.

    compute     every operator of forward and backward, of the optimizer's step and of the
                trainer's check that the gradients are finite costs op_overhead + FLOPs /
                flop_rate + bytes touched / bytes_rate (FLOPs by torch's FlopCounterMode,
                bytes: each operator's inputs and outputs); reading the batch, sample_read_s
                per sample
    collectives each call at the calibrated mean time of one of its kind and payload (its
                bytes per call) after a little compute, and the waiting for ranks that share
                cores to arrive after the step's compute (`arrival_wait`: the calibrated
                waits after bursts of compute). A call started a unit of
                compute before it is waited for (ZeRO-3's prefetched gathers, ZeRO's
                reduce-scatters but the last unit's of backward) at what the calibration
                saw such a call add to its caller: its wait, and the cycles its copies
                took from the compute meanwhile
    sharing     compute takes the longer of this rank's critical path, at the rates of a
                rank alone, and all ranks' work done at once: where each rank has a core, at
                the rates measured with every rank working (they contend for memory:
                `shared_rates`); where ranks outnumber the cores, over the machine's
                concurrency (they take turns)
    schedules   a pipeline's critical path comes from running its schedule: each stage does
                its forwards and backwards in order, each once its input has arrived (the
                neighbour's op done, plus one message's calibrated time), and each op pays
                on its own stage's clock for posting its sends and receives; tensor parallel's
                compute is traced on this rank's share of the model (its split layers, the
                replicated rest and the vocabulary-parallel loss)

On a CPU the collectives compete with compute for the same cores, so nothing is hidden: their
time adds to the step's. Strategies whose extra work the trace cannot see (gradient codecs'
compression, ZeRO's flat copies) are priced by what they communicate only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from shardwise.distributed.mesh import coordinates
from shardwise.faults.nonfinite import all_finite
from shardwise.plan import costs as cost_model
from shardwise.plan.activations import TrainingPass, fake_state, stepped_optimizer
from shardwise.plan.predictors import predict
from shardwise.strategies.pipeline import schedule_order
from shardwise.strategies.section import StrategySection

KIND = {  # how each recorded op is priced: which calibrated collective it behaves like
    "all_reduce": "all_reduce",
    "broadcast": "all_reduce",
    "reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "send": "send",
    "gossip": "exchange",
    "ring_all_reduce": "exchange",
}


@dataclass
class Work:
    """What some compute does: operator calls, FLOPs and bytes touched."""

    ops: int = 0
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.ops + other.ops, self.flops + other.flops, self.bytes + other.bytes)

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


def training_work(
    job: cost_model.Job, samples: int, layers=None, before=(), with_backward: bool = True
) -> Work:
    """Forward and backward of `samples` through `layers` (default: the whole model) and the
    loss; with `before` (a pipeline's earlier stages), from their output and without the loss
    unless these layers end the model. With `with_backward` False, the forward only."""
    modules = [job.model] if layers is None else list(layers)
    last = layers is None or modules[-1] is cost_model.pipeline_layers(job.model)[-1]
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


def after_backward_work(numels: list[int], optimizer: str) -> Work:
    """What a rank computes between backward and the next step on tensors of `numels`
    elements: the trainer's check that the gradients are finite, and one optimizer step (not
    the first, which also makes the state)."""
    checked = trace(all_finite, lambda: [torch.empty(n) for n in numels])
    return checked + trace(lambda opt: opt.step(), lambda: stepped_optimizer(numels, optimizer))


def call_seconds(cal: dict, kind: str, volume: float, ranks: int | None = None) -> float:
    """Seconds of one call of `kind` that sends `volume` bytes among `ranks` ranks (None:
    all): the calibration's mean times for that group size (all ranks' where it has none),
    linear between the payloads it measured, and past the largest at its fitted bandwidth."""
    rates = cal["collectives"][kind]
    rates = rates.get("groups", {}).get(str(ranks), rates)
    return _piecewise(rates["points"], volume, 1 / rates["bandwidth"])


def _piecewise(points: list[list[float]], x: float, slope_past: float) -> float:
    """The line through (x, y) `points` at `x`: the first y below them, and past the last
    point at `slope_past`."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1] + (x - points[-1][0]) * slope_past


def arrival_wait(cal: dict, compute_s: float) -> float:
    """Seconds a rank waits for the others to arrive at the first collective after
    `compute_s` of compute, beyond what a call after a short burst (as every collective was
    calibrated) already includes: the calibration's `arrival_waits` between the bursts it
    measured, and past the longest along their last segment. It grows less than in
    proportion to the compute: a line through bursts of 1-20 ms put the GPT's wait after
    85 ms of compute on 4 ranks of 2 cores at 22 ms, where bursts of 99 ms waited 14."""
    points = cal["arrival_waits"]
    (b0, w0), (b1, w1) = points[-2:]
    last_slope = max(0.0, (w1 - w0) / (b1 - b0)) if b1 > b0 else 0.0
    return max(0.0, _piecewise(points, compute_s, last_slope) - points[0][1])


def comm_seconds(costs: cost_model.Costs, cal: dict, compute_s: float, world: int) -> float:
    """Every collective call (the trainer's loss all-reduce among them) at the calibrated
    time of its kind and payload (each call after a little compute, as in a step), and the
    waiting for ranks that share cores to arrive after the step's compute (`arrival_wait`). A
    pipeline's messages are priced in its schedule (`pipeline_finish`) instead."""
    trainer = cost_model.trainer_comm(world)
    seconds = sum(call_seconds(cal, KIND[op], nbytes) for op, nbytes in trainer.items())
    for t in costs.traffic:
        if t.op != "send":
            kind = KIND.get(t.op, "all_reduce")
            if t.prefetched:  # started a unit of compute before it is waited for
                kind = f"prefetched_{kind}"
            seconds += t.calls * call_seconds(cal, kind, t.nbytes / t.calls, t.ranks)
    return seconds + arrival_wait(cal, compute_s)


def posts_per_step(stage: int, stages: int, microbatches: int) -> int:
    """Point-to-point calls (sends and receives) a pipeline stage posts in one step: with each
    neighbour, one per micro-batch each way (activations forward, their gradients back), the
    first activation's header and the step's loss."""
    neighbours = (stage > 0) + (stage < stages - 1)
    return neighbours * (2 * microbatches + 2)


def pipeline_finish(
    orders: list[list[tuple]],
    forward: list[float],
    backward: list[float],
    message: list[float],
) -> list[float]:
    """When each stage of a pipeline ends its part of a step, running `orders` (each stage's
    ("F", i) / ("B", i) sequence): a stage does its ops in order, each once its input has
    arrived: the previous stage's forward of micro-batch i (or the next stage's backward)
    done, plus `message[boundary]` seconds. (The loss comes back with the last gradient.)"""
    stages = len(orders)
    done: dict[tuple, float] = {}
    clock, at = [0.0] * stages, [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while at[s] < len(orders[s]):
                op, i = orders[s][at[s]]
                if op == "F":
                    needs, cost = ((s - 1, "F", i), message[s - 1]) if s > 0 else (None, 0.0)
                else:
                    needs, cost = ((s + 1, "B", i), message[s]) if s < stages - 1 else (None, 0.0)
                if needs is not None and needs not in done:
                    break  # its input comes from a stage that has not got there yet
                ready = done[needs] + cost if needs is not None else 0.0
                clock[s] = max(clock[s], ready) + (forward if op == "F" else backward)[s]
                done[(s, op, i)] = clock[s]
                at[s] += 1
                progressed = True
    return clock


def shared_rates(cal: dict, world: int) -> dict | None:
    """The rates of a rank while all `world` ranks compute at once, where each has a core of
    its own (no more ranks than the machine's concurrency): they contend only for memory and
    caches, as the calibration's `shared` rates measured (2 ranks on this 2-core VM: element-
    wise work at 36-60 GB/s each against 66-72 GB/s alone; their steps' compute was priced
    15-29% short at the rates of one alone). None where ranks outnumber the cores (they take
    turns, priced by the concurrency) or the calibration has no shared rates."""
    if "shared" in cal and world <= round(cal.get("concurrency", 1)):
        return {**cal, **cal["shared"]}
    return None


def predict_step(job: cost_model.Job, strategy: StrategySection, cal: dict) -> dict[str, float]:
    """Seconds per step by part (compute with the optimizer, the sharing of the machine and
    the pipeline's waits, comm) and the total.

    Compute is the longer of two bounds: this rank's critical path (a pipeline's from running
    its schedule) at the rates of a rank alone, and every rank's work done at once: where
    each rank has a core, at the rates of `shared_rates`, else over the machine's concurrency
    (ranks that share cores take turns)."""
    costs = predict(job, strategy)
    n = job.world_size
    shared = shared_rates(cal, n)
    replicas, tp, pp = cost_model.mesh_sizes(strategy, n)
    samples = job.global_batch // replicas

    def reading(rates: dict) -> float:
        return samples * rates.get("sample_read_s", 0.0)

    if pp > 1:
        m = strategy.microbatches
        layers, starts = cost_model.pipeline_stages(job, pp, getattr(strategy, "split", None))
        bounds = [*starts, len(layers)]
        stages = [layers[bounds[s] : bounds[s + 1]] for s in range(pp)]
        forward, backward, after, traced = [], [], [], []
        for s, stage in enumerate(stages):
            before = layers[: bounds[s]]
            both = training_work(job, samples // m, stage, before)
            forward.append(training_work(job, samples // m, stage, before, False).seconds(cal))
            backward.append(both.seconds(cal) - forward[-1])
            numels = [p.numel() for layer in stage for p in layer.parameters()]
            optimizer = after_backward_work(numels, job.optimizer)
            after.append(optimizer.seconds(cal) + reading(cal))  # (every stage reads the batch)
            traced.append((both, optimizer))
        boundary = cost_model.boundary_bytes(job, layers, bounds, samples // m)
        orders = [schedule_order(strategy.schedule, s, pp, m) for s in range(pp)]
        messages = [call_seconds(cal, "send", b) for b in boundary]
        # Each op posts its messages on its own stage's clock: a forward receives from the
        # stage before and sends to the one after, a backward the other way round; the
        # step's other posts (the header, the loss) are small.
        posts = [call_seconds(cal, "post", b) for b in boundary]
        for s in range(pp):
            ends = [posts[b] for b in (s - 1, s) if 0 <= b < pp - 1]
            forward[s] += sum(ends)
            backward[s] += sum(ends)
            others = posts_per_step(s, pp, m) - 2 * m * len(ends)
            after[s] += others * call_seconds(cal, "post", 8)
        finish = pipeline_finish(orders, forward, backward, messages)
        path = max(f + a for f, a in zip(finish, after, strict=True))
        work = [m * (f + b) + a for f, b, a in zip(forward, backward, after, strict=True)]
        ideal = max(work)
        if shared is not None:  # each stage's work, its compute at the shared rates
            slower = [
                m * (both.seconds(shared) - both.seconds(cal))
                + optimizer.seconds(shared)
                - optimizer.seconds(cal)
                + reading(shared)
                - reading(cal)
                for both, optimizer in traced
            ]
            work = [w + extra for w, extra in zip(work, slower, strict=True)]
        everyone = replicas * sum(work)
    else:
        local = job
        if tp > 1:  # this rank's share of the model, traced as it runs (replicated parts too)
            where = coordinates(job.rank, {"dp": replicas, "tp": tp, "pp": pp})
            local = cost_model.tp_local(job, strategy.loss_parallel, tp, where["tp"])
        traced = training_work(local, samples)
        traced += after_backward_work(costs.optimizer_numels, job.optimizer)
        path = ideal = traced.seconds(cal) + reading(cal)
        everyone = n * (path if shared is None else traced.seconds(shared) + reading(shared))
    at_once = everyone / n if shared is not None else everyone / cal.get("concurrency", 1)
    compute = max(path, at_once)
    parts = {
        "compute": min(ideal, compute),
        "sharing": compute - min(ideal, compute),  # waiting for cores, memory, pipeline inputs
        "comm": comm_seconds(costs, cal, compute, n) if n > 1 else 0.0,
    }
    parts["total"] = sum(parts.values())
    return parts
