"""Benchmark: what one call through our comm layer costs over the bare `torch.distributed` call.

Every collective a strategy issues goes through `shardwise.comm` (accounting, the flight
recorder, the wait's timer): the layer must cost next to nothing beside the collective. Each
rank issues `--calls` all-reduces of one float, in rounds that alternate ours (flight recorder
and accounting on, as in training) and the bare call, and the same for an asynchronous
all-reduce waited through its handle. Per call, in microseconds: ours, bare, and the difference
(the median over rounds of each round's difference: the two ran side by side). A collective's
own time jitters by more than the layer costs, so the layer is also timed alone: the same calls
with the backend's all-reduce replaced by one that returns a finished work at once (the
difference to that stub called bare is then all ours).

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

ROUNDS = 100  # rounds per variant pair (short ones: a drift in load hits both alike)


def _timed(call, n: int) -> float:
    """Microseconds per call of `call`, `n` calls, on the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = torch.tensor([(time.perf_counter() - t0) / n * 1e6])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def variants(x: torch.Tensor) -> dict[str, tuple]:
    """(ours, bare) per kind of call."""
    return {
        "all_reduce": (lambda: comm.all_reduce(x), lambda: dist.all_reduce(x)),
        "all_reduce async + wait": (
            lambda: comm.all_reduce(x, async_op=True).wait(),
            lambda: dist.all_reduce(x, async_op=True).wait(),
        ),
    }


class _Finished:
    def wait(self) -> bool:
        return True


def layer_alone(x: torch.Tensor, calls: int) -> dict[str, float]:
    """Microseconds per call of our layer over the bare call, the backend's all-reduce stubbed
    (best of 5 timings of `calls` calls: no collective jitters there)."""
    real, finished = dist.all_reduce, _Finished()
    dist.all_reduce = lambda *args, **kwargs: finished
    try:
        figures = {}
        for kind, (ours, bare) in variants(x).items():
            best = {
                name: min(timeit.repeat(call, number=calls, repeat=5)) / calls * 1e6
                for name, call in (("ours", ours), ("bare", bare))
            }
            figures[kind] = best["ours"] - best["bare"]
        return figures
    finally:
        dist.all_reduce = real


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
    for kind, (ours, bare) in variants(x).items():
        _timed(ours, 200), _timed(bare, 200)  # warm-up
        rounds: dict[str, list[float]] = {"ours": [], "bare": []}
        for r in range(args.reps):
            pair = [("ours", ours), ("bare", bare)]
            for name, call in pair if r % 2 == 0 else pair[::-1]:
                rounds[name].append(_timed(call, per_round))
        diffs = [a - b for a, b in zip(rounds["ours"], rounds["bare"], strict=True)]
        result[kind] = {
            "ours_us": statistics.median(rounds["ours"]),
            "bare_us": statistics.median(rounds["bare"]),
            "overhead_us": statistics.median(diffs),
        }
    result["layer_alone_us"] = layer_alone(x, args.steps)
    if rt.is_main:
        print(
            "shardwise: the layer alone (backend stubbed): "
            + ", ".join(f"{k} {v:.2f} us" for k, v in result["layer_alone_us"].items())
        )
        for kind in variants(x):
            v = result[kind]
            print(
                f"shardwise: {kind}: ours {v['ours_us']:.1f} us/call, bare {v['bare_us']:.1f}: "
                f"overhead {v['overhead_us']:+.1f} us per call ({result['calls']:,} calls each)"
            )
        emit(result, args.out)
    sw.shutdown()


if __name__ == "__main__":
    main()
