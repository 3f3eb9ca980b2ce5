"""The figures of `shardwise report`, each comparing every run: loss, evaluation, throughput,
where each rank's step goes, memory, bytes by collective, stability, the traced timeline and the
prediction beside the measurement. Each is a matplotlib figure; `png_base64` embeds one."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

from shardwise.observe.report_inputs import PREDICTED, RunRecord
from shardwise.observe.report_measures import (
    bytes_by_op,
    predicted_rows,
    rank_breakdowns,
    rank_memory,
)

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


def _figure(width: float = 10, height: float = 3.6, cols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, cols, figsize=(width, height), squeeze=False)
    return fig, list(axes[0])


def loss_figure(runs: list[RunRecord]):
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


def eval_figure(runs: list[RunRecord]):
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


def throughput_figure(runs: list[RunRecord]):
    fig, (ax,) = _figure(height=0.5 + 0.45 * len(runs))
    values = [run.summary.get("samples_per_s", 0.0) for run in runs]
    ax.barh([run.label for run in runs], values, color="#4c72b0")
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:,.0f}", va="center", fontsize=8)
    ax.set(xlabel="samples/s (after the first steps)", title="Throughput")
    ax.invert_yaxis()
    return fig


def breakdown_figure(runs: list[RunRecord]):
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


def memory_figure(runs: list[RunRecord]):
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


def bytes_figure(runs: list[RunRecord]):
    fig, (ax,) = _figure(height=0.8 + 0.45 * len(runs))
    sent = [bytes_by_op(run) for run in runs]
    ops = sorted({op for by_op in sent for op in by_op})
    segments = {op: [by_op.get(op, 0.0) / 2**10 for by_op in sent] for op in ops}
    _stacked(ax, [run.label for run in runs], segments)
    ax.set(xlabel="KiB sent per rank per step", title="Communication by collective")
    ax.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    return fig


def stability_figure(runs: list[RunRecord]):
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


def timeline_figure(runs: list[RunRecord]):
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


def prediction_figure(runs: list[RunRecord]):
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


def png_base64(fig) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()
