"""`shardwise report RUN_DIR [RUN_DIR ...] [-o report.html]`: one offline page comparing runs.

Everything comes from what the runs left in their directories: summary.json, metrics.jsonl
(rank 0's line per step), timing/rank{r}.jsonl (each rank's phases, blocked time, bytes by
collective, memory) and, where the run traced steps, trace.json. The page is one HTML file with
its figures embedded (PNG, base64): it opens anywhere, offline. A Markdown summary of the same
figures goes beside it (and to the terminal) for CI logs.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.phases import breakdown

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
    timing: list[list[dict[str, Any]]]  # per rank
    trace: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(init=False)  # metrics lines of training steps

    def __post_init__(self) -> None:
        self.steps = [m for m in self.metrics if "loss" in m]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    lines = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{number}: not JSON ({e.msg})") from None
    return lines


def load_run(path: Path) -> Run:
    """A finished run's files; a one-line `ReportError` if `path` is not one."""
    if not (path / "summary.json").is_file():
        raise ReportError(f"{path} is not a finished run directory (no summary.json)")
    try:
        summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ReportError(f"{path / 'summary.json'}: not JSON ({e.msg})") from None
    trace_file = path / "trace.json"
    trace = json.loads(trace_file.read_text(encoding="utf-8")) if trace_file.is_file() else None
    if (path / "ps").is_dir():  # a parameter-server job: its workers' own logs
        return _parameter_server_run(path, summary, trace)
    metrics = _jsonl(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else []
    world = int(summary.get("world_size", 1))
    timing_files = [path / "timing" / f"rank{r}.jsonl" for r in range(world)]
    timing = [_jsonl(p) for p in timing_files if p.is_file()]
    label = f"{summary.get('strategy', path.name)} ({world} ranks)"
    return Run(path, label, summary, metrics, timing, trace)


def _parameter_server_run(path: Path, summary: dict[str, Any], trace: dict | None) -> Run:
    """Worker 0's log stands for the run's curves; each worker's steps for its timing (its
    whole step outside the server's answer counts as compute)."""
    workers = [_jsonl(p) for p in sorted((path / "ps").glob("worker*.jsonl"))]
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
    if workers and workers[0]:
        summary.setdefault("final_train_loss", workers[0][-1]["loss"])
    return Run(
        path,
        summary.get("strategy", path.name),
        summary,
        workers[0] if workers else [],
        timing,
        trace,
    )


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
        by_time.plot([m["t"] for m in steps], [m["loss"] for m in steps], label=run.label)
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
        (f"{run.label}, rank {r}", b) for run in runs for r, b in enumerate(rank_breakdowns(run))
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
    rows = [(f"{run.label}, rank {r}", m) for run in runs for r, m in enumerate(rank_memory(run))]
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
    spread = statistics.pstdev(norms) / statistics.mean(norms) if len(norms) > 1 else math.nan
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
        for rank in range(_ranks(run.trace)):
            for track, height in ((0, 0.55), (1, 0.25)):
                mine = [e for e in events if e["pid"] == rank and e["tid"] == track]
                mine.sort(key=lambda e: -e["dur"])  # nested spans: the inner ones on top
                bars = [(e["ts"] / 1000, max(e["dur"] / 1000, 0.01)) for e in mine]
                colours = [
                    PHASE_COLOURS.get(e["name"], "#c44e52") if track == 0 else "#dd8452"
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
            error = "" if pair["error"] is None else f" ({pair['error']:+.1%})"
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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(k, row[k]) for k in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _html_table(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(k, v))}</td>" for k, v in row.items()) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render(runs: list[Run]) -> str:
    """The whole page: the table, then every figure, embedded."""
    tables = _html_table(table(runs))
    if any(predicted_rows(run) for run in runs):
        tables += "<h2>Predicted / measured (rank 0)</h2>" + _html_table(prediction_table(runs))
    sections = []
    for title, make in FIGURES.items():
        if title == "Timeline" and not any(run.trace for run in runs):
            continue
        if title == "Predicted vs measured" and not any(predicted_rows(run) for run in runs):
            continue
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
        help="HTML file (default: report.html in the first run directory)",
    )
    parser.add_argument("--screenshot", help="also a PNG of the page, by headless Chromium")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(Path(p)) for p in args.runs]
    except ReportError as e:
        print(f"shardwise: report: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else runs[0].path / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs), encoding="utf-8")
    summary = markdown(runs)
    out.with_suffix(".md").write_text(summary, encoding="utf-8")
    print(summary)
    print(f"shardwise: report in {out} (Markdown beside it)")
    if args.screenshot:
        try:
            screenshot(out, Path(args.screenshot))
        except ReportError as e:
            print(f"shardwise: report: {e}", file=sys.stderr)
            return 2
        print(f"shardwise: screenshot in {args.screenshot}")
    return 0


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
        done = subprocess.run(
            [*argv, page.resolve().as_uri()], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0 or not png.is_file():
            raise ReportError(f"Chromium failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        with Image.open(png) as image:
            drawn = ImageOps.invert(image.convert("RGB")).getbbox()  # what is not white
            bottom = drawn[3] if drawn else 0
            if bottom < height - 40:
                image.crop((0, 0, width, min(height, bottom + 40))).save(png)
                return
        height *= 2
