"""Each rank's share of the global batch, so that data parallel averages over samples, not ranks.

Data parallel sums the ranks' gradients, each multiplied by a weight. With equal local batches
the weight is 1/replicas and the sum is the mean gradient of the global batch. When rank r's
batch holds n_r of the global batch's N samples (per-rank batch sizes weighted by capacity, the
last partial batch of an epoch), its gradient is the mean over its n_r samples, and the global
batch's mean gradient is Σ_r (n_r / N) g_r: the weight must be n_r / N. Any mean-reduced loss
(per sample, or per token with a token count declared instead of samples) stays exact.

A rank declares n_r before its backward (`sw.train_step` does, from the batch's first
dimension). N is either declared too (a loader that plans every rank's batch size knows it:
free) or summed over the data-parallel group by one small asynchronous all-reduce started at
once, so it travels while the forward pass runs and is waited for only when the first gradient
bucket is about to be reduced. A declared N is checked once, by that all-reduce, in the first
step that declares it: a wrong one weighed every gradient wrong in silence, and one declared on
some ranks only left the others waiting in the all-reduce the declaring ranks never joined.
(Once only, as a declared N is meant to be free: a later step that declares it on some ranks
alone still leaves the others waiting, until the timeout names the all-reduce.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.arguments import whole_number
from shardwise.comm.mean import divide_, divide_into
from shardwise.distributed.runtime import Runtime


def batch_samples(inputs: Any) -> int:
    """Samples in a batch: the first dimension of its (first) tensor."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0:
            raise ValueError("cannot count the samples of a 0-dimensional input")
        return inputs.shape[0]
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    if isinstance(inputs, (list, tuple)) and inputs:
        return batch_samples(inputs[0])
    raise ValueError(
        f"cannot count the samples of a {type(inputs).__name__}: pass samples= explicitly"
    )


