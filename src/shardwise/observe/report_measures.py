"""The numbers `shardwise report` derives from each run: where its ranks' steps go, their
memory, the bytes they sent, its stability, and the headline and prediction tables."""

from __future__ import annotations

import math
import statistics
from typing import Any

from shardwise.observe.phases import breakdown
from shardwise.observe.report_inputs import PREDICTED, RunRecord

WARMUP = 3  # first steps pay for allocation and lazy set-up: left out of the time figures


def rank_breakdowns(run: RunRecord) -> list[dict[str, float]]:
    """Per rank: mean seconds per step in compute, exposed communication, idle, and the step."""
    if not run.timing:
        return []
    return breakdown([lines[WARMUP:] or lines for lines in run.timing])


def rank_memory(run: RunRecord) -> list[dict[str, int]]:
    """Each rank's bytes per category, from the timing line that carries them (the last step)."""
    found = []
    for lines in run.timing:
        found.append(next((line["memory"] for line in reversed(lines) if "memory" in line), {}))
    return found


def bytes_by_op(run: RunRecord) -> dict[str, float]:
    """Mean bytes this rank sent per step, per collective, over the ranks."""
    totals: dict[str, float] = {}
    for lines in run.timing:
        for line in lines:
            for op, nbytes in line.get("comm_bytes", {}).items():
                totals[op] = totals.get(op, 0.0) + nbytes / len(lines) / len(run.timing)
    return totals


def stability(run: RunRecord) -> dict[str, Any]:
    """Loss spikes (a step's loss above twice the median of the 10 before it), skipped steps,
    and the grad norm's coefficient of variation."""
    losses = [m.get("loss") for m in run.steps]
    spikes = sum(
        1
        for i in range(10, len(losses))
        if losses[i] is not None
        and None not in losses[i - 10 : i]
        and losses[i] > 2 * statistics.median(losses[i - 10 : i])
    )
    norms = [m["grad_norm"] for m in run.steps if m.get("grad_norm") is not None]
    mean = statistics.mean(norms) if len(norms) > 1 else 0.0
    spread = statistics.pstdev(norms) / mean if mean else math.nan
    skipped = len(run.summary.get("skipped_steps", []))
    return {"loss_spikes": spikes, "skipped_steps": skipped, "grad_norm_cv": spread}


def predicted_rows(run: RunRecord) -> dict[str, dict]:
    """The run's predicted-beside-measured pairs, by row (none where it was not predicted)."""
    return (run.summary.get("predicted") or {}).get("rows", {})


def prediction_table(runs: list[RunRecord]) -> list[dict[str, str]]:
    """Predicted / measured (error) per run, for the figures the prediction covers."""
    rows = []
    for run in runs:
        pairs = predicted_rows(run)
        row = {"run": run.label}
        for key, (title, scale, unit) in PREDICTED.items():
            pair = pairs.get(key)
            if pair is None:
                row[title] = "-"
                continue
            error = "" if pair.get("error") is None else f" ({pair['error']:+.1%})"
            row[title] = (
                f"{pair['predicted'] * scale:,.1f} / {pair['measured'] * scale:,.1f} {unit}{error}"
            )
        rows.append(row)
    return rows


def headline_table(runs: list[RunRecord]) -> list[dict[str, Any]]:
    """One row of headline figures per run."""
    rows = []
    for run in runs:
        parts = rank_breakdowns(run)
        idle = max((b["idle"] / b["step"] for b in parts if b["step"]), default=math.nan)
        hidden = statistics.mean(b["overlapped_comm"] for b in parts) if parts else math.nan
        peak = max((m.get("peak", 0) for m in rank_memory(run)), default=0)
        rows.append(
            {
                "run": run.label,
                "steps": run.summary.get("steps"),
                "final loss": run.summary.get("final_train_loss"),
                "eval accuracy": run.summary.get("eval_accuracy"),
                "samples/s": run.summary.get("samples_per_s"),
                "comm KiB/step": run.summary.get("comm_bytes_per_step", 0) / 2**10,
                "most idle rank": idle,
                "comm overlapped ms (at most)": 1000 * hidden,
                "peak MiB": peak / 2**20,
                "wall s": run.summary.get("wall_time_s"),
                **{name.replace("_", " "): value for name, value in stability(run).items()},
            }
        )
    return rows
