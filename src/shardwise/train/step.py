"""One step of the trainer (or one work-queue round), and what it leaves in the run's files."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from shardwise import comm
from shardwise.data.datasets import PAD_TARGET
from shardwise.faults.nonfinite import NonFiniteStop, grads_finite
from shardwise.observe.memory import ActivationMeter, PeakMeter, memory_report
from shardwise.train.agreement import agree_round, agree_step
from shardwise.train.training_run import TrainingRun


def run_step(run: TrainingRun, step: int) -> None:
    """One optimizer step, its globally averaged loss, and its line in metrics.jsonl."""
    measuring = step == run.cfg.train.steps and run.cfg.train.measure  # the state at its fullest
    # The most bytes alive at once in the measured step, beside its prediction. What is alive
    # at its start is found (a pass of the garbage collector) before the step's clock starts.
    peak = PeakMeter(run.rt.device).scan() if measuring else None
    run.phases.start_step(step)
    t0, waited0 = time.perf_counter(), comm.stats.step_wait_s()
    with run.phases.phase("data"):
        x, y = run.job.inputs_targets(run.feed.next(step), run.rt.device)
    if peak is not None:
        peak.include(*tree_leaves((x, y)))
    with peak or contextlib.nullcontext():
        local_loss, tokens, work_s = _forward_backward(run, step, x, y, waited0, measuring)
        with run.phases.phase("sync"):
            agreed = _agree(run, local_loss, y, tokens)
            lr = run.scheduler.get_last_lr()[0]
        with run.phases.phase("optimizer"):
            record = _update(run, step, agreed.bad_ranks)
    if peak is not None:
        run.measured.memory["step_peak"] = peak.peak - run.measured.data_bytes
    if agreed.bad_ranks:  # (every rank agreed: the update was skipped everywhere)
        run.policy.after_step(step, agreed.bad_ranks, batch=run.feed.drawn)
    timed = (time.perf_counter() - t0, comm.stats.end_step())
    _balance(run, step, y.shape[0], work_s, record)
    if agreed.bad_ranks:
        record = {"skipped": True, "nonfinite_ranks": list(agreed.bad_ranks)}
        record["batch"] = run.feed.drawn
    log_step(run, step, lr, (run.feed.global_batch, y.shape[0]), work_s, timed, record)


def _forward_backward(run: TrainingRun, step, x, y, waited0: float, measuring: bool):
    """This rank's loss, its real target tokens (None: its share is its samples) and its work
    in seconds (forward and backward, a slowed rank's sleep included: what the balancer
    measures; waiting in collectives is not work)."""
    meter = ActivationMeter() if measuring else contextlib.nullcontext()
    with run.phases.phase("backward"):  # (and the forward calls, which PhaseTimer's hooks time)
        started = time.perf_counter()
        # The loader planned every rank's batch, so it knows the global one (in samples); a
        # per-token loss weighs real tokens, summed over the ranks by the strategy.
        tokens = real_tokens(y) if run.job.per_token else None
        total = run.feed.global_batch if tokens is None else None
        # `train.accumulate: K`: K micro-batches, each weighed by its own samples or tokens.
        accumulate = run.cfg.train.accumulate
        samples = tokens if accumulate == 1 or tokens is None else real_tokens
        with meter:
            loss = run.wrapped.compute(
                x, y, run.wrapped.loss, samples=samples, total=total, accumulate=accumulate
            )
        work_s = time.perf_counter() - started - (comm.stats.step_wait_s() - waited0)
        if step == run.cfg.train.steps:  # gradients present: the model state at its fullest
            run.measured.memory = memory_report(run.model, run.opt)
            if isinstance(meter, ActivationMeter):
                run.measured.memory["activations"] = meter.peak
    return loss, tokens, work_s


def real_tokens(y: torch.Tensor) -> int:
    """The target tokens of a per-token loss's batch that are not padding."""
    return int((y != PAD_TARGET).sum())


def _agree(run: TrainingRun, local_loss: torch.Tensor, y: torch.Tensor, tokens: int | None):
    # An fp16 loss scaler checks the gradients itself (an overflow: it skips the step and
    # lowers the scale); only the loss is ours to check then.
    finite = run.model.scales_loss() or grads_finite(run.model)
    count = y.shape[0] if tokens is None else tokens  # the logged loss: a mean over these
    joiners = run.elastic.joiners_waiting() if run.elastic and run.rt.is_main else 0
    agreed = agree_step(
        run.rt, local_loss, count, finite, run.stop_signal, run.wrapped.reduce, joiners
    )
    run.measured.loss, run.stopped_by = agreed.loss, agreed.stopped_by
    run.joiners_due = agreed.joiners > 0
    return agreed


def _update(run: TrainingRun, step: int, bad_ranks: dict[int, str]) -> dict[str, Any]:
    """The optimizer step (skipped everywhere after a non-finite one, the schedule's too)."""
    train, model, record = run.cfg.train, run.model, {}
    if bad_ranks:
        run.opt.zero_grad()
        return record
    run.policy.after_step(step, {})
    if train.clip_grad_norm:
        record["grad_norm"] = float(model.clip_grad_norm_(train.clip_grad_norm))
    elif train.measure and step % train.log_every == 0:  # every rank alike: a sharded sum meets
        record["grad_norm"] = model.grad_square_sum().sqrt().item()
    if model.scales_loss():
        record["loss_scale"] = model.loss_scale()
    run.opt.step()
    run.opt.zero_grad()
    if run.pruner is not None:
        run.pruner.step()
    run.scheduler.step()
    return record


