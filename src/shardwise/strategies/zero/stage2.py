"""ZeRO stage 2: stage 1, with the gradients sharded too.

A unit's full gradient exists only from its first parameter's gradient until its reduce-scatter
has run, during backward; afterwards a rank keeps only the averaged slice it owns. Memory with
fp32 Adam: 4P parameters + (4P gradients + 8P optimizer state) / N.

Gradient accumulation over K micro-batches can go two ways. Outside `no_sync()` every backward
reduce-scatters and the averaged slices add up in the shards: K times the communication, but
never more than a unit or two of full gradient at once. Inside `no_sync()` (FSDP2's
`set_requires_gradient_sync(False)`), the full gradient of every unit stays and accumulates
locally, and the first backward outside it adds its own and reduce-scatters each unit once:
DDP's communication, at the price of 4P bytes of full gradients while accumulating (stage 1's
memory).
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
        if unit.grad_full is None and self.backward.enabled:
            # Made in this backward: every slot is written whole (a gradient, or zero where a
            # parameter got none: `_zero`), only the padding needs zeros.
            unit.grad_full = torch.empty_like(unit.full, memory_format=torch.contiguous_format)
            unit.grad_full[sum(unit.numels) :].zero_()
            unit.fresh_grads = True
        elif unit.grad_full is None:  # no_sync(): the first of sums to come
            unit.grad_full = torch.zeros_like(unit.full, memory_format=torch.contiguous_format)
            unit.fresh_grads = False
        slot = unit.slot(unit.grad_full, p)
        if unit.fresh_grads:
            self.weighing.move_in(p, slot, weigh=True)
        else:
            slot.add_(p.grad)  # onto a no_sync() sum
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
        for unit, shard in zip(self.units, self.shards, strict=True):
            unit.grad_full = None  # (what no_sync() accumulated, where it was discarded)
            shard.grad = None

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate every unit's full (unsharded) gradient locally,
        without communication; the next one outside adds its own and reduce-scatters each unit
        once (see the module's docstring: 4P bytes of full gradients meanwhile)."""
        return self.backward.paused()