class BatchShare:
    """The weight of this rank's gradient in the sum over its data-parallel group."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.local: int | None = None
        self.total: int | None = None
        # Whether every rank's share is 1/replicas. Every rank must agree: one that weighs its
        # gradient and one that leaves it to the all-reduce's mean (`uneven_weight`) would sum
        # different things. A rank's own count cannot tell: with 1, 2 and 3 samples of 6, the
        # second's share is 1/3.
        self.even = False
        self._count: torch.Tensor | None = None
        self._handle: comm.Handle | None = None
        self._total_checked = False  # (a declared total: by the all-reduce, once)

    def declare(self, samples: int, total: int | None = None) -> None:
        """This rank's samples for the next synchronised backward, and the group's (None: sum
        them over the group now, asynchronously). Every rank of the group must declare. Where
        the total is given, the shares count as uneven on every rank (each weighed by its
        own), as nothing tells a rank the others' counts."""
        samples = whole_number("samples", samples)
        if total is not None:
            total = whole_number("total samples", total, least=max(samples, 1))
        self.local, self.total = samples, total
        world = self.runtime.world_size
        if world == 1 and total not in (None, samples):
            raise ValueError(f"total={total} samples, but the only replica declared {samples}")
        if world > 1 and (total is None or not self._total_checked):
            # The counts and their squares, summed: equal shares if and only if the sum of
            # squares is N * (N/W)^2, i.e. W * squares == N^2. Then how many ranks declared a
            # total, their totals and those squared (`_check_total`). Whole numbers: summed
            # exactly in int64. (Always five, whether a total is declared or not: every rank
            # must send the same; 24 bytes more than the two counts alone, a step.)
            declared = total or 0
            count = [samples, samples * samples, total is not None, declared, declared**2]
            self._count = torch.tensor(count, dtype=torch.int64, device=self.runtime.device)
            self._handle = comm.all_reduce(self._count, group=self.runtime.group, async_op=True)
        else:  # (one replica: its share is all; or a total checked before, each its own share)
            self.total = samples if total is None else total
            self.even = world == 1

    def _resolve(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            summed, squares, declared, totals, total_squares = self._count.tolist()
            self._handle = self._count = None
            if declared:
                self._check_total(summed, declared, totals, total_squares)
            else:
                self.total = summed
                self.even = self.runtime.world_size * squares == summed * summed
        if self.total == 0:
            raise ValueError("no rank declared any samples for this step")

    def _check_total(self, summed: int, declared: int, totals: int, total_squares: int) -> None:
        """The declared total against the samples the ranks declared, from the all-reduce's
        sums alone: the same answer, and the same words, on every rank."""
        world = self.runtime.world_size
        if declared != world:
            raise ValueError(
                f"a total of the step's samples was declared on {declared} of the {world} "
                "data-parallel ranks: declare it on every rank, or on none"
            )
        if world * total_squares != totals * totals:  # (all equal: no spread about the mean)
            raise ValueError(
                f"the {world} data-parallel ranks declared different totals of the step's "
                "samples: each declares the same, the sum of every rank's samples"
            )
        if totals != world * summed:
            raise ValueError(
                f"total={totals // world} samples declared, but the {world} data-parallel "
                f"ranks declared {summed} between them: the total is the sum of every rank's "
                "samples"
            )
        self._total_checked = True
        self.even = False  # (each weighed by its own share: a rank does not see the others')

    def weigh(self, grad: torch.Tensor) -> None:
        """Multiply `grad` (this rank's local mean gradient) by its weight, in place."""
        weight = self.uneven_weight()
        if weight is None and self.runtime.world_size == 1:
            return  # (dividing by one: the same bits, a pass over the gradients saved)
        if weight is None:
            divide_(grad, self.runtime.world_size)  # equal after all: the same rounding as ever
        else:
            grad.mul_(weight)

    def weigh_into(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        """`out` = `grad` times its weight: the copy into a bucket and the weighing in one pass
        over the memory, the same bits as copying, then `weigh`."""
        weight = self.uneven_weight()
        if weight is None and self.runtime.world_size == 1:
            out.copy_(grad)
        elif weight is None:
            divide_into(grad, self.runtime.world_size, out)
        else:
            torch.mul(grad, weight, out=out)

    def uneven_weight(self) -> float | None:
        """samples / total unless every rank's share is 1/replicas (or none declared); else
        None. The same answer on every rank."""
        if self.local is None:
            return None
        self._resolve()
        return None if self.even else self.local / self.total

    def done(self) -> None:
        """The synchronised backward finished: the next one needs its own declaration."""
        self._resolve()
        self.local = self.total = None
        self.even = False


class WeighedOnArrival:
    """Which of this backward's gradients were weighed as they moved into their bucket (the copy
    and the weighing in one pass over them, `BatchShare.weigh_into`). The others, sums that
    no_sync() accumulated in place, are weighed as their bucket is launched (`weigh_rest`).
    DDP's buckets and ZeRO's units both move gradients in through this."""

    def __init__(self, share: BatchShare) -> None:
        self.share = share
        self.done: set[nn.Parameter] = set()

    def move_in(self, p: nn.Parameter, slot: torch.Tensor, weigh: bool) -> None:
        """`p`'s fresh gradient into `slot`, weighed on the way where `weigh` (a backward that
        reduces, by an all-reduce that does not average); else copied as it is: inside no_sync()
        a sum to come, weighed at the launch."""
        if weigh:
            self.share.weigh_into(p.grad, slot)
            self.done.add(p)
        else:
            slot.copy_(p.grad)

    def weigh_in_place(self, p: nn.Parameter, slot: torch.Tensor, weigh: bool) -> None:
        """`p`'s fresh gradient, made in `slot` itself: weighed there where `weigh` (the same
        bits as `move_in`'s)."""
        if weigh:
            self.share.weigh(slot)
            self.done.add(p)

    def zeroed(self, p: nn.Parameter) -> None:
        self.done.add(p)  # (a zero gradient, whatever its weight)

    def weigh_rest(
        self,
        params: list[nn.Parameter],
        bucket: torch.Tensor,
        slot_of: Callable[[nn.Parameter], torch.Tensor],
    ) -> None:
        """Weigh what of `bucket` (holding `params`) was not weighed as it moved in."""
        rest = [p for p in params if p not in self.done]
        if len(rest) == len(params):
            self.share.weigh(bucket)
        else:
            for p in rest:
                self.share.weigh(slot_of(p))

    def clear(self) -> None:
        """The backward is over (or a new one begins after zero_grad)."""
        self.done.clear()
