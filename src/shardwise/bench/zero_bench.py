"""Benchmark: DDP and ZeRO-1/2/3 (ours) against torch FSDP2 (`fully_shard`), one job, one run.

DeepSpeed ZeRO-1/2/3 join when `deepspeed` is installed (`pip install --no-build-isolation
deepspeed`; CPU accelerator over the same gloo group). Every variant wraps an identical copy of
the model, trains with AdamW fp32 on the same batches, and is timed step by step, shuffled. Reported
per variant: step time, samples/s, model-state bytes per parameter per rank (parameters,
gradients, optimizer state, measured after backward), and, for ours, the bytes our accounting
layer counted for one step, and its floors (`floor.py`: compute alone, and compute plus its
collectives replayed bare), timed in the same rounds. FSDP2 shards per unit as our stage 3
does (each block or layer, then the root).

Run: shardwise bench zero --world-size 2
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

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
from shardwise.strategies.zero import stage3_units

OURS = {
    "ddp": lambda: sw.DDP(),
    # (ZeRO-3's default keeps units gathered from forward to backward while they fit 1 GiB:
    # both models whole, as FSDP2's reshard_after_forward=False, `fsdp2-keep`)
    **{f"zero{s}": (lambda s=s: sw.ZeRO(stage=s)) for s in (1, 2, 3)},
    # Every unit gathered again for backward (FSDP2's default, reshard_after_forward=True).
    "zero3-regather": lambda: sw.ZeRO(stage=3, keep_gathered_mb=0),
}
# FSDP2 on the same units: its default (every unit resharded after forward), and every unit
# kept gathered from forward to backward (our default's policy on these models).
FSDP2 = {"fsdp2": "none", "fsdp2-keep": "all"}


def fsdp2(factory, keep: str = "none") -> torch.nn.Module:
    """FSDP2 per unit as our stage 3 cuts them (`stage3_units`), then the root; `keep`:
    which units are not resharded after forward (none, all)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = factory()
    units = stage3_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=keep != "all")
    return fully_shard(model, mesh=mesh, reshard_after_forward=keep != "all")


class DeepSpeedStep:
    """DeepSpeed's engine behind the optimizer interface the timing loop uses."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()  # also zeroes the gradients

    def zero_grad(self) -> None:
        pass

    def state_bytes(self) -> dict[str, int]:
        """Model state as the ZeRO paper counts it: parameters (or their partitions), fp32
        master partitions, gradient partitions and optimizer state; communication buffers
        (DeepSpeed's reduce buckets) are not model state and are left out."""
        zero = self.engine.optimizer
        tensors: list = []
        for p in self.engine.module.parameters():
            tensors += [p, p.grad, getattr(p, "ds_tensor", None)]
        for group in zero.optimizer.param_groups:  # the torch optimizer over the partitions
            tensors += [(p, p.grad) for p in group["params"]]
        tensors += [list(state.values()) for state in zero.optimizer.state.values()]
        for name in MODEL_STATE_ATTRIBUTES:
            tensors.append(getattr(zero, name, None))
        storages = {}
        for t in _flatten(tensors):
            if t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return {"total": sum(storages.values())}


# Where DeepSpeed's ZeRO optimizers keep flat parameters, masters and gradient partitions.
MODEL_STATE_ATTRIBUTES = (
    "bit16_groups_flat",
    "single_partition_of_fp32_groups",
    "averaged_gradients",
    "fp16_partitioned_groups_flat",
    "fp32_partitioned_groups_flat",
    "grad_partitions_flat_buffer",
)


def _flatten(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _flatten(item)]
    return []


def deepspeed_variants(factory, batch_size: int) -> dict[str, tuple]:
    """DeepSpeed ZeRO-1/2/3 on the CPU accelerator over our gloo group, when installed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        return {}
    variants = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = factory()
        config = {
            "train_micro_batch_size_per_gpu": batch_size,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 2**31,
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config
        )
        variants[f"deepspeed{stage}"] = (engine, DeepSpeedStep(engine))
    return variants


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
    zero3 = variants["zero3"][0]  # (its same-policy rival is fsdp2-keep: so it must keep all)
    if len(zero3.kept) != len(zero3.unit_modules):
        raise ValueError(f"bench zero: the {name} is too large for ZeRO-3 to keep whole")
    for key, keep in FSDP2.items():
        torch.manual_seed(0)
        theirs = fsdp2(factory, keep)
        variants[key] = (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4))
    variants.update(deepspeed_variants(factory, batch[0].shape[0]))
    torch.manual_seed(0)
    alone = factory()  # the compute floor: no wrapper, no communication
    variants["compute"] = (alone, torch.optim.AdamW(alone.parameters(), lr=1e-4))
    steps_of = {key: train_step(*pair, batch, loss_fn) for key, pair in variants.items()}
    for key in OURS:  # each strategy's bytes alone (`floor.py`)
        steps_of[f"bytes:{key}"] = bare_collectives(calls_of(steps_of[key]))
    times = interleaved_times(steps_of, steps, reps)
    step_times = medians(times)
    params = num_parameters(variants["ddp"][0])
    global_batch = batch[0].shape[0] * world
    result = {"model": name, "params": params, "global_batch": global_batch}
    for key, (model, opt) in variants.items():
        memory = state_bytes_after_backward(model, opt, batch, loss_fn)
        result[key] = {
            "step_time_s": step_times[key],
            "samples_per_s": global_batch / step_times[key],
            "bytes_per_param": memory["total"] / params,
            # The rivals talk to torch.distributed directly: our layer cannot count their bytes.
            "comm_bytes_per_step": comm_bytes_of_one_step(model, opt, batch, loss_fn)
            if key in OURS
            else None,
        }
        if key in OURS:
            result[key].update(floor_figures(times, key))
    result["ratio_zero3_over_fsdp2"] = step_times["zero3"] / step_times["fsdp2"]
    result["ratio_zero3_over_fsdp2_by_rep"] = by_rep(times, "zero3", "fsdp2")
    # (the bound no implementation of the same step beats, repetition by repetition)
    result["ratio_compute_over_fsdp2_by_rep"] = by_rep(times, "compute", "fsdp2")
    # The same policy on both sides: every unit kept (our default here), or none.
    result["ratio_zero3_over_fsdp2-keep"] = step_times["zero3"] / step_times["fsdp2-keep"]
    result["ratio_zero3_over_fsdp2-keep_by_rep"] = by_rep(times, "zero3", "fsdp2-keep")
    regather = step_times["zero3-regather"] / step_times["fsdp2"]
    result["ratio_zero3-regather_over_fsdp2"] = regather
    result["ratio_zero3-regather_over_fsdp2_by_rep"] = by_rep(times, "zero3-regather", "fsdp2")
    if "deepspeed3" in step_times:
        result["ratio_zero3_over_deepspeed3"] = step_times["zero3"] / step_times["deepspeed3"]
    return result


def table_rows(result: dict) -> list[list[str]]:
    rivals = (*FSDP2, "deepspeed1", "deepspeed2", "deepspeed3")
    rivals = [k for k in rivals if k in result]
    return ratio_table(result, [*OURS, *rivals, "compute"], baseline="fsdp2")


if __name__ == "__main__":
    main_for("zero", bench_model, table_rows)
