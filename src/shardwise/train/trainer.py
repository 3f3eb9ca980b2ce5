"""The training loop every strategy shares: one process of a job, from config to summary.

Run by each worker (under our launcher or torchrun). Rank 0 owns the run directory: resolved
config, metrics.jsonl (one line per step), summary.json and the final checkpoint; every rank
writes its own time per step (work, waiting) to timing/rank{r}.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError

import shardwise as sw
from shardwise import comm
from shardwise.checkpoint import run_checkpoint
from shardwise.checkpoint.reshardable import save_model
from shardwise.config import Config
from shardwise.data import ledger
from shardwise.data.balance import ThroughputBalancer, weighted_sizes
from shardwise.data.datasets import PAD_TARGET
from shardwise.data.queue_loader import QueueLoader
from shardwise.data.skew import format_report, skew_report
from shardwise.distributed import runtime
from shardwise.distributed.leaving import failed_ranks
from shardwise.distributed.signals import handling_stop_signals
from shardwise.faults import injection as faults
from shardwise.faults.injection import FaultInjector
from shardwise.faults.nonfinite import EXIT_NONFINITE, all_finite
from shardwise.faults.watchdog import EXIT_HUNG, DesyncError, Watchdog, name_ranks
from shardwise.jobs import (
    OPTIMIZERS,
    Job,
    base_lr,
    build_job,
    optimizer_kwargs,
    schedule,
    straggler_delay,
)
from shardwise.observe import memory
from shardwise.observe.board import Board
from shardwise.observe.clock import measure_offset
from shardwise.observe.memory import ActivationMeter, PeakMeter
from shardwise.observe.phases import PhaseTimer
from shardwise.observe.run_output import MetricsFile, ProgressReporter, write_summary
from shardwise.observe.timeline import Timeline, merge
from shardwise.plan import calibrate, costs, prediction, predictors
from shardwise.strategies.base import DistributedModel
from shardwise.train.run_dir import agree_run_dir, claim_run_dir
from shardwise.train.validator import evaluate

WARMUP_STEPS_EXCLUDED = 3  # first steps pay for allocation and lazy init; not in samples/s


def _endless(loader: sw.data.ShardedLoader) -> Iterator:
    """Epoch after epoch, from the loader's position on."""
    while True:
        yield from loader


def _agree(
    run: Run, local_loss: torch.Tensor, count: int, grads_finite: bool, desync: bool
) -> tuple[float, dict[int, int], dict[int, str]]:
    """One tiny all-reduce for what every rank must agree on after backward: the loss averaged
    over the global batch (of the ranks whose loss is finite), which ranks were sent a signal
    to stop (rank -> signal number), and which ranks saw a non-finite loss or gradient (the
    step is then skipped).

    A non-finite loss names the rank it came from; gradients already averaged carry one rank's
    NaN to all, so a non-finite gradient with finite losses names every rank that holds one."""
    value = local_loss.item()
    finite = math.isfinite(value)
    t = torch.zeros(3 + run.rt.world_size, dtype=torch.float64, device=run.rt.device)
    t[0], t[1] = value * count if finite else 0.0, count if finite else 0
    t[2] = run.stop_signal > 0  # (summed: how many ranks were sent one)
    # Each rank's own slot: 0 (fine), 1 (non-finite gradient) or 2 (non-finite loss), plus 4 x
    # the signal it was sent (a whole number far below 2**53: exact in float64).
    nonfinite = 2 if not finite else 0 if grads_finite else 1
    t[3 + run.rt.rank] = nonfinite + 4 * run.stop_signal
    if desync:  # an injected fault: this rank issues another collective than the others
        comm.broadcast(t, src=0)
    comm.all_reduce(t)
    loss = (t[0] / t[1]).item() if t[1] > 0 else float("nan")
    slots = [round(f) for f in t[3:].tolist()]
    bad = {r: "loss" for r, f in enumerate(slots) if f % 4 == 2}
    if not bad:
        bad = {r: "gradient" for r, f in enumerate(slots) if f % 4 == 1}
    return loss, _signalled(slots, 4) if t[2] > 0 else {}, bad


