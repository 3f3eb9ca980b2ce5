"""The device mesh: ranks laid out on a (pipeline, data, tensor) grid, one process group per line.

    rank = (pp_index * dp + dp_index) * tp + tp_index

Tensor parallel varies fastest, so a tensor-parallel group is consecutive ranks: on a real
cluster those share a node and its fast links, which tensor parallel (two all-reduces per
transformer block, on the critical path) needs most. Data parallel comes next and pipeline
parallel, whose point-to-point messages tolerate the slowest links, is outermost. Megatron-LM and
torchtitan order their meshes the same way.

Every rank creates every group, in the same order (`new_group` is collective over the world),
once; strategies then receive the group of their dimension as a `Runtime` whose `rank` and
`world_size` are the coordinates along it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from shardwise import runtime
from shardwise.runtime import Runtime

DIMS = ("pp", "dp", "tp")  # outermost first


@dataclass(frozen=True)
class DeviceMesh:
    """Sizes and this rank's coordinates along each dimension, with its process groups."""

    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, dist.ProcessGroup]
    ranks: dict[str, list[int]]  # global ranks of this rank's group along each dimension

    @property
    def dp(self) -> int:
        return self.sizes["dp"]

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    @property
    def pp(self) -> int:
        return self.sizes["pp"]

    def runtime(self, dim: str, base: Runtime | None = None) -> Runtime:
        """A runtime whose rank, world size and group are this rank's along `dim`."""
        base = base or runtime.current()
        return dataclasses.replace(
            base, rank=self.coords[dim], world_size=self.sizes[dim], group=self.groups[dim]
        )

    def __repr__(self) -> str:
        sizes = " x ".join(f"{d}={self.sizes[d]}" for d in DIMS)
        return f"DeviceMesh({sizes}; this rank at {self.coords})"


def check_sizes(world_size: int, dp: int | None, tp: int, pp: int) -> dict[str, int]:
    """The three sizes, `dp` inferred when None; a one-line error when they do not fit."""
    for name, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"mesh size {name} must be a positive integer, got {size!r}")
    if dp is None:
        if world_size % (tp * pp):
            raise ValueError(f"mesh tp={tp} x pp={pp} does not divide the world size {world_size}")
        dp = world_size // (tp * pp)
    if dp * tp * pp != world_size:
        raise ValueError(
            f"mesh dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, "
            f"but the world has {world_size}"
        )
    return {"pp": pp, "dp": dp, "tp": tp}


def coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    tp_index = rank % sizes["tp"]
    dp_index = rank // sizes["tp"] % sizes["dp"]
    pp_index = rank // (sizes["tp"] * sizes["dp"])
    return {"pp": pp_index, "dp": dp_index, "tp": tp_index}


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    return (coords["pp"] * sizes["dp"] + coords["dp"]) * sizes["tp"] + coords["tp"]


def build_mesh(dp: int | None = None, tp: int = 1, pp: int = 1) -> DeviceMesh:
    """Create the mesh's process groups (collective: every rank calls it with the same sizes)."""
    rt = runtime.current() if runtime._runtime is not None else runtime.init()
    sizes = check_sizes(rt.world_size, dp, tp, pp)
    mine = coordinates(rt.rank, sizes)
    groups: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    for dim in DIMS:
        others = [d for d in DIMS if d != dim]
        # One group per point of the other two dimensions, created in the same order everywhere.
        for a in range(sizes[others[0]]):
            for b in range(sizes[others[1]]):
                line = [
                    rank_of({others[0]: a, others[1]: b, dim: i}, sizes) for i in range(sizes[dim])
                ]
                group = dist.new_group(line, timeout=rt.timeout)
                if rt.rank in line:
                    groups[dim], ranks[dim] = group, line
    return DeviceMesh(sizes=sizes, coords=mine, groups=groups, ranks=ranks)
