"""The communication layer: counted collectives, our all-reduce algorithms, and accounting."""

from shardwise.comm import flight, interrupt, store
from shardwise.comm.accounting import CommSnapshot, CommStats, native_volume, stats
from shardwise.comm.algorithms import make_all_reduce
from shardwise.comm.collectives import (
    Handle,
    all_gather_into_tensor,
    all_gather_pairwise,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    exchange,
    group_rank,
    group_size,
    irecv,
    recv,
    reduce,
    reduce_scatter_tensor,
    send,
)
from shardwise.comm.hierarchical import HierarchicalGroups, hierarchical_all_reduce
from shardwise.comm.ring import ring_all_reduce

__all__ = [
    "CommSnapshot",
    "CommStats",
    "Handle",
    "HierarchicalGroups",
    "all_gather_into_tensor",
    "all_gather_pairwise",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "exchange",
    "flight",
    "group_rank",
    "group_size",
    "hierarchical_all_reduce",
    "interrupt",
    "irecv",
    "make_all_reduce",
    "native_volume",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "ring_all_reduce",
    "send",
    "stats",
    "store",
]
