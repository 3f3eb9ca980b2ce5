"""Benchmark: the large-batch recipe (Goyal et al. 2017; You et al. 2017, 2019) on the digits
MLP: a small batch's accuracy kept at 64x the batch by LARS (and LAMB) with a warm-up, and lost
by plain SGD, whether its rate stays, is scaled linearly (with the warm-up) or is the best of a
sweep.

One process: the optimizers' update is the point here (tests/test_layerwise_optim.py shows it
equal under ZeRO, tensor parallel and a mesh). Every run trains the same number of epochs from
the same initial weights and sample order, with a cosine schedule after a linear warm-up of
`--warmup-epochs`; we report the final eval accuracy of each, one table and one JSON line.

Run: shardwise bench largebatch [--epochs 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.data.datasets import digits
from shardwise.nn.models import MLP
from shardwise.nn.schedules import Schedule, lr_scheduler
from shardwise.optim import LAMB, LARS

SMALL, LARGE = 16, 1024  # 64x
BASE_LR = 0.05  # SGD's rate at the small batch (momentum 0.9), tuned there


def runs(warmup: int) -> list[dict]:
    """(label, batch, optimizer, rate, warm-up epochs): the small baseline, then the large
    batch's candidates."""
    linear = BASE_LR * LARGE / SMALL
    out = [dict(batch=SMALL, optimizer="sgd", lr=BASE_LR, warmup=0, note="baseline")]
    out.append(dict(batch=LARGE, optimizer="sgd", lr=BASE_LR, warmup=0, note="rate kept"))
    out.append(dict(batch=LARGE, optimizer="sgd", lr=linear, warmup=warmup, note="linear rule"))
    for lr in (0.1, 0.2, 0.5):
        out.append(dict(batch=LARGE, optimizer="sgd", lr=lr, warmup=warmup, note="sweep"))
    for lr in (10.0, 20.0, 40.0):
        out.append(dict(batch=LARGE, optimizer="lars", lr=lr, warmup=warmup, note="sweep"))
    for lr in (0.02, 0.05, 0.1):
        out.append(dict(batch=LARGE, optimizer="lamb", lr=lr, warmup=warmup, note="sweep"))
    return out


def train(run: dict, epochs: int, seed: int = 0) -> float:
    """Final eval accuracy of one run."""
    splits = digits()
    x, y = splits.train.tensors
    x_eval, y_eval = splits.test.tensors
    torch.manual_seed(seed)
    model = MLP([64, 128, 128, 10])
    if run["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=run["lr"], momentum=0.9)
    elif run["optimizer"] == "lars":
        opt = LARS(model.parameters(), lr=run["lr"], momentum=0.9, eta=0.001)
    else:
        opt = LAMB(model.parameters(), lr=run["lr"], weight_decay=0.0)
    per_epoch = -(-len(x) // run["batch"])
    schedule = Schedule("cosine", per_epoch * epochs, run["warmup"] * per_epoch)
    scheduler = lr_scheduler(opt, schedule)
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        samples = torch.randperm(len(x), generator=order)
        for i in range(per_epoch):
            chosen = samples[i * run["batch"] : (i + 1) * run["batch"]]
            F.cross_entropy(model(x[chosen]), y[chosen]).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
    with torch.no_grad():
        return (model(x_eval).argmax(-1) == y_eval).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench largebatch")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--out", help="JSON result file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    table = runs(args.warmup_epochs)
    for run in table:
        run["accuracy"] = train(run, args.epochs)
    print_table(table, args.epochs)
    best = {
        name: max(r["accuracy"] for r in table if r["batch"] == LARGE and r["optimizer"] == name)
        for name in ("sgd", "lars", "lamb")
    }
    line = {
        "bench": "largebatch",
        "epochs": args.epochs,
        "small_batch": SMALL,
        "large_batch": LARGE,
        "baseline_accuracy": table[0]["accuracy"],
        "best_large_accuracy": best,
        "runs": table,
        "wall_s": time.perf_counter() - started,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


def print_table(table: list[dict], epochs: int) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"large batch: digits MLP, {epochs} epochs, eval accuracy")
    for column in ("batch", "optimizer", "lr", "warm-up epochs", "", "accuracy"):
        t.add_column(column, justify="right")
    for r in table:
        t.add_row(
            str(r["batch"]),
            r["optimizer"],
            f"{r['lr']:g}",
            str(r["warmup"]),
            r["note"],
            f"{100 * r['accuracy']:.1f}%",
        )
    Console().print(t)


if __name__ == "__main__":
    raise SystemExit(main())
