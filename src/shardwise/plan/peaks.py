"""Predicted peak memory of a training step: the most bytes a rank holds at once.

A step has three moments that can peak, each priced on fake tensors (FakeTensorMode: shapes,
no data) by `memory.PeakMeter`, the meter that measures the real step:

    backward    the state the rank holds between steps, the batch, and what forward and
                backward make: activations, the operators' temporaries, gradients; with the
                strategy's own buffers made and freed at the moments it makes and frees them
                (ZeRO's gradient buffers, reductions in flight, gathered parameters), emulated
                by hooks on the fake parameters and modules that allocate fake tensors
    step        the whole model state (gradients included) and the optimizer step's temporaries
    sync        after the step, with the gradients still there: a relaxed strategy's averages

What the backend does in threads of its own is not seen, but where it surfaces in the caller's
thread: gloo's reduce-scatter works on a copy of the whole buffer, which appears when the
caller waits for it; that copy is emulated there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from shardwise.observe.memory import PeakMeter
from shardwise.plan.activations import backward_peak, fake_state, let_go, optimizer_peak


def batch_bytes(batch: Callable, samples: int) -> int:
    """Bytes of a batch of `samples` (inputs and targets)."""
    with FakeTensorMode():
        return sum(t.numel() * t.element_size() for t in batch(samples))


def step_peak(
    job,
    memory: dict[str, int],
    optimizer_numels: list[int],
    samples: int,
    *,
    made_grads: int | None = None,
    dtype: torch.dtype | None = None,
    buffers: int = 0,
    emulation: Callable[[dict[str, nn.Parameter]], list] | None = None,
    step_extra: int = 0,
    after_step: int = 0,
    backward: int | None = None,
) -> int | None:
    """The largest of the three moments for a rank of `job` (a `costs.Job`) whose model state is
    `memory` (by category) and whose optimizer steps tensors of `optimizer_numels`.

    `made_grads`: the bytes of gradients backward makes anew each step (the rest of
    `memory["grads"]` outlives the step: DDP's buckets, stage 1's buffers); None: none, and
    each fresh gradient is let go once moved into its lasting buffer. `buffers`: the
    strategy's own lasting state beyond the model state (error feedback, an anchor).
    `emulation(params)` installs the strategy's hooks on the fake parameters (by name).
    `step_extra`: the strategy's buffers beside the optimizer's temporaries; `after_step`:
    its buffers after the step, with the gradients still there (averages, gathers).
    `backward`: what backward makes at its peak, where the caller traced it (a pipeline
    stage's whole schedule)."""
    if job.batch is None or samples < 1:
        return None
    state = sum(memory.values()) + batch_bytes(job.batch, samples) + buffers
    held = state - (made_grads or 0)
    if backward is None:
        backward = backward_peak(
            job.model,
            lambda: job.batch(samples),
            job.loss_fn,
            dtype,
            keep_grads=made_grads is not None,
            emulation=emulation,
        )
    step = optimizer_peak(optimizer_numels, job.optimizer) + step_extra
    return max(held + backward, state + step, state + after_step)


class ZeroEmulation:
    """ZeRO's buffers through forward and backward, made and freed as `strategies.zero` does,
    on fake tensors.

    Units (lists of parameter names) are reduced in reverse order, each once all its
    gradients are in and every later unit has been launched: a reduced slice (S elements) is
    made at the launch; stages 2 and 3 first make the unit's full gradient buffer (S x N) at
    its first gradient and, launching a unit, complete the one launched before it (its full
    buffer goes, its slice becomes the shard's gradient; fp32 masters: a copy in fp32). All are
    completed at the end of backward. On gloo a completion surfaces the backend's copy of the
    whole buffer. Stage 3 gathers a unit's parameters (S x N, and the slice's compute copy
    until the gather is waited for) before its forward, with the next unit's, frees them after
    it, gathers them again (with the previous unit's) when its output's gradient arrives, and
    frees them once its launch has completed the earlier unit; parameters outside every unit
    (unit 0) are gathered for the whole forward and backward.
    """

    def __init__(
        self,
        model: nn.Module,
        units: list[list[str]],
        unit_modules: list[str],
        world_size: int,
        stage: int,
        compute: torch.dtype,
        fp32_masters: bool,
        gloo: bool,
    ) -> None:
        self.model, self.units, self.unit_modules = model, units, unit_modules
        self.n, self.stage, self.compute = world_size, stage, compute
        self.fp32_masters, self.gloo = fp32_masters, gloo
        self.numels = [0] * len(units)
        self.order = list(reversed(range(len(units))))

    def _reset(self) -> None:
        count = len(self.units)
        self.pending = [len(names) for names in self.units]
        self.next_launch = 0
        self.grad_full: list = [None] * count
        self.reduced: list = [None] * count
        self.shard_grads: list = [None] * count
        self.full: list = [None] * count
        self.copies: list = [None] * count
        self.in_flight: list[int] = []
        self.queued = False

    def _shard(self, i: int) -> int:
        return -(-self.numels[i] // self.n)

    def __call__(self, params: dict[str, nn.Parameter]) -> list:
        self._reset()
        self.numels = [sum(params[name].numel() for name in names) for names in self.units]
        unit_of = {name: i for i, names in enumerate(self.units) for name in names}
        for name, p in params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, i=unit_of[name]: self._grad(p, i))
        if self.stage < 3:
            return []
        modules = dict(self.model.named_modules())
        offset = len(self.units) - len(self.unit_modules)  # 1 where unit 0 holds the rest
        handles = []
        if offset:
            handles.append(self.model.register_forward_pre_hook(lambda *_: self._gather(0, 0)))
        for i, name in enumerate(self.unit_modules, start=offset):
            handles += [
                modules[name].register_forward_pre_hook(lambda *_, i=i: self._gather(i, 1)),
                modules[name].register_forward_hook(lambda _m, _a, out, i=i: self._after(i, out)),
            ]
        return handles

    # ---- stage 3's gathers
    def _start_gather(self, i: int) -> None:
        if 0 <= i < len(self.units) and self.full[i] is None:
            self.full[i] = torch.empty(self._shard(i) * self.n, dtype=self.compute)
            self.copies[i] = torch.empty(self._shard(i), dtype=self.compute)

    def _gather(self, i: int, direction: int) -> None:
        self._start_gather(i)
        if direction:
            self._start_gather(i + direction)
        self.copies[i] = None  # waited for

    def _after(self, i: int, out: torch.Tensor) -> None:
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad: self._gather(i, -1))
        self.full[i] = None

    # ---- gradients
    def _grad(self, p: nn.Parameter, i: int) -> None:
        if self.stage >= 2 and self.grad_full[i] is None:
            self.grad_full[i] = torch.zeros(self._shard(i) * self.n, dtype=self.compute)
        p.grad = None  # moved into the unit's buffer
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.pending[i] -= 1
        while (
            self.next_launch < len(self.units) and self.pending[self.order[self.next_launch]] == 0
        ):
            self._launch(self.order[self.next_launch])
            self.next_launch += 1

    def _launch(self, i: int) -> None:
        earlier = list(self.in_flight)
        self.reduced[i] = torch.empty(self._shard(i), dtype=self.compute)
        self.in_flight.append(i)
        if self.stage >= 2:
            for j in earlier:
                self._complete(j)
        if self.stage == 3:
            self.full[i] = None  # (after the earlier unit's wait: alive through it)

    def _complete(self, i: int) -> None:
        if self.gloo:
            torch.empty(self._shard(i) * self.n, dtype=self.compute)  # seen, then let go
        reduced = self.reduced[i]
        if self.fp32_masters:
            reduced = reduced.to(torch.float32)
        if self.fp32_masters or self.stage >= 2:
            self.shard_grads[i] = reduced  # the shard's gradient (stage 1: its buffer's slice)
        self.grad_full[i] = self.reduced[i] = None
        self.in_flight.remove(i)

    def _finish(self) -> None:
        while self.next_launch < len(self.units):
            self._launch(self.order[self.next_launch])
            self.next_launch += 1
        for i in list(self.in_flight):
            self._complete(i)


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
    job,
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
    from shardwise.strategies.pipeline import schedule_order

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
