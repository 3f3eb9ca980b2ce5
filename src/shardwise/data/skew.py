"""How evenly an epoch's data falls on the ranks: samples, cost and labels per rank.

A rank that gets more samples, longer sequences or another mix of labels than the others is
slower, or trains on another distribution. `skew_report` measures it from the parts (the
dataset indices each rank reads in an epoch): per rank the sample count, the tokens and the
attention cost Σ L² where samples are sequences, and the label histogram where targets are
classes, with the largest deviation from the mean and the total variation distance between a
rank's label mix and the whole epoch's. `shardwise train` prints it at the start and writes it
to `RUN_DIR/data_skew.json`.

Padding is no token. A row that packs several documents costs Σ L² over its documents, the
work of attention kept inside each; a dense attention mask (TinyGPT's) still does the whole
row's, so this is the cost a kernel that skips masked blocks would pay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from shardwise.data.datasets import PAD_TARGET


def _describe(dataset: Dataset, index: int) -> tuple[int | None, int, int]:
    """(class label or None, tokens, attention cost) of one sample."""
    sample = dataset[index]
    target = sample["labels"] if isinstance(sample, Mapping) else sample[1]  # (dict samples)
    if not (isinstance(target, torch.Tensor) and target.dim() > 0):
        return int(target), 1, 1
    # A sequence: one token per target that counts (padding's do not); attention is quadratic
    # in each document's length where a row packs several (`DocumentRows.document_lengths`).
    lengths = getattr(dataset, "document_lengths", None)
    lengths = lengths(index) if lengths else [int((target != PAD_TARGET).sum())]
    return None, sum(lengths), sum(n * n for n in lengths)


def skew_report(
    dataset: Dataset, parts: Sequence[Sequence[int]], most: int | None = None
) -> dict[str, Any]:
    """Per-rank figures of one epoch's `parts`, and how far apart the ranks are. `most`: read
    at most this many samples of each part, evenly spaced (a user's dataset may take long to
    read whole: the ranks wait for the report), and scale its tokens and cost to the part's
    size: estimates then, each rank's `read` says of how many."""
    ranks = []
    overall: Counter[int] = Counter()
    for part in parts:
        read = part if most is None or len(part) <= most else _evenly(part, most)
        labels: Counter[int] = Counter()
        tokens = attention = 0
        for i in read:
            label, n, cost = _describe(dataset, i)
            tokens, attention = tokens + n, attention + cost
            if label is not None:
                labels[label] += 1
        scale = len(part) / len(read) if read else 1
        overall.update(labels)
        ranks.append(
            {
                "samples": len(part),
                "read": len(read),
                "tokens": round(tokens * scale),
                "attention_cost": round(attention * scale),
                "labels": labels,
            }
        )
    total = sum(overall.values())
    for rank in ranks:
        count = sum(rank["labels"].values())
        rank["label_tv_distance"] = (
            0.5 * sum(abs(rank["labels"][k] / count - overall[k] / total) for k in overall)
            if count and total
            else 0.0
        )
        rank["labels"] = {str(k): v for k, v in sorted(rank["labels"].items())}
    return {
        "ranks": ranks,
        "max_over_mean": {
            key: max(r[key] for r in ranks) / (sum(r[key] for r in ranks) / len(ranks) or 1)
            for key in ("samples", "tokens", "attention_cost")
        },
        "max_label_tv_distance": max(r["label_tv_distance"] for r in ranks),
    }


def _evenly(part: Sequence[int], most: int) -> list[int]:
    return [part[k * len(part) // most] for k in range(most)]


def format_report(report: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    read = sum(r.get("read", r["samples"]) for r in report["ranks"])
    total = sum(r["samples"] for r in report["ranks"])
    estimated = f" (from {read:,} of the {total:,} samples)" if read < total else ""
    lines = [
        "data per rank (epoch 0): samples, tokens, attention cost, label mix vs all (TV)"
        + estimated
    ]
    for r, rank in enumerate(report["ranks"]):
        lines.append(
            f"  rank {r}: {rank['samples']:>7,} {rank['tokens']:>10,} "
            f"{rank['attention_cost']:>14,}   TV {rank['label_tv_distance']:.3f}"
        )
    worst = report["max_over_mean"]
    lines.append(
        f"  heaviest rank / mean: samples {worst['samples']:.3f}, tokens {worst['tokens']:.3f}, "
        f"attention {worst['attention_cost']:.3f}"
    )
    return "\n".join(lines)
