"""What `shardwise report` reads from a run directory, every field checked: `load_run`.

A finished run leaves summary.json, metrics.jsonl (rank 0's line per step), timing/rank{r}.jsonl
(each rank's phases, blocked time, bytes by collective, memory) and, where it traced steps,
trace.json; a parameter-server job leaves its workers' logs, ps/worker{n}.jsonl, instead of the
metrics and timing. Every field the report reads is checked here, once, so that the figures can
trust their data: a file that is not what a finished run leaves gets one line naming it, its
line and the field (a `ReportError`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.observe.phases import PHASES

PREDICTED = {  # summary["predicted"] rows the report compares: (title, scale, unit)
    "step_time_s": ("step time", 1000, "ms"),
    "model_state": ("model state", 2**-20, "MiB"),
    "activations": ("activations", 2**-20, "MiB"),
    "peak": ("step peak", 2**-20, "MiB"),
    "comm_bytes_per_step": ("bytes / step", 2**-20, "MiB"),
}


class ReportError(ValueError):
    """A run directory the report cannot read; the message says which and why."""


@dataclass
class RunRecord:
    """What one finished run left in its directory, as the report reads it."""

    path: Path
    label: str  # the run's name in tables and figures
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


# The files are strict JSON (the trainer writes a non-finite float as null:
# `run_output.strict_json`), and a null number is one the run did not measure: it is left out,
# but for a step's loss, where null marks a non-finite step.
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


def exists_as(path: Path, kind: str) -> bool:
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
    if not exists_as(path, "file"):
        return []
    lines = _read(path).splitlines()
    return [
        _checked(_json(line, f"{path}:{n}"), kinds, f"{path}:{n}", required)
        for n, line in enumerate(lines, 1)
        if line.strip()
    ]


def _numbered(folder: Path, prefix: str) -> list[tuple[int, Path]]:
    """The files `{prefix}{n}.jsonl` in `folder` (none if there is no folder), by n."""
    if not exists_as(folder, "dir"):
        return []
    try:
        names = os.listdir(folder)
    except OSError as e:
        raise ReportError(f"{folder}: {e.strerror or e}") from None
    pattern = re.compile(rf"{prefix}(0|[1-9][0-9]{{0,17}})\.jsonl")
    found = [(int(m[1]), folder / name) for name in names if (m := pattern.fullmatch(name))]
    return sorted((n, path) for n, path in found if exists_as(path, "file"))


def load_run(path: Path) -> RunRecord:
    """A finished run's files, every field the report reads checked; a one-line `ReportError`
    if `path` is not one."""
    if exists_as(path, "file"):
        raise ReportError(f"{path} is a file, not a run directory")
    if not exists_as(path / "summary.json", "file"):
        raise ReportError(f"{path} is not a finished run directory (no summary.json)")
    summary = _summary(path / "summary.json")
    trace = _trace(path / "trace.json")
    if exists_as(path / "ps", "dir"):  # a parameter-server job: its workers' own logs
        return _parameter_server_run(path, summary, trace)
    metrics = _jsonl(path / "metrics.jsonl", METRICS, required=("step",))
    # Never iterate over a world size read from a file: the rank files on disk bound the work
    # (those of ranks past the world size, left by an earlier run on more ranks, are not read).
    world = summary.get("world_size", 1)
    files = [(r, file) for r, file in _numbered(path / "timing", "rank") if r < world]
    timing = [_timing(file) for _, file in files]
    label = f"{summary['strategy']} ({world} ranks)"
    return RunRecord(path, _plain(label), summary, metrics, timing, trace, [r for r, _ in files])


def _summary(file: Path) -> dict[str, Any]:
    """The summary's fields the report reads, checked; of the prediction, the rows the report
    compares that have both figures (a null one was not finite)."""
    summary = _checked(_json(_read(file), str(file)), SUMMARY, str(file))
    if "strategy" not in summary:  # (every run's has one, a parameter server's too: `{}` was read)
        raise ReportError(f"{file}: no 'strategy': not the summary a run writes")
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
    if not exists_as(file, "file"):
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


def distinct_labels(runs: list[RunRecord]) -> list[RunRecord]:
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


def _parameter_server_run(path: Path, summary: dict[str, Any], trace: dict | None) -> RunRecord:
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
    label = _plain(summary["strategy"])
    metrics = workers[0] if workers else []
    return RunRecord(path, label, summary, metrics, timing, trace, [n for n, _ in numbered])