def _signalled(slots: list[int], unit: int) -> dict[int, int]:
    """rank -> the signal it was sent, from each rank's slot of an agreement (signal x unit)."""
    return {r: f // unit for r, f in enumerate(slots) if f // unit}


def _grads_finite(model: DistributedModel) -> bool:
    """Whether the gradients this rank holds are all finite."""
    grads = [g for g in model.local_grads() if g is not None]
    return bool(all_finite(grads)) if grads else True


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
    loader: sw.data.ShardedLoader | QueueLoader
    shard: tuple[int, int]  # (replicas, index) of this rank's data
    metrics: MetricsFile | None
    board: Board | None  # TensorBoard (rank 0)
    timing: MetricsFile | None  # this rank's own time per step (every rank writes one)
    progress: ProgressReporter
    saver: run_checkpoint.Saver
    faults: FaultInjector
    watchdog: Watchdog
    balancer: ThroughputBalancer | None
    phases: PhaseTimer  # this rank's seconds per phase of the step
    timeline: Timeline | None = None  # `train.trace_steps`: this rank's events
    start_step: int = 0  # steps done before this process started (a resumed run)
    drawn: int = 0  # global batches drawn so far, skipped ones included
    skip: set[int] = field(default_factory=set)  # global batches (1-based) left out
    stop_signal: int = 0  # SIGTERM / SIGINT received: checkpoint after this step and leave
    stopped_by: dict[int, int] = field(default_factory=dict)  # agreed: rank -> its signal
    bad_streak: int = 0  # consecutive steps with a non-finite loss or gradient
    bad_batches: list[int] = field(default_factory=list)  # the global batches of those steps
    rolled_back_at: int = 0  # the step the last rollback was made at (0: none yet)
    loads: int = 0  # checkpoints loaded (each one agreed through the store)
    skipped_steps: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)  # the whole step's, every rank's
    loss: float = float("nan")
    memory: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)  # prediction.for_run, before step 1
    data_bytes: int = 0  # tensors alive beside the job's own (its dataset): not its peak's

    def __post_init__(self) -> None:
        self.batches = _endless(self.loader)

    @property
    def stopping(self) -> bool:
        """Every rank agreed to stop after this step (a rank was sent SIGTERM or SIGINT)."""
        return bool(self.stopped_by)

    @property
    def global_batch(self) -> int:
        return self.loader.global_batch

    def data_state(self) -> dict[str, Any]:
        return {
            "loader": self.loader.state_dict(),
            "drawn": self.drawn,
            "skip": sorted(self.skip),
            "batch_sizes": getattr(self.loader, "sizes", None),  # a queue has none
        }

    def restore(self, restored: dict[str, Any]) -> int:
        """Go on from a loaded checkpoint (`run_checkpoint.load`); returns its step."""
        data = restored["data"]
        self.loader.load_state_dict(data["loader"])
        sizes = data.get("batch_sizes")
        if self.balancer and sizes and len(sizes) == self.loader.replicas:
            self.loader.resize([int(b) for b in sizes])  # where the balancing had got to
        self.batches = _endless(self.loader)
        self.drawn, self.skip = int(data["drawn"]), self.skip | set(data["skip"])
        return restored["step"]


class NonFiniteStop(RuntimeError):
    """Training stopped under the non-finite policy; the message is the report."""


def setup(cfg: Config, run_dir: str | None, resume: bool = False) -> Run:
    """Process group, run directory, model, strategy, optimizer, schedule and data; with
    `resume`, everything restored from the run directory's newest complete checkpoint."""
    rt = sw.init(backend=cfg.launch.backend, timeout_s=cfg.launch.comm_timeout_s)
    if cfg.launch.threads_per_rank:
        torch.set_num_threads(cfg.launch.threads_per_rank)
    comm.flight.recorder.reset()
    job = build_job(cfg)
    data_bytes = _data_bytes(job.model, rt.device) if cfg.train.measure else 0
    out = agree_run_dir(cfg, run_dir, rt, resume)
    # What each checkpoint records of the job, and a resume checks: the model before the
    # strategy splits it.
    signature = run_checkpoint.job_signature(job.model, cfg.optim.name, cfg.strategy.name)
    predicted = _predict(cfg, job, rt, out) if rt.is_main and not resume else {}
    model, opt = sw.prepare(
        job.model,
        cfg.strategy.build(rt.world_size, out),
        optimizer=OPTIMIZERS[cfg.optim.name],
        **optimizer_kwargs(cfg.optim),
    )
    # From here the job is trained through `model`. The unsplit module goes: a pipeline stage
    # holds its own layers only, and the whole would keep every other stage's parameters
    # alive on this rank (on the tiny GPT's first of 4 stages, 6 MiB beside its own 0.4).
    job = replace(job, model=model)
    shard = model.data_shard()
    for group in opt.param_groups:  # the linear scaling rule, once the replicas are known
        group["lr"] = base_lr(cfg.optim, cfg.data.batch_size, shard[0])
    scheduler = sw.lr_scheduler(opt, schedule(cfg.optim, cfg.train.steps))
    loader = make_loader(cfg, job, shard)
    if isinstance(loader, QueueLoader):
        model.pace_by_rounds()
    elif rt.is_main and not resume:
        report = skew_report(job.splits.train, loader.parts(0))
        (out / "data_skew.json").write_text(json.dumps(report, indent=1))
        print(f"shardwise: {format_report(report)}", flush=True)
    balancer = None
    if cfg.data.balance == "dynamic":
        balancer = ThroughputBalancer(loader, cfg.data.balance_every, rt)
    metrics = timing = board = None
    progress = ProgressReporter(cfg.train.steps, cfg.name, rt.is_main, cfg.train.log_every)
    saver = run_checkpoint.Saver(
        out, rt, cfg.train.keep_checkpoints, sync=not cfg.train.async_checkpoint, job=signature
    )
    injector = FaultInjector(rt.rank, out, cfg.faults)
    watchdog = Watchdog(rt.rank, rt.world_size, cfg.launch.hang_timeout_s, out)
    run = Run(
        *(cfg, rt, job, model, opt, scheduler, out, loader, shard, metrics, board, timing),
        progress,
        *(saver, injector, watchdog, balancer),
        PhaseTimer(model, cfg.train.measure, sample_every=cfg.train.log_every),
        skip=set(cfg.train.skip_batches),
        predicted=predicted,
        data_bytes=data_bytes,
    )
    if cfg.train.trace_steps:
        run.timeline = Timeline(rt.rank, injector.clock())
    if resume:
        run.start_step = _resume(run)
        if rt.is_main:  # the checkpoint fits: from here the run directory is this job's
            claim_run_dir(cfg, out)
    keep = run.start_step if resume else None
    (out / "timing").mkdir(exist_ok=True)
    run.timing = MetricsFile(out / "timing" / f"rank{rt.rank}.jsonl", keep_steps=keep)
    if rt.is_main:
        run.metrics = MetricsFile(out / "metrics.jsonl", keep_steps=keep)
        if cfg.train.tensorboard and cfg.train.measure:
            run.board = Board(out)
        if cfg.train.sample_ledger:
            ledger.truncate(out, run.start_step)  # steps after the checkpoint run again
    comm.barrier()  # (nobody writes its ledger before rank 0 cut it)
    return run


