"""Asynchronous all-reduce algorithms a strategy can choose between, by name.

Each takes a flat buffer, starts summing it over the group and returns a `Handle`
(`all_reduce_base`): the backend's own (native), ours as point-to-point messages (ring,
hierarchical), or through shared memory where every rank is on one host (`shared_memory`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal, get_args

import torch
import torch.distributed as dist

from shardwise.comm.all_reduce_base import AllReduceAlgorithm, NativeAllReduce, ThreadedAllReduce
from shardwise.comm.hierarchical import HierarchicalGroups, hierarchical_all_reduce
from shardwise.comm.ring import ring_all_reduce
from shardwise.comm.shared_memory import SharedMemoryAllReduce

AllReduceName = Literal["native", "shared_memory", "ring", "hierarchical"]

__all__ = [
    "AllReduceAlgorithm",
    "AllReduceName",
    "NativeAllReduce",
    "ThreadedAllReduce",
    "check_all_reduce_name",
    "make_all_reduce",
]


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
    if name == "shared_memory":
        return SharedMemoryAllReduce(timeout)
    if name == "ring":
        return RingAllReduce(timeout)
    if name == "hierarchical":
        return HierarchicalAllReduce(group_size or 1, timeout)
    check_all_reduce_name(name)
    raise AssertionError(f"no all-reduce made for {name!r}")


def check_all_reduce_name(name: str) -> None:
    """A one-line error unless `name` is one of `AllReduceName`'s."""
    names = get_args(AllReduceName)
    if name not in names:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, names))}, got {name!r}")
