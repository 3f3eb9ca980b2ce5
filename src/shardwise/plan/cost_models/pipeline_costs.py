"""Pipeline parallel's cost model (GPipe, Huang et al., 2019; 1F1B, Narayanan et al., 2019):
each stage holds its layers' state, the activations of the micro-batches it has in flight,
and sends one activation forward and one gradient back per micro-batch and stage boundary.

    peak        the stage's whole step as `strategies.pipeline` runs it, traced on fake
                tensors: its forwards and backwards in the schedule's order, receive buffers
                posted one op ahead, and what it sends kept until the step ends
    step time   its critical path comes from running its schedule: each stage does its
                forwards and backwards in order, each once its input has arrived (the
                neighbour's op done, plus one message's calibrated time), and each op pays
                on its own stage's clock for posting its sends and receives
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from shardwise.observe.memory import PeakMeter
from shardwise.plan.activations import fake_state, let_go
from shardwise.plan.cost_models import CostModel
from shardwise.plan.costs import FP32, CostJob, Costs, replicated_memory
from shardwise.plan.peaks import step_peak
from shardwise.plan.rates import call_seconds
from shardwise.plan.work import Compute, Work, after_backward_work, reading, training_work
from shardwise.strategies.pipeline import schedule_order
from shardwise.strategies.pipeline_stages import balanced_split, pipeline_layers
from shardwise.strategies.section import StrategySection


def pipeline_stages(job: CostJob, stages: int, split: list[int] | None) -> tuple[list, list[int]]:
    """The model's pipeline layers and the start layer of each stage (balanced by parameters,
    as `Pipeline.stage_starts` does, unless `split` gives them)."""
    layers = pipeline_layers(job.model)
    if split:
        return layers, [0, *split]
    weights = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    return layers, balanced_split(weights, stages)


def pp_costs(
    job: CostJob,
    s: StrategySection,
    stages: int | None = None,
    stage: int | None = None,
    samples: int | None = None,
    data_parallel: bool = False,
) -> Costs:
    """Stage `stage` of `stages` (default: this rank of the whole world, or the `stages`
    option) on `samples` (default: the global batch); `data_parallel`: a mesh's data axis
    keeps its gradients in buckets."""
    stages = stages or s.stages or job.world_size
    stage = job.rank if stage is None else stage
    samples = job.global_batch if samples is None else samples
    m = s.microbatches
    layers, starts = pipeline_stages(job, stages, getattr(s, "split", None))
    bounds = [*starts, len(layers)]
    mine = layers[bounds[stage] : bounds[stage + 1]]
    numels = [p.numel() for layer in mine for p in layer.parameters() if p.requires_grad]
    costs = Costs(memory=replicated_memory(numels, job.optimizer), optimizer_numels=numels)
    traced = job.activations(samples // m, layers=layers)
    if traced is not None:
        _, per_layer = traced
        per_micro = sum(per_layer[bounds[stage] : bounds[stage + 1]])
        in_flight = m if s.schedule == "gpipe" else min(m, stages - stage)
        costs.activations = per_micro * in_flight
        # Per micro-batch: its activations forward to the next stage, the gradient of its
        # input back to the previous one; per step, a header (8 int64) and the loss (fp32)
        # from the last stage back.
        boundary = boundary_bytes(job, layers, bounds, samples // m)
        if stage < stages - 1:
            costs.add_comm("send", 64 + m * boundary[stage], m + 1)
        if stage > 0:
            costs.add_comm("send", m * boundary[stage - 1] + FP32, m + 1)
        # Its gradients are made each step, accumulating over the micro-batches (a mesh's
        # data axis keeps them in buckets, into which each fresh one is moved).
        schedule = pipeline_peak(job, layers, bounds, stage, s.schedule, m, samples, data_parallel)
        made = None if data_parallel else costs.memory["grads"]
        costs.peak = step_peak(
            job, costs.memory, numels, samples, made_grads=made, backward=schedule
        )
    return costs


def boundary_bytes(job: CostJob, layers: list, bounds: list[int], samples: int) -> list[int]:
    """Bytes of the activation each stage hands the next, for one micro-batch."""
    sizes = []
    with FakeTensorMode():
        x, _ = job.batch(samples)
        states = [fake_state(layer, None) for layer in layers]
        with torch.no_grad():
            for i, layer in enumerate(layers):
                x = functional_call(layer, states[i], (x,))
                if i + 1 in bounds[1:-1]:
                    sizes.append(x.numel() * x.element_size())
    return sizes


class _Schedule(nn.Module):
    """One stage's step as `strategies.pipeline` runs it, as one module call (so that
    `functional_call` keeps the fake parameters through every backward): its forwards and
    backwards in the schedule's order, receive buffers posted one op ahead, and what it sends
    kept until the step ends."""

    def __init__(self, layers, order, first, last, loss, shape, m) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.order, self.first, self.last, self.loss = order, first, last, loss
        self.shape, self.m = shape, m  # the activation a stage receives: (shape, dtype)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def _post(self, posted: dict, saved: dict, start: int) -> None:
        for op, i in self.order[start:]:
            if op == "F" and not self.first:
                posted.setdefault(("F", i), torch.empty(self.shape[0], dtype=self.shape[1]))
                return
            if op == "B" and not self.last and i in saved:
                posted.setdefault(("B", i), torch.empty_like(saved[i][1]))
                return

    def forward(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
        posted: dict = {}
        saved: dict = {}
        sent = []
        for k, (op, i) in enumerate(self.order):
            if op == "F":
                if self.first:
                    x = xs[i]
                else:
                    self._post(posted, saved, k)
                    x = posted.pop(("F", i)).requires_grad_(self.shape[1].is_floating_point)
                out = self._run(x)
                if self.last:
                    out = self.loss(out, ys[i]) / self.m
                else:
                    sent.append(out)
                saved[i] = (None if self.first else x, out)
            else:
                x, out = saved.pop(i)
                if self.last:
                    out.backward()
                else:
                    self._post(posted, saved, k)
                    out.backward(posted.pop(("B", i)))
                if x is not None:
                    sent.append(x.grad)
            self._post(posted, saved, k + 1)


def pipeline_peak(
    job: CostJob,
    layers: list,
    bounds: list[int],
    stage: int,
    schedule: str,
    m: int,
    samples: int,
    buckets: bool = False,
) -> int:
    """The most bytes stage `stage` holds at once in its step's schedule beyond its state
    (activations of the micro-batches in flight, what it has sent, receive buffers,
    gradients): `PeakMeter` on fake tensors. With `buckets` (a data-parallel stage), each
    fresh gradient is moved into its lasting bucket and let go."""
    stages = len(bounds) - 1
    mine = layers[bounds[stage] : bounds[stage + 1]]
    order = schedule_order(schedule, stage, stages, m)
    with FakeTensorMode():
        x, y = job.batch(samples)
        with torch.no_grad():  # what the stage receives: the earlier stages' output
            boundary = x.chunk(m)[0]
            for layer in layers[: bounds[stage]]:
                boundary = functional_call(layer, fake_state(layer, None), (boundary,))
        run = _Schedule(
            mine,
            order,
            stage == 0,
            stage == stages - 1,
            job.loss_fn,
            (boundary.shape, boundary.dtype),
            m,
        )
        state = {
            f"layers.{i}.{k}": v
            for i, layer in enumerate(mine)
            for k, v in fake_state(layer, None).items()
        }
        xs, ys = list(x.chunk(m)), list(y.chunk(m))
        if buckets:
            for p in state.values():
                if isinstance(p, nn.Parameter) and p.requires_grad:
                    p.register_post_accumulate_grad_hook(let_go)
        meter = PeakMeter(alive=[x, y, *xs, *ys, *state.values()])
        with meter:
            functional_call(run, state, (xs, ys))
    return meter.peak - meter.start


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


def _stage_times(
    job: CostJob, layers: list, bounds: list[int], micro: int, read_s: float, cal: dict
) -> tuple[list[float], list[float], list[float], list[tuple[Work, Work]]]:
    """Each stage's seconds of forward and of backward per micro-batch of `micro` samples and
    after its backwards (the finite check, the optimizer step, reading the batch: every stage
    reads it), and its traced (forward and backward, after-backward) work."""
    forward, backward, after, traced = [], [], [], []
    for k in range(len(bounds) - 1):
        stage, before = layers[bounds[k] : bounds[k + 1]], layers[: bounds[k]]
        both = training_work(job, micro, stage, before)
        forward.append(training_work(job, micro, stage, before, False).seconds(cal))
        backward.append(both.seconds(cal) - forward[-1])
        numels = [p.numel() for layer in stage for p in layer.parameters()]
        optimizer = after_backward_work(numels, job.optimizer)
        after.append(optimizer.seconds(cal) + read_s)
        traced.append((both, optimizer))
    return forward, backward, after, traced


def _add_posts(
    forward: list[float],
    backward: list[float],
    after: list[float],
    boundary: list[int],
    m: int,
    cal: dict,
) -> None:
    """Each op posts its messages on its own stage's clock: a forward receives from the stage
    before and sends to the one after, a backward the other way round; the step's other posts
    (the header, the loss) are small."""
    stages = len(forward)
    posts = [call_seconds(cal, "post", b) for b in boundary]
    for k in range(stages):
        ends = [posts[b] for b in (k - 1, k) if 0 <= b < stages - 1]
        forward[k] += sum(ends)
        backward[k] += sum(ends)
        others = posts_per_step(k, stages, m) - 2 * m * len(ends)
        after[k] += others * call_seconds(cal, "post", 8)


def pipeline_compute(
    job: CostJob, s: StrategySection, stages: int, replicas: int, cal: dict, shared: dict | None
) -> Compute:
    """A pipeline of `stages` stages in each of `replicas` replicas: its critical path from
    running its schedule, its busiest stage's work, and every stage's work (at the `shared`
    rates where ranks compute at once on cores of their own)."""
    samples, m = job.global_batch // replicas, s.microbatches
    layers, starts = pipeline_stages(job, stages, getattr(s, "split", None))
    bounds = [*starts, len(layers)]
    forward, backward, after, traced = _stage_times(
        job, layers, bounds, samples // m, reading(samples, cal), cal
    )
    boundary = boundary_bytes(job, layers, bounds, samples // m)
    orders = [schedule_order(s.schedule, k, stages, m) for k in range(stages)]
    messages = [call_seconds(cal, "send", b) for b in boundary]
    _add_posts(forward, backward, after, boundary, m, cal)
    finish = pipeline_finish(orders, forward, backward, messages)
    path = max(f + a for f, a in zip(finish, after, strict=True))
    work = [m * (f + b) + a for f, b, a in zip(forward, backward, after, strict=True)]
    ideal = max(work)
    if shared is not None:  # each stage's work, its compute at the shared rates
        slower = [
            m * (both.seconds(shared) - both.seconds(cal))
            + optimizer.seconds(shared)
            - optimizer.seconds(cal)
            + reading(samples, shared)
            - reading(samples, cal)
            for both, optimizer in traced
        ]
        work = [w + extra for w, extra in zip(work, slower, strict=True)]
    return Compute(path, ideal, replicas * sum(work))


def sizes(s: StrategySection, world_size: int) -> tuple[int, int, int]:
    """`stages` ranks to a model (default: the world), as many replicas as that leaves."""
    pp = s.stages or world_size
    return world_size // pp, 1, pp


def _compute(
    job: CostJob, s: StrategySection, costs: Costs, cal: dict, shared: dict | None
) -> Compute:
    replicas, _, stages = sizes(s, job.world_size)
    return pipeline_compute(job, s, stages, replicas, cal, shared)


MODEL = CostModel(pp_costs, _compute, sizes)
