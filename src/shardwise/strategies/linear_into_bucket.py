"""Linear layers that write their weight gradient straight into its bucket slot.

DDP keeps every gradient in a flat bucket, and autograd makes each weight gradient in a fresh
tensor that DDP then copies in: on the bench MLP (5.8M parameters, 2 ranks on 2 cores) the copy
was 7 of a 22 ms backward. Megatron-LM avoids it for its own layers
(`gradient_accumulation_fusion`: the weight-gradient GEMM writes into the main-gradient buffer).
We do the same for the user's own `nn.Linear` modules without changing their class: while the
model is wrapped, the forward of each one whose weight is `MIN_BYTES` or more runs through
`LinearIntoSlot`, whose backward computes
`grad_output^T @ input` with the bucket slot as `out=` and hands autograd that slot as the
weight's gradient. Autograd's accumulation takes a fresh gradient that nothing else references as
`.grad` without copying it, so DDP's hook finds the gradient already in its place.

Exactness: the slot receives what autograd would have made, unweighted (the same GEMM on the
same operands; written `ROWS_BYTES` of rows at a time, which MKL may sum in another order where
the batch is long: within rounding, 5e-5 on 1000-row sums of magnitude 30), and DDP weighs it
where it lies (or its all-reduce averages it), as it would a copy. Where the simple case does
not hold, autograd's own path runs: `.grad` already set (no_sync accumulating, or
`zero_grad(set_to_none=False)`), the layer's second use in one forward, autocast, a dtype or
device other than the slot's, torch.compile tracing. Where autograd sums the slot with another
contribution (a weight also used outside its module), the sum is a fresh tensor and DDP copies
it.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# Below this, a weight's gradient is copied in as before: the copy of a small gradient costs
# about what the custom function's Python adds. Measured with `bench ddp`'s models, 2 ranks on
# 2 cores: the MLP's 6.4 and 16.8 MB weights stepped 2.5 ms faster (57.2-57.9 against 60.0-61.1
# ms), the GPT's, of 0.25-1 MB, 0.5 % slower (three interleaved runs of 9-15 repetitions).
MIN_BYTES = 2 * 2**20
# The gradient is written this many bytes of rows at a time. One GEMM with a larger output sends
# it past the cache to memory, and the all-reduce that reads it next waits for memory: the bench
# MLP stepped in 58.3-58.7 ms written a MiB at a time, 59.5-59.7 ms 256 KiB at a time, and
# 60.2-60.8 ms in one GEMM (4 MiB at a time: no better); one interleaved run each.
ROWS_BYTES = 2**20


class Slots(Protocol):
    def claim_slot(self, weight: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
        """Where `weight`'s fresh gradient (dtype and device of `grad`) may be written, or None
        where autograd must make it as usual."""


class LinearIntoSlot(torch.autograd.Function):
    """`F.linear`, whose backward writes the weight's gradient into the slot `slots` gives."""

    # The bias comes before the weight: autograd then accumulates the bias's gradient first, as
    # for its own linear, and buckets cut in reverse registration order follow backward's order.
    @staticmethod
    def forward(ctx, input, bias, weight, slots: Slots):
        ctx.save_for_backward(input, weight)
        ctx.slots = slots
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        need_input, need_bias, need_weight, _ = ctx.needs_input_grad
        # As aten's linear backward: every leading dimension folded into one.
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_output.matmul(weight) if need_input else None
        grad_weight = None
        if need_weight:
            input_2d = input.reshape(-1, input.shape[-1])
            slot = ctx.slots.claim_slot(weight, grad_2d)
            if slot is None:
                grad_weight = grad_2d.t().mm(input_2d)
            else:
                grad_t = grad_2d.t()
                rows = max(1, ROWS_BYTES // (slot.shape[1] * slot.element_size()))
                for start in range(0, slot.shape[0], rows):
                    torch.mm(grad_t[start : start + rows], input_2d, out=slot[start : start + rows])
                # A tensor object of its own, referenced by autograd alone: it becomes `.grad`.
                grad_weight = slot.view_as(slot)
        grad_bias = grad_2d.sum(0) if need_bias else None
        return grad_input, grad_bias, grad_weight, None


def _forward(module: nn.Linear, slots: Slots, input: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if (
        torch.compiler.is_compiling()  # (the compiled graph keeps autograd's own linear)
        or not (torch.is_grad_enabled() and weight.requires_grad)
        or torch.is_autocast_enabled(input.device.type)
        or input.dtype != weight.dtype
    ):
        return F.linear(input, weight, module.bias)
    return LinearIntoSlot.apply(input, module.bias, weight, slots)


class WritesIntoSlots:
    """The `nn.Linear` modules of a model whose forward runs through `LinearIntoSlot`, until
    `remove()`: those whose weight's gradient has a slot and is `MIN_BYTES` or more. Subclasses
    with a forward of their own keep it."""

    def __init__(self, model: nn.Module, slots: Slots, weights: set[nn.Parameter]) -> None:
        self.modules = [
            m
            for m in model.modules()
            if isinstance(m, nn.Linear)
            and type(m).forward is nn.Linear.forward
            and "forward" not in vars(m)  # (someone else's replacement stays)
            and m.weight in weights
            and m.weight.numel() * m.weight.element_size() >= MIN_BYTES
        ]
        for m in self.modules:
            m.forward = partial(_forward, m, slots)

    def remove(self) -> None:
        for m in self.modules:
            del m.forward
        self.modules = []
