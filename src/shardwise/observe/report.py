"""`shardwise report RUN_DIR [RUN_DIR ...] [-o report.html]`: one offline page comparing runs.

Everything comes from what the runs left in their directories: summary.json, metrics.jsonl
(rank 0's line per step), timing/rank{r}.jsonl (each rank's phases, blocked time, bytes by
collective, memory) and, where the run traced steps, trace.json. The page is one HTML file with
its figures embedded (PNG, base64): it opens anywhere, offline. A Markdown summary of the same
figures goes beside it (and to the terminal) for CI logs.

Every field the report reads is checked before any figure is drawn: a file that is not what a
finished run leaves gets one line naming it, its line and the field. Nothing is written until
the page and its Markdown are whole.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
import re
import stat
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.observe.phases import PHASES, breakdown

MEMORY_CATEGORIES = ("params", "master_weights", "grads", "optimizer", "buffers", "activations")
BREAKDOWN = (("compute", "#4c72b0"), ("exposed_comm", "#dd8452"), ("idle", "#c44e52"))
PHASE_COLOURS = {
    "data": "#8c8c8c",
    "forward": "#4c72b0",
    "forward+backward": "#55a868",  # (the forward calls drawn over it)
    "optimizer": "#8172b3",
    "sync": "#937860",
    "eval": "#dadada",
}
WARMUP = 3  # first steps pay for allocation and lazy set-up: left out of the time figures


class ReportError(ValueError):
    """A run directory the report cannot read; the message says which and why."""


@dataclass
class Run:
    path: Path
    label: str
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    timing: list[list[dict[str, Any]]]  # per rank that left a timing file
    trace: dict[str, Any] | None = None
    ranks: list[int] | None = None  # the rank of each `timing` entry (default: 0, 1, ...)
    steps: list[dict[str, Any]] = field(init=False)  # metrics lines of training steps

    def __post_init__(self) -> None:
        self.steps = [m for m in self.metrics if "loss" in m]
        if self.ranks is None:
            self.ranks = list(range(len(self.timing)))


# ---- reading run directories ---------------------------------------------------------------
# Every field the report reads is checked here, once, so the figures can trust their data. The
# files are strict JSON (the trainer writes a non-finite float as null: `reporting.strict_json`),
# and a null number is one the run did not measure: it is left out, but for a step's loss,
# where null marks a non-finite step.
WHOLE, RANKS, NUMBER, TEXT, LIST, OBJECT = "whole", "ranks", "number", "text", "list", "object"
NUMBERS = "numbers"  # an object whose values are numbers (bytes by category or collective)
KINDS = {
    WHOLE: "a whole number >= 0 (below 2**63)",
    RANKS: "a whole number >= 1 (below 2**63)",
    NUMBER: "a finite number (at most 1e100 either way)",  # so that sums and scales stay finite
    TEXT: "a string",
    LIST: "a list",
    OBJECT: "an object",
    NUMBERS: "an object of numbers",
}
SUMMARY = {"world_size": RANKS, "strategy": TEXT, "steps": WHOLE, "skipped_steps": LIST}
SUMMARY |= {"predicted": OBJECT, "final_train_loss": NUMBER, "eval_accuracy": NUMBER}
SUMMARY |= {"samples_per_s": NUMBER, "comm_bytes_per_step": NUMBER, "wall_time_s": NUMBER}
METRICS = {"step": WHOLE, "loss": NUMBER, "t": NUMBER, "eval_accuracy": NUMBER}
METRICS |= {"grad_norm": NUMBER, "lr": NUMBER}
TIMING = {"step": WHOLE, "step_s": NUMBER, "wait_s": NUMBER, "overlap_s": NUMBER}
TIMING |= {f"{phase}_s": NUMBER for phase in PHASES} | {"memory": NUMBERS, "comm_bytes": NUMBERS}
PS_WORKER = {"step": WHOLE, "t": NUMBER, "loss": NUMBER, "step_time_s": NUMBER, "wait_s": NUMBER}
SPAN = {"name": TEXT, "pid": WHOLE, "tid": WHOLE, "ts": NUMBER, "dur": NUMBER}
PAIR = {"predicted": NUMBER, "measured": NUMBER, "error": NUMBER}
LABEL_CHARS = 100  # a strategy's name beyond this is cut (it labels rows of tables and figures)


def _is(kind: str, value: Any) -> bool:
    if kind in (WHOLE, RANKS):  # (not a bool, which Python counts as an int)
        least = 1 if kind == RANKS else 0
        return type(value) is int and least <= value < 2**63
    if kind == NUMBER:
        return type(value) in (int, float) and abs(value) <= 1e100  # (NaN compares false)
    return isinstance(value, {TEXT: str, LIST: list, OBJECT: dict, NUMBERS: dict}[kind])


def _checked(record: Any, kinds: dict[str, str], where: str, required: tuple = ()) -> dict:
    """`record` with the fields `kinds` names checked, null numbers left out (but a loss);
    a one-line `ReportError` naming `where` and the field if one is not of its kind."""
    if not isinstance(record, dict):
        raise ReportError(f"{where}: not a JSON object")
    out = dict(record)
    for key, kind in kinds.items():
        value = record.get(key)
        if value is None:
            if key in required:
                raise ReportError(f"{where}: no {key!r}")
            if key != "loss":  # (a null loss: a step whose loss was not finite)
                out.pop(key, None)
        elif not _is(kind, value):
            raise ReportError(f"{where}: {key} must be {KINDS[kind]}, not {_shown(value)}")
        elif kind == NUMBERS:
            out[key] = {name: v for name, v in value.items() if v is not None}
            for name, v in out[key].items():
                if not _is(NUMBER, v):
                    must = f"must be {KINDS[NUMBER]}, not {_shown(v)}"
                    raise ReportError(f"{where}: {key}.{name} {must}")
    return out


def _shown(value: Any) -> str:
    """A wrong value in an error line: short, and its type where that is the trouble."""
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _exists(path: Path, kind: str) -> bool:
    """Whether `path` is a regular file (`kind` "file") or a directory ("dir"); a one-line
    `ReportError` where that cannot be told (no permission to look)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise ReportError(f"{path}: {e.strerror or e}") from None
    return stat.S_ISREG(mode) if kind == "file" else stat.S_ISDIR(mode)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise ReportError(f"{path}: {e.strerror or e}") from None


