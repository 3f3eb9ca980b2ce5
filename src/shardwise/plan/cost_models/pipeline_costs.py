"""Pipeline parallel's cost model (GPipe, Huang et al., 2019; 1F1B and interleaved 1F1B,
Narayanan et al., 2021; ZB-H1, Qi et al., 2023): each rank holds its chunks' state (one chunk,
or v under interleaved), the activations of the micro-batches it has in flight (under ZB-H1
until their deferred weight gradient), and sends one activation forward and one gradient back
per micro-batch and chunk boundary.

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
from shardwise.strategies.pipeline import Pipeline
from shardwise.strategies.pipeline_schedule import schedule_order
from shardwise.strategies.pipeline_stages import balanced_split, pipeline_layers
from shardwise.strategies.section import StrategySection
from shardwise.strategies.zero_bubble import split_backward

# ZB-H1's W: a weight gradient costs about what an input gradient does (one matmul each per
# linear layer), so the backward's time is priced half as B, half as W.
WEIGHT_SHARE = 0.5


def num_chunks(s: StrategySection) -> int:
    """Chunks of the model per rank (interleaved's v; 1 otherwise)."""
    return Pipeline(
        schedule=s.schedule, virtual_stages=getattr(s, "virtual_stages", None)
    ).num_chunks


def rank_chunks(stage: int, stages: int, chunks: int) -> list[int]:
    """The model's chunks that rank `stage` holds: stage, stage + S, ..."""
    return [c * stages + stage for c in range(chunks)]


def pipeline_stages(job: CostJob, stages: int, split: list[int] | None) -> tuple[list, list[int]]:
    """The model's pipeline layers and the start layer of each of `stages` parts (balanced by
    parameters, as `Pipeline.stage_starts` does, unless `split` gives them)."""
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
    m, v = s.microbatches, num_chunks(s)
    layers, starts = pipeline_stages(job, stages * v, getattr(s, "split", None))
    bounds = [*starts, len(layers)]
    mine = rank_chunks(stage, stages, v)
    held = [layer for g in mine for layer in layers[bounds[g] : bounds[g + 1]]]
    numels = [p.numel() for layer in held for p in layer.parameters() if p.requires_grad]
    costs = Costs(memory=replicated_memory(numels, job.optimizer), optimizer_numels=numels)
    traced = job.activations(samples // m, layers=layers)
    if traced is not None:
        _, per_layer = traced
        order = schedule_order(s.schedule, stage, stages, m, v)
        per_chunk = [sum(per_layer[bounds[g] : bounds[g + 1]]) for g in mine]
        costs.activations = activations_held(order, per_chunk)
        # Per micro-batch and chunk: its activations forward to the next chunk, the gradient
        # of its input back to the previous one; per step and boundary, a header (8 int64)
        # and, along the last S-1, the loss (fp32) back.
        boundary = boundary_bytes(job, layers, bounds, samples // m)
        for g in mine:
            if g < len(boundary):
                costs.add_comm("send", 64 + m * boundary[g], m + 1)
            if g > 0 and g - 1 >= stages * (v - 1):  # the loss back too
                costs.add_comm("send", m * boundary[g - 1] + FP32, m + 1)
            elif g > 0:
                costs.add_comm("send", m * boundary[g - 1], m)
        # Its gradients are made each step, accumulating over the micro-batches (a mesh's
        # data axis keeps them in buckets, into which each fresh one is moved).
        schedule = pipeline_peak(job, layers, bounds, stage, s, samples, data_parallel)
        made = None if data_parallel else costs.memory["grads"]
        costs.peak = step_peak(
            job, costs.memory, numels, samples, made_grads=made, backward=schedule
        )
    return costs


def activations_held(order: list[tuple], per_chunk: list[int]) -> int:
    """The most activation bytes a rank holds at once running `order`: a micro-batch's chunk
    from its forward until its backward, or, where the backward is split, its W."""
    split = any(kind == "W" for kind, _, _ in order)
    held = peak = 0
    for kind, _, c in order:
        if kind == "F":
            held += per_chunk[c]
        elif kind == ("W" if split else "B"):
            held -= per_chunk[c]
        peak = max(peak, held)
    return peak


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
    """One rank's step as `strategies.pipeline` runs it, as one module call (so that
    `functional_call` keeps the fake parameters through every backward): its forwards,
    backwards and weight gradients in the schedule's order, receive buffers posted one op
    ahead, and what it sends kept until the step ends."""

    def __init__(self, chunks, globals_, total, order, loss, shapes, m) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(nn.ModuleList(c) for c in chunks)
        self.globals, self.total = globals_, total  # each chunk's index in the model; S*v
        self.order, self.loss = order, loss
        self.shapes, self.m = shapes, m  # the activation each chunk receives: (shape, dtype)

    def _run(self, c: int, x: torch.Tensor) -> torch.Tensor:
        for layer in self.chunks[c]:
            x = layer(x)
        return x

    def _first(self, c: int) -> bool:
        return self.globals[c] == 0

    def _last(self, c: int) -> bool:
        return self.globals[c] == self.total - 1

    def _post(self, posted: dict, saved: dict, start: int) -> None:
        for kind, i, c in self.order[start:]:
            if kind == "F" and not self._first(c):
                shape, dtype = self.shapes[c]
                posted.setdefault(("F", i, c), torch.empty(shape, dtype=dtype))
                return
            if kind == "B" and not self._last(c) and (i, c) in saved:
                posted.setdefault(("B", i, c), torch.empty_like(saved[(i, c)][1]))
                return

    def forward(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
        posted: dict = {}
        saved: dict = {}
        deferred: dict = {}
        sent = []
        for k, (kind, i, c) in enumerate(self.order):
            if kind == "F":
                if self._first(c):
                    x = xs[i]
                else:
                    self._post(posted, saved, k)
                    x = posted.pop(("F", i, c)).requires_grad_(self.shapes[c][1].is_floating_point)
                out = self._run(c, x)
                if self._last(c):
                    out = self.loss(out, ys[i]) / self.m
                else:
                    sent.append(out)
                saved[(i, c)] = (None if self._first(c) else x, out)
            elif kind == "B":
                x, out = saved.pop((i, c))
                grad = None
                if not self._last(c):
                    self._post(posted, saved, k)
                    grad = posted.pop(("B", i, c))
                params = [p for p in self.chunks[c].parameters() if p.requires_grad]
                if any(kind == "W" for kind, _, _ in self.order):
                    input_grad, deferred[(i, c)] = split_backward(out, grad, x, params)
                else:
                    out.backward(grad)
                    input_grad = None if x is None else x.grad
                if input_grad is not None:
                    sent.append(input_grad)
            else:
                deferred.pop((i, c)).run()
            self._post(posted, saved, k + 1)


def pipeline_peak(
    job: CostJob,
    layers: list,
    bounds: list[int],
    stage: int,
    s: StrategySection,
    samples: int,
    buckets: bool = False,
) -> int:
    """The most bytes rank `stage` holds at once in its step's schedule beyond its state
    (activations of the micro-batches in flight, what it has sent, receive buffers,
    gradients): `PeakMeter` on fake tensors. With `buckets` (a data-parallel stage), each
    fresh gradient is moved into its lasting bucket and let go."""
    m, v = s.microbatches, num_chunks(s)
    stages = (len(bounds) - 1) // v
    mine = rank_chunks(stage, stages, v)
    order = schedule_order(s.schedule, stage, stages, m, v)
    chunks = [layers[bounds[g] : bounds[g + 1]] for g in mine]
    with FakeTensorMode():
        x, y = job.batch(samples)
        shapes = []
        with torch.no_grad():  # what each chunk receives: the earlier chunks' output
            for g in mine:
                boundary = x.chunk(m)[0]
                for layer in layers[: bounds[g]]:
                    boundary = functional_call(layer, fake_state(layer, None), (boundary,))
                shapes.append((boundary.shape, boundary.dtype))
        run = _Schedule(chunks, mine, len(bounds) - 1, order, job.loss_fn, shapes, m)
        state = {
            f"chunks.{c}.{i}.{k}": t
            for c, chunk in enumerate(chunks)
            for i, layer in enumerate(chunk)
            for k, t in fake_state(layer, None).items()
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
    weight: list[float] | None = None,
) -> list[float]:
    """When each rank of a pipeline ends its part of a step, running `orders` (each rank's
    (kind, micro-batch, chunk) sequence; its chunk c is the model's chunk c*S + rank): a rank
    does its ops in order, each once its input has arrived: the previous chunk's forward of
    micro-batch i (or the next chunk's backward) done, plus `message[boundary]` seconds.
    `forward`, `backward` and `weight` (a split backward's W) are seconds per model chunk.
    (The loss comes back with the last gradient.)"""
    ranks, last = len(orders), len(forward) - 1
    seconds = {"F": forward, "B": backward, "W": weight or [0.0] * len(forward)}
    done: dict[tuple, float] = {}
    clock, at = [0.0] * ranks, [0] * ranks
    progressed = True
    while progressed:
        progressed = False
        for s in range(ranks):
            while at[s] < len(orders[s]):
                kind, i, c = orders[s][at[s]]
                g = c * ranks + s
                needs, cost = None, 0.0
                if kind == "F" and g > 0:
                    needs, cost = ("F", i, g - 1), message[g - 1]
                elif kind == "B" and g < last:
                    needs, cost = ("B", i, g + 1), message[g]
                if needs is not None and needs not in done:
                    break  # its input comes from a rank that has not got there yet
                ready = done[needs] + cost if needs is not None else 0.0
                clock[s] = max(clock[s], ready) + seconds[kind][g]
                done[(kind, i, g)] = clock[s]
                at[s] += 1
                progressed = True
    return clock


def _stage_times(
    job: CostJob, layers: list, bounds: list[int], micro: int, cal: dict
) -> tuple[list[float], list[float], list[float], list[tuple[Work, Work]]]:
    """Each chunk's seconds of forward and of backward per micro-batch of `micro` samples and
    after its backwards (the finite check, the optimizer step), and its traced (forward and
    backward, after-backward) work."""
    forward, backward, after, traced = [], [], [], []
    for k in range(len(bounds) - 1):
        stage, before = layers[bounds[k] : bounds[k + 1]], layers[: bounds[k]]
        both = training_work(job, micro, stage, before)
        forward.append(training_work(job, micro, stage, before, False).seconds(cal))
        backward.append(both.seconds(cal) - forward[-1])
        numels = [p.numel() for layer in stage for p in layer.parameters()]
        optimizer = after_backward_work(numels, job.optimizer)
        after.append(optimizer.seconds(cal))
        traced.append((both, optimizer))
    return forward, backward, after, traced


def _add_posts(
    forward: list[float],
    backward: list[float],
    boundary: list[int],
    cal: dict,
) -> None:
    """Each op posts its messages on its own rank's clock: a forward receives from the chunk
    before and sends to the one after, a backward the other way round."""
    chunks = len(forward)
    posts = [call_seconds(cal, "post", b) for b in boundary]
    for k in range(chunks):
        ends = sum(posts[b] for b in (k - 1, k) if 0 <= b < chunks - 1)
        forward[k] += ends
        backward[k] += ends


def pipeline_compute(
    job: CostJob,
    s: StrategySection,
    stages: int,
    replicas: int,
    cal: dict,
    shared: dict | None,
    in_ops: list[float] | None = None,
) -> Compute:
    """A pipeline of `stages` ranks in each of `replicas` replicas: its critical path from
    running its schedule, its busiest rank's work, and every rank's work (at the `shared`
    rates where ranks compute at once on cores of their own). `in_ops`: each chunk's seconds
    of blocking collectives per micro-batch (a tp x pp mesh's all-reduces), half in its
    forward, half in its backward."""
    samples, m, v = job.global_batch // replicas, s.microbatches, num_chunks(s)
    layers, starts = pipeline_stages(job, stages * v, getattr(s, "split", None))
    bounds = [*starts, len(layers)]
    forward, backward, after, traced = _stage_times(job, layers, bounds, samples // m, cal)
    if in_ops is not None:
        forward = [f + t / 2 for f, t in zip(forward, in_ops, strict=True)]
        backward = [b + t / 2 for b, t in zip(backward, in_ops, strict=True)]
    boundary = boundary_bytes(job, layers, bounds, samples // m)
    orders = [schedule_order(s.schedule, k, stages, m, v) for k in range(stages)]
    messages = [call_seconds(cal, "send", b) for b in boundary]
    _add_posts(forward, backward, boundary, cal)
    weight = None
    if s.schedule == "zb-h1":
        weight = [WEIGHT_SHARE * b for b in backward]
        backward = [b - w for b, w in zip(backward, weight, strict=True)]
    finish = pipeline_finish(orders, forward, backward, messages, weight)
    read = reading(samples, cal)
    # Besides one post per micro-batch each way, each chunk posts two more per neighbour
    # (the header, the loss): small.
    small = call_seconds(cal, "post", 8)
    ends = [
        sum(
            after[g] + 2 * small * ((g > 0) + (g < len(boundary)))
            for g in rank_chunks(k, stages, v)
        )
        + read
        for k in range(stages)
    ]
    path = max(f + a for f, a in zip(finish, ends, strict=True))
    work = [
        sum(
            m * (forward[g] + backward[g] + (weight[g] if weight else 0.0))
            for g in rank_chunks(k, stages, v)
        )
        + ends[k]
        for k in range(stages)
    ]
    ideal = max(work)
    if shared is not None:  # each rank's work, its compute at the shared rates
        slower = [
            sum(
                m * (traced[g][0].seconds(shared) - traced[g][0].seconds(cal))
                + traced[g][1].seconds(shared)
                - traced[g][1].seconds(cal)
                for g in rank_chunks(k, stages, v)
            )
            + reading(samples, shared)
            - read
            for k in range(stages)
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
