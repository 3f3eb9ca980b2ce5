"""Benchmark: what one call through our comm layer costs over the bare `torch.distributed` call.

Every collective a strategy issues goes through `shardwise.comm` (accounting, the flight
recorder, the wait's timer): the layer must cost next to nothing beside the collective. Each
rank issues `--calls` all-reduces of one float, in rounds that alternate three ways of making
the same call: ours (flight recorder and accounting on, as in training), torch's
(`dist.all_reduce`, the bare call) and the process group's own method, which both wrap (`comm/
direct.py`: ours calls it without torch's wrapper); and the same for an asynchronous all-reduce
waited through its handle. Per call, in microseconds: each way's median over rounds, and ours
less each of the others (the median over rounds of each round's difference: they ran side by
side). A collective's own time jitters by more than the layer costs, so the layers are also
timed alone: the same calls with the process group's all-reduce replaced by one that returns a
finished work at once (the differences are then all the wrappers').

Run: shardwise bench calls --world-size 2
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import comm
from shardwise.bench.common import emit

ROUNDS = 100  # rounds per variant trio (short ones: a drift in load hits all alike)
WAYS = ("ours", "torch", "process group")


def _timed(call, n: int) -> float:
    """Microseconds per call of `call`, `n` calls, on the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = torch.tensor([(time.perf_counter() - t0) / n * 1e6])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def variants(x: torch.Tensor) -> dict[str, dict[str, object]]:
    """The ways of making each kind of call (`WAYS`)."""
    group, options = dist.GroupMember.WORLD, dist.AllreduceOptions()
    return {
        "all_reduce": {
            "ours": lambda: comm.all_reduce(x),
            "torch": lambda: dist.all_reduce(x),
            "process group": lambda: group.allreduce([x], options).wait(),
        },
        "all_reduce async + wait": {
            "ours": lambda: comm.all_reduce(x, async_op=True).wait(),
            "torch": lambda: dist.all_reduce(x, async_op=True).wait(),
            "process group": lambda: group.allreduce([x], options).wait(),
        },
    }


class _Finished:
    def wait(self) -> bool:
        return True


def layers_alone(x: torch.Tensor, calls: int) -> dict[str, dict[str, float]]:
    """Microseconds per call of our layer over torch's wrapper and over the process group's
    call, that call stubbed (best of 5 timings of `calls` calls: no collective jitters there)."""
    real, finished = dist.ProcessGroup.allreduce, _Finished()
    dist.ProcessGroup.allreduce = lambda *args, **kwargs: finished
    try:
        figures = {}
        for kind, ways in variants(x).items():
            best = {
                way: min(timeit.repeat(call, number=calls, repeat=5)) / calls * 1e6
                for way, call in ways.items()
            }
            figures[kind] = {
                "over_torch_us": best["ours"] - best["torch"],
                "over_process_group_us": best["ours"] - best["process group"],
            }
        return figures
    finally:
        dist.ProcessGroup.allreduce = real


def main() -> None:
    parser = argparse.ArgumentParser(description="shardwise bench calls")
    parser.add_argument("--steps", type=int, default=10_000, help="calls per variant")
    parser.add_argument("--reps", type=int, default=ROUNDS, help="rounds")
    parser.add_argument("--out")
    args = parser.parse_args()
    rt = sw.init()
    x = torch.zeros(1)
    per_round = max(1, args.steps // args.reps)
    result = {"bench": "calls", "world_size": rt.world_size, "calls": per_round * args.reps}
    for kind, ways in variants(x).items():
        for call in ways.values():
            _timed(call, 200)  # warm-up
        rounds: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(args.reps):
            order = WAYS[r % 3 :] + WAYS[: r % 3]  # (each way first, second and last alike)
            for way in order if r % 2 == 0 else order[::-1]:
                rounds[way].append(_timed(ways[way], per_round))
        figures = {f"{way.replace(' ', '_')}_us": statistics.median(rounds[way]) for way in WAYS}
        for other in WAYS[1:]:
            diffs = [a - b for a, b in zip(rounds["ours"], rounds[other], strict=True)]
            figures[f"over_{other.replace(' ', '_')}_us"] = statistics.median(diffs)
        result[kind] = figures
    result["layer_alone_us"] = layers_alone(x, args.steps)
    if rt.is_main:
        print(
            "shardwise: the layer alone (the process group's call stubbed), ours over torch's "
            "wrapper / over the process group's call: "
            + ", ".join(
                f"{kind} {v['over_torch_us']:+.2f} / {v['over_process_group_us']:+.2f} us"
                for kind, v in result["layer_alone_us"].items()
            )
        )
        for kind in variants(x):
            v = result[kind]
            print(
                f"shardwise: {kind}: ours {v['ours_us']:.1f} us/call, torch {v['torch_us']:.1f}, "
                f"process group {v['process_group_us']:.1f}: ours over torch "
                f"{v['over_torch_us']:+.1f} us, over the process group "
                f"{v['over_process_group_us']:+.1f} us per call ({result['calls']:,} calls each)"
            )
        emit(result, args.out)
    sw.shutdown()


if __name__ == "__main__":
    main()
