"""The training loop every strategy shares: one process of a job, from config to summary.

Run by each worker (under our launcher or torchrun). Rank 0 owns the run directory: resolved
config, metrics.jsonl (one line per step), summary.json and the final checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import comm, run_checkpoint
from shardwise.checkpoint import save_model
from shardwise.config import Config, dump_config
from shardwise.faults import FaultInjector
from shardwise.jobs import (
    OPTIMIZERS,
    Job,
    build_job,
    lr_multiplier,
    optimizer_kwargs,
    straggler_delay,
)
from shardwise.ps.worker import PSConfig
from shardwise.reporting import MetricsFile, ProgressReporter, write_summary
from shardwise.runner import new_run_dir
from shardwise.strategies.base import DistributedModel

WARMUP_STEPS_EXCLUDED = 3  # first steps pay for allocation and lazy init; not in samples/s
RUN_DIR_KEY = "shardwise/run_dir"  # where rank 0 tells the others the run directory


def agree_run_dir(cfg: Config, requested: str | None, rt: sw.Runtime) -> Path:
    """Rank 0 picks (and creates) the directory, a new one unless `requested`; the others
    read its path from the job's store (plain text: no object crosses the wire). Two jobs
    never share one by accident."""
    store = dist.distributed_c10d._get_default_store()
    if rt.is_main:
        path = new_run_dir(cfg, requested)
        (path / "config.yaml").write_text(dump_config(cfg))
        store.set(RUN_DIR_KEY, str(path))
    return Path(store.get(RUN_DIR_KEY).decode())


def _batches(loader: sw.data.ShardedLoader, consumed: int = 0):
    """Endless iteration over epochs; each pass reshuffles (the sampler's epoch advances).
    A resumed run has `consumed` batches behind it: the same order goes on from there."""
    loader.epoch, skip = divmod(consumed, len(loader))
    yield from itertools.islice(iter(loader), skip, None)
    while True:
        yield from loader


def _global_mean(value: float, count: int, stop: bool, device) -> tuple[float, bool]:
    """The loss averaged over the global batch, and whether any rank was asked to stop (one
    message for both, so that every rank stops after the same step)."""
    t = torch.tensor([value * count, count, float(stop)], dtype=torch.float64, device=device)
    comm.all_reduce(t)
    return (t[0] / t[1]).item(), bool(t[2] > 0)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, job: Job, batch_size: int, everyone: bool = True
) -> tuple[float, float]:
    """Loss and accuracy over the whole test split. With `everyone`, each rank of the job
    scores its data shard and the sums are added over the world; otherwise this process scores
    all of it (a parameter-server worker, or the supervisor), with no message."""
    shard = sw.data_shard(model) if everyone else (1, 0)
    loader = sw.data.loader(
        job.splits.test, batch_size, shuffle=False, drop_last=False, shard=shard
    )
    loss_fn = sw.parallel_loss(model, job.loss_fn)
    device = next(model.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    was_training = model.training
    model.eval()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        sums[0] += loss_fn(logits, y).item() * y.numel()
        sums[1] += (sw.predict(model, logits) == y).sum().item()
        sums[2] += y.numel()
    if everyone:
        # Ranks that split one model scored the same samples: every sample counts equally
        # often, so the world-wide sums still give the mean.
        comm.all_reduce(sums)
    model.train(was_training)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


@dataclass
class Run:
    """One rank's training run: what `setup` makes and each `run_step` uses."""

    cfg: Config
    rt: sw.Runtime
    job: Job
    model: DistributedModel
    opt: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    out: Path
    batches: Iterator
    shard: tuple[int, int]  # (replicas, index) of this rank's data
    metrics: MetricsFile | None
    progress: ProgressReporter
    start_step: int = 0  # steps done before this process started (a resumed run)
    stop_requested: bool = False  # SIGTERM / SIGINT: checkpoint after this step and leave
    stopping: bool = False  # every rank agreed to stop
    step_times: list[float] = field(default_factory=list)
    loss: float = float("nan")
    memory: dict[str, int] = field(default_factory=dict)

    @property
    def global_batch(self) -> int:
        return self.cfg.data.batch_size * self.shard[0]


def setup(cfg: Config, run_dir: str | None, resume: bool = False) -> Run:
    """Process group, run directory, model, strategy, optimizer, schedule and data; with
    `resume`, everything restored from the run directory's newest complete checkpoint."""
    rt = sw.init(backend=cfg.launch.backend, timeout_s=cfg.launch.comm_timeout_s)
    if cfg.launch.threads_per_rank:
        torch.set_num_threads(cfg.launch.threads_per_rank)
    job = build_job(cfg)
    out = agree_run_dir(cfg, run_dir, rt)
    model, opt = sw.prepare(
        job.model,
        cfg.strategy.build(rt.world_size, out),
        optimizer=OPTIMIZERS[cfg.optim.name],
        **optimizer_kwargs(cfg.optim),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(cfg.optim, cfg.train.steps))
    start = _resume(out, model, opt, scheduler) if resume else 0
    shard = model.data_shard()
    loader = sw.data.loader(
        job.splits.train, cfg.data.batch_size, shuffle=True, seed=cfg.train.seed, shard=shard
    )
    keep = start if resume else None
    metrics = MetricsFile(out / "metrics.jsonl", keep_steps=keep) if rt.is_main else None
    progress = ProgressReporter(cfg.train.steps, cfg.name, rt.is_main, cfg.train.log_every)
    batches = _batches(loader, consumed=start)
    return Run(cfg, rt, job, model, opt, scheduler, out, batches, shard, metrics, progress, start)


def _resume(out: Path, model: DistributedModel, opt, scheduler) -> int:
    """Load the newest complete checkpoint of the run; its step (0: none, start afresh)."""
    rt = model.runtime
    found = run_checkpoint.newest(out, rt.world_size, model.checkpoint_name())
    if found is None:
        if rt.is_main:
            print(f"shardwise: no checkpoint in {out}: starting from step 0", flush=True)
        return 0
    step = run_checkpoint.load(found[0], model, opt, scheduler)
    if rt.is_main:
        print(f"shardwise: resumed from {found[0]} (step {step})", flush=True)
    return step


def run_step(run: Run, step: int, loop_start: float) -> None:
    """One optimizer step, its globally averaged loss, and its line in metrics.jsonl."""
    cfg, model, opt = run.cfg, run.model, run.opt
    x, y = (t.to(run.rt.device) for t in next(run.batches))
    t0 = time.perf_counter()
    # An emulated straggler computes slowly: the delay comes before its gradients exist
    # (after them, DDP's all-reduce, started during backward, would hide it).
    if delay := straggler_delay(cfg.train, run.shard[1], run.shard[0], step):
        time.sleep(delay)
    local_loss = sw.train_step(model, x, y, run.job.loss_fn)  # forward + backward
    if step == cfg.train.steps:  # gradients present: the model state at its fullest
        run.memory = sw.memory_report(model, opt)
    if cfg.train.clip_grad_norm:
        model.clip_grad_norm_(cfg.train.clip_grad_norm)
    opt.step()
    opt.zero_grad()
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    step_time = time.perf_counter() - t0
    # The loss average is a (tiny) collective too: it is counted in this step's figures.
    run.loss, run.stopping = _global_mean(
        local_loss.item(), y.shape[0], run.stop_requested, run.rt.device
    )
    step_comm = comm.stats.end_step()
    record = {}
    if cfg.train.eval_every and step % cfg.train.eval_every == 0:
        record["eval_loss"], record["eval_accuracy"] = evaluate(
            model, run.job, cfg.train.eval_batch_size
        )
        comm.stats.end_step()  # evaluation's messages are not the training step's
    run.step_times.append(step_time)
    run.progress.update(step, run.loss, run.global_batch / step_time)
    if run.metrics:
        run.metrics.write(
            {
                "step": step,
                "loss": run.loss,
                "lr": lr,
                "step_time_s": step_time,
                "samples_per_s": run.global_batch / step_time,
                "comm_bytes": step_comm.bytes,
                "comm_calls": step_comm.calls,
                "comm_wait_s": step_comm.wait_s,
                "t": time.perf_counter() - loop_start,
                **record,
            }
        )


def finish(run: Run, started: float) -> dict[str, Any]:
    """Final evaluation, summary and consolidated checkpoint (rank 0), then release."""
    cfg, rt = run.cfg, run.rt
    run.progress.close()
    train_comm = comm.stats.total()
    eval_loss, accuracy = evaluate(run.model, run.job, cfg.train.eval_batch_size)
    state = sw.full_state_dict(run.model)
    timed = run.step_times[WARMUP_STEPS_EXCLUDED:] or run.step_times
    summary = {
        "name": cfg.name,
        "strategy": cfg.strategy.describe(),
        "world_size": rt.world_size,
        "steps": cfg.train.steps,
        "final_train_loss": run.loss,
        "eval_loss": eval_loss,
        "eval_accuracy": accuracy,
        "samples_per_s": run.global_batch * len(timed) / sum(timed),
        "comm_bytes_per_step": train_comm.bytes / cfg.train.steps,
        "comm_bytes_total": train_comm.bytes,
        "comm_wait_s": train_comm.wait_s,
        "memory": run.memory,
        "run_dir": str(run.out),
    }
    if rt.is_main:
        meta = {"step": cfg.train.steps, "world_size": rt.world_size, "name": cfg.name}
        save_model(run.out / "checkpoint", state, meta)
        run.metrics.close()
    summary["wall_time_s"] = time.perf_counter() - started
    if rt.is_main:
        write_summary(run.out, summary)
    run.model.close()
    # Nobody leaves while rank 0 still writes: an early exit would look like a crash to it.
    comm.barrier()
    return summary


def train(cfg: Config, run_dir: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Run the job described by `cfg` in this process (one rank of it); return the summary.
    With `resume`, continue from the run directory's newest checkpoint (if it has one)."""
    started = time.perf_counter()
    if isinstance(cfg.strategy, PSConfig):  # roles instead of replicas; the supervisor sums up
        from shardwise.ps_job import run_role

        run_role(cfg, run_dir)
        return {}
    run = setup(cfg, run_dir, resume)
    faults = FaultInjector(run.rt.rank, run.out)
    comm.stats.reset()
    loop_start = time.perf_counter()
    with _stop_on_signals(run):
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            faults.before_step(step)
            run_step(run, step, loop_start)
            every = cfg.train.checkpoint_every
            if run.stopping or (every and step % every == 0):
                _checkpoint(run, step)
            if run.stopping:
                if run.rt.is_main:
                    print(f"shardwise: stopped after step {step}; resume with --resume {run.out}")
                run.model.close()
                return {}
    return finish(run, started)


def _checkpoint(run: Run, step: int) -> None:
    started = time.perf_counter()
    path = run_checkpoint.save(
        run.out, step, run.model, run.opt, run.scheduler, run.cfg.train.keep_checkpoints
    )
    if run.metrics:
        stall = time.perf_counter() - started
        run.metrics.write({"step": step, "checkpoint": str(path), "checkpoint_stall_s": stall})
    comm.stats.end_step()  # the save's barriers are not the next step's messages


@contextlib.contextmanager
def _stop_on_signals(run: Run):
    """SIGTERM and SIGINT ask the run to stop: every rank finishes the step, the run saves a
    checkpoint and leaves (instead of dying inside a collective)."""

    def ask_to_stop(signum, frame) -> None:
        run.stop_requested = True

    previous = {s: signal.signal(s, ask_to_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
