"""Hybrid sharding's process groups (HSDP: FSDP's HYBRID_SHARD, the MiCS idea of Zhang et al.,
VLDB 2022): the N ranks split into N/K shard groups of K consecutive ranks, which shard the
model's state among themselves, and K replicate groups, the ranks at the same index of every
shard group, which hold the same slices and average them.

    shard groups      [0 .. K-1], [K .. 2K-1], ...          reduce-scatter, all-gather
    replicate groups  [0, K, 2K, ...], [1, K+1, ...], ...   all-reduce of one slice

Consecutive ranks share a node on a real cluster (as the device mesh lays out tensor parallel,
`mesh.py`), so the gathers and reduce-scatters, three quarters of the traffic, stay on the fast
links; only the slice's all-reduce, 1/K of the gradients, crosses nodes. Every rank creates
every group, in the same order, once (`new_group` is collective over the world).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardwise.arguments import whole_number
from shardwise.distributed.runtime import Runtime


@dataclass(frozen=True)
class ShardGroups:
    """This rank's shard group (its index in it) and replicate group."""

    shard_size: int  # K: ranks that share one copy of the model's state
    shard_rank: int  # this rank's index in its shard group: which slice it owns
    shard: dist.ProcessGroup | None  # the K ranks (None: the default group)
    replicate: dist.ProcessGroup | None  # one rank per shard group (None: one shard group)
    num_replicas: int  # N / K

    @property
    def is_hybrid(self) -> bool:
        return self.num_replicas > 1


def check_shard_size(shard_size: int | None, world_size: int | None = None) -> None:
    """A one-line error unless `shard_size` is None or a whole number >= 1 dividing the world
    (where `world_size` is known)."""
    if shard_size is None:
        return
    whole_number("shard_group", shard_size, least=1)
    if world_size is not None and world_size % shard_size:
        raise ValueError(
            f"shard_group={shard_size} must divide the world size {world_size} "
            f"(shard groups of {shard_size} consecutive ranks)"
        )


def whole(rt: Runtime) -> ShardGroups:
    """One shard group: the runtime's own group (the whole world, or a mesh axis)."""
    return ShardGroups(rt.world_size, rt.rank, rt.group, None, 1)


def build_shard_groups(shard_size: int | None, rt: Runtime) -> ShardGroups:
    """Create the shard and replicate groups (collective: every rank of the world calls it with
    the same `shard_size`). None, or the whole world, is one shard group and creates nothing."""
    check_shard_size(shard_size, rt.world_size)
    if shard_size is None or shard_size == rt.world_size:
        return whole(rt)
    assert rt.group is None, "shard groups are cut from the whole world only"
    n, k = rt.world_size, shard_size
    shard = replicate = None
    for start in range(0, n, k):
        ranks = list(range(start, start + k))
        group = dist.new_group(ranks, timeout=rt.timeout)
        if rt.rank in ranks:
            shard = group
    for index in range(k):
        ranks = list(range(index, n, k))
        group = dist.new_group(ranks, timeout=rt.timeout)
        if rt.rank in ranks:
            replicate = group
    return ShardGroups(k, rt.rank % k, shard, replicate, n // k)
