"""The communication layer: counted collectives, our all-reduce algorithms, and accounting."""

from shardwise.comm.accounting import CommSnapshot, CommStats, native_volume, stats
from shardwise.comm.algorithms import make_all_reduce
from shardwise.comm.collectives import (
    Handle,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    exchange,
    reduce,
    reduce_scatter_tensor,
)
from shardwise.comm.hierarchical import HierarchicalGroups, hierarchical_all_reduce
from shardwise.comm.ring import ring_all_reduce

__all__ = [
    "CommSnapshot",
    "CommStats",
    "Handle",
    "HierarchicalGroups",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "exchange",
    "hierarchical_all_reduce",
    "make_all_reduce",
    "native_volume",
    "reduce",
    "reduce_scatter_tensor",
    "ring_all_reduce",
    "stats",
]
