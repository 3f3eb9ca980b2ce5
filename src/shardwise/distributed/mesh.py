"""The device mesh: ranks laid out on a (pipeline, data, tensor) grid, one process group per line.

    rank = (pp_index * dp_size + dp_index) * tp_size + tp_index

Tensor parallel varies fastest, so a tensor-parallel group is consecutive ranks: on a real
cluster those share a node and its fast links, which tensor parallel (two all-reduces per
transformer block, on the critical path) needs most. Data parallel comes next and pipeline
parallel, whose point-to-point messages tolerate the slowest links, is outermost. Megatron-LM and
torchtitan order their meshes the same way.

Every rank creates every group, in the same order (`new_group` is collective over the world),
once; strategies then receive the group of their axis as a `Runtime` whose `rank` and
`world_size` are the coordinates along it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from shardwise.distributed import runtime
from shardwise.distributed.runtime import Runtime

AXES = ("pp", "dp", "tp")  # outermost first


@dataclass(frozen=True)
class DeviceMesh:
    """Sizes and this rank's coordinates along each axis, with its process groups."""

    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, dist.ProcessGroup]
    ranks: dict[str, list[int]]  # global ranks of this rank's group along each axis

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    def runtime(self, axis: str, base: Runtime) -> Runtime:
        """A runtime whose rank, world size and group are this rank's along `axis`."""
        return dataclasses.replace(
            base, rank=self.coords[axis], world_size=self.sizes[axis], group=self.groups[axis]
        )

    def __repr__(self) -> str:
        sizes = " x ".join(f"{a}={self.sizes[a]}" for a in AXES)
        return f"DeviceMesh({sizes}; this rank at {self.coords})"


def check_sizes(world_size: int, dp_size: int | None, tp_size: int, pp_size: int) -> dict[str, int]:
    """The three sizes, `dp_size` inferred when None; a one-line error when they do not fit."""
    for name, size in (("tp", tp_size), ("pp", pp_size), ("dp", dp_size)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"mesh size {name} must be a positive integer, got {size!r}")
    if dp_size is None:
        if world_size % (tp_size * pp_size):
            raise ValueError(
                f"mesh tp={tp_size} x pp={pp_size} does not divide the world size {world_size}"
            )
        dp_size = world_size // (tp_size * pp_size)
    if dp_size * tp_size * pp_size != world_size:
        raise ValueError(
            f"mesh dp={dp_size} x tp={tp_size} x pp={pp_size} = {dp_size * tp_size * pp_size} "
            f"ranks, but the world has {world_size}"
        )
    return {"pp": pp_size, "dp": dp_size, "tp": tp_size}


def coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    tp_index = rank % sizes["tp"]
    dp_index = rank // sizes["tp"] % sizes["dp"]
    pp_index = rank // (sizes["tp"] * sizes["dp"])
    return {"pp": pp_index, "dp": dp_index, "tp": tp_index}


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    return (coords["pp"] * sizes["dp"] + coords["dp"]) * sizes["tp"] + coords["tp"]


def build_mesh(
    dp_size: int | None = None, tp_size: int = 1, pp_size: int = 1, rt: Runtime | None = None
) -> DeviceMesh:
    """Create the mesh's process groups (collective: every rank calls it with the same sizes)."""
    rt = rt or runtime.init()
    sizes = check_sizes(rt.world_size, dp_size, tp_size, pp_size)
    mine = coordinates(rt.rank, sizes)
    groups: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    for axis in AXES:
        others = [a for a in AXES if a != axis]
        # One group per point of the other two axes, created in the same order everywhere.
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                line = [
                    rank_of({others[0]: i, others[1]: j, axis: k}, sizes)
                    for k in range(sizes[axis])
                ]
                group = dist.new_group(line, timeout=rt.timeout)
                if rt.rank in line:
                    groups[axis], ranks[axis] = group, line
    return DeviceMesh(sizes=sizes, coords=mine, groups=groups, ranks=ranks)
