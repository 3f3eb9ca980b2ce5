"""What a run shows and leaves behind: progress bar, metrics.jsonl, summary table and JSON."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


class WriteError(OSError):
    """A file of the run could not be written (a full disk, say): the message names it, which
    the error of a write to an open file does not."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: [Errno {self.errno}] {self.strerror}"


@contextlib.contextmanager
def writing(path: Path):
    """Inside, an `OSError` is a `WriteError` naming `path`."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(e.errno, e.strerror or str(e), str(path)) from e


def os_reason(error: OSError) -> str:
    """An OS error in one line, with the path it names (where it names one)."""
    where = f": {error.filename}" if error.filename else ""
    return f"[Errno {error.errno}] {error.strerror}{where}" if error.strerror else str(error)


def check_writable_file(out: Path) -> None:
    """Before the work whose result goes to `out`: it can be written as a file (its folder made
    where missing), else a one-line `ValueError` saying why."""
    if out.is_dir():
        raise ValueError(f"cannot write {out}: it is a directory (give a file's path)")
    existing = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot write {out}: {existing} is not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot write {out}: {os_reason(e)}") from None
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"cannot write {out}: its folder {out.parent} is not writable")


class MetricsFile:
    """One strict-JSON object per line (a NaN loss is null: see `strict_json`); flushed so a
    crashed run keeps what it logged. A write that fails is a `WriteError` naming the file.

    `keep_steps`: a resumed run first drops the lines of steps after its checkpoint (they are
    about to be run again); `kept_t` is then the run's time at the last line kept (its `"t"`),
    which the resumed process's times go on from."""

    def __init__(self, path: Path, keep_steps: int | None = None) -> None:
        self.path, self.kept_t = path, 0.0
        with writing(path):
            if keep_steps is not None and path.exists():
                self._keep_up_to(keep_steps)
            self._file = path.open("a", encoding="utf-8")

    def _keep_up_to(self, step: int) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if _step(line) <= step]
        self.path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        self.kept_t = max((_t(line) for line in kept), default=0.0)

    def rewind(self, step: int) -> None:
        """Drop the lines of the steps after `step` (a rollback is about to run them again)."""
        with writing(self.path):
            self._file.close()
            self._keep_up_to(step)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file.closed:
            raise ValueError(f"{self.path}: a line written after its writer was closed")
        try:
            line = strict_json(record)
        except TypeError as e:  # (before anything is written: the file stays whole)
            raise TypeError(
                f"{self.path}: {e}: a line's fields are numbers, strings, lists and dicts of "
                "them (a tensor's value: .item() or .tolist())"
            ) from None
        with writing(self.path):
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with writing(self.path):
            self._file.close()


def _step(line: str) -> float:
    """A metrics line's step (null or absent: 0); a line cut short by a crash sorts last, so a
    resume drops it."""
    try:
        return json.loads(line).get("step") or 0
    except json.JSONDecodeError:
        return math.inf


def _t(line: str) -> float:
    """A kept metrics line's run time `"t"` (0 where it has none: an event's line)."""
    t = json.loads(line).get("t")
    return float(t) if isinstance(t, (int, float)) else 0.0


def strict_json(record: dict[str, Any], **dumps_kwargs: Any) -> str:
    """`record` as strict JSON (which has no NaN or infinity): a non-finite float anywhere in it
    is written as null, and a top-level `"nonfinite"` map says what each was, keyed by its
    dotted path: `{"loss": null, "nonfinite": {"loss": "nan"}}`."""
    replaced: dict[str, str] = {}
    clean = _finite(record, "", replaced)
    if replaced:
        clean["nonfinite"] = replaced
    return json.dumps(clean, allow_nan=False, **dumps_kwargs)