def _data_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the tensors alive on `device` beside the model's own: the dataset, mostly."""
    own = sum(memory.storage_bytes([*model.parameters(), *model.buffers()]).values())
    return memory.live_bytes(device) - own


def _predict(cfg: Config, job: Job, rt: sw.Runtime, out: Path) -> dict[str, Any]:
    """Rank 0's predicted costs (`prediction.for_run`), made before the strategy reshapes the model
    and written to RUN_DIR/prediction.json; the step time too where this machine has a
    calibration for this many ranks (`shardwise calibrate`)."""
    global_batch = cfg.data.batch_size * predictors.replicas(cfg.strategy, rt.world_size)
    cost_job = costs.CostJob.of(job, cfg, rt.world_size, rt.rank, global_batch)
    try:
        calibration = calibrate.load(rt.world_size)
    except (ValueError, OSError) as e:
        print(f"shardwise: {e}: no step time predicted", flush=True)
        calibration = None
    predicted = prediction.for_run(cost_job, cfg.strategy, calibration)
    if calibration is not None:
        predicted["calibration"] = calibrate.age_note(calibration)
    (out / "prediction.json").write_text(json.dumps(predicted, indent=1))
    return predicted


def _agree_checkpoint(run: Run, fresh_start_ok: bool) -> run_checkpoint.Found | None:
    """The checkpoint to load, chosen by rank 0 (after its saves are in place) and read by the
    others from the store: every rank loads the same one, and only rank 0 checks the files."""
    store = runtime.store()
    key = f"shardwise/load/{run.loads}"
    run.loads += 1
    if run.rt.is_main:
        name = run.model.checkpoint_name()
        found = run_checkpoint.newest(run.out, run.rt.world_size, name, job=run.saver.job)
        choice: Any = (
            None if found is None else [str(found.directory), found.step, found.world_size]
        )
        existing = run_checkpoint.complete(run.out / "checkpoints")
        if found is None and existing and not fresh_start_ok:
            choice = {
                "error": f"none of the {len(existing)} checkpoints in {run.out} can be "
                "resumed from (see above); move them away to start afresh"
            }
        store.set(key, json.dumps(choice))
    choice = json.loads(comm.store.get(store, key, run.rt.timeout.total_seconds()))
    if isinstance(choice, dict):
        raise run_checkpoint.RunCheckpointError(choice["error"])
    return None if choice is None else run_checkpoint.Found(Path(choice[0]), *choice[1:])


def _resume(run: Run) -> int:
    """Load the newest complete checkpoint of the run; its step (0: none, start afresh)."""
    rt = run.rt
    found = _agree_checkpoint(run, fresh_start_ok=False)
    if found is None:
        if rt.is_main:
            print(f"shardwise: no checkpoint in {run.out}: starting from step 0", flush=True)
        return 0
    step = run.restore(run_checkpoint.load(found, run.model, run.opt, run.scheduler))
    if rt.is_main:
        how = (
            ""
            if found.world_size == rt.world_size
            else (f", resharded from {found.world_size} to {rt.world_size} ranks")
        )
        print(f"shardwise: resumed from {found.directory} (step {step}{how})", flush=True)
    return step


