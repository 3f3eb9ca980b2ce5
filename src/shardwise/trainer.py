"""The training loop every strategy shares: one process of a job, from config to summary.

Run by each worker (under our launcher or torchrun). Rank 0 owns the run directory: resolved
config, metrics.jsonl (one line per step), summary.json and the final checkpoint.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

import shardwise as sw
from shardwise import comm
from shardwise.checkpoint import save_model
from shardwise.config import Config, dump_config
from shardwise.jobs import (
    OPTIMIZERS,
    Job,
    build_job,
    build_strategy,
    lr_multiplier,
    straggler_delay,
)
from shardwise.jobs import optimizer_kwargs as make_optimizer_kwargs
from shardwise.reporting import MetricsFile, ProgressReporter, print_summary

WARMUP_STEPS_EXCLUDED = 3  # first steps pay for allocation and lazy init; not in samples/s


def _run_dir(cfg: Config, requested: str | None, rt: sw.Runtime) -> Path:
    """Rank 0 picks (and creates) the directory; everyone learns its path."""
    path = None
    if rt.is_main:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(requested or Path(cfg.launch.runs_dir) / f"{cfg.name}-{stamp}")
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(dump_config(cfg))
        path = str(path.resolve())
    return Path(comm.broadcast_object(path))


def _batches(loader: sw.data.ShardedLoader):
    """Endless iteration over epochs; each pass reshuffles (the sampler's epoch advances)."""
    while True:
        yield from loader


def _global_mean(value: float, count: int, device: torch.device) -> float:
    t = torch.tensor([value * count, count], dtype=torch.float64, device=device)
    comm.all_reduce(t)
    return (t[0] / t[1]).item()


@torch.no_grad()
def evaluate(model: torch.nn.Module, job: Job, cfg: Config, rt: sw.Runtime) -> tuple[float, float]:
    """Loss and accuracy over the whole test split, each rank scoring its shard."""
    model.eval()
    loader = sw.data.loader(
        job.splits.test,
        cfg.train.eval_batch_size,
        shuffle=False,
        drop_last=False,
        shard=sw.data_shard(model),
    )
    loss_fn = sw.parallel_loss(model, job.loss_fn)
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(rt.device), y.to(rt.device)
        logits = model(x)
        n = y.numel()
        sums[0] += loss_fn(logits, y).item() * n
        sums[1] += (sw.predict(model, logits) == y).sum().item()
        sums[2] += n
    # Ranks that split one model scored the same samples: every sample counts equally often,
    # so the world-wide sums still give the mean.
    comm.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def train(cfg: Config, run_dir: str | None = None) -> dict[str, Any]:
    """Run the job described by `cfg` in this process (one rank of it); return the summary."""
    started = time.perf_counter()
    if cfg.strategy.name == "ps":  # roles instead of replicas; the supervisor summarises
        from shardwise.ps.job import run_role

        run_dir_path = Path(run_dir or cfg.launch.runs_dir)
        run_role(cfg, run_dir_path, run_dir_path / "ps-snapshots")
        return {}
    rt = sw.init(backend=cfg.launch.backend, timeout_s=cfg.launch.comm_timeout_s)
    if cfg.launch.threads_per_rank:
        torch.set_num_threads(cfg.launch.threads_per_rank)
    job = build_job(cfg)
    strategy = build_strategy(cfg.strategy)
    model, opt = sw.prepare(
        job.model,
        strategy,
        optimizer=OPTIMIZERS[cfg.optim.name],
        **make_optimizer_kwargs(cfg.optim),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(cfg.optim, cfg.train.steps))
    out = _run_dir(cfg, run_dir, rt)
    metrics = MetricsFile(out / "metrics.jsonl") if rt.is_main else None
    progress = ProgressReporter(cfg.train.steps, cfg.name, rt.is_main, cfg.train.log_every)
    replicas, index = sw.data_shard(model)
    loader = sw.data.loader(
        job.splits.train,
        cfg.data.batch_size,
        shuffle=True,
        seed=cfg.train.seed,
        shard=(replicas, index),
    )
    global_batch = cfg.data.batch_size * replicas
    comm.stats.reset()
    batches = _batches(loader)
    step_times, loss = [], float("nan")
    loop_start = time.perf_counter()
    for step in range(1, cfg.train.steps + 1):
        x, y = (t.to(rt.device) for t in next(batches))
        t0 = time.perf_counter()
        # An emulated straggler computes slowly: the delay comes before its gradients exist
        # (after them, DDP's all-reduce, started during backward, would hide it).
        if delay := straggler_delay(cfg.train, index, replicas, step):
            time.sleep(delay)
        local_loss = sw.train_step(model, x, y, job.loss_fn)  # forward + backward
        if step == cfg.train.steps:  # gradients present: the model state at its fullest
            memory = sw.memory_report(model, opt)
        if cfg.train.clip_grad_norm:
            sw.clip_grad_norm_(model, cfg.train.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step_time = time.perf_counter() - t0
        # The loss average is a (tiny) collective too: it is counted in this step's figures.
        loss = _global_mean(local_loss.item(), y.shape[0], rt.device)
        step_comm = comm.stats.end_step()
        record = {}
        if cfg.train.eval_every and step % cfg.train.eval_every == 0:
            record["eval_loss"], record["eval_accuracy"] = evaluate(model, job, cfg, rt)
            comm.stats.end_step()  # evaluation's messages are not the training step's
        step_times.append(step_time)
        progress.update(step, loss, global_batch / step_time)
        if metrics:
            metrics.write(
                {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "step_time_s": step_time,
                    "samples_per_s": global_batch / step_time,
                    "comm_bytes": step_comm.bytes,
                    "comm_calls": step_comm.calls,
                    "comm_wait_s": step_comm.wait_s,
                    "t": time.perf_counter() - loop_start,
                    **record,
                }
            )
    progress.close()
    train_comm = comm.stats.total()
    eval_loss, accuracy = evaluate(model, job, cfg, rt)
    state = sw.full_state_dict(model)
    timed = step_times[WARMUP_STEPS_EXCLUDED:] or step_times
    summary = {
        "name": cfg.name,
        "strategy": _describe(cfg),
        "world_size": rt.world_size,
        "steps": cfg.train.steps,
        "final_train_loss": loss,
        "eval_loss": eval_loss,
        "eval_accuracy": accuracy,
        "samples_per_s": global_batch * len(timed) / sum(timed),
        "comm_bytes_per_step": train_comm.bytes / cfg.train.steps,
        "comm_bytes_total": train_comm.bytes,
        "comm_wait_s": train_comm.wait_s,
        "memory": memory,
        "run_dir": str(out),
    }
    if rt.is_main:
        meta = {"step": cfg.train.steps, "world_size": rt.world_size, "name": cfg.name}
        save_model(out / "checkpoint", state, meta)
        metrics.close()
    summary["wall_time_s"] = time.perf_counter() - started
    if rt.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(summary)
    strategy.close(model)
    # Nobody leaves while rank 0 still writes: an early exit would look like a crash to it.
    comm.barrier()
    return summary


def _describe(cfg: Config) -> str:
    s = cfg.strategy
    if s.name == "zero":
        return f"zero-{s.stage}"
    if s.name == "ddp":
        return f"ddp ({s.compression or s.algorithm + ' all-reduce'})"
    if s.name == "pp":
        return f"pipeline ({s.schedule}, {s.microbatches} micro-batches)"
    if s.name == "mesh":
        sizes = f"dp={s.dp or 'rest'} x tp={s.tp} x pp={s.pp}"
        return f"mesh ({sizes}, {s.data}" + (f", {s.schedule})" if s.pp > 1 else ")")
    return "tensor parallel" if s.name == "tp" else s.name
