"""Hierarchical all-reduce: reduce inside groups, all-reduce across group leaders, broadcast back.

Groups are blocks of consecutive ranks, normally the ranks of one node, so that only one rank per
node talks over the slow inter-node links (the 2D / hierarchical scheme of Jia et al. 2018 and
NCCL's tree-of-rings idea). The sub-groups are created once, collectively, by `build`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.comm.collectives import ProcessGroup, all_reduce, broadcast, reduce


@dataclass(frozen=True)
class HierarchicalGroups:
    """This rank's intra-group and (for leaders) the group of all leaders."""

    group_size: int
    intra: ProcessGroup
    leaders: ProcessGroup | None  # None on ranks that are not group leaders

    @classmethod
    def build(
        cls, group_size: int, parent: ProcessGroup | None = None, timeout=None
    ) -> HierarchicalGroups:
        """Collective: every rank of `parent` must call this, with the same `group_size`."""
        ranks = dist.get_process_group_ranks(parent or dist.group.WORLD)
        if group_size < 1 or len(ranks) % group_size:
            raise ValueError(
                f"hierarchical group_size must divide the world size {len(ranks)}, got {group_size}"
            )
        me = dist.get_rank()
        intra = None
        for start in range(0, len(ranks), group_size):
            block = ranks[start : start + group_size]
            group = dist.new_group(block, timeout=timeout)
            if me in block:
                intra = group
        leader_ranks = ranks[::group_size]
        leaders = dist.new_group(leader_ranks, timeout=timeout)
        assert intra is not None
        return cls(group_size, intra, leaders if me in leader_ranks else None)


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HierarchicalGroups) -> None:
    """Sum `tensor` in place over all ranks, in three phases."""
    leader = 0  # group rank 0 of each block is its leader
    if groups.group_size > 1:
        reduce(tensor, dst=leader, group=groups.intra)
    if groups.leaders is not None and dist.get_world_size(groups.leaders) > 1:
        all_reduce(tensor, group=groups.leaders)
    if groups.group_size > 1:
        broadcast(tensor, src=leader, group=groups.intra)