def _balance(run: TrainingRun, step: int, samples: int, work_s: float, record: dict) -> None:
    """`data.balance: dynamic`: batch sizes follow the ranks' measured speeds."""
    if run.balancer or run.cfg.data.rank_weights:
        record["batch_sizes"] = run.feed.loader.sizes
    if run.balancer:
        # (the waits subtracted from the step's time can add up past it: no work, not less)
        run.balancer.observe(samples, max(0.0, work_s))
        if (sizes := run.balancer.rebalance()) is not None and run.rt.is_main:
            rates = ", ".join(f"{r:.0f}" for r in run.balancer.rates)
            print(f"shardwise: step {step}: samples/s per rank [{rates}] -> batch sizes {sizes}")


def run_round(run: TrainingRun, step: int) -> None:
    """One work-queue round (`data.mode: queue`, local SGD): this rank trains the chunks it
    claims, one local step each, as many as its speed allows, until the round's are gone;
    then the replicas are averaged, each weighted by the samples it trained on, and the loss
    is averaged over every sample of the round. The schedule steps once per round.

    A chunk whose loss or gradients are not finite (`train.nonfinite`) is left out of the
    round under 'skip' (its local step too: the replicas meet only at the round's end), and
    under 'stop' makes the round's loss NaN on every rank, which stops the run."""
    model, opt = run.model, run.opt
    t0, waited0 = time.perf_counter(), comm.stats.step_wait_s()
    samples, loss_sum, skipped = 0, 0.0, 0
    for batch in run.feed.round(step):
        x, y = run.job.inputs_targets(batch, run.rt.device)
        loss = run.wrapped.compute(x, y, run.wrapped.loss)
        if not (math.isfinite(loss.item()) and grads_finite(model)):
            opt.zero_grad()
            if run.cfg.train.nonfinite == "stop":
                loss_sum = math.nan  # (every rank's round loss: every rank stops)
                break
            skipped += 1
            continue
        if run.cfg.train.clip_grad_norm:
            model.clip_grad_norm_(run.cfg.train.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        samples, loss_sum = samples + y.shape[0], loss_sum + loss.item() * y.shape[0]
    work_s = time.perf_counter() - t0 - (comm.stats.step_wait_s() - waited0)
    model.end_round(samples)
    loss, everyone, run.stopped_by = agree_round(
        run.rt, loss_sum, samples, run.stop_signal, comm.all_reduce
    )
    run.measured.loss = loss
    if not math.isfinite(loss):
        raise NonFiniteStop(f"shardwise: round {step}: non-finite loss: stopping")
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    timed = (time.perf_counter() - t0, comm.stats.end_step())
    record = {"skipped_chunks": skipped} if skipped else {}  # (this rank's)
    log_step(run, step, lr, (everyone, samples), work_s, timed, record)


def log_step(
    run: TrainingRun,
    step: int,
    lr: float,
    samples: tuple[int, int],
    work_s: float,
    timed: tuple[float, comm.CommSnapshot],
    record: dict[str, Any],
) -> None:
    """After a step (or a round): evaluation if due, this rank's timing line, the progress bar
    and rank 0's metrics line. `samples`: (the whole step's, this rank's); `timed`: the step's
    seconds and messages."""
    step_time, step_comm = timed
    phases = run.phases.take()
    if run.validator.due(step):
        record.update(_evaluate(run))
    run.measured.step_times.append(step_time)
    run.measured.step_samples.append(samples[0])
    last = step == run.cfg.train.steps and run.measured.memory
    run.metrics.log_timing(
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
            **({"memory": run.measured.memory} if last else {}),
        }
    )
    log_saves(run)
    run.metrics.log_step(step, run.measured.loss, samples[0], step_time, step_comm, lr=lr, **record)


def _evaluate(run: TrainingRun) -> dict[str, float]:
    started, measuring = time.perf_counter(), run.phases.active
    run.phases.active = False  # evaluation's forward calls are not the step's
    scored = run.validator(run.model)
    run.phases.active = measuring
    comm.stats.end_step()  # nor are its messages
    if run.trace:
        run.trace.timeline.span("eval", started, time.perf_counter())
    return {"eval_loss": scored.loss, **accuracy_entry(scored)}


def accuracy_entry(scored) -> dict[str, float]:
    """An evaluation's accuracy, where its model is a classifier (else no entry at all)."""
    return {} if scored.accuracy is None else {"eval_accuracy": scored.accuracy}


def log_saves(run: TrainingRun) -> None:
    """Rank 0: a line for each checkpoint written since the last look."""
    for saved_step, _, write_s in run.checkpointer.take_done():
        run.metrics.log_event({"step": saved_step, "checkpoint_write_s": write_s})