def _json(text: str, where: str) -> Any:
    """`text` parsed as strict JSON; a one-line `ReportError` naming `where` otherwise."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON ({constant})")

    try:
        return json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise ReportError(f"{where}: not JSON ({e.msg})") from None
    except ValueError as e:  # a NaN or an integer too long to read
        raise ReportError(f"{where}: {e}") from None
    except RecursionError:
        raise ReportError(f"{where}: JSON nested too deeply") from None


def _jsonl(path: Path, kinds: dict[str, str], required: tuple) -> list[dict[str, Any]]:
    """Each line of a JSON-lines file, checked (blank lines skipped; no file: none)."""
    if not _exists(path, "file"):
        return []
    lines = _read(path).splitlines()
    return [
        _checked(_json(line, f"{path}:{n}"), kinds, f"{path}:{n}", required)
        for n, line in enumerate(lines, 1)
        if line.strip()
    ]


def _numbered(folder: Path, prefix: str) -> list[tuple[int, Path]]:
    """The files `{prefix}{n}.jsonl` in `folder` (none if there is no folder), by n."""
    if not _exists(folder, "dir"):
        return []
    try:
        names = os.listdir(folder)
    except OSError as e:
        raise ReportError(f"{folder}: {e.strerror or e}") from None
    pattern = re.compile(rf"{prefix}(0|[1-9][0-9]{{0,17}})\.jsonl")
    found = [(int(m[1]), folder / name) for name in names if (m := pattern.fullmatch(name))]
    return sorted((n, path) for n, path in found if _exists(path, "file"))


def load_run(path: Path) -> Run:
    """A finished run's files, every field the report reads checked; a one-line `ReportError`
    if `path` is not one."""
    if _exists(path, "file"):
        raise ReportError(f"{path} is a file, not a run directory")
    if not _exists(path / "summary.json", "file"):
        raise ReportError(f"{path} is not a finished run directory (no summary.json)")
    summary = _summary(path / "summary.json")
    trace = _trace(path / "trace.json")
    if _exists(path / "ps", "dir"):  # a parameter-server job: its workers' own logs
        return _parameter_server_run(path, summary, trace)
    metrics = _jsonl(path / "metrics.jsonl", METRICS, required=("step",))
    # Never iterate over a world size read from a file: the rank files on disk bound the work
    # (those of ranks past the world size, left by an earlier run on more ranks, are not read).
    world = summary.get("world_size", 1)
    files = [(r, file) for r, file in _numbered(path / "timing", "rank") if r < world]
    timing = [_timing(file) for _, file in files]
    label = f"{summary.get('strategy', _name(path))} ({world} ranks)"
    return Run(path, _plain(label), summary, metrics, timing, trace, [r for r, _ in files])


def _summary(file: Path) -> dict[str, Any]:
    """The summary's fields the report reads, checked; of the prediction, the rows the report
    compares that have both figures (a null one was not finite)."""
    summary = _checked(_json(_read(file), str(file)), SUMMARY, str(file))
    if "predicted" in summary:
        rows = summary["predicted"].get("rows") or {}
        if not isinstance(rows, dict):
            raise ReportError(f"{file}: predicted.rows must be an object, not {_shown(rows)}")
        where = f"{file}: predicted.rows"
        pairs = {k: _checked(rows[k], PAIR, f"{where}.{k}") for k in PREDICTED if k in rows}
        both = {k: pair for k, pair in pairs.items() if "predicted" in pair and "measured" in pair}
        summary["predicted"] = {"rows": both}
    return summary


def _timing(file: Path) -> list[dict[str, Any]]:
    """A rank's timing lines; where a line has phase times, it has all of them."""
    lines = _jsonl(file, TIMING, required=("step", "step_s", "wait_s"))
    phases = [f"{phase}_s" for phase in PHASES]
    for n, line in enumerate(lines, 1):
        missing = [key for key in phases if key not in line]
        if "data_s" in line and missing:
            raise ReportError(f"{file}:{n}: data_s but no {', '.join(missing)}")
    return lines


