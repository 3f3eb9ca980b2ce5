"""ZeRO stage 2: stage 1, with the gradients sharded too.

A unit's full gradient exists only from its first parameter's gradient until its reduce-scatter
has run, during backward; afterwards a rank keeps only the averaged slice it owns. Memory with
fp32 Adam: 4P parameters + (4P gradients + 8P optimizer state) / N. Gradients cannot be
accumulated locally any more (`no_sync`): each backward reduces, and the shards add up.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardwise.strategies.zero.stage1 import ZeroStage1
from shardwise.strategies.zero.units import FlatUnit


class ZeroStage2(ZeroStage1):
    stage = 2
    keeps_full_grads = False

    def prepare_units(self) -> None:
        pass  # full gradient buffers are made on demand, one unit at a time

    def _on_grad(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        if unit.grad_full is None:
            unit.grad_full = torch.zeros_like(unit.full, memory_format=torch.contiguous_format)
        unit.slot(unit.grad_full, p).copy_(p.grad)
        p.grad = None  # the parameter's gradient is not kept beyond this hook

    def _launch(self, index: int) -> None:
        # At most two reductions in flight: the one launched before this one is waited for
        # now, so its full gradient goes while backward runs on (left to the end of backward,
        # every unit's would be alive at once, as much as stage 1 keeps).
        earlier = [i for i, u in enumerate(self.units) if u.handle is not None]
        super()._launch(index)
        for i in earlier:
            self._complete(i)

    def release_full_grad(self, unit: FlatUnit) -> None:
        unit.grad_full = None  # reduced: only this rank's slice lives on, as the shard's grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.grad = None

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        raise RuntimeError(
            f"ZeRO stage {self.stage} reduces every backward pass; to accumulate, call "
            "backward k times (loss / k) before the step: the gradient shards add up"
        )