def _next_batch(run: Run, step: int):
    """The next global batch's slice for this rank, leaving out the batches to skip."""
    while True:
        batch = next(run.batches)
        run.drawn += 1
        if run.drawn not in run.skip:
            break
    if run.cfg.train.sample_ledger:
        ledger.write(run.out, run.rt.rank, step, run.drawn, run.loader)
    return batch


def make_loader(
    cfg: Config, job: Job, shard: tuple[int, int]
) -> sw.data.ShardedLoader | QueueLoader:
    """The training data: each step's global batch split over the replicas, or (`data.mode:
    queue`) chunks each rank claims from the job's store, in rounds of `strategy.period`
    chunks per rank."""
    if cfg.data.mode == "queue":
        return QueueLoader(
            job.splits.train,
            cfg.data.batch_size,
            replicas=shard[0],
            period=cfg.strategy.period,
            store=runtime.store(),
            seed=cfg.train.seed,
        )
    sizes = batch_sizes(cfg, shard[0])
    return sw.data.loader(job.splits.train, sizes, shuffle=True, seed=cfg.train.seed, shard=shard)


def batch_sizes(cfg: Config, replicas: int) -> int | list[int]:
    """The loader's batch size: the same for every replica, or shares by `data.rank_weights`."""
    if cfg.data.rank_weights is None:
        return cfg.data.batch_size
    if len(cfg.data.rank_weights) != replicas:
        raise ValueError(
            f"data.rank_weights has {len(cfg.data.rank_weights)} weights for {replicas} "
            "data-parallel ranks"
        )
    return weighted_sizes(cfg.data.batch_size * replicas, cfg.data.rank_weights)


def run_step(run: Run, step: int, loop_start: float) -> None:
    """One optimizer step, its globally averaged loss, and its line in metrics.jsonl."""
    cfg, model, opt, phases = run.cfg, run.model, run.opt, run.phases
    measure_memory = step == cfg.train.steps  # the model state at its fullest, activations too
    meter = ActivationMeter() if measure_memory and cfg.train.measure else contextlib.nullcontext()
    # The most bytes alive at once in the measured step, beside its prediction. What is alive
    # at its start is found (a pass of the garbage collector) before the step's clock starts.
    peak = PeakMeter(run.rt.device).scan() if measure_memory and cfg.train.measure else None
    phases.start_step(step)
    t0, waited0 = time.perf_counter(), comm.stats.step_wait_s()
    with phases.phase("data"):
        x, y = (t.to(run.rt.device) for t in _next_batch(run, step))
    if peak is not None:
        peak.include(x, y)
    with peak or contextlib.nullcontext():
        with phases.phase("backward"):  # (and the forward calls, which PhaseTimer's hooks time)
            started = time.perf_counter()
            loss_fn = run.job.loss_fn
            if run.faults.poisons_loss(step):
                loss_fn = _poisoned(loss_fn)
            # The loader planned every rank's batch, so it knows the global one (in samples); a
            # per-token loss weighs real tokens, summed over the ranks by the strategy.
            tokens = _tokens(run.job, y)
            total = run.loader.global_batch if tokens is None else None
            with meter:
                # An emulated straggler computes slowly: the delay comes before its gradients
                # exist (after them, DDP's all-reduce, started during backward, would hide it).
                if delay := straggler_delay(cfg.train, run.shard[1], run.shard[0], step):
                    time.sleep(delay)
                slept = run.faults.slow_ahead(y.shape[0], step=step)  # an emulated slower rank
                local_loss = sw.train_step(model, x, y, loss_fn, samples=tokens, total=total)
            waited = comm.stats.step_wait_s() - waited0  # blocked in collectives: not work
            # Forward and backward (a slowed rank's sleep included): what the balancer measures.
            work_s = time.perf_counter() - started - waited
            run.faults.observe_work(y.shape[0], work_s - slept - (delay or 0.0))
            if measure_memory:  # gradients present: the model state at its fullest
                run.memory = sw.memory_report(model, opt)
                if isinstance(meter, ActivationMeter):
                    run.memory["activations"] = meter.peak
        with phases.phase("sync"):
            # An fp16 loss scaler checks the gradients itself (an overflow: it skips the step and
            # lowers the scale); only the loss is ours to check then.
            grads_finite = model.scales_loss() or _grads_finite(model)
            count = y.shape[0] if tokens is None else tokens  # the logged loss: a mean over these
            run.loss, run.stopped_by, bad_ranks = _agree(
                run, local_loss, count, grads_finite, run.faults.desyncs(step)
            )
            lr = run.scheduler.get_last_lr()[0]
        record: dict[str, Any] = {}
        with phases.phase("optimizer"):
            if bad_ranks:
                opt.zero_grad()  # the update is skipped everywhere; so is the schedule's step
            else:
                run.bad_streak, run.bad_batches = 0, []
                if cfg.train.clip_grad_norm:
                    record["grad_norm"] = float(model.clip_grad_norm_(cfg.train.clip_grad_norm))
                elif cfg.train.measure and step % cfg.train.log_every == 0:  # every rank alike: a
                    record["grad_norm"] = model.grad_square_sum().sqrt().item()  # sharded sum meets
                if model.scales_loss():
                    record["loss_scale"] = model.loss_scale()
                opt.step()
                opt.zero_grad()
                run.scheduler.step()
    if peak is not None:
        run.memory["step_peak"] = peak.peak - run.data_bytes
    if bad_ranks:
        _nonfinite(run, step, bad_ranks)
    step_time = time.perf_counter() - t0
    step_comm = comm.stats.end_step()
    if run.balancer or cfg.data.rank_weights:
        record["batch_sizes"] = run.loader.sizes
    if run.balancer:
        run.balancer.observe(y.shape[0], work_s)
        if (sizes := run.balancer.rebalance()) is not None and run.rt.is_main:
            rates = ", ".join(f"{r:.0f}" for r in run.balancer.rates)
            print(f"shardwise: step {step}: samples/s per rank [{rates}] -> batch sizes {sizes}")
    if bad_ranks:
        record = {"skipped": True, "nonfinite_ranks": list(bad_ranks), "batch": run.drawn}
    samples = (run.global_batch, y.shape[0])
    _log_step(run, step, loop_start, lr, samples, work_s, (step_time, step_comm), record)