def _trace(file: Path) -> dict[str, Any] | None:
    """The trace's spans (its "X" events, checked); None without a trace or spans."""
    if not _exists(file, "file"):
        return None
    trace = _json(_read(file), str(file))
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ReportError(f"{file}: not a trace (an object with a traceEvents list)")
    spans = []
    for i, event in enumerate(trace["traceEvents"]):
        where = f"{file}: event {i}"
        if not isinstance(event, dict):
            raise ReportError(f"{where}: not a JSON object")
        if event.get("ph") == "X":
            spans.append(_checked(event, SPAN, where, required=("pid", "tid", "ts", "dur")))
    return {"traceEvents": spans} if spans else None


def _name(path: Path) -> str:
    """The run directory's own name (that of the folder `.` or `a/..` stands for)."""
    return os.path.basename(os.path.abspath(path)) or str(path)


def _plain(text: str, limit: int = LABEL_CHARS) -> str:
    """`text` on one line of printable characters, cut to `limit` (a label: no terminal
    escapes or line breaks from run data)."""
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def distinct_labels(runs: list[Run]) -> list[Run]:
    """`runs`, each label told apart from the others': runs of one strategy get their
    directory's name, and where that is shared too, a number (#2, #3, ...)."""
    shared = {label for label, n in Counter(run.label for run in runs).items() if n > 1}
    for run in runs:
        if run.label in shared:
            run.label = f"{run.label} [{_plain(_name(run.path))}]"
    seen: Counter[str] = Counter()
    for run in runs:
        seen[run.label] += 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"
    return runs


