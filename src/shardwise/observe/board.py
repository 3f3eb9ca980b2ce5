"""TensorBoard event files for a run: `tensorboard --logdir runs/` shows every run under it.

Rank 0 writes RUN_DIR/tensorboard/ from the same records as metrics.jsonl (one per step), so
the two never disagree: the loss, learning rate, gradient norm, throughput, communication,
evaluation and (at the end) memory, each under a section of its own (train/, perf/, comm/,
eval/, memory/). Each rank's time per phase is in its timing file and the report. torch's
`SummaryWriter` writes from a background thread: a step only queues its scalars.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SECTIONS = {  # metrics.jsonl key -> TensorBoard tag
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "samples_per_s": "perf/samples_per_s",
    "step_time_s": "perf/step_time_s",
    "comm_bytes": "comm/bytes",
    "comm_calls": "comm/calls",
    "comm_wait_s": "comm/wait_s",
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
}


class Board:
    """Scalars per step into RUN_DIR/tensorboard (rank 0 only)."""

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        """`purge_step`: a resumed run's first step; what an earlier attempt wrote from there
        on is hidden (TensorBoard's purge), so no step shows twice."""
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: ~1 s, rank 0

        self.path = run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.path), purge_step=purge_step)

    def rewind(self, step: int) -> None:
        """Hide what was written for the steps after `step` (a rollback runs them again)."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer.close()
        self._writer = SummaryWriter(log_dir=str(self.path), purge_step=step + 1)

    def write(self, record: dict[str, Any]) -> None:
        """One metrics record: its known keys, and `memory` (bytes per category)."""
        step = record.get("step")
        if step is None:
            return
        for key, tag in SECTIONS.items():
            self._scalar(tag, record.get(key), step)
        for category, nbytes in record.get("memory", {}).items():
            self._scalar(f"memory/{category}_mib", nbytes / 2**20, step)

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            self._writer.add_scalar(tag, value, step)  # (a NaN loss leaves a gap)

    def close(self) -> None:
        """Flush and close (again: nothing); a run that stops early keeps what it wrote."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
