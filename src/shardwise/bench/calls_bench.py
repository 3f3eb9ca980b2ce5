"""Benchmark: what one call through our comm layer costs over the bare `torch.distributed` call.

Every collective a strategy issues goes through `shardwise.comm` (accounting, the flight
recorder, the wait's timer): the layer must cost next to nothing beside the collective. Each
rank issues `--steps` all-reduces of one float each way, `--reps` times (the median of the
repetitions): ours (flight recorder and accounting on,
as in training), torch's (`dist.all_reduce`, the bare call) and the process group's own method,
which both wrap (`comm/direct.py`: ours calls it without torch's wrapper); and the same for an
asynchronous all-reduce waited through its handle. The ways take turns call by call (each of
the six orders of the three in turn), each call timed on its own: a drift in the machine's
load, or a call that stalls, then hits every way alike, and the median call of each way is
what it costs (rounds of 100 calls a way, timed whole, differed by 20 us run to run: a few
calls of milliseconds decide a round's mean). Per call, in microseconds, the slowest rank's
median: each way's, and ours less each other's. A collective's own time jitters by more than
a layer costs, so the layers are also timed alone: the same calls with the process group's
all-reduce replaced by one that returns a finished work at once (the differences are then all
the wrappers'). End to end, each costs several times what it costs alone: on 2 cores, code run
right after a wait runs from cold caches.

Run: shardwise bench calls --world-size 2
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import timeit

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import comm
from shardwise.bench.common import emit

WAYS = ("ours", "torch", "process group")
ORDERS = list(itertools.permutations(WAYS))


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


def per_call_medians(ways: dict[str, object], calls: int) -> dict[str, float]:
    """Microseconds of each way's median call, the ways taking turns call by call; the
    slowest rank's."""
    durations: dict[str, list[float]] = {way: [] for way in WAYS}
    clock = time.perf_counter
    for way in WAYS:  # (warm-up)
        for _ in range(200):
            ways[way]()
    dist.barrier()
    for i in range(calls):
        for way in ORDERS[i % len(ORDERS)]:
            t0 = clock()
            ways[way]()
            durations[way].append(clock() - t0)
    medians = torch.tensor([statistics.median(durations[way]) * 1e6 for way in WAYS])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(WAYS, medians.tolist(), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description="shardwise bench calls")
    parser.add_argument("--steps", type=int, default=10_000, help="calls of each way")
    parser.add_argument("--reps", type=int, default=3, help="repetitions")
    parser.add_argument("--out")
    args = parser.parse_args()
    rt = sw.init()
    x = torch.zeros(1)
    result = {"bench": "calls", "world_size": rt.world_size, "calls": args.steps}
    for kind, ways in variants(x).items():
        reps = [per_call_medians(ways, args.steps) for _ in range(args.reps)]
        figures = {
            f"{way.replace(' ', '_')}_us": statistics.median(r[way] for r in reps) for way in WAYS
        }
        for other in WAYS[1:]:
            by_rep = [r["ours"] - r[other] for r in reps]
            figures[f"over_{other.replace(' ', '_')}_us"] = statistics.median(by_rep)
            figures[f"over_{other.replace(' ', '_')}_us_by_rep"] = by_rep
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
                f"{v['over_process_group_us']:+.1f} us per call (medians of {result['calls']:,} "
                f"calls each way; over torch by repetition: "
                + " ".join(f"{d:+.1f}" for d in v["over_torch_us_by_rep"])
                + ")"
            )
        emit(result, args.out)
    sw.shutdown()


if __name__ == "__main__":
    main()