def _parameter_server_run(path: Path, summary: dict[str, Any], trace: dict | None) -> Run:
    """Worker 0's log stands for the run's curves; each worker's steps for its timing (its
    whole step outside the server's answer counts as compute)."""
    numbered = _numbered(path / "ps", "worker")
    required = ("step", "step_time_s", "wait_s")
    workers = [_jsonl(file, PS_WORKER, required) for _, file in numbered]
    timing = [
        [
            {
                "step": row["step"],
                "step_s": row["step_time_s"],
                "wait_s": row["wait_s"],
                "backward_s": row["step_time_s"] - row["wait_s"],
            }
            for row in rows
        ]
        for rows in workers
    ]
    summary = {"steps": max((len(rows) for rows in workers), default=0), **summary}
    if workers and workers[0] and workers[0][-1].get("loss") is not None:
        summary.setdefault("final_train_loss", workers[0][-1]["loss"])
    label = _plain(summary.get("strategy", _name(path)))
    metrics = workers[0] if workers else []
    return Run(path, label, summary, metrics, timing, trace, [n for n, _ in numbered])


# ---- the figures ---------------------------------------------------------------------------
def _figure(width: float = 10, height: float = 3.6, cols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, cols, figsize=(width, height), squeeze=False)
    return fig, list(axes[0])


def loss_figure(runs: list[Run]):
    fig, (by_step, by_time) = _figure(cols=2)
    for run in runs:
        steps = [m for m in run.steps if m.get("loss") is not None]
        by_step.plot([m["step"] for m in steps], [m["loss"] for m in steps], label=run.label)
        timed = [m for m in steps if "t" in m]
        by_time.plot([m["t"] for m in timed], [m["loss"] for m in timed], label=run.label)
    by_step.set(xlabel="step", ylabel="training loss", title="Loss per step")
    by_time.set(xlabel="seconds of training", ylabel="training loss", title="Loss over time")
    by_step.legend(fontsize=7)
    return fig


def eval_figure(runs: list[Run]):
    fig, (ax,) = _figure()
    for run in runs:
        points = [(m["step"], m["eval_accuracy"]) for m in run.metrics if "eval_accuracy" in m]
        final = run.summary.get("eval_accuracy")
        if final is not None and (not points or points[-1][0] != run.summary.get("steps")):
            points.append((run.summary.get("steps", 0), final))
        ax.plot(*zip(*points, strict=True), marker="o", label=run.label)
    ax.set(xlabel="step", ylabel="test accuracy", title="Evaluation accuracy")
    ax.legend(fontsize=7)
    return fig


def throughput_figure(runs: list[Run]):
    fig, (ax,) = _figure(height=0.5 + 0.45 * len(runs))
    values = [run.summary.get("samples_per_s", 0.0) for run in runs]
    ax.barh([run.label for run in runs], values, color="#4c72b0")
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:,.0f}", va="center", fontsize=8)
    ax.set(xlabel="samples/s (after the first steps)", title="Throughput")
    ax.invert_yaxis()
    return fig


def rank_breakdowns(run: Run) -> list[dict[str, float]]:
    """Per rank: mean seconds per step in compute, exposed communication, idle, and the step."""
    if not run.timing:
        return []
    return breakdown([lines[WARMUP:] or lines for lines in run.timing])


def breakdown_figure(runs: list[Run]):
    rows = [
        (f"{run.label}, rank {r}", b)
        for run in runs
        for r, b in zip(run.ranks, rank_breakdowns(run), strict=True)
    ]
    fig, (ax,) = _figure(height=0.8 + 0.35 * len(rows))
    segments = {name: [1000 * b[name] for _, b in rows] for name, _ in BREAKDOWN}
    _stacked(ax, [label for label, _ in rows], segments, [colour for _, colour in BREAKDOWN])
    ax.scatter(
        [1000 * b["step"] for _, b in rows],
        range(len(rows)),
        marker="|",
        s=200,
        color="black",
        label="measured step",
        zorder=3,
    )
    ax.set(xlabel="ms per step", title="Where each rank's step goes")
    ax.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    return fig


def _stacked(ax, labels: list[str], segments: dict[str, list[float]], colours=None) -> None:
    """Horizontal bars, one per label, stacked from `segments` (name -> a width per label)."""
    left = [0.0] * len(labels)
    for i, (name, widths) in enumerate(segments.items()):
        colour = colours[i] if colours else None
        ax.barh(labels, widths, left=left, color=colour, label=name)
        left = [a + w for a, w in zip(left, widths, strict=True)]


