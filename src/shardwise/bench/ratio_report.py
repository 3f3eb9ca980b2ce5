"""Benchmark output: a table on rank 0 and one JSON line with every figure."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

import shardwise as sw
from shardwise.bench.common import emit

COLUMNS = (
    "model",
    "params",
    "impl",
    "step ms",
    "samples/s",
    "bytes/param",
    "comm/step",
    "ratio",
    "÷ compute",
    "÷ compute+bytes",
)


def ratio_table(result: dict, variants: list[str], baseline: str) -> list[list[str]]:
    """Rows: one per variant, with step time relative to `baseline`."""
    rows = []
    for key in variants:
        v = result[key]
        comm = v.get("comm_bytes_per_step")
        rows.append(
            [
                result["model"],
                f"{result['params'] / 1e6:.2f}M",
                key,
                f"{1000 * v['step_time_s']:.1f}",
                f"{v['samples_per_s']:,.1f}",
                f"{v['bytes_per_param']:.2f}",
                f"{comm / 2**20:.1f} MiB" if comm is not None else "-",
                f"{v['step_time_s'] / result[baseline]['step_time_s']:.3f}",
                _ratio(v.get("over_floor_overlapped")),
                _ratio(v.get("over_floor_unoverlapped")),
            ]
        )
    return rows


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def by_rep_lines(results: list[dict]) -> list[str]:
    """Each repetition's ratios, one line per figure: every list `*_by_rep` of the results,
    with its median (what a bound on "the median of the repetitions" reads: the table's ratio
    is the ratio of the median steps, another figure)."""
    lines = []
    for result in results:
        for key, value in result.items():
            figures = {key: value} if key.endswith("_by_rep") else {}
            if isinstance(value, dict):
                figures = {f"{key} {k}": v for k, v in value.items() if k.endswith("_by_rep")}
            for name, ratios in figures.items():
                listed = " ".join(f"{r:.3f}" for r in ratios)
                median = f" (median {statistics.median(ratios):.3f})" if ratios else ""
                lines.append(f"{result['model']}: {name.removesuffix('_by_rep')}: {listed}{median}")
    return lines


def main_for(suite: str, bench_model: Callable, table_rows: Callable) -> None:
    """Entry point of a benchmark worker: parse, run every model, report on rank 0."""
    parser = argparse.ArgumentParser(description=f"shardwise bench {suite}")
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    rt = sw.init()
    results = [bench_model(m.strip(), args.steps, args.reps) for m in args.models.split(",")]
    if rt.is_main:
        from rich.console import Console
        from rich.table import Table

        title = f"{suite} benchmark, world size {rt.world_size} (median of interleaved reps)"
        table = Table(title=title)
        for col in COLUMNS:
            table.add_column(col, justify="right")
        for result in results:
            for row in table_rows(result):
                table.add_row(*row)
        Console(width=150).print(table)
        print("\n".join(["by repetition:", *by_rep_lines(results)]))
        line = {
            "bench": suite,
            "world_size": rt.world_size,
            "threads_per_rank": torch.get_num_threads(),
            "results": results,
        }
        emit(line, args.out)
    sw.shutdown()
