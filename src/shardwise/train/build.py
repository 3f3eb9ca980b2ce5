"""The trainer's parts, made from a config: process group, run directory, model, strategy,
optimizer, schedule, data, checkpointer, policies, faults, meters; with `resume`, everything
restored from the run directory's newest complete checkpoint."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shardwise import api, comm, user_code
from shardwise.checkpoint import run_checkpoint
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.config import Config
from shardwise.data import ledger
from shardwise.data.balance import ThroughputBalancer
from shardwise.data.queue_loader import QueueLoader
from shardwise.data.skew import format_report, skew_report
from shardwise.data.token_file import TokenWindows
from shardwise.distributed.runtime import Runtime
from shardwise.faults.injection import FaultInjector
from shardwise.faults.nonfinite import NonFinitePolicy
from shardwise.faults.watchdog import Watchdog
from shardwise.jobs import (
    OPTIMIZERS,
    Job,
    base_lr,
    build_job,
    optimizer_kwargs,
    schedule,
    straggler_delay,
)
from shardwise.nn.schedules import lr_scheduler
from shardwise.observe import memory
from shardwise.observe.metrics import MetricsWriter
from shardwise.observe.phases import PhaseTimer
from shardwise.observe.step_trace import StepTrace
from shardwise.observe.timeline import Timeline
from shardwise.plan import calibrate, costs, prediction, predictors
from shardwise.recipes.continual import start_from
from shardwise.recipes.distillation import TeacherCache, distill_loss, prepare_teacher
from shardwise.recipes.pruning import GlobalMagnitudePruner, NMPruner, Pruner
from shardwise.strategies.accumulation import check_accumulate
from shardwise.train.data_feed import DataFeed, make_loader, stage_loader
from shardwise.train.recovered import Recovered
from shardwise.train.run_dir import agree_run_dir, claim_run_dir
from shardwise.train.training_run import Measured, TrainingRun, Wrapped
from shardwise.train.validator import Validator

# The samples of each rank's part the start's skew report reads at most: rank 0 reads them while
# the others wait (a user's dataset at 2 ms a sample: 6,000 samples kept them 14 s, past a
# short launch.comm_timeout_s); more are estimated from these.
SKEW_SAMPLES = 1024


def build(
    cfg: Config, run_dir: str | None, resume: bool = False, recovered: Recovered | None = None
) -> TrainingRun:
    """Every part of this rank's run, ready for its first (or next) step; with `recovered`
    (an elastic job's new membership, `elastic.py`), from that state instead of a checkpoint."""
    rt = api.init(backend=cfg.launch.backend, timeout_s=cfg.launch.comm_timeout_s)
    if cfg.launch.threads_per_rank:
        torch.set_num_threads(cfg.launch.threads_per_rank)
    comm.flight.recorder.reset()
    job = build_job(cfg)
    measured = Measured(data_bytes=_data_bytes(job.model, rt.device) if cfg.train.measure else 0)
    out = agree_run_dir(cfg, run_dir, rt, resume)
    # What each checkpoint records of the job, and a resume checks: the model before the
    # strategy splits it.
    signature = run_checkpoint.job_signature(job.model, cfg.optim.name, cfg.strategy.name)
    if rt.is_main and not resume and cfg.train.measure:  # (a prediction is a measure's peer)
        measured.predicted = _predict(cfg, job, rt, out)
    replicas = recovered.global_replicas if recovered else None
    job, opt, scheduler = _prepare(cfg, job, rt, out, replicas)
    model, train = job.model, cfg.train
    feed, balancer = _data(cfg, job, rt, out, resume, replicas)
    faults = FaultInjector(rt.rank, out, cfg.faults)
    checkpointer = Checkpointer(
        *(out, model, opt, scheduler),
        keep=train.keep_checkpoints,
        asynchronous=train.async_checkpoint,
        job=signature,
    )
    if rt.is_main:  # (rank 0 reports its checkpoints' checksums last: the one to damage one)
        checkpointer.save = faults.wrap_save(checkpointer.save, checkpointer.wait)
    run = TrainingRun(
        *(cfg, rt, job, model, opt, scheduler, out, feed, checkpointer),
        NonFinitePolicy(train.nonfinite, train.max_bad_steps, announce=rt.is_main),
        Watchdog(rt.rank, rt.world_size, cfg.launch.hang_timeout_s, out),
        Validator(
            *(job.splits.test, job.loss_fn, train.eval_batch_size),
            every=train.eval_every,
            inputs_targets=job.inputs_targets,
        ),
        faults,
        PhaseTimer(model, train.measure, sample_every=train.log_every),
        _wrapped(cfg, job, faults, feed),
        measured,
        balancer=balancer,
        pruner=_pruner(cfg, model, opt),
    )
    if train.trace_steps:
        timeline = Timeline(rt.rank, faults.clock())
        run.trace = StepTrace(timeline, tuple(train.trace_steps), out, rt, run.phases)
    if recovered is not None:
        _recover(run, recovered)
        run.checkpointer.adopt()  # (the job's own run directory, gone on from its peers)
    elif resume:
        step, data = run.checkpointer.resume()
        if data is not None:
            run.restore(data)
        run.start_step = step
        if run.pruner is not None:
            run.pruner.resume(step)
        if rt.is_main:  # the checkpoint fits: from here the run directory is this job's
            claim_run_dir(cfg, out)
    if cfg.start is not None and run.start_step == 0:  # (the run's own checkpoints first)
        _start(run)
    _open_files(run, keep=run.start_step if resume else None)
    return run


def _recover(run: TrainingRun, recovered: Recovered) -> None:
    """An elastic job's state, re-cut for this membership (`elastic.gather`)."""
    run.model.load_full_state(run.opt, recovered.params, recovered.states)
    run_checkpoint.load_schedule(run.scheduler, run.opt, recovered.scheduler)
    if recovered.rng is not None:
        run_checkpoint.set_rng_state(recovered.rng)
    else:  # a newcomer
        run_checkpoint.own_generators(recovered.step, run.rt.rank)
    run.restore(recovered.data)
    run.policy.load_state_dict(recovered.policy)
    run.start_step = recovered.step
    if run.pruner is not None:
        run.pruner.resume(recovered.step)


def _start(run: TrainingRun) -> None:
    """`start:`: the model (and per mode the optimizer, schedule, data position and step) from
    another run's checkpoint."""
    start = run.cfg.start
    step, data = start_from(
        *(start.checkpoint, run.model, run.opt, start.mode),
        scheduler=run.scheduler,
        grow_vocab=start.grow_vocab,
        seed=run.cfg.train.seed,
    )
    if data is not None:
        run.restore(data)
    run.start_step = step
    if run.pruner is not None and step:
        run.pruner.resume(step)
    if run.rt.is_main:
        kept = {
            "resume": f"everything, going on after step {step}",
            "continue": "weights and optimizer state; a fresh schedule, data position and step",
            "finetune": "weights only; a fresh optimizer, schedule, data position and step",
        }[start.mode]
        print(f"shardwise: {start.mode} from {start.checkpoint}: {kept}", flush=True)


def _prepare(cfg: Config, job: Job, rt: Runtime, out: Path, replicas: int | None = None):
    """The strategy applied to the job's model, its optimizer (the linear scaling rule once the
    replicas are known) and LR schedule. From here the job is trained through the distributed
    model: the unsplit module goes (a pipeline stage holds its own layers only, and the whole
    would keep every other stage's parameters alive on this rank). `replicas`: the ones the
    global batch was made for, where fewer (or more) ranks train it now (an elastic job)."""
    model, opt = api.prepare(
        job.model,
        cfg.strategy.build(rt.world_size, out),
        optimizer=OPTIMIZERS[cfg.optim.name],
        source=job.source,  # (a model on the meta device: each rank reads its own part)
        **optimizer_kwargs(cfg.optim),
    )
    job = replace(job, model=model, source=None)
    for group in opt.param_groups:
        group["lr"] = base_lr(cfg.optim, cfg.data.batch_size, replicas or model.data_shard()[0])
    return job, opt, lr_scheduler(opt, schedule(cfg.optim, cfg.train.steps))


def _data(cfg: Config, job: Job, rt: Runtime, out: Path, resume: bool, replicas: int | None = None):
    """The data feed, and the balancer that resizes its batches (`data.balance: dynamic`);
    `replicas`: what the global batch was made for (an elastic job's original ranks)."""
    loader = make_loader(cfg, job, job.model.data_shard(), replicas)
    if not isinstance(loader, QueueLoader):  # every rank's batch splits into its micro-batches
        check_accumulate(cfg.train.accumulate, loader.sizes)
    if isinstance(loader, QueueLoader):
        job.model.pace_by_rounds()
    elif rt.is_main and not resume and not isinstance(job.splits.train, TokenWindows):
        # (a token file's windows are alike, and reading each would read the whole file)
        report = skew_report(job.splits.train, loader.parts(0), most=SKEW_SAMPLES)
        (out / "data_skew.json").write_text(json.dumps(report, indent=1))
        print(f"shardwise: {format_report(report)}", flush=True)
    balancer = None
    if cfg.data.balance == "dynamic":
        balancer = ThroughputBalancer(
            loader, cfg.data.balance_every, rt, minimum=cfg.train.accumulate
        )
    ledger_dir = out if cfg.train.sample_ledger else None
    shard = job.model.data_shard()
    stages = [
        (s.at, functools.partial(stage_loader, cfg, s, shard, replicas)) for s in cfg.data.stages
    ]
    feed = DataFeed(loader, set(cfg.train.skip_batches), ledger_dir, rt.rank, stages)
    return feed, balancer


def _wrapped(cfg: Config, job: Job, faults: FaultInjector, feed: DataFeed) -> Wrapped:
    """The step's calls as the faults make them; `train.delay_s` is an emulated straggler's
    fixed delay in each step, applied like a `slow` fault."""
    delay, shard, queue = None, job.model.data_shard(), cfg.data.mode == "queue"
    if any(cfg.train.delay_s) and not queue:  # (work-queue rounds: no straggler delay)

        def delay(step: int) -> float:
            return straggler_delay(cfg.train, shard[1], shard[0], step)

    compute, loss = functools.partial(api.train_step, job.model), job.loss_fn
    if cfg.distill is not None:  # the teacher's logits travel with the targets
        compute, loss = _distilled(cfg, job, compute, loss, feed)
    return Wrapped(
        compute=faults.wrap_compute(compute, delay),
        loss=faults.wrap_loss(loss) if not queue else loss,  # (rounds: no `nan`)
        reduce=faults.wrap_reduce(comm.all_reduce),
    )


def _pruner(cfg: Config, model, opt) -> Pruner | None:
    """`prune:`: the weights of smallest magnitude over the whole model, gradually, or N of
    every M."""
    p = cfg.prune
    if p is None:
        return None
    if p.pattern is not None:
        n, m = map(int, p.pattern.split(":"))
        return NMPruner(model, opt, n, m, start=p.start)
    return GlobalMagnitudePruner(model, opt, p.sparsity, p.start, p.end, p.every)


def _distilled(cfg: Config, job: Job, compute, hard_loss, feed: DataFeed):
    """The step and loss of `distill`: the teacher (built by its factory, frozen, maybe
    sharded) runs on the batch first, under no_grad, or its cached top-K logits of the
    batch's samples are read (`distill.cache`); the loss weighs its softened outputs against
    the labels' (`hard_loss`)."""
    d = cfg.distill
    loss = distill_loss(d.temperature, d.alpha, hard_loss)
    if d.cache is not None:
        if not Path(d.cache).exists():
            TeacherCache.build(_teacher(cfg), job.splits.train, d.cache, d.top_k)
        cache = TeacherCache(d.cache, len(job.splits.train), job.splits.num_classes)

        def cached(inputs, targets, loss_fn, **kwargs):
            logits = cache.lookup(torch.as_tensor(feed.loader.last_indices))
            return compute(inputs, (targets, logits), loss_fn, **kwargs)

        return cached, loss
    teacher = _teacher(cfg)

    def online(inputs, targets, loss_fn, **kwargs):
        with torch.no_grad():
            logits = teacher(inputs)
        return compute(inputs, (targets, logits), loss_fn, **kwargs)

    return online, loss


def _teacher(cfg: Config) -> torch.nn.Module:
    """`distill.teacher`'s module, frozen, maybe sharded (every rank calls it)."""
    d = cfg.distill
    torch.manual_seed(cfg.train.seed)  # (a factory that initialises: the same on every rank)
    module = user_code.call(d.teacher, d.args, "distill.teacher")
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"distill.teacher {d.teacher}: returned a {type(module).__name__}")
    return prepare_teacher(module, shard=d.shard)


