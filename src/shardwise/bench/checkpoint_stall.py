"""Checkpoint stall, ours against torch's Distributed Checkpoint (DCP), on one state.

Each rank holds the tiny GPT under our DDP with AdamW state after one step. In rotating order,
`--reps` times: our `run_saver.Saver` (background writer) and `dcp.async_save`, then our
synchronous save and `dcp.save`. The stall is how long the training thread is held by the call
(the asynchronous writes are waited for outside the timing). Rank 0 writes the medians to
`OUT/result.json`.

Run by `shardwise bench faults` on 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise.bench.common import gpt_batch, gpt_model
from shardwise.checkpoint import run_saver
from shardwise.nn.models import lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description="checkpoint stall: ours vs DCP")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rt = sw.init()
    model, opt = sw.prepare(gpt_model(), sw.DDP(), optimizer=torch.optim.AdamW, lr=1e-3)
    x, y = gpt_batch(4)
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    root = Path(args.out)
    times = _interleaved_stalls(_saves(rt, root, model, opt), args.reps)
    if rt.is_main:
        medians = {k: statistics.median(v) for k, v in times.items()}
        (root / "result.json").write_text(json.dumps(medians))
    sw.shutdown()


def _saves(rt, root: Path, model, opt) -> dict[str, Callable[[int], float]]:
    """Each way to save the state, by name: a call (given the repetition) that saves it and
    returns the seconds the training thread was held."""
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ours = {True: run_saver.Saver(root / "ours-sync", rt, keep=1, sync=True)}
    ours[False] = run_saver.Saver(root / "ours-async", rt, keep=1)

    def save_ours(sync: bool, rep: int) -> float:
        started = time.perf_counter()
        ours[sync].save(model, opt, schedule, rep + 1, data={})
        stall = time.perf_counter() - started
        ours[sync].wait()
        return stall

    def save_dcp(sync: bool, rep: int) -> float:
        state = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
        where = str(root / f"dcp-{'sync' if sync else 'async'}-{rep}")
        started = time.perf_counter()
        pending = dcp.save(state, checkpoint_id=where) if sync else None
        if not sync:
            pending = dcp.async_save(state, checkpoint_id=where)
        stall = time.perf_counter() - started
        if not sync:
            pending.result()
        return stall

    return {
        "ours_async": lambda rep: save_ours(False, rep),
        "dcp_async": lambda rep: save_dcp(False, rep),
        "ours_sync": lambda rep: save_ours(True, rep),
        "dcp_sync": lambda rep: save_dcp(True, rep),
    }


def _interleaved_stalls(
    saves: dict[str, Callable[[int], float]], reps: int
) -> dict[str, list[float]]:
    """Each save's stalls over `reps` rounds, in an order rotated every round."""
    times: dict[str, list[float]] = {k: [] for k in saves}
    names = list(saves)
    for rep in range(reps + 1):  # the first round warms up (allocations, lazy imports)
        for key in names[rep % len(names) :] + names[: rep % len(names)]:
            dist.barrier()
            stall = saves[key](rep)
            if rep:
                times[key].append(stall)
    return times


if __name__ == "__main__":
    main()
