"""Benchmark: our DDP against torch's DistributedDataParallel, same job, same processes.

Both wrap identical copies of the model and train with AdamW on the same batches. Their steps
are interleaved one by one, in a shuffled order (`interleaved_times`), so
drift in machine load hits both alike, and the environment (threads per rank, malloc
thresholds) is set once by the launcher for both. A repetition's step time is the slowest
rank's mean; we report the median over repetitions, and each repetition's ratio. The floors
(`floor.py`) are timed in the same rounds: the model with no wrapper (compute alone), and
our step's collectives replayed bare (its bytes alone).

Run: shardwise bench ddp --world-size 2   (or python -m shardwise.bench.ddp_bench under torchrun)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.bench.common import (
    interleaved_times,
    make_workload,
    medians,
    state_bytes_after_backward,
    train_step,
)
from shardwise.bench.floor import bare_collectives, by_rep, calls_of, floor_figures
from shardwise.bench.ratio_report import main_for, ratio_table
from shardwise.nn.models import num_parameters


def torch_ddp_bucket_bytes(model: nn.parallel.DistributedDataParallel) -> list[int]:
    """Sizes of the gradient buckets torch's reducer allocated (a copy beside .grad)."""
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return [int(s) for s in str(sizes).split(",") if s.strip()]


def bench_model(name: str, steps: int, reps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    factory, batch, loss_fn = make_workload(name, rank)
    torch.manual_seed(0)
    ours, ours_opt = sw.prepare(factory(), sw.DDP(), optimizer=torch.optim.AdamW, lr=1e-4)
    torch.manual_seed(0)
    theirs = nn.parallel.DistributedDataParallel(factory())
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    torch.manual_seed(0)
    alone = factory()  # the compute floor: no wrapper, no communication
    variants = {"ours": (ours, ours_opt), "torch": (theirs, theirs_opt)}
    variants["compute"] = (alone, torch.optim.AdamW(alone.parameters(), lr=1e-4))
    steps_of = {key: train_step(*pair, batch, loss_fn) for key, pair in variants.items()}
    steps_of["bytes:ours"] = bare_collectives(calls_of(steps_of["ours"]))
    times = interleaved_times(steps_of, steps, reps)
    step_times = medians(times)
    params = num_parameters(ours)
    memory = {key: state_bytes_after_backward(*variants[key], batch, loss_fn) for key in variants}
    memory["torch"]["total"] += sum(torch_ddp_bucket_bytes(theirs))
    global_batch = batch[0].shape[0] * world
    result = {"model": name, "params": params, "global_batch": global_batch}
    for key in ("ours", "torch", "compute"):
        result[key] = {
            "step_time_s": step_times[key],
            "samples_per_s": global_batch / step_times[key],
            "bytes_per_param": memory[key]["total"] / params,
        }
    result["ours"].update(floor_figures(times, "ours"))
    result["ratio_step_time_ours_over_torch"] = step_times["ours"] / step_times["torch"]
    result["ratio_ours_over_torch_by_rep"] = by_rep(times, "ours", "torch")
    # (the bound no implementation of the same step beats, repetition by repetition)
    result["ratio_compute_over_torch_by_rep"] = by_rep(times, "compute", "torch")
    sw.DDP().close(ours)
    return result


def table_rows(result: dict) -> list[list[str]]:
    return ratio_table(result, ["ours", "torch", "compute"], baseline="torch")


if __name__ == "__main__":
    main_for("ddp", bench_model, table_rows)
