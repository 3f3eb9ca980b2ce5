"""Flat units: ZeRO's storage. Some parameters laid end to end in one padded buffer (so N
ranks divide it), each parameter a view into it; rank r owns slice r.

Stages 1/2 make units by size (`bucket_mb`, reverse registration order, like DDP's buckets);
stage 3 makes one unit per block (`stage3.stage3_units`), so gathering follows the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise import comm
from shardwise.comm.flat import flatten
from shardwise.nn.meta_init import ParameterSource, read_range
from shardwise.strategies.zero.freed import mark_freed, mark_gathered

Place = Callable[[int, torch.dtype, torch.device], torch.Tensor]  # a zeroed buffer's maker


class FlatUnit:
    """Some parameters flattened into one padded buffer; this rank owns one equal slice of it."""

    def __init__(
        self,
        params: list[nn.Parameter],
        rank: int,
        world_size: int,
        dtype: torch.dtype,
        group: comm.ProcessGroup | None,
        all_gather: Callable[..., comm.Handle],
        source: tuple[ParameterSource, list[str]] | None = None,
        place: Place | None = None,
    ) -> None:
        """`source`: (where the values are, the parameters' names) for parameters that hold
        no values yet (`nn/meta_init.py`): only this rank's slice is read, and the full buffer
        starts freed (stage 3). `all_gather`: the collective that gathers the full buffer from
        the slices (`ZeroStage1.all_gather`). `place`: what makes the zeroed buffer that slice
        is read into (its numel, dtype, device), where not any tensor."""
        assert len({p.dtype for p in params}) == 1, "a unit holds one dtype"
        self.params, self.rank, self.world_size, self.group = params, rank, world_size, group
        self.all_gather = all_gather
        self.shard_numel = -(-sum(p.numel() for p in params) // world_size)
        self.numels = [p.numel() for p in params]
        offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.offset_of = dict(zip(params, offsets, strict=True))  # parameters hash by identity
        padded = self.shard_numel * world_size  # shard_numel is rounded up: N divides this
        device = params[0].device
        if source is None:
            exact = torch.zeros(padded, dtype=params[0].dtype, device=device)
            offset = 0
            with torch.no_grad():
                for p, n in zip(params, self.numels, strict=True):
                    exact[offset : offset + n].copy_(p.reshape(-1))
                    offset += n
            self.initial = None  # the values are the full buffer's
            self.master_init = self.own(exact).clone() if dtype != exact.dtype else None
            self.full = exact.to(
                dtype
            )  # the compute copy (the same tensor without mixed precision)
        else:
            make = place or (lambda n, dtype, device: torch.zeros(n, dtype=dtype, device=device))
            self.initial = make(self.shard_numel, params[0].dtype, device)
            start = rank * self.shard_numel
            for offset, values in read_range(*source, self.numels, start, start + self.shard_numel):
                self.initial[offset : offset + values.numel()].copy_(values)
            self.master_init = self.initial if dtype != self.initial.dtype else None
            self.full = torch.empty(padded, dtype=dtype, device=device)  # never written
        self.bind_views()
        if source is not None:
            self.full.untyped_storage().resize_(0)  # (untouched: it cost no memory) gathered later
        # Each parameter's slot in a buffer that lives as long as the unit (`keep_slots`), by
        # the buffer's address: made once, not sliced from it in every gradient's hook.
        self._kept_slots: dict[int, dict[nn.Parameter, torch.Tensor]] = {}
        self.grad_full: torch.Tensor | None = None
        self.fresh_grads = False  # stage 2: grad_full made in this backward (not a no_sync sum)
        self.reduced: torch.Tensor | None = None
        self.received: torch.Tensor | None = None  # every rank's copy of this rank's slice
        self.handle: comm.Handle | None = None
        self.gather_handle: comm.Handle | None = None

    def own_values(self) -> torch.Tensor:
        """This rank's slice of the parameters' values (a view of the full buffer, or what was
        read from the source while the full buffer is freed)."""
        return self.own(self.full) if self.initial is None else self.initial.to(self.full.dtype)

    def bind_views(self) -> None:
        """Make every parameter a view into `full` (so gathering `full` updates the model)."""
        offset = 0
        for p, n in zip(self.params, self.numels, strict=True):
            p.data = self.full[offset : offset + n].view_as(p)
            offset += n

    def slot(self, buffer: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """`p`'s place in a unit-sized buffer."""
        kept = self._kept_slots.get(buffer.data_ptr())
        if kept is not None:
            return kept[p]
        offset = self.offset_of[p]
        return buffer[offset : offset + p.numel()].view(p.shape)

    def keep_slots(self, buffer: torch.Tensor) -> None:
        """Make every parameter's slot in `buffer` (unit-sized, kept as long as this unit:
        the views hold it) once, for `slot`. On every gradient's hook, slicing the slot from
        the buffer cost 25 us of the bench GPT's ZeRO-3 hook (1.3 ms a step, 53 hooks), its
        code cold after each layer's backward."""
        self._kept_slots[buffer.data_ptr()] = {
            p: buffer[offset : offset + p.numel()].view(p.shape)
            for p, offset in self.offset_of.items()
        }

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One tensor per parameter (any device/dtype) -> a padded unit-sized flat buffer."""
        out = torch.zeros(self.full.numel(), dtype=dtype, device=self.full.device)
        flat = flatten([t.to(out.device) for t in tensors], dtype)
        out[: flat.numel()] = flat
        return out

    def own(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a unit-sized buffer."""
        return buffer[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    # Stage 3: the full buffer exists only while the unit runs forward or backward; in between,
    # its parameters refuse to compute (`freed.py`).
    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            mark_freed(p)

    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def start_gather(self, shard: torch.Tensor) -> None:
        if self.is_gathered() or self.gather_handle is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        for p in self.params:
            mark_gathered(p)
        if self.world_size == 1:  # the shard is the whole: a copy (and cast), no message
            with torch.no_grad():
                self.full.copy_(shard.detach())
            return
        self.gather_handle = self.all_gather(self.full, shard.detach(), self.group, async_op=True)

    def wait_gather(self) -> None:
        # (let go of before its wait: one that failed is not waited for, and raised, again)
        handle, self.gather_handle = self.gather_handle, None
        if handle is not None:
            handle.wait()