def _log_step(
    run: Run,
    step: int,
    loop_start: float,
    lr: float,
    samples: tuple[int, int],
    work_s: float,
    timed: tuple[float, comm.CommSnapshot],
    record: dict[str, Any],
) -> None:
    """After a step (or a work-queue round): evaluation if due, this rank's timing line, the
    progress bar and rank 0's metrics line. `samples`: (the whole step's, this rank's);
    `timed`: the step's seconds and messages."""
    step_time, step_comm = timed
    cfg = run.cfg
    phases = run.phases.take()
    if cfg.train.eval_every and step % cfg.train.eval_every == 0:
        started, measuring = time.perf_counter(), run.phases.active
        run.phases.active = False  # evaluation's forward calls are not the step's
        scored = evaluate(run.model, run.job, cfg.train.eval_batch_size)
        run.phases.active = measuring
        record["eval_loss"], record["eval_accuracy"] = scored.loss, scored.accuracy
        comm.stats.end_step()  # nor are its messages
        if run.timeline:
            run.timeline.span("eval", started, time.perf_counter())
    run.step_times.append(step_time)
    run.step_samples.append(samples[0])
    run.timing.write(
        {
            "step": step,
            "samples": samples[1],
            "work_s": work_s,  # forward and backward (a slowed rank's sleep included)
            **{f"{phase}_s": seconds for phase, seconds in phases.items()},
            "wait_s": step_comm.wait_s,  # blocked in collectives: waiting for the others
            "overlap_s": step_comm.overlap_s,  # asynchronous ones in flight before their wait
            "step_s": step_time,
            "wall_time": time.time(),
            "comm_bytes": {op: totals.bytes for op, totals in step_comm.by_op.items()},
            **({"memory": run.memory} if step == cfg.train.steps and run.memory else {}),
        }
    )
    run.progress.update(step, run.loss, samples[0] / step_time)
    if run.metrics:
        _log_saves(run)
        line = {
            "step": step,
            "loss": run.loss,
            "lr": lr,
            "step_time_s": step_time,
            "samples_per_s": samples[0] / step_time,
            "comm_bytes": step_comm.bytes,
            "comm_calls": step_comm.calls,
            "comm_wait_s": step_comm.wait_s,
            "t": time.perf_counter() - loop_start,
            "wall_time": time.time(),  # comparable across processes and restarts
            **record,
        }
        run.metrics.write(line)
        if run.board:
            run.board.write(line)


