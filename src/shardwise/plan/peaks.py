"""Predicted peak memory of a training step: the most bytes a rank holds at once, from the
moments every strategy shares; a strategy's own buffers come from its cost model
(`plan.cost_models`: ZeRO's emulated units, a pipeline stage's traced schedule).

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
from torch.utils._pytree import tree_leaves

from shardwise.plan.activations import backward_peak, optimizer_peak
from shardwise.plan.costs import CostJob


def batch_bytes(batch: Callable, samples: int) -> int:
    """Bytes of a batch of `samples` (inputs and targets: tensors, or dicts of them; a tensor
    that is both, a dict batch's labels, once)."""
    with FakeTensorMode():
        tensors = {id(t): t for t in tree_leaves(batch(samples))}
        return sum(t.numel() * t.element_size() for t in tensors.values())


def step_peak(
    job: CostJob,
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
    accumulated: int | None = None,
) -> int | None:
    """The largest of the three moments for a rank of `job` (a `costs.CostJob`) whose model state is
    `memory` (by category) and whose optimizer steps tensors of `optimizer_numels`.

    `made_grads`: the bytes of gradients backward makes anew each step (the rest of
    `memory["grads"]` outlives the step: DDP's buckets, stage 1's buffers); None: none, and
    each fresh gradient is let go once moved into its lasting buffer. `buffers`: the
    strategy's own lasting state beyond the model state (error feedback, an anchor).
    `emulation(params)` installs the strategy's hooks on the fake parameters (by name).
    `step_extra`: the strategy's buffers beside the optimizer's temporaries; `after_step`:
    its buffers after the step, with the gradients still there (averages, gathers).
    `backward`: what backward makes at its peak, where the caller traced it (a pipeline
    stage's whole schedule). Under accumulation (`job.accumulate` > 1), the micro-batches after
    the first run their backward beside the gradients accumulated so far: `accumulated` bytes
    (default: `made_grads`; ZeRO-2/3 under no_sync: every unit's full buffer)."""
    if job.batch is None or samples < 1:
        return None
    state = sum(memory.values()) + batch_bytes(job.batch, samples) + buffers
    held = state - (made_grads or 0)
    if backward is None and emulation is not None:  # (the strategy's own: traced for it alone)
        micro = lambda: job.batch(job.micro(samples))  # noqa: E731
        backward = backward_peak(job.model, micro, job.loss_fn, dtype, emulation=emulation)
    elif backward is None:  # (under accumulation, its largest micro-batch's)
        backward = _plain_backward_peak(job, samples, dtype, keep_grads=made_grads is not None)
    step = optimizer_peak(optimizer_numels, job.optimizer) + step_extra
    later = 0
    if job.accumulate > 1:
        kept = made_grads or 0 if accumulated is None else accumulated
        later = kept + _plain_backward_peak(job, samples, dtype, keep_grads=False)
    return max(held + max(backward, later), state + step, state + after_step)


def _plain_backward_peak(
    job: CostJob, samples: int, dtype: torch.dtype | None, keep_grads: bool
) -> int:
    """`backward_peak` of the largest micro-batch of `samples`, with no strategy's hooks: the
    same for every strategy that adds none (kept with the job's traces)."""
    micro = job.micro(samples)
    return job.traced(
        ("backward", micro, dtype, keep_grads),
        lambda: backward_peak(
            job.model, lambda: job.batch(micro), job.loss_fn, dtype, keep_grads=keep_grads
        ),
    )