def rank_memory(run: Run) -> list[dict[str, int]]:
    """Each rank's bytes per category, from the timing line that carries them (the last step)."""
    found = []
    for lines in run.timing:
        found.append(next((line["memory"] for line in reversed(lines) if "memory" in line), {}))
    return found


def memory_figure(runs: list[Run]):
    rows = [
        (f"{run.label}, rank {r}", m)
        for run in runs
        for r, m in zip(run.ranks, rank_memory(run), strict=True)
    ]
    fig, (ax,) = _figure(height=0.8 + 0.35 * len(rows))
    segments = {c: [m.get(c, 0) / 2**20 for _, m in rows] for c in MEMORY_CATEGORIES}
    _stacked(ax, [label for label, _ in rows], segments)
    ax.set(xlabel="MiB (at the last step, gradients present)", title="Memory per rank")
    ax.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    return fig


def bytes_by_op(run: Run) -> dict[str, float]:
    """Mean bytes this rank sent per step, per collective, over the ranks."""
    totals: dict[str, float] = {}
    for lines in run.timing:
        for line in lines:
            for op, nbytes in line.get("comm_bytes", {}).items():
                totals[op] = totals.get(op, 0.0) + nbytes / len(lines) / len(run.timing)
    return totals


def bytes_figure(runs: list[Run]):
    fig, (ax,) = _figure(height=0.8 + 0.45 * len(runs))
    sent = [bytes_by_op(run) for run in runs]
    ops = sorted({op for by_op in sent for op in by_op})
    segments = {op: [by_op.get(op, 0.0) / 2**10 for by_op in sent] for op in ops}
    _stacked(ax, [run.label for run in runs], segments)
    ax.set(xlabel="KiB sent per rank per step", title="Communication by collective")
    ax.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    return fig


def stability(run: Run) -> dict[str, Any]:
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


def stability_figure(runs: list[Run]):
    fig, (norms, lr) = _figure(cols=2)
    for run in runs:
        logged = [m for m in run.steps if m.get("grad_norm") is not None]
        norms.plot([m["step"] for m in logged], [m["grad_norm"] for m in logged], label=run.label)
        scheduled = [m for m in run.steps if "lr" in m]  # (a parameter server's: the servers')
        lr.plot([m["step"] for m in scheduled], [m["lr"] for m in scheduled], label=run.label)
        skipped = [m["step"] for m in run.metrics if m.get("skipped")]
        if skipped:
            norms.scatter(skipped, [0] * len(skipped), marker="x", color="red")
    norms.set(xlabel="step", ylabel="gradient L2 norm", title="Gradient norm (x: skipped step)")
    lr.set(xlabel="step", ylabel="learning rate", title="Learning-rate schedule")
    norms.legend(fontsize=7)
    return fig


