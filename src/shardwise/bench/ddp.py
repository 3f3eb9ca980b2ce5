"""Benchmark: our DDP against torch's DistributedDataParallel, same job, same processes.

Both wrap identical copies of the model and train with AdamW on the same batches. Repetitions
are interleaved (ours, torch, torch, ours, ...) so drift in machine load hits both alike, and the
environment (threads per rank, malloc thresholds) is set once by the launcher for both. A step
time is the slowest rank's; we report the median over repetitions.

Run: shardwise bench ddp --world-size 2   (or python -m shardwise.bench.ddp under torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.memory import model_state_bytes
from shardwise.models import MLP, TinyGPT, lm_loss, num_parameters

WARMUP_STEPS = 3
VERBOSE = bool(int(os.environ.get("SHARDWISE_BENCH_VERBOSE", "0")))
GPT_VOCAB = 65  # tiny-shakespeare-sized vocabulary: ~3.3M parameters


def make_workload(name: str, rank: int):
    """Model factory, one batch for this rank, and the loss."""
    g = torch.Generator().manual_seed(1234 + rank)
    if name == "mlp":
        x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
        return (lambda: MLP([784, 2048, 2048, 10])), (x, y), F.cross_entropy
    if name == "gpt":
        tokens = torch.randint(0, GPT_VOCAB, (8, 129), generator=g)
        model = lambda: TinyGPT(GPT_VOCAB, seq_len=128, d_model=256, n_layer=4, n_head=4)  # noqa: E731
        return model, (tokens[:, :-1], tokens[:, 1:]), lm_loss
    raise ValueError(f"unknown benchmark model {name!r}; choose mlp or gpt")


def torch_ddp_bucket_bytes(model: nn.parallel.DistributedDataParallel) -> list[int]:
    """Sizes of the gradient buckets torch's reducer allocated (a copy beside .grad)."""
    sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
    return [int(s) for s in str(sizes).split(",") if s.strip()]


def timed_steps(model, opt, batch, loss_fn, steps: int) -> float:
    """Seconds per step on the slowest rank."""
    x, y = batch
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def state_bytes_after_backward(model, opt, batch, loss_fn) -> dict[str, int]:
    """Model state at its fullest: gradients exist (after backward, before the step)."""
    x, y = batch
    loss_fn(model(x), y).backward()
    report = model_state_bytes(model, opt)
    opt.step()
    opt.zero_grad()
    return report


def bench_model(name: str, steps: int, reps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    factory, batch, loss_fn = make_workload(name, rank)
    torch.manual_seed(0)
    ours, ours_opt = sw.prepare(factory(), sw.DDP(), optimizer=torch.optim.AdamW, lr=1e-4)
    torch.manual_seed(0)
    theirs = nn.parallel.DistributedDataParallel(factory())
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    variants = {"ours": (ours, ours_opt), "torch": (theirs, theirs_opt)}
    for model, opt in variants.values():
        timed_steps(model, opt, batch, loss_fn, WARMUP_STEPS)
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for rep in range(reps):
        order = ["ours", "torch"] if rep % 2 == 0 else ["torch", "ours"]
        for key in order:
            times[key].append(timed_steps(*variants[key], batch, loss_fn, steps))
    if rank == 0 and VERBOSE:
        print({k: [round(1000 * t, 1) for t in v] for k, v in times.items()}, flush=True)
    params = num_parameters(ours)
    memory = {key: state_bytes_after_backward(*variants[key], batch, loss_fn) for key in variants}
    memory["torch"]["buffers"] = sum(torch_ddp_bucket_bytes(theirs))
    memory["torch"]["total"] += memory["torch"]["buffers"]
    global_batch = batch[0].shape[0] * world
    result = {"model": name, "params": params, "global_batch": global_batch}
    for key in variants:
        step = statistics.median(times[key])
        result[key] = {
            "step_time_s": step,
            "samples_per_s": global_batch / step,
            "bytes_per_param": memory[key]["total"] / params,
        }
    result["ratio_step_time_ours_over_torch"] = (
        result["ours"]["step_time_s"] / result["torch"]["step_time_s"]
    )
    sw.strategies.DDP().close(ours)
    return result


def print_table(results: list[dict], world: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DDP benchmark, world size {world} (median of interleaved reps)")
    for col in ("model", "params", "impl", "step ms", "samples/s", "bytes/param", "ours/torch"):
        table.add_column(col, justify="right")
    for r in results:
        for key in ("ours", "torch"):
            v = r[key]
            table.add_row(
                r["model"],
                f"{r['params'] / 1e6:.2f}M",
                key,
                f"{1000 * v['step_time_s']:.1f}",
                f"{v['samples_per_s']:,.1f}",
                f"{v['bytes_per_param']:.1f}",
                f"{r['ratio_step_time_ours_over_torch']:.3f}" if key == "ours" else "",
            )
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rt = sw.init()
    results = [bench_model(m.strip(), args.steps, args.reps) for m in args.models.split(",")]
    if rt.is_main:
        print_table(results, rt.world_size)
        line = {
            "bench": "ddp",
            "world_size": rt.world_size,
            "threads_per_rank": torch.get_num_threads(),
            "results": results,
        }
        print(json.dumps(line))
        if args.out:
            Path(args.out).write_text(json.dumps(line) + "\n")
    sw.shutdown()


if __name__ == "__main__":
    main()