def _open_files(run: TrainingRun, keep: int | None) -> None:
    """The run's metrics and timing files (a resume drops the lines of steps after its
    checkpoint), and its sample ledger cut to the checkpoint."""
    cfg, rt = run.cfg, run.rt
    run.metrics = MetricsWriter(
        run.out,
        cfg.train.steps,
        name=cfg.name,
        log_every=cfg.train.log_every,
        tensorboard=cfg.train.tensorboard and cfg.train.measure,
        keep_steps=keep,
        rt=rt,
    )
    if rt.is_main and cfg.train.sample_ledger:
        ledger.truncate(run.out, run.start_step)  # steps after the checkpoint run again
    comm.barrier()  # (nobody writes its ledger before rank 0 cut it)


def _data_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the tensors alive on `device` beside the model's own: the dataset, mostly."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not t.is_meta]
    own = sum(memory.storage_bytes(tensors).values())
    return memory.live_bytes(device) - own


def _predict(cfg: Config, job: Job, rt: Runtime, out: Path) -> dict[str, Any]:
    """Rank 0's predicted costs (`prediction.for_run`), made before the strategy reshapes the
    model and written to RUN_DIR/prediction.json; the step time too where this machine has a
    calibration for this many ranks (`shardwise calibrate`)."""
    global_batch = cfg.data.batch_size * predictors.replicas(cfg.strategy, rt.world_size)
    cost_job = costs.CostJob.of(job, cfg, rt.world_size, rt.rank, global_batch)
    try:
        calibration = calibrate.load(rt.world_size)
    except (ValueError, OSError) as e:
        print(f"shardwise: {e}: no step time predicted", flush=True)
        calibration = None
    try:
        predicted = prediction.for_run(cost_job, cfg.strategy, calibration)
    except Exception as e:  # a model that cannot be traced on fake tensors: train unpredicted
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        print(f"shardwise: no prediction for this model ({reason})", flush=True)
        return {}
    if calibration is not None:
        predicted["calibration"] = calibrate.age_note(calibration)
    (out / "prediction.json").write_text(json.dumps(predicted, indent=1))
    return predicted