def timeline_figure(runs: list[Run]):
    traced = [run for run in runs if run.trace]
    fig, axes = _figure(height=1.2 + 0.9 * sum(_ranks(r.trace) for r in traced), cols=1)
    ax = axes[0]
    y, labels = 0, []
    for run in traced:
        events = [e for e in run.trace["traceEvents"] if e.get("ph") == "X"]
        for rank in sorted({e["pid"] for e in events}):
            for track, height in ((0, 0.55), (1, 0.25)):
                mine = [e for e in events if e["pid"] == rank and e["tid"] == track]
                mine.sort(key=lambda e: -e["dur"])  # nested spans: the inner ones on top
                bars = [(e["ts"] / 1000, max(e["dur"] / 1000, 0.01)) for e in mine]
                colours = [
                    PHASE_COLOURS.get(e.get("name"), "#c44e52") if track == 0 else "#dd8452"
                    for e in mine
                ]
                offset = 0.0 if track == 0 else 0.6
                ax.broken_barh(bars, (y + offset - 0.3, height), facecolors=colours)
            labels.append(f"{run.label}\nrank {rank}")
            y += 1
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set(
        xlabel="ms (rank 0's clock)",
        title="Timeline of the traced steps (thin: blocked in a collective)",
    )
    from matplotlib.patches import Patch

    names = {"forward+backward": "backward"}
    handles = [Patch(color=c, label=names.get(n, n)) for n, c in PHASE_COLOURS.items()]
    handles.append(Patch(color="#dd8452", label="collective"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.invert_yaxis()
    return fig


def _ranks(trace: dict[str, Any] | None) -> int:
    if not trace:
        return 0
    return len({e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"})


PREDICTED = {  # summary["predicted"] rows the report compares: (title, scale, unit)
    "step_time_s": ("step time", 1000, "ms"),
    "model_state": ("model state", 2**-20, "MiB"),
    "activations": ("activations", 2**-20, "MiB"),
    "peak": ("step peak", 2**-20, "MiB"),
    "comm_bytes_per_step": ("bytes / step", 2**-20, "MiB"),
}


def predicted_rows(run: Run) -> dict[str, dict]:
    return (run.summary.get("predicted") or {}).get("rows", {})


def prediction_figure(runs: list[Run]):
    """Predicted beside measured, per run: step time, model state (rank 0), activations."""
    shown = [
        key
        for key in ("step_time_s", "model_state", "activations")
        if any(key in predicted_rows(run) for run in runs)
    ]
    fig, axes = _figure(height=0.8 + 0.35 * len(runs) + 1, cols=max(len(shown), 1))
    labels = [run.label for run in runs]
    for ax, key in zip(axes, shown, strict=False):
        title, scale, unit = PREDICTED[key]
        for offset, which, colour in ((-0.2, "predicted", "#9ecae1"), (0.2, "measured", "#3182bd")):
            values = [predicted_rows(run).get(key, {}).get(which, math.nan) * scale for run in runs]
            ax.barh(
                [i + offset for i in range(len(runs))],
                values,
                height=0.4,
                label=which,
                color=colour,
            )
        ax.set_yticks(range(len(runs)), labels if ax is axes[0] else [""] * len(runs))
        ax.invert_yaxis()
        ax.set_xlabel(f"{title} ({unit})")
        ax.legend(fontsize=8)
    return fig


def prediction_table(runs: list[Run]) -> list[dict[str, str]]:
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


FIGURES = {
    "Loss": loss_figure,
    "Evaluation": eval_figure,
    "Throughput": throughput_figure,
    "Step-time breakdown": breakdown_figure,
    "Memory": memory_figure,
    "Communication": bytes_figure,
    "Stability and learning rate": stability_figure,
    "Timeline": timeline_figure,
    "Predicted vs measured": prediction_figure,
}


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


# ---- the page and the summary ----------------------------------------------------------------
def table(runs: list[Run]) -> list[dict[str, Any]]:
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


PERCENT = ("eval accuracy", "most idle rank", "grad norm cv")  # columns that are fractions


def _cell(key: str, value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.1%}" if key in PERCENT else f"{value:,.4g}"
    return "-" if value is None else str(value)


def markdown(runs: list[Run]) -> str:
    out = _markdown_table(table(runs))
    if any(predicted_rows(run) for run in runs):
        out += "\nPredicted / measured (rank 0):\n\n" + _markdown_table(prediction_table(runs))
    return out


def _markdown_table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(map(_md, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md(_cell(k, row[k])) for k in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    """`text` as one table cell of Markdown: no HTML of its own (a run's name from its files
    shows as written), no cell or row break."""
    text = html.escape(text, quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\n", " ")


def _html_table(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(k, v))}</td>" for k, v in row.items()) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render(runs: list[Run]) -> str:
    """The whole page: the table, then every figure, embedded."""
    import matplotlib

    tables = _html_table(table(runs))
    if any(predicted_rows(run) for run in runs):
        tables += "<h2>Predicted / measured (rank 0)</h2>" + _html_table(prediction_table(runs))
    sections = []
    for title, make in FIGURES.items():
        if title == "Timeline" and not any(run.trace for run in runs):
            continue
        if title == "Predicted vs measured" and not any(predicted_rows(run) for run in runs):
            continue
        # A run's name is text, not TeX: `$` in a label must not start mathtext (which can fail).
        with matplotlib.rc_context({"text.parse_math": False}):
            image = _png(make(runs))
        sections.append(
            f'<section><h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" '
            f'src="data:image/png;base64,{image}"></section>'
        )
    sources = "".join(f"<li><code>{html.escape(str(run.path))}</code></li>" for run in runs)
    return PAGE.format(tables=tables, sections="".join(sections), runs=sources)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shardwise report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
img {{ max-width: 100%; }}
section {{ margin-top: 1.5em; }}
</style></head><body>
<h1>shardwise report</h1>
{tables}
{sections}
<h2>Runs</h2><ul>{runs}</ul>
</body></html>
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise report", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument(
        "-o",
        "--out",
        default=None,
        help="HTML file, .html (default: report.html in the first run directory); the Markdown "
        "summary goes beside it, .md",
    )
    parser.add_argument("--screenshot", help="also a PNG of the page, by headless Chromium")
    args = parser.parse_args(argv)
    try:
        _check_outputs(args)
        runs = distinct_labels([load_run(Path(p)) for p in args.runs])
        out = Path(args.out) if args.out else runs[0].path / "report.html"
        summary = markdown(runs)
        write_whole({out: render(runs), out.with_suffix(".md"): summary})
        print(summary)
        print(f"shardwise: report in {out} (Markdown beside it)")
        if args.screenshot:
            screenshot(out, Path(args.screenshot))
            print(f"shardwise: screenshot in {args.screenshot}")
    except ReportError as e:
        print(f"shardwise: report: {e}", file=sys.stderr)
        return 2
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Before anything is read: the page, its Markdown beside it (same name, .md) and the
    screenshot are three files, none of them a run's own."""
    if args.out is not None:
        out = Path(args.out)
        if out.suffix.lower() not in (".html", ".htm"):
            raise ReportError(
                f"-o {out}: the page is HTML; name it .html (its Markdown goes beside it, .md)"
            )
        if _exists(out, "dir"):
            raise ReportError(f"-o {out} is a directory; name the page's file (report.html)")
    if args.screenshot is not None and Path(args.screenshot).suffix.lower() != ".png":
        raise ReportError(f"--screenshot {args.screenshot}: the screenshot is a PNG; name it .png")


def write_whole(files: dict[Path, str]) -> None:
    """Each file whole or not at all: written under a temporary name beside it, then renamed
    over it once every one is written."""
    for path in files:
        if _exists(path, "dir"):
            raise ReportError(f"cannot write {path}: it is a directory")
    partial: dict[Path, Path] = {}
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial[path] = path.with_name(f".{path.name}.partial")
            partial[path].write_text(text, encoding="utf-8")
        for path, temporary in partial.items():
            os.replace(temporary, path)
    except OSError as e:
        for temporary in partial.values():
            temporary.unlink(missing_ok=True)
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise ReportError(f"cannot write {path}: {e.strerror or e}{where}") from None


def screenshot(page: Path, png: Path, width: int = 1200, height: int = 4000) -> None:
    """The whole page as headless Chromium draws it (Debian's `chromium` package): a window
    taller each time until the page ends above its bottom, then cropped below the page."""
    import shutil
    import subprocess

    from PIL import Image, ImageOps

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise ReportError("--screenshot needs Chromium on PATH (Debian: apt-get install chromium)")
    png.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(4):
        argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        argv += [f"--window-size={width},{height}", f"--screenshot={png.resolve()}"]
        try:
            done = subprocess.run(
                [*argv, page.resolve().as_uri()], capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ReportError(f"Chromium did not draw the page: {e}") from None
        if done.returncode != 0 or not png.is_file():
            raise ReportError(f"Chromium failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        with Image.open(png) as image:
            drawn = ImageOps.invert(image.convert("RGB")).getbbox()  # what is not white
            bottom = drawn[3] if drawn else 0
            if bottom < height - 40:
                image.crop((0, 0, width, min(height, bottom + 40))).save(png)
                return
        height *= 2
