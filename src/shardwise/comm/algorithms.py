"""Asynchronous all-reduce algorithms a strategy can choose between, by name.

Each takes a flat buffer, starts summing it over the group and returns a `Handle`. The native
algorithm is asynchronous in the backend already. Ours (ring, hierarchical) are sequences of
messages, so they run on one communication thread per algorithm, over a process group of their
own: one thread keeps the order of operations identical on every rank, and the separate group
keeps them from interleaving with collectives the training thread issues meanwhile.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from shardwise.comm.accounting import stats
from shardwise.comm.collectives import Handle, ProcessGroup, all_reduce
from shardwise.comm.hierarchical import HierarchicalGroups, hierarchical_all_reduce
from shardwise.comm.ring import ring_all_reduce

AllReduceName = Literal["native", "ring", "hierarchical"]


class AllReduceAlgorithm:
    """Sums a flat buffer over the group, asynchronously: `start(buffer)` returns a Handle.

    A data-parallel strategy `describe`s each of its buffers once, in order, before the first
    `start`: stateful algorithms (compression) keep their state per buffer index, which is
    what `state_dict` saves (the same buffers exist again in a fresh prepare of the model).
    """

    def describe(self, buffer: torch.Tensor, shapes: list[torch.Size]) -> None:
        """`buffer` holds tensors of `shapes`, in order."""

    def start(self, buffer: torch.Tensor) -> Handle:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)[:3]}")

    def close(self) -> None:
        pass


class NativeAllReduce(AllReduceAlgorithm):
    """The backend's own all-reduce (gloo's ring/halving-doubling, NCCL's rings and trees)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group

    def start(self, buffer: torch.Tensor) -> Handle:
        return all_reduce(buffer, group=self.group, async_op=True)


class ThreadedAllReduce(AllReduceAlgorithm):
    """Runs a blocking all-reduce function on a dedicated thread and process group."""

    op = "all_reduce"

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-comm")

    def _run(self, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def _run_in_background(self, buffer: torch.Tensor) -> None:
        with stats.background():
            self._run(buffer)

    def start(self, buffer: torch.Tensor) -> Handle:
        return Handle(self.op, self._thread.submit(self._run_in_background, buffer), None)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class RingAllReduce(ThreadedAllReduce):
    op = "ring_all_reduce"

    def __init__(self, timeout: timedelta | None) -> None:
        super().__init__()
        self.group = dist.new_group(timeout=timeout)  # collective: all ranks create it together

    def _run(self, buffer: torch.Tensor) -> None:
        ring_all_reduce(buffer, self.group)


class HierarchicalAllReduce(ThreadedAllReduce):
    op = "hierarchical_all_reduce"

    def __init__(self, group_size: int, timeout: timedelta | None) -> None:
        super().__init__()
        self.groups = HierarchicalGroups.build(group_size, timeout=timeout)

    def _run(self, buffer: torch.Tensor) -> None:
        hierarchical_all_reduce(buffer, self.groups)


def make_all_reduce(
    name: AllReduceName, group_size: int | None = None, timeout: timedelta | None = None
) -> AllReduceAlgorithm:
    """Collective when `name` is not native (it creates process groups)."""
    if name == "native":
        return NativeAllReduce()
    if name == "ring":
        return RingAllReduce(timeout)
    if name == "hierarchical":
        return HierarchicalAllReduce(group_size or 1, timeout)
    raise ValueError(
        f"all-reduce algorithm must be 'native', 'ring' or 'hierarchical', got {name!r}"
    )
