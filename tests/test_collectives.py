"""Our collectives (`comm/collectives.py`) on real gloo groups: the process group's own calls
(`comm/direct.py`) where they can take a call, torch's wrapper where it must (a tensor subclass,
a complex tensor), each result against what the ranks' inputs make by hand; a group this rank is
not in refused in a line."""

from __future__ import annotations

import copy
import pickle
import sys
import zlib

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm.accounting import CommStats
from shardwise.comm.flight import KEEP, Call, recorder
from spawn import run


class Tagged(torch.Tensor):
    """A tensor subclass: torch functions dispatch through it (its default)."""


def _input(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64) * (rank + 2) + rank).to(dtype)


def collectives_as_by_hand():
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = [_input(k, 7) for k in range(world)]
    failures = []
    comm.stats.end_step()  # (what starting the job sent is not counted below)

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

    # Counted as made: calls by op, and the bytes a rank sends by the textbook algorithms'.
    counted = comm.stats.end_step().by_op
    made = {"all_reduce": 8, "all_gather": 1, "reduce_scatter": 1}
    for op, calls in made.items():
        if counted[op].calls != calls:
            failures.append(f"rank {rank}: {op}: {counted[op].calls} calls counted, {calls} made")
    # 2(n-1)/n of each payload: six of 7 float32 (four reductions, the subclass, the parameter),
    # two of 5 eight-byte numbers (int64, complex64)
    sent = 6 * (2 * (world - 1) * 28 // world) + 2 * (2 * (world - 1) * 40 // world)
    if counted["all_reduce"].bytes != sent:
        failures.append(f"rank {rank}: all_reduce bytes {counted['all_reduce'].bytes} != {sent}")

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


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def calls_as_recorded() -> dict:
    """Each call's site as the recorder names it, with the line it was made on; the running
    hash of the world's calls, with one made by hand call by call (the CRC of each signature
    chained); the history's (seq, shape) and the shapes issued."""
    rank = dist.get_rank()
    recorder.reset()
    x = torch.zeros(6)
    sites = []

    def site_of_last_call(line: int) -> None:
        sites.append((recorder.last().site, f"test_collectives.py:{line} (calls_as_recorded)"))

    line = _next_line()
    comm.all_reduce(x)
    site_of_last_call(line)
    line = _next_line()
    comm.all_reduce(x, async_op=True).wait()
    site_of_last_call(line)
    line = _next_line()
    comm.barrier()  # (recorded by the call itself, not through `_issue`)
    site_of_last_call(line)
    line = _next_line()
    comm.ring_all_reduce(x)  # (its messages are issued inside `shardwise.comm`)
    site_of_last_call(line)
    recorder.reset()
    by_hand = {}
    issued = []
    for i in range(3 * KEEP + 5):
        # The same bytes in two shapes: rank 1's call 100 differs from rank 0's in its shape.
        shape = (6,) if i == 100 and rank == 1 else (2, 3) if i % 3 else (3, 2)
        comm.all_reduce(x.view(shape))
        issued.append(shape)
        crc = zlib.crc32(f"all_reduce|{shape}|float32".encode()).to_bytes(4, "little")
        by_hand["world"] = zlib.crc32(crc, by_hand.get("world", 0))
    history = [(c.seq, tuple(c.shape)) for c in recorder.history]
    return {
        "sites": sites,
        "hash": recorder.hash["world"],
        "by_hand": by_hand["world"],
        "seq": recorder.seq["world"],
        "history": history,
        "issued": issued,
    }


def test_the_recorder_names_each_call_s_site_and_hashes_what_ranks_issued():
    ranks = run(calls_as_recorded, 2)
    for got in ranks:
        for site, expected in got["sites"]:
            assert site == expected
        assert got["hash"] == got["by_hand"]
        assert len(got["history"]) == KEEP
        seq = got["seq"]
        assert [s for s, _ in got["history"]] == list(range(seq - KEEP + 1, seq + 1))
        assert [shape for _, shape in got["history"]] == got["issued"][-KEEP:]
    assert ranks[0]["seq"] == ranks[1]["seq"]
    assert ranks[0]["hash"] != ranks[1]["hash"]  # (one call's shape differed)


def test_a_call_with_no_python_caller_is_recorded_with_no_site():
    """As from a C thread's callback: fewer frames above the recorder than a collective has."""
    from shardwise.comm.flight import FlightRecorder

    recorder = FlightRecorder()
    recorder.issue("all_reduce", None, torch.zeros(2), depth=1000)
    assert recorder.last().site == "?" and recorder.seq == {"world": 1}


def test_collectives_sum_gather_and_scatter_as_by_hand_whoever_takes_the_call():
    for failures in run(collectives_as_by_hand, 3):
        assert failures == []


def test_the_accounting_stays_bounded_and_exact_when_no_step_ever_ends():
    stats = CommStats()
    for k in range(3 * CommStats.FOLD_EVERY):
        stats.record("all_reduce", k, 0.001)
        stats.record_waited("all_gather", 2, 0.5, 0.25)
    assert len(stats._notes) <= CommStats.FOLD_EVERY
    step = stats.end_step()
    n = 3 * CommStats.FOLD_EVERY
    assert step.by_op["all_reduce"].calls == n
    assert step.by_op["all_reduce"].bytes == n * (n - 1) // 2
    assert step.by_op["all_gather"].bytes == 2 * n
    assert abs(step.by_op["all_gather"].overlap_s - 0.25 * n) < 1e-6
    assert stats.end_step().calls == 0


def test_a_recorded_call_reads_copies_and_pickles_as_made():
    call = Call("all_reduce", "0,2", 7, torch.Size([3, 4]), torch.float32, "train.py:12 (step)")
    assert (call.op, call.group, call.seq, call.shape) == ("all_reduce", "0,2", 7, (3, 4))
    assert call.dtype == "float32"
    assert call.describe() == "all_reduce #7 (group 0,2, 3x4 float32) at train.py:12 (step)"
    for again in (copy.copy(call), copy.deepcopy(call), pickle.loads(pickle.dumps(call))):
        assert type(again) is Call and again == call
    assert call != Call("all_reduce", "0,2", 8, (3, 4), torch.float32, "train.py:12 (step)")
