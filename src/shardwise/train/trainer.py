"""The training loop every strategy shares: one process of a job, from config to summary.

Run by each worker (under our launcher or torchrun). The loop composes parts that a user's own
loop can use as well: the checkpointer (`checkpoint/checkpointer.py`), the non-finite policy
(`faults/nonfinite.py`), the watchdog (`faults/watchdog.py`), the metrics writer
(`observe/metrics.py`), the validator (`validator.py`) and the balancer (`data/balance.py`);
`build.py` makes them from the config and `step.py` is one step. Rank 0 owns the run
directory: resolved config, metrics.jsonl (one line per step), summary.json and the final
checkpoint; every rank writes its own time per step (work, waiting) to timing/rank{r}.jsonl.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Any

from shardwise import api, comm
from shardwise.checkpoint.reshardable import save_model
from shardwise.comm.interrupt import PeerLost
from shardwise.config import Config
from shardwise.data import ledger
from shardwise.data.queue_loader import QueueLoader
from shardwise.distributed import membership
from shardwise.distributed.membership import Dropped
from shardwise.distributed.signals import handling_stop_signals
from shardwise.faults.nonfinite import EXIT_NONFINITE, NonFiniteStop
from shardwise.faults.watchdog import EXIT_HUNG, DesyncError
from shardwise.observe.run_output import write_summary
from shardwise.plan import prediction
from shardwise.ps.worker import PSConfig
from shardwise.train import elastic
from shardwise.train.build import build
from shardwise.train.exits import leave, signal_exit_code, stop_message
from shardwise.train.step import accuracy_entry, log_saves, run_round, run_step
from shardwise.train.training_run import TrainingRun

WARMUP_STEPS_EXCLUDED = 3  # first steps pay for allocation and lazy init; not in samples/s


def train(cfg: Config, run_dir: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Run the job described by `cfg` in this process (one rank of it); return the summary.
    With `resume`, continue from the run directory's newest checkpoint (if it has one).

    Every rank ends the same way, with an exit code that says how: the non-finite policy
    stopped the run (`EXIT_NONFINITE`), a hang or desync (`EXIT_HUNG`), a signal to any rank
    (128 + its number, after a checkpoint: the steps were not all done, so no final model).
    A rank that fails on its own leaves at once (`exits.leave`)."""
    if isinstance(cfg.strategy, PSConfig):  # roles, not replicas: not this loop's job
        raise ValueError(
            f"strategy {cfg.strategy.name!r} runs its own roles: start it with "
            "launch.job_runner.train_rank (what `shardwise train` does)"
        )
    started = time.perf_counter()
    # A stop signal while the run is built stops it after its first step, with a checkpoint
    # (not a replacement waiting to join, which a stopping job must not wait for).
    early: list[int] = []
    noting = (
        contextlib.nullcontext()
        if membership.is_replacement()
        else handling_stop_signals(lambda signum, _frame: early.append(signum))
    )
    with noting:
        try:
            run = _first_run(cfg, run_dir, resume)
        except Exception as e:
            leave(e)
    if early:
        run.stop_signal = early[-1]
    if cfg.launch.desync_check_per_call:
        comm.flight.recorder.check_call = run.watchdog.compare_each_call
    run.watchdog.start()
    trainer = Trainer(run)
    try:
        summary = trainer.fit(started)
    except Dropped as e:  # the others went on without this rank: it has nothing left to do
        print(f"shardwise: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_HUNG) from None
    except (NonFiniteStop, DesyncError) as e:
        if run.rt.is_main or isinstance(e, DesyncError):
            print(e, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            run.checkpointer.wait()  # a checkpoint being written is finished, not torn
        raise SystemExit(EXIT_NONFINITE if isinstance(e, NonFiniteStop) else EXIT_HUNG) from None
    except Exception as e:
        leave(e)
    finally:
        run = trainer.run  # (an elastic job's newest)
        run.watchdog.stop()
        comm.flight.recorder.check_call = None
        run.metrics.close()
    if run.stopping:
        raise SystemExit(signal_exit_code(run.stopped_by))
    return summary


def _first_run(cfg: Config, run_dir: str | None, resume: bool) -> TrainingRun:
    """This rank's run: built from the config (and the run's newest checkpoint, with
    `resume`), or, for a replacement in an elastic job, from the state its members send."""
    if cfg.train.on_failure == "stop":
        return build(cfg, run_dir, resume)
    if membership.is_replacement():
        return elastic.join(cfg, run_dir)
    run = build(cfg, run_dir, resume)
    elastic.Elastic.starting(run)  # (a hung rank is dropped, not the job)
    return run


class Trainer:
    """The loop over steps of one rank's run: each step, then what is due after it (a
    rollback, a checkpoint, a desync check, a stop)."""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run

    def fit(self, started: float) -> dict[str, Any]:
        """Train to `train.steps` (or to an agreed stop: then an empty summary)."""
        cfg = self.run.cfg
        comm.stats.reset()
        self.run.metrics.start_clock()
        step = self.run.start_step
        with handling_stop_signals(self._ask_to_stop):
            while step < cfg.train.steps:
                step += 1
                try:
                    step = self._step_and_after(step)
                except PeerLost as e:
                    if self.run.elastic is None:
                        raise
                    self._go_on_with(self.run.elastic.recover(self.run, e))  # without the lost
                    step = self.run.start_step
                    continue
                if self.run.stopping:
                    return {}
            # (every step done: a signal now is noted and the run finishes, its final model
            # and summary written, rather than a rank killed with them half made)
            return self._finish(started)

    def _step_and_after(self, step: int) -> int:
        """`step`, then what is due after it (a rollback, a checkpoint, a desync check, a
        stop); the step the run is at then."""
        run, cfg = self.run, self.run.cfg
        if run.elastic is not None:  # (replacements taken in, and the state kept, first)
            run = self._go_on_with(run.elastic.before_step(run, step))
        self._step(step)
        if run.policy.rollback_due:
            back_to = self._rollback(step)
            if run.stopping:  # (a stop asked in that step: the run is its checkpoint's again)
                self._stop(back_to, saved=True)
            return back_to
        every = cfg.train.checkpoint_every
        due = run.stopping or (every and step % every == 0)
        saved = due and self._checkpoint(step)
        if cfg.launch.desync_check_every and step % cfg.launch.desync_check_every == 0:
            run.watchdog.check_sequences()
        if run.stopping:
            self._stop(step, saved)
        return step

    def _go_on_with(self, run: TrainingRun) -> TrainingRun:
        """Train on with `run` (the job re-formed, or the same run). A stop asked meanwhile
        was noted on the run left behind: it carries over (before, it was lost, and the job
        trained to its end)."""
        left, self.run = self.run, run
        run.stop_signal = run.stop_signal or left.stop_signal
        return run

    def _ask_to_stop(self, signum, frame) -> None:
        """SIGTERM or SIGINT: every rank finishes the step, the run saves a checkpoint and
        leaves (instead of dying inside a collective)."""
        self.run.stop_signal = signum

    def _step(self, step: int) -> None:
        run = self.run
        run.watchdog.step = step
        run.faults.before_step(step)
        if run.trace:
            run.trace.before_step(step)
        if isinstance(run.feed.loader, QueueLoader):
            run_round(run, step)
        else:
            run_step(run, step)
        if run.trace:
            run.trace.after_step(step, run.cfg.train.steps)

    def _checkpoint(self, step: int) -> bool:
        """Save the run's state after `step`; False where the policy forbids it (bad steps in
        a row under `rollback`: not a state to go back to)."""
        run = self.run
        if not run.policy.may_checkpoint:
            return False
        path = run.checkpointer.save(step, run.feed.state_dict())
        stall = run.checkpointer.last_stall_s  # (a fault that damages the save waits after it)
        run.metrics.log_event({"step": step, "checkpoint": str(path), "checkpoint_stall_s": stall})
        return True

    def _rollback(self, step: int) -> int:
        """Back to the newest checkpoint, leaving out the batches of the bad steps; its step."""
        run = self.run
        streak = run.policy.streak
        left_out = run.policy.rollback(step)  # (gives up where rolling back made no progress)
        found = run.checkpointer.newest(fresh_start_ok=True)
        if found is None:
            raise NonFiniteStop(
                f"shardwise: {streak} non-finite steps in a row up to step {step}, and no "
                "checkpoint to roll back to: stopping"
            )
        back_to, data = run.checkpointer.load(found)
        run.restore(data)
        run.feed.skip |= left_out
        if run.cfg.train.sample_ledger:
            ledger.truncate_rank(run.out, run.rt.rank, back_to)
        run.metrics.rewind(back_to)  # (the steps after it are run again: no step shows twice)
        if run.rt.is_main:
            print(
                f"shardwise: rolled back from step {step} to {found.directory} (step {back_to}); "
                f"global batches {sorted(left_out)} left out",
                flush=True,
            )
        # (at the step gone back to: a later rollback to the same checkpoint keeps this line)
        run.metrics.log_event(
            {
                "step": back_to,
                "rolled_back_from": step,
                "rollback_to": back_to,
                "batches_left_out": sorted(left_out),
            }
        )
        return back_to

    def _stop(self, step: int, saved: bool) -> None:
        """After the step every rank agreed to stop at: its checkpoint complete, and rank 0
        says who was sent which signal and how to go on."""
        run = self.run
        run.checkpointer.wait()  # the checkpoint is complete before this rank leaves
        if run.rt.is_main:
            log_saves(run)
            first_bad = step - run.policy.streak + 1
            how = (
                "with a checkpoint"
                if saved
                else f"with no checkpoint (non-finite steps since step {first_bad})"
            )
            line = stop_message(run.stopped_by, step, run.cfg.train.steps, how, run.out)
            print(line, flush=True)
        run.model.close()

    def _finish(self, started: float) -> dict[str, Any]:
        """Final evaluation, summary and consolidated checkpoint (rank 0), then release."""
        run, cfg = self.run, self.run.cfg
        run.metrics.progress.close()
        if run.elastic is not None and run.rt.is_main:
            run.elastic.finished()  # (no replacement joins any more)
        train_comm = comm.stats.total()
        scored = run.validator(run.model)
        state = api.full_state_dict(run.model)
        summary = self._summary(scored, train_comm)
        run.checkpointer.wait()
        # From here rank 0 works alone (the final weights, the summary) while the others wait
        # in the last barrier: however long that takes, it is not a hang.
        run.watchdog.stop()
        log_saves(run)
        if run.rt.is_main:
            meta = {"step": cfg.train.steps, "world_size": run.rt.world_size, "name": cfg.name}
            run.checkpointer.record_model_config()  # (a run that saved no checkpoint before)
            save_model(run.out / "checkpoint", state, meta)
        final = {"step": cfg.train.steps, "eval_loss": scored.loss, **accuracy_entry(scored)}
        run.metrics.log_board({**final, "memory": run.measured.memory})
        run.metrics.close()
        summary["wall_time_s"] = time.perf_counter() - started
        if run.rt.is_main:
            write_summary(run.out, summary)
        run.model.close()
        # Nobody leaves while rank 0 still writes: an early exit would look like a crash to it.
        comm.barrier()
        return summary

    def _summary(self, scored, train_comm: comm.CommSnapshot) -> dict[str, Any]:
        run, cfg, measured = self.run, self.run.cfg, self.run.measured
        timed_steps = measured.step_times
        skip = WARMUP_STEPS_EXCLUDED if len(timed_steps) > WARMUP_STEPS_EXCLUDED else 0
        timed = timed_steps[skip:] or [float("nan")]
        # (over the steps this process ran: a resumed run's are fewer, a rolled-back one's more)
        per_step = train_comm.bytes / max(1, len(timed_steps))
        return {
            "name": cfg.name,
            "strategy": cfg.strategy.describe(),
            "world_size": run.rt.world_size,
            "steps": cfg.train.steps,
            "final_train_loss": measured.loss,
            "eval_loss": scored.loss,
            **accuracy_entry(scored),
            "eval_targets": scored.targets,
            "samples_per_s": sum(measured.step_samples[skip:]) / sum(timed),
            "comm_bytes_per_step": per_step,
            "comm_bytes_total": train_comm.bytes,
            "comm_wait_s": train_comm.wait_s,
            "memory": measured.memory,
            "predicted": prediction.versus_measured(
                measured.predicted, measured.memory, per_step, statistics.median(timed)
            ),
            "skipped_steps": run.policy.skipped_steps,
            "run_dir": str(run.out),
        }