def _finite(value: Any, path: str, replaced: dict[str, str]) -> Any:
    if isinstance(value, (torch.Tensor, np.generic)) and value.ndim == 0:
        value = value.item()  # (a 0-dim tensor or numpy number: `clip_grad_norm_`'s norm)
    if isinstance(value, float) and not math.isfinite(value):
        replaced[path] = str(value)  # "nan", "inf" or "-inf"
        return None
    if isinstance(value, dict):
        return {
            k: _finite(v, f"{path}.{k}" if path else str(k), replaced) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{path}.{i}", replaced) for i, v in enumerate(value)]
    return value


class ProgressReporter:
    """A rich progress bar on a terminal; elsewhere (CI, pipes, logs) a plain line every `every`
    steps, at most about ten a run, and at least one a minute: a long run's ten lines came hours
    apart."""

    LINE_AT_LEAST_EVERY_S = 60.0

    def __init__(self, total: int, title: str, enabled: bool, every: int) -> None:
        self.enabled, self.total = enabled, total
        self.every = max(every, total // 10)  # for the plain-text fallback: about ten lines
        self._last_line = time.monotonic()
        self.console = Console()
        self._bar: Progress | None = None
        if enabled and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task(title, total=total, status="")
            self._bar.start()

    def update(self, step: int, loss: float | None, samples_per_s: float) -> None:
        if not self.enabled:
            return
        status = f"loss {loss:.4f}  {samples_per_s:,.0f} samples/s" if loss is not None else ""
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        elif loss is not None and (
            step % self.every == 0
            or step == self.total
            or time.monotonic() - self._last_line >= self.LINE_AT_LEAST_EVERY_S
        ):
            print(f"step {step}/{self.total}  {status}", file=sys.stdout, flush=True)
            self._last_line = time.monotonic()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _memory_cell(memory: dict[str, int]) -> str:
    parts = (human_bytes(memory[k]) for k in ("params", "master_weights", "grads", "optimizer"))
    return " / ".join(parts)


def _versus(summary: dict, row: str, unit: Callable[[float], str] = human_bytes) -> str:
    pair = summary["predicted"]["rows"][row]
    error = "" if pair["error"] is None else f" ({100 * pair['error']:+.1f} %)"
    return f"{unit(pair['predicted'])} / {unit(pair['measured'])}{error}"


def _calibration(summary: dict) -> str:
    """How old the calibration the step time was priced at is (a KeyError where none was)."""
    return summary["predicted"]["calibration"]


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.1f} ms"


# What a summary table shows, in order: (label, how to format it); a row whose keys a summary
# lacks is left out, so data-parallel and parameter-server runs share one table.
SUMMARY_ROWS: list[tuple[str, Callable[[dict], str]]] = [
    ("strategy", lambda s: s["strategy"]),
    ("world size", lambda s: str(s["world_size"])),
    ("steps", lambda s: str(s["steps"])),
    ("updates (pushes into the servers)", lambda s: f"{s['updates']} ({s['pushes_into_servers']})"),
    ("final train loss", lambda s: f"{s['final_train_loss']:.4f}"),
    ("eval loss", lambda s: f"{s['eval_loss']:.4f}"),
    ("eval accuracy", lambda s: f"{100 * s['eval_accuracy']:.2f} %"),
    ("samples/s", lambda s: f"{s['samples_per_s']:,.1f}"),
    ("samples/s consumed (applied)", lambda s: f"{s['consumed_samples_per_s']:,.1f}"),
    ("comm sent / rank / step", lambda s: human_bytes(s["comm_bytes_per_step"])),
    ("comm sent / rank (total)", lambda s: human_bytes(s["comm_bytes_total"])),
    ("comm wait (rank 0)", lambda s: f"{s['comm_wait_s']:.3f} s"),
    ("params / masters / grads / optim (rank 0)", lambda s: _memory_cell(s["memory"])),
    ("peak memory, process (rank 0)", lambda s: human_bytes(s["memory"]["peak"])),
    ("model state predicted / measured", lambda s: _versus(s, "model_state")),
    ("comm / step predicted / measured", lambda s: _versus(s, "comm_bytes_per_step")),
    ("activations predicted / measured", lambda s: _versus(s, "activations")),
    ("step peak predicted / measured", lambda s: _versus(s, "peak")),
    ("step time predicted / measured", lambda s: _versus(s, "step_time_s", _ms)),
    ("step time priced at", _calibration),
    (
        "staleness (mean; histogram)",
        lambda s: f"{s['staleness_mean']:.2f}; {s['staleness_histogram']}",
    ),
    (
        "dead workers (rank: silent s)",
        lambda s: ", ".join(f"{w}: {t:.1f}" for w, t in s["dead_workers"].items()) or "none",
    ),
    (
        "late pushes, not applied (rank: count)",
        lambda s: ", ".join(f"{w}: {n}" for w, n in s["late_pushes"].items()) or "none",
    ),
    ("wall time", lambda s: f"{s['wall_time_s']:.1f} s"),
    ("run directory", lambda s: s["run_dir"]),
]


def print_summary(summary: dict[str, Any]) -> None:
    rows = []
    for label, cell in SUMMARY_ROWS:
        try:
            rows.append((label, cell(summary)))
        except KeyError:  # not a figure of this kind of run
            continue
    print_key_values(f"shardwise run: {summary['name']}", rows)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """`summary.json` in the run directory (strict JSON: see `strict_json`), and the table on
    the terminal."""
    with writing(run_dir / "summary.json"):
        (run_dir / "summary.json").write_text(strict_json(summary, indent=2))
    print_summary(summary)


def print_key_values(title: str, rows: list[tuple[str, str]]) -> None:
    """A two-column table (metric, value): how every run ends."""
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, value)
    console = Console()
    if not console.is_terminal:  # logs and CI: no terminal width to fit, so do not truncate
        console = Console(width=120)
    console.print(table)
