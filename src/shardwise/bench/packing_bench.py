"""Benchmark: documents packed end to end against one padded row per document (#14).

One process. The training split of `datasets.verses` (Genesis, one verse per line, 25-319
characters) in rows of 256 tokens, and the benchmarks' GPT size (d_model 256, 4 blocks, 4
heads). Every step trains both variants on the same documents: `--rows` packed rows (attention
kept inside each document), or those rows' documents one per padded row (plain causal
attention, as an unpacked run trains). A step is forward, backward and an AdamW step. The
variants alternate over `--reps` repetitions of `--steps` steps; we report medians: the split's
padding fraction, real (not padding) tokens/s and rows/s.

Run: python -m shardwise.bench.packing_bench [--rows 4] [--steps 2] [--reps 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from shardwise.bench.whole_jobs import default_out
from shardwise.data import datasets
from shardwise.data.datasets import PAD_TARGET, DocumentRows
from shardwise.job_sections import PACKAGE_DATA
from shardwise.nn.models import TinyGPT, lm_loss

SEQ_LEN = 256
Batch = tuple[torch.Tensor, torch.Tensor]


def _stack(rows: DocumentRows) -> Batch:
    xs, ys = zip(*(rows[i] for i in range(len(rows))), strict=True)
    return torch.stack(xs), torch.stack(ys)


def workloads(rows_per_step: int, steps: int) -> tuple[datasets.Splits, dict[str, list[Batch]]]:
    """The split, and each variant's batches: step s holds the same documents in both."""
    splits = datasets.verses(PACKAGE_DATA / "genesis_kjv.txt", SEQ_LEN, packing="pack")
    rows = splits.train.rows
    if rows_per_step * steps > len(rows):
        raise ValueError(f"{steps} steps of {rows_per_step} rows exceed the {len(rows)} rows")
    # The packer emits its longest documents first: a seeded draw gives typical rows.
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    batches: dict[str, list[Batch]] = {"none": [], "pack": []}
    for s in range(steps):
        chosen = [rows[i] for i in order[s * rows_per_step : (s + 1) * rows_per_step]]
        batches["pack"].append(_stack(DocumentRows(chosen, SEQ_LEN)))
        alone = [[doc] for row in chosen for doc in row]
        batches["none"].append(_stack(DocumentRows(alone, SEQ_LEN)))
    return splits, batches


def timed(model: TinyGPT, opt: torch.optim.Optimizer, batches: list[Batch]) -> float:
    """Seconds per step over `batches`."""
    started = time.perf_counter()
    for x, y in batches:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - started) / len(batches)


def measure(splits: datasets.Splits, batches: dict[str, list[Batch]], reps: int) -> dict:
    """Per variant: the first batch's loss, then median step time over interleaved reps."""
    models = {}
    for key, bos in (("none", None), ("pack", splits.bos_token)):
        torch.manual_seed(0)  # the same initial weights for both
        model = TinyGPT(splits.num_classes, SEQ_LEN, 256, 4, 4, bos_token=bos)
        models[key] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = {}
    with torch.no_grad():  # the same documents: the same per-token loss
        for key, (model, _) in models.items():
            x, y = batches[key][0]
            losses[key] = lm_loss(model(x), y).item()
    for key, (model, opt) in models.items():  # warm-up: allocations, lazy initialisation
        timed(model, opt, batches[key][:1])
    times: dict[str, list[float]] = {key: [] for key in models}
    names = list(models)
    for rep in range(reps):
        for key in names[rep % 2 :] + names[: rep % 2]:
            times[key].append(timed(*models[key], batches[key]))
    return {key: (losses[key], statistics.median(times[key])) for key in models}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench packing")
    parser.add_argument("--rows", type=int, default=4, help="packed rows per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    parser.add_argument("--reps", type=int, default=4, help="interleaved repetitions")
    parser.add_argument("--out", help="JSON file (default: under runs/)")
    args = parser.parse_args(argv)
    if min(args.rows, args.steps, args.reps) < 1:
        raise ValueError("--rows, --steps and --reps must be >= 1")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    splits, batches = workloads(args.rows, args.steps)
    measured = measure(splits, batches, args.reps)
    tokens = sum(int((y != PAD_TARGET).sum()) for _, y in batches["pack"]) / args.steps
    unpacked = DocumentRows([[doc] for row in splits.train.rows for doc in row], SEQ_LEN)
    padding = {"none": unpacked.padding_fraction, "pack": splits.train.padding_fraction}
    result = {}
    for key, (loss, step_s) in measured.items():
        rows = sum(len(x) for x, _ in batches[key]) / args.steps
        result[key] = {
            "padding_fraction": padding[key],
            "rows_per_step": rows,
            "step_time_s": step_s,
            "real_tokens_per_s": tokens / step_s,
            "rows_per_s": rows / step_s,
            "first_loss": loss,
        }
    _print_table(result, tokens)
    line = {
        "bench": "packing",
        "seq_len": SEQ_LEN,
        "model": {"d_model": 256, "n_layer": 4, "n_head": 4},
        "threads": torch.get_num_threads(),
        "real_tokens_per_step": tokens,
        **{k: getattr(args, k) for k in ("rows", "steps", "reps")},
        "results": result,
        "speedup_pack_over_none": result["none"]["step_time_s"] / result["pack"]["step_time_s"],
    }
    print(json.dumps(line))
    out = Path(args.out or default_out("packing") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(line) + "\n")
    return 0


def _print_table(result: dict, tokens: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"packing: the same {tokens:,.0f} real tokens per step, rows of {SEQ_LEN}")
    for col in (
        "packing",
        "split padding",
        "rows/step",
        "step ms",
        "real tokens/s",
        "rows/s",
        "loss",
    ):
        table.add_column(col, justify="right")
    for key, r in result.items():
        table.add_row(
            key,
            f"{100 * r['padding_fraction']:.1f} %",
            f"{r['rows_per_step']:.1f}",
            f"{1000 * r['step_time_s']:.0f}",
            f"{r['real_tokens_per_s']:,.0f}",
            f"{r['rows_per_s']:.1f}",
            f"{r['first_loss']:.5f}",
        )
    Console(width=110).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
