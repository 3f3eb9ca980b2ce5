"""Our collectives (`comm/collectives.py`) on real gloo groups: the process group's own calls
(`comm/direct.py`) where they can take a call, torch's wrapper where it must (a tensor subclass,
a complex tensor), each result against what the ranks' inputs make by hand; a group this rank is
not in refused in a line."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise import comm
from spawn import run


class Tagged(torch.Tensor):
    """A tensor subclass: torch functions dispatch through it (its default)."""


def _input(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64) * (rank + 2) + rank).to(dtype)


def collectives_as_by_hand():
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = [_input(k, 7) for k in range(world)]
    failures = []

    def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        if not torch.equal(got, expected):
            failures.append(f"rank {rank}: {name}: {got.tolist()} != {expected.tolist()}")

    reductions = {
        dist.ReduceOp.SUM: lambda ts: sum(ts[1:], ts[0].clone()),
        dist.ReduceOp.MAX: lambda ts: torch.stack(ts).amax(0),
        dist.ReduceOp.MIN: lambda ts: torch.stack(ts).amin(0),
        dist.ReduceOp.PRODUCT: lambda ts: torch.stack(ts).prod(0),
    }
    for op, by_hand in reductions.items():
        x = inputs[rank].clone()
        comm.all_reduce(x, op=op)
        check(f"all_reduce {op}", x, by_hand(inputs))
    for dtype in (torch.int64, torch.complex64):
        x = _input(rank, 5, dtype)
        comm.all_reduce(x, async_op=True).wait()
        check(f"all_reduce {dtype}", x, sum(_input(k, 5, dtype) for k in range(world)))
    tagged = inputs[rank].clone().as_subclass(Tagged)
    comm.all_reduce(tagged)
    summed = reductions[dist.ReduceOp.SUM](inputs)
    check("all_reduce of a subclass", tagged.as_subclass(torch.Tensor), summed)
    parameter = torch.nn.Parameter(inputs[rank].clone(), requires_grad=False)
    comm.all_reduce(parameter.data)
    check("all_reduce of a parameter", parameter.data, summed)

    shard = _input(rank, 3)
    gathered = torch.empty(3 * world)
    comm.all_gather_into_tensor(gathered, shard, async_op=True).wait()
    check("all_gather", gathered, torch.cat([_input(k, 3) for k in range(world)]))
    full = _input(rank, 3 * world)
    mine = torch.empty(3)
    comm.reduce_scatter_tensor(mine, full)
    summed = sum(_input(k, 3 * world) for k in range(world))
    check("reduce_scatter", mine, summed[3 * rank : 3 * rank + 3])

    # A group of ranks 0 and 1: rank 2 is not a member, and its call is refused in a line.
    pair = dist.new_group([0, 1])
    x = inputs[rank].clone()
    try:
        comm.all_reduce(x, group=pair)
    except ValueError as e:
        refused = str(e)
    else:
        refused = ""
        check("all_reduce in a pair", x, inputs[0] + inputs[1])
    if (rank == 2) != ("not a member" in refused):
        failures.append(f"rank {rank}: all_reduce in a pair: {refused or 'not refused'}")
    return failures


def test_collectives_sum_gather_and_scatter_as_by_hand_whoever_takes_the_call():
    for failures in run(collectives_as_by_hand, 3):
        assert failures == []
