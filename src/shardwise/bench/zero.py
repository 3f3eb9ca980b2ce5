"""Benchmark: DDP and ZeRO-1/2/3 (ours) against torch FSDP2 (`fully_shard`), one job, one run.

Every variant wraps an identical copy of the model, trains with AdamW fp32 on the same batches,
and is timed in rotating order. Reported per variant: step time, samples/s, model-state bytes
per parameter per rank (parameters, gradients, optimizer state, measured after backward), and,
for ours, the bytes our accounting layer counted for one step. FSDP2 shards per unit as our
stage 3 does (each block / layer, then the root).

Run: shardwise bench zero --world-size 2
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.bench.common import make_workload, median_step_times, state_bytes_after_backward
from shardwise.bench.report import main_for, ratio_table
from shardwise.models import num_parameters
from shardwise.strategies.zero import stage3_units

OURS = {"ddp": lambda: sw.DDP(), **{f"zero{s}": (lambda s=s: sw.ZeRO(stage=s)) for s in (1, 2, 3)}}


def fsdp2(factory) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = factory()
    for unit in stage3_units(model):
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def comm_bytes_of_one_step(model, opt, batch, loss_fn) -> int:
    x, y = batch
    sw.comm.stats.end_step()
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return sw.comm.stats.end_step().bytes


def bench_model(name: str, steps: int, reps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    factory, batch, loss_fn = make_workload(name, rank)
    variants = {}
    for key, strategy in OURS.items():
        torch.manual_seed(0)
        variants[key] = sw.prepare(factory(), strategy(), optimizer=torch.optim.AdamW, lr=1e-4)
    torch.manual_seed(0)
    theirs = fsdp2(factory)
    variants["fsdp2"] = (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4))
    step_times = median_step_times(variants, batch, loss_fn, steps, reps)
    params = num_parameters(variants["ddp"][0])
    global_batch = batch[0].shape[0] * world
    result = {"model": name, "params": params, "global_batch": global_batch}
    for key, (model, opt) in variants.items():
        memory = state_bytes_after_backward(model, opt, batch, loss_fn)
        result[key] = {
            "step_time_s": step_times[key],
            "samples_per_s": global_batch / step_times[key],
            "bytes_per_param": memory["total"] / params,
            # FSDP2 talks to torch.distributed directly: our layer cannot count its bytes.
            "comm_bytes_per_step": None
            if key == "fsdp2"
            else comm_bytes_of_one_step(model, opt, batch, loss_fn),
        }
    result["ratio_zero3_over_fsdp2"] = step_times["zero3"] / step_times["fsdp2"]
    return result


def table_rows(result: dict) -> list[list[str]]:
    return ratio_table(result, [*OURS, "fsdp2"], baseline="fsdp2")


if __name__ == "__main__":
    main_for("zero", bench_model, table_rows)
