"""ZeRO stage 2: stage 1, with the gradients sharded too.

A unit's full gradient exists only from its first parameter's gradient until its reduce-scatter
has run, during backward; afterwards a rank keeps only the averaged slice it owns. (Where every
rank is on one host's CPU, full gradients wait in staging buffers in shared memory, at most
`bucket_mb` of them or two units' (three with a stage-3 root), and are reduced together:
`ZeroStage2._flush`.) Memory with fp32 Adam: 4P parameters + (4P gradients + 8P optimizer
state) / N.

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

from shardwise.comm.shared_memory import SharedMemoryCollectives
from shardwise.strategies.zero.stage1 import ZeroStage1
from shardwise.strategies.zero.units import FlatUnit


def staging_buffers(
    stage: int, has_root: bool, units: int, largest_bytes: int, budget_bytes: int
) -> int:
    """How many full-gradient staging buffers, each the largest unit's size, stages 2/3 make
    (`StagedGradients`): as many as `budget_bytes` (ZeRO's `bucket_mb`) holds, at least two
    (one unit reducing while the next fills; three in stage 3 with a root unit, whose head's
    gradients come first in backward and its embeddings' last), no more than there are units."""
    least = 3 if stage == 3 and has_root else 2
    return min(units, max(least, budget_bytes // max(1, largest_bytes)))


class StagedGradients:
    """Buffers in shared memory, `count` of them, each the size of the largest unit, that
    units take for their full gradient during backward, reduce-scattered where they lie
    (`SharedMemoryCollectives`) instead of exchanged through gloo's loopback sockets. A unit
    that finds none free (a model whose gradients come in an order of their own) makes its own
    and exchanges it, as every rank does: what is free follows from what backward did, not
    from timing. Communication buffers, made with the model and kept for the job (DeepSpeed's
    reduce buckets are so too; `plan` counts them)."""

    def __init__(self, shared: SharedMemoryCollectives, units: list[FlatUnit], count: int) -> None:
        largest = max((u.full for u in units), key=torch.Tensor.numel)
        made = [
            shared.new_buffer(largest.numel(), largest.dtype, largest.device) for _ in range(count)
        ]
        # (all ranks agree: where one could not map its files, none are shared anywhere)
        self.buffers = [b for b in made if shared.placed(b)]
        for unit in units:  # (any unit may take any buffer: its slots in each, made once)
            for b in self.buffers:
                if b.dtype == unit.full.dtype:
                    unit.keep_slots(b[: unit.full.numel()])

    def take(self, full: torch.Tensor, busy: set[int]) -> torch.Tensor | None:
        """A free buffer's first `full.numel()` elements, for a unit whose full buffer is
        `full`; None where none is free (a buffer in use: its address in `busy`)."""
        free = [b for b in self.buffers if b.data_ptr() not in busy and b.dtype == full.dtype]
        return free[0][: full.numel()] if free else None

    def holds(self, full: torch.Tensor | None) -> bool:
        return full is not None and any(full.data_ptr() == b.data_ptr() for b in self.buffers)


class ZeroStage2(ZeroStage1):
    stage = 2
    keeps_full_grads = False
    staging: StagedGradients | None = None  # shared-memory buffers for full gradients

    def prepare_units(self) -> None:
        # Full gradient buffers are made on demand, one unit at a time: in shared memory where
        # the units are sharded over the whole world (no mesh axis, no HSDP) of one host's CPU
        # ranks (`shared`) and no codec encodes them (`StagedGradients`).
        if self.exchanges_slices and self.shared is not None:
            largest = max(u.full.numel() * u.full.element_size() for u in self.units)
            count = staging_buffers(
                self.stage, self.has_root_unit(), len(self.units), largest, self.bucket_bytes
            )
            self.staging = StagedGradients(self.shared, self.units, count)
        self.deferred: list[int] = []  # staged units whose reduction waits for `_flush`

    def has_root_unit(self) -> bool:
        return False  # (stage 3's units can have one)

    def _on_grad(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        if unit.grad_full is None and self.backward.enabled:
            # Made in this backward: every slot is written whole (a gradient, or zero where a
            # parameter got none: `_zero`), only the padding needs zeros.
            unit.grad_full = self._staged(unit)
            if unit.grad_full is None:
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
        unit = self.units[index]
        if self.staging is not None and not self.staging.holds(unit.grad_full):
            staged = self._staged(unit)  # (a no_sync() sum: reduced where it lies, as any)
            if staged is not None:
                unit.grad_full = staged.copy_(unit.grad_full)
        if self.staging is not None and self.staging.holds(unit.grad_full):
            self.deferred.append(index)  # (reduced with the others staged: `_flush`)
            return
        if self.staging is not None and self.staging.buffers:
            # Exchanged through the process group, where a peer that runs the units in another
            # order may have staged it: the ranks first meet in shared memory, saying which
            # unit each exchanges, and are all refused if they differ (before, this rank
            # waited in gloo for a peer that waited in shared memory, until the timeout).
            self.shared.meet_before_exchange(index)
        # At most two reductions in flight: the one launched before this one is waited for
        # now, so its full gradient goes while backward runs on (left to the end of backward,
        # every unit's would be alive at once, as much as stage 1 keeps).
        earlier = [i for i, u in enumerate(self.units) if u.handle is not None]
        super()._launch(index)
        for i in earlier:
            self._complete(i)

    def _staged(self, unit: FlatUnit) -> torch.Tensor | None:
        """A staging buffer for `unit`'s full gradient: a free one (not any other unit's full
        gradient now), or, where every one holds a deferred unit's, one freed by reducing
        those (`_flush`). Decided by what this rank's backward did, not by timing: every rank
        takes the same one."""
        if self.staging is None:
            return None
        staged = self.staging.take(unit.full, self._busy())
        if staged is None and self.deferred:
            self._flush()
            staged = self.staging.take(unit.full, self._busy())
        return staged

    def _busy(self) -> set[int]:
        return {u.grad_full.data_ptr() for u in self.units if u.grad_full is not None}

    def _flush(self) -> None:
        """Reduce the deferred units, one after the other on this thread, and hand over their
        slices: their staging buffers are free again.

        A staged unit's reduction waits until the staging buffers run out or backward ends.
        Reduced as each unit completed, on the communication thread, the ranks met once per
        unit, each time the faster one waiting for the slower, and the thread took the cores
        that compute (overlap buys nothing where they are the same): the bench GPT's ZeRO-3
        step (five units) took 2-7 ms longer so, the MLP's (three) 1-4 ms (2 ranks on 2
        cores, interleaved rounds). Now the ranks meet once for all of them."""
        deferred, self.deferred = self.deferred, []
        for i in deferred:
            self._reduce(i, here=True)
        for i in deferred:
            self._complete(i)

    def _finish(self) -> None:
        self._flush()
        super()._finish()

    def release_full_grad(self, unit: FlatUnit) -> None:
        unit.grad_full = None  # reduced: only this rank's slice lives on, as the shard's grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.backward.take_back(self._take_back_abandoned)  # (a backward that raised)
        self.weighing.clear()  # (a backward that raised never reached `_finish`)
        self.deferred.clear()  # (nor `_flush`)
        for unit, shard in zip(self.units, self.shards, strict=True):
            unit.grad_full = None  # (what no_sync() accumulated, where it was discarded)
            shard.grad = None

    def _take_back_abandoned(self) -> None:
        super()._take_back_abandoned()
        # A hook that raised left its parameter's gradient on the parameter (the hook moves it
        # into the unit, then drops it): the next backward added to it.
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate every unit's full (unsharded) gradient locally,
        without communication; the next one outside adds its own and reduce-scatters each unit
        once (see the module's docstring: 4P bytes of full gradients meanwhile)."""
        return self.backward.paused()
