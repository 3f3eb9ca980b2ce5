"""What a run shows and leaves behind: progress bar, metrics.jsonl, summary table and JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


class MetricsFile:
    """One JSON object per line; flushed so a crashed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ProgressReporter:
    """A rich progress bar on a terminal; a plain line every `every` steps elsewhere (CI, pipes)."""

    def __init__(self, total: int, title: str, enabled: bool, every: int) -> None:
        self.enabled, self.total = enabled, total
        self.every = max(every, total // 10)  # for the plain-text fallback: about ten lines
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
        elif loss is not None and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total}  {status}", file=sys.stdout, flush=True)

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


def print_summary(summary: dict[str, Any]) -> None:
    rows = [
        ("strategy", summary["strategy"]),
        ("world size", str(summary["world_size"])),
        ("steps", str(summary["steps"])),
        ("final train loss", f"{summary['final_train_loss']:.4f}"),
        ("eval loss", f"{summary['eval_loss']:.4f}"),
        ("eval accuracy", f"{100 * summary['eval_accuracy']:.2f} %"),
        ("samples/s", f"{summary['samples_per_s']:,.1f}"),
        ("comm sent / rank / step", human_bytes(summary["comm_bytes_per_step"])),
        ("comm sent / rank (total)", human_bytes(summary["comm_bytes_total"])),
        ("comm wait (rank 0)", f"{summary['comm_wait_s']:.3f} s"),
        ("params / masters / grads / optim (rank 0)", _memory_cell(summary["memory"])),
        ("peak memory (rank 0)", human_bytes(summary["memory"]["peak"])),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("run directory", summary["run_dir"]),
    ]
    print_key_values(f"shardwise run: {summary['name']}", rows)


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