def run_round(run: Run, step: int, loop_start: float) -> None:
    """One work-queue round (`data.mode: queue`, local SGD): this rank trains the chunks it
    claims, one local step each, as many as its speed allows, until the round's are gone;
    then the replicas are averaged, each weighted by the samples it trained on, and the loss
    is averaged over every sample of the round. The schedule steps once per round."""
    model, opt, loader = run.model, run.opt, run.loader
    t0, waited0 = time.perf_counter(), comm.stats.step_wait_s()
    samples, loss_sum = 0, 0.0
    for x, y in loader.round():
        run.drawn += 1
        if run.cfg.train.sample_ledger:
            ledger.write(run.out, run.rt.rank, step, run.drawn, loader)
        x, y = x.to(run.rt.device), y.to(run.rt.device)
        started = time.perf_counter()
        slept = run.faults.slow_ahead(y.shape[0], step=step)  # an emulated slower rank
        loss = sw.train_step(model, x, y, run.job.loss_fn)
        run.faults.observe_work(y.shape[0], time.perf_counter() - started - slept)
        if run.cfg.train.clip_grad_norm:
            model.clip_grad_norm_(run.cfg.train.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        samples, loss_sum = samples + y.shape[0], loss_sum + loss.item() * y.shape[0]
    work_s = time.perf_counter() - t0 - (comm.stats.step_wait_s() - waited0)
    model.end_round(samples)
    totals = torch.zeros(2 + run.rt.world_size, dtype=torch.float64, device=run.rt.device)
    totals[0], totals[1] = loss_sum, samples
    totals[2 + run.rt.rank] = run.stop_signal  # (each rank's slot: the signal it was sent)
    comm.all_reduce(totals)
    run.loss = (totals[0] / totals[1]).item()
    run.stopped_by = _signalled([round(f) for f in totals[2:].tolist()], 1)
    if not math.isfinite(run.loss):
        raise NonFiniteStop(f"shardwise: round {step}: non-finite loss: stopping")
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    timed = (time.perf_counter() - t0, comm.stats.end_step())
    _log_step(run, step, loop_start, lr, (int(totals[1].item()), samples), work_s, timed, {})


def _tokens(job: Job, y: torch.Tensor) -> int | None:
    """This rank's real target tokens where the job's loss is a mean per token over padded
    sequences (its share of the step is counted in them); None: its share is its samples."""
    return int((y != PAD_TARGET).sum()) if job.per_token else None


def _poisoned(loss_fn):
    """An injected fault: this rank's loss, and so every gradient it sends, is NaN."""
    return lambda output, target: loss_fn(output, target) * float("nan")


def _nonfinite(run: Run, step: int, bad_ranks: dict[int, str]) -> None:
    """The non-finite policy, after a step every rank agreed to skip."""
    cfg = run.cfg.train
    run.bad_streak += 1
    run.bad_batches.append(run.drawn)
    run.skipped_steps.append(step)
    what = next(iter(bad_ranks.values()))
    named = ("rank " if len(bad_ranks) == 1 else "ranks ") + ", ".join(map(str, bad_ranks))
    report = f"shardwise: step {step}: non-finite {what} on {named} (global batch {run.drawn})"
    if cfg.nonfinite == "stop" or (cfg.nonfinite == "skip" and run.bad_streak >= cfg.max_bad_steps):
        raise NonFiniteStop(f"{report}; {run.bad_streak} bad step(s) in a row: stopping")
    if run.rt.is_main:
        print(f"{report}: update skipped on every rank", flush=True)


def finish(run: Run, started: float) -> dict[str, Any]:
    """Final evaluation, summary and consolidated checkpoint (rank 0), then release."""
    cfg, rt = run.cfg, run.rt
    run.progress.close()
    train_comm = comm.stats.total()
    scored = evaluate(run.model, run.job, cfg.train.eval_batch_size)
    state = sw.full_state_dict(run.model)
    skip = WARMUP_STEPS_EXCLUDED if len(run.step_times) > WARMUP_STEPS_EXCLUDED else 0
    timed = run.step_times[skip:] or [float("nan")]
    summary = {
        "name": cfg.name,
        "strategy": cfg.strategy.describe(),
        "world_size": rt.world_size,
        "steps": cfg.train.steps,
        "final_train_loss": run.loss,
        "eval_loss": scored.loss,
        "eval_accuracy": scored.accuracy,
        "eval_targets": scored.targets,
        "samples_per_s": sum(run.step_samples[skip:]) / sum(timed),
        "comm_bytes_per_step": train_comm.bytes / cfg.train.steps,
        "comm_bytes_total": train_comm.bytes,
        "comm_wait_s": train_comm.wait_s,
        "memory": run.memory,
        "predicted": prediction.versus_measured(
            run.predicted, run.memory, train_comm.bytes / cfg.train.steps, statistics.median(timed)
        ),
        "skipped_steps": run.skipped_steps,
        "run_dir": str(run.out),
    }
    run.saver.wait()
    # From here rank 0 works alone (the final weights, the summary) while the others wait in
    # the last barrier: however long that takes, it is not a hang.
    run.watchdog.stop()
    if rt.is_main:
        _log_saves(run)
        meta = {"step": cfg.train.steps, "world_size": rt.world_size, "name": cfg.name}
        save_model(run.out / "checkpoint", state, meta)
        run.metrics.close()
        if run.board:
            final = {"step": cfg.train.steps, "eval_loss": scored.loss}
            run.board.write({**final, "eval_accuracy": scored.accuracy, "memory": run.memory})
            run.board.close()
    summary["wall_time_s"] = time.perf_counter() - started
    if rt.is_main:
        write_summary(run.out, summary)
    run.timing.close()
    run.model.close()
    # Nobody leaves while rank 0 still writes: an early exit would look like a crash to it.
    comm.barrier()
    return summary


def train(cfg: Config, run_dir: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Run the job described by `cfg` in this process (one rank of it); return the summary.
    With `resume`, continue from the run directory's newest checkpoint (if it has one).

    Every rank ends the same way, with an exit code that says how: the non-finite policy
    stopped the run (`EXIT_NONFINITE`), a hang or desync (`EXIT_HUNG`), a signal to any rank
    (128 + its number, after a checkpoint: the steps were not all done, so no final model).
    A rank that fails on its own leaves at once (`leave`)."""
    started = time.perf_counter()
    try:
        run = setup(cfg, run_dir, resume)
    except Exception as e:
        leave(e)
    if cfg.launch.desync_check_per_call:
        comm.flight.recorder.check_call = run.watchdog.compare_each_call
    run.watchdog.start()
    try:
        summary = _train(run, started)
    except (NonFiniteStop, DesyncError) as e:
        if run.rt.is_main or isinstance(e, DesyncError):
            print(e, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            run.saver.wait()  # a checkpoint being written is finished, not torn
        raise SystemExit(EXIT_NONFINITE if isinstance(e, NonFiniteStop) else EXIT_HUNG) from None
    except Exception as e:
        leave(e)
    finally:
        run.watchdog.stop()
        comm.flight.recorder.check_call = None
        if run.board:
            run.board.close()
    if run.stopped_by:  # every rank leaves with the signal's code (the lowest rank's signal)
        raise SystemExit(128 + run.stopped_by[min(run.stopped_by)])
    return summary


def leave(error: Exception) -> NoReturn:
    """This rank failed on its own: one line for an expected error (a file of the run that
    cannot be written, a checkpoint that does not fit), the traceback for anything else; the
    other ranks are told (`runtime.announce_leaving`), and the process exits now. A graceful
    teardown cannot finish: its barrier never completes while the others wait for this rank in
    a collective, and the process, its barrier pending, did not exit until their watchdog
    ended them (71 s on a full disk)."""
    rank = os.environ.get("RANK", "0")
    # Expected: a file of the run that cannot be written or read (OSError, SafetensorError), a
    # checkpoint or config that does not fit (ValueError: RunCheckpointError, ConfigError).
    if isinstance(error, (OSError, ValueError, SafetensorError)):
        reason = " ".join(str(error).split())
        print(f"shardwise: rank {rank}: {reason}", file=sys.stderr, flush=True)
    elif gone := _ranks_that_left(int(rank)):  # a collective broken by their exit: no bug here
        reason = f"{name_ranks(gone)} left the job"
        print(f"shardwise: rank {rank}: {reason}: stopping", file=sys.stderr, flush=True)
    else:
        traceback.print_exc()
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
    runtime.announce_leaving(reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if isinstance(error, ValueError) else 1)


def _ranks_that_left(rank: int) -> list[int]:
    """The other ranks that announced they left the job on a failure (`announce_leaving`)."""
    try:
        return failed_ranks(runtime.store(), runtime.current().world_size, but=rank)
    except Exception:  # no job to ask (it failed before joining), or its store is gone
        return []


def _train(run: Run, started: float) -> dict[str, Any]:
    cfg = run.cfg
    comm.stats.reset()
    loop_start = time.perf_counter()
    step = run.start_step
    with _stop_on_signals(run):
        while step < cfg.train.steps:
            step += 1
            run.watchdog.step = step
            run.faults.before_step(step)
            traced = cfg.train.trace_steps and run.timeline
            if traced and step == cfg.train.trace_steps[0]:
                _start_trace(run)
            if isinstance(run.loader, QueueLoader):
                run_round(run, step, loop_start)
            else:
                run_step(run, step, loop_start)
            if traced and step == min(cfg.train.trace_steps[1], cfg.train.steps):
                _end_trace(run)
            if cfg.train.nonfinite == "rollback" and run.bad_streak >= cfg.train.max_bad_steps:
                step = _rollback(run, step)
                continue
            every = cfg.train.checkpoint_every
            saved = (run.stopping or (every and step % every == 0)) and _checkpoint(run, step)
            if cfg.launch.desync_check_every and step % cfg.launch.desync_check_every == 0:
                run.watchdog.check_sequences()
            if run.stopping:
                _stop(run, step, saved)
                return {}
    return finish(run, started)


def _stop(run: Run, step: int, saved: bool) -> None:
    """After the step every rank agreed to stop at: its checkpoint complete, and rank 0 says
    who was sent which signal and how to go on."""
    run.saver.wait()  # the checkpoint is complete before this rank leaves
    if run.rt.is_main:
        _log_saves(run)
        who = name_ranks(sorted(run.stopped_by))
        names = "/".join(sorted({_signal_name(n) for n in run.stopped_by.values()}))
        how = (
            "with a checkpoint"
            if saved
            else f"with no checkpoint (non-finite steps since step {step - run.bad_streak + 1})"
        )
        print(
            f"shardwise: {who} got {names}: stopped after step {step} of {run.cfg.train.steps} "
            f"{how}; go on with: shardwise train --resume {run.out}",
            flush=True,
        )
    run.model.close()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _start_trace(run: Run) -> None:
    """Measure the clocks' offsets, then record every phase and collective (`timeline.py`)."""
    timeline = run.timeline
    timeline.offsets.append(measure_offset(run.rt.device, timeline.clock))
    comm.stats.end_step()  # the clocks' messages are not the step's
    timeline.recording = True
    run.phases.timeline, comm.stats.listener = timeline, timeline.collective


def _end_trace(run: Run) -> None:
    """Stop recording, measure the offsets again (the clocks drift), write this rank's events;
    rank 0 merges every rank's into RUN_DIR/trace.json."""
    timeline = run.timeline
    timeline.recording = False
    run.phases.timeline = comm.stats.listener = None
    timeline.offsets.append(measure_offset(run.rt.device, timeline.clock))
    files = [run.out / "trace" / f"rank{r}.json" for r in range(run.rt.world_size)]
    timeline.write(files[run.rt.rank])
    comm.barrier()  # every rank's file is complete
    comm.stats.end_step()
    if run.rt.is_main:
        merged = merge(files, run.out / "trace.json")
        bounds = ", ".join(
            f"rank {r}: {1e3 * o[0]['offset_s']:+.3f} ms +- {1e3 * o[0]['error_s']:.3f}"
            for r, o in merged["otherData"]["offsets_to_rank0"].items()
        )
        print(f"shardwise: timeline in {run.out / 'trace.json'} (clock offsets {bounds})")


def _rollback(run: Run, step: int) -> int:
    """Back to the newest checkpoint, leaving out the batches of the bad steps; its step.

    Gives up (`NonFiniteStop`) where rolling back made no progress: this streak of bad steps
    began before the run got past the step the last rollback was made at. The batches left
    out then were not the cause (the state they went back to was), and another rollback would
    go back to the same state again, or to one saved since from no better weights."""
    first_bad = step - run.bad_streak + 1
    if run.rolled_back_at and first_bad <= run.rolled_back_at:
        raise NonFiniteStop(
            f"shardwise: steps {first_bad}-{step} non-finite again, before the run got past "
            f"step {run.rolled_back_at} where it rolled back: rolling back makes no progress: "
            "stopping"
        )
    run.saver.wait()
    bad = set(run.bad_batches)
    found = _agree_checkpoint(run, fresh_start_ok=True)
    if found is None:
        raise NonFiniteStop(
            f"shardwise: {run.bad_streak} non-finite steps in a row up to step {step}, and no "
            "checkpoint to roll back to: stopping"
        )
    back_to = run.restore(run_checkpoint.load(found, run.model, run.opt, run.scheduler))
    run.rolled_back_at = step
    run.skip |= bad
    run.bad_streak, run.bad_batches = 0, []
    if run.cfg.train.sample_ledger:
        ledger.truncate_rank(run.out, run.rt.rank, back_to)
    if run.rt.is_main:
        print(
            f"shardwise: rolled back from step {step} to {found.directory} (step {back_to}); "
            f"global batches {sorted(bad)} left out",
            flush=True,
        )
        run.metrics.write({"step": step, "rollback_to": back_to, "batches_left_out": sorted(bad)})
    return back_to


def _checkpoint(run: Run, step: int) -> bool:
    """Save the run's state after `step`; False where it is not saved: under `rollback`, while
    bad steps are in a row (a checkpoint is a state to go back to, known good, and the weights
    after the last good step may be what makes every step since non-finite)."""
    if run.bad_streak and run.cfg.train.nonfinite == "rollback":
        return False
    started = time.perf_counter()
    path = run.saver.save(run.model, run.opt, run.scheduler, step, run.data_state())
    stall = time.perf_counter() - started
    if run.rt.is_main:
        run.metrics.write({"step": step, "checkpoint": str(path), "checkpoint_stall_s": stall})
        if run.faults.corrupts_checkpoint(step):
            run.saver.wait()
            print(f"shardwise: fault injected: corrupted {faults.corrupt(path)}", flush=True)
    return True


def _log_saves(run: Run) -> None:
    for saved_step, _, write_s in run.saver.take_done():
        run.metrics.write({"step": saved_step, "checkpoint_write_s": write_s})


@contextlib.contextmanager
def _stop_on_signals(run: Run):
    """SIGTERM and SIGINT ask the run to stop: every rank finishes the step, the run saves a
    checkpoint and leaves (instead of dying inside a collective)."""

    def ask_to_stop(signum, frame) -> None:
        run.stop_signal = signum

    with handling_stop_signals(ask_to_stop):
        yield
