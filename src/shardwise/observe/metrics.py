"""The metrics writer: what a training loop leaves per step, from the trainer or a user's loop.

    metrics = sw.MetricsWriter("runs/mine", steps=1000)        # every rank
    for step in range(1, 1001):
        t0 = time.perf_counter()
        ...
        metrics.log_step(step, loss.item(), samples=global_batch,
                         step_time=time.perf_counter() - t0, lr=scheduler.get_last_lr()[0])
    metrics.close()

Rank 0 writes RUN_DIR/metrics.jsonl (one strict-JSON line per step, with the step's messages
from `comm.stats`) and, with `tensorboard`, RUN_DIR/tensorboard/ from the same records; every
rank writes its own time per step to RUN_DIR/timing/rank{r}.jsonl (`log_timing`) and rank 0
shows the progress bar. `shardwise report` reads these files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from shardwise import comm
from shardwise.arguments import finite_number, whole_number
from shardwise.distributed import runtime
from shardwise.observe.board import Board
from shardwise.observe.run_output import MetricsFile, ProgressReporter


class MetricsWriter:
    """One run's metrics.jsonl, TensorBoard, per-rank timing files and progress bar."""

    def __init__(
        self,
        run_dir: str | Path,
        steps: int,
        *,
        name: str = "run",
        log_every: int = 10,
        tensorboard: bool = False,
        keep_steps: int | None = None,
        rt: runtime.Runtime | None = None,
    ) -> None:
        """`steps`: how many the run has (the progress bar's end); `keep_steps`: a resumed run
        keeps the lines of the steps up to its checkpoint's and drops the rest."""
        whole_number("MetricsWriter steps", steps)
        whole_number("MetricsWriter log_every", log_every, least=1)
        self.rt = rt or runtime.current_or_alone()
        out = Path(run_dir)
        (out / "timing").mkdir(parents=True, exist_ok=True)
        self.timing = MetricsFile(out / "timing" / f"rank{self.rt.rank}.jsonl", keep_steps)
        self.metrics = MetricsFile(out / "metrics.jsonl", keep_steps) if self.rt.is_main else None
        purge = None if keep_steps is None else keep_steps + 1
        self.board = Board(out, purge) if tensorboard and self.rt.is_main else None
        self.progress = ProgressReporter(steps, name, self.rt.is_main, log_every)
        # (a resumed run's time goes on from its last line kept: the figures over time read on)
        self.kept_t = self.metrics.kept_t if self.metrics else 0.0
        self.start_clock()

    def start_clock(self) -> None:
        """The run's time (its lines' `"t"`) counts from now, or from the last line kept."""
        self.started = time.perf_counter() - self.kept_t

    def log_step(
        self,
        step: int,
        loss: float,
        samples: int,
        step_time: float,
        step_comm: comm.CommSnapshot | None = None,
        **fields: Any,
    ) -> None:
        """Rank 0: the step's line (loss, throughput over `samples` of the whole step,
        communication: `step_comm`, else `comm.stats` since the last step, and `fields`);
        every rank: the progress bar."""
        finite_number("step_time", step_time, above=0)  # (a negative one wrote a negative rate)
        step_comm = step_comm or comm.stats.end_step()
        self.progress.update(step, loss, samples / step_time)
        line = {
            "step": step,
            "loss": loss,
            **({"lr": fields.pop("lr")} if "lr" in fields else {}),
            "step_time_s": step_time,
            "samples_per_s": samples / step_time,
            "comm_bytes": step_comm.bytes,
            "comm_calls": step_comm.calls,
            "comm_wait_s": step_comm.wait_s,
            "t": time.perf_counter() - self.started,
            "wall_time": time.time(),  # comparable across processes and restarts
            **fields,
        }
        self.log_event(line, board=True)

    def rewind(self, step: int) -> None:
        """A rollback to `step`: the lines (and TensorBoard's points) of the steps after it go,
        as on a resume, since those steps are run again; the run's time goes on."""
        self.timing.rewind(step)
        if self.metrics is not None:
            self.metrics.rewind(step)
        if self.board is not None:
            self.board.rewind(step)

    def log_event(self, record: dict[str, Any], board: bool = False) -> None:
        """Rank 0: one line that is not a step's (a checkpoint written, a rollback); with
        `board`, its known keys go to TensorBoard too."""
        if self.metrics is not None:
            self.metrics.write(record)
        if board and self.board is not None:
            self.board.write(record)

    def log_board(self, record: dict[str, Any]) -> None:
        """Rank 0: scalars for TensorBoard only (the final evaluation, the memory)."""
        if self.board is not None:
            self.board.write(record)

    def log_timing(self, record: dict[str, Any]) -> None:
        """This rank's own line of its timing file (its work, waits and phases of a step)."""
        self.timing.write(record)

    def close(self) -> None:
        self.progress.close()
        self.timing.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board.close()
            self.board = None
