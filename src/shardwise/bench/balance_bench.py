"""Benchmark: per-rank batches against a slow rank.

One rank of 2 (then of 3) works 2x slower per sample (the `slow` fault). The same job (the CNN
on the digits, 128 samples per rank per step, our DDP) runs with:

- `equal`: every rank the same slice of the global batch (the others wait for the slow one);
- `weighted`: static shares by declared capacity (`data.rank_weights`, the slow rank 0.5);
- `dynamic`: shares re-planned from measured throughput every 5 steps, from equal;
- `queue`: local SGD on the work queue (`data.mode: queue`): each rank claims the next chunk of
  128 samples when it is ready, so the fast ones take more; the replicas are averaged, weighted
  by samples, after every round of 2 chunks per rank (as many samples as 2 steps of the
  others, whose figures a round's line is compared with).

SyncBatchNorm is off: its all-reduces in the middle of the forward would make the emulated
slow rank (which sleeps before its forward) wait for the fast ones there, which slow hardware
does not do; one all-reduce of the gradients ends each step, as in most jobs.

The CNN is wide (96 and 192 channels) so that a step's work grows with its samples well above
what it costs whatever its size. That matters because of how the slow fault emulates slower
hardware: a rank's cost per sample is fitted from its (batch size, work time) pairs, and with
static shares the batch size never varies, so the fit can only use work / samples, which
carries the step's fixed costs: the slowed rank then stretches those too, by F, and stays the
slowest under capacity weighting (the dynamic variant, whose sizes vary, fits the slope).

The variants run one after the other in rotating order, `--reps` times. Reported per variant:
median step time, samples/s, and the median over repetitions of its ratio to the `equal` run
of the same rotation, with the lowest and highest (ideal: 1.5x at 2 ranks, 1.29x at 3),
each rank's share of time spent waiting for the others, and the training time until the test
accuracy first reaches `--target`. Every figure comes from the ranks' own logs (rank 0's
metrics.jsonl and each rank's timing/rank{r}.jsonl), written as they trained. A plot shows each
rank's work per step over the run.

Run: shardwise bench balance
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from shardwise.bench.whole_jobs import train_job

WARMUP = 5  # steps left out of the timings (allocation, lazy set-up, the first window)
JOB = [
    "model.name=cnn",
    "model.channels=[96, 192]",  # per-sample compute well above the fixed (see docstring)
    "strategy.sync_batchnorm=false",  # one all-reduce a step (see the docstring)
    "data.batch_size=128",
    "optim.name=sgd",
    "optim.lr=0.05",
    "train.eval_every=10",
    "train.eval_batch_size=512",
]


QUEUE_PERIOD = 2  # chunks per rank per round: a round holds the samples of 2 steps


def variant_sets(name: str, world: int, steps: int) -> list[str]:
    """The config overrides of one variant of `steps` steps at `world` ranks."""
    if name == "equal":
        return []
    if name == "weighted":
        return [f"data.rank_weights={[1.0] * (world - 1) + [0.5]}"]
    if name == "dynamic":
        return ["data.balance=dynamic", "data.balance_every=5"]
    if name == "queue":  # as many samples as the others train, in rounds of 2 steps' worth
        return [
            "strategy.name=local_sgd",
            f"strategy.period={QUEUE_PERIOD}",
            "data.mode=queue",
            f"train.steps={steps // QUEUE_PERIOD}",
            f"train.eval_every={10 // QUEUE_PERIOD}",
        ]
    raise ValueError(f"unknown balance variant {name!r}")


def device_factor(world: int) -> int:
    """How many times its CPU time each rank's work is made to take (sleeping the rest), so
    that ranks do not compete for cores: 1 where every rank has a core of its own."""
    return -(-world // (os.cpu_count() or 1))


def emulated_speeds(world: int) -> list[str]:
    """`slow` faults: the last rank 2x slower per sample than the others, every rank's work
    stretched by `device_factor` (3 ranks on 2 cores: each computes half the time, as a rank
    waiting on its own accelerator would)."""
    base = device_factor(world)
    factors = [base] * (world - 1) + [2 * base]
    return [f"slow:rank={r}:factor={f}" for r, f in enumerate(factors) if f > 1]


def run_job(out: Path, name: str, world: int, steps: int, rep: int) -> dict:
    run_dir = out / f"w{world}-{name}-{rep}"
    sets = [*JOB, f"train.steps={steps}", f"faults={emulated_speeds(world)}"]
    sets += variant_sets(name, world, steps)
    job = train_job(run_dir, "digits", sets, extra=["--nproc", str(world)])
    if job.returncode != 0:
        return {"error": f"exit {job.returncode}", "output": (job.stdout + job.stderr)[-2000:]}
    return measure(run_dir, world)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def measure(run_dir: Path, world: int, target: float = 0.95) -> dict:
    """A finished run's figures, from its logs."""
    metrics = [r for r in _lines(run_dir / "metrics.jsonl") if "loss" in r]
    timed = metrics[WARMUP:]
    samples = sum(r["samples_per_s"] * r["step_time_s"] for r in timed)  # global batches
    seconds = sum(r["step_time_s"] for r in timed)
    ranks = [_lines(run_dir / "timing" / f"rank{r}.jsonl") for r in range(world)]
    reached = next((r["t"] for r in metrics if r.get("eval_accuracy", 0) >= target), None)
    return {
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "samples_per_s": samples / seconds,
        "wait_share": [
            sum(s["wait_s"] for s in lines[WARMUP:]) / sum(s["step_s"] for s in lines[WARMUP:])
            for lines in ranks
        ],
        "final_shares": [lines[-1]["samples"] for lines in ranks],
        "time_to_target_s": reached,
        "work_s": [[s["work_s"] for s in lines] for lines in ranks],
    }


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians over the repetitions of each variant, and samples/s against `equal`."""
    out: dict[str, dict] = {}
    for name, reps in runs.items():
        ok = [r for r in reps if "error" not in r]
        if not ok:
            out[name] = {"error": reps[0]["error"], "output": reps[0]["output"]}
            continue
        reached = [r["time_to_target_s"] for r in ok if r["time_to_target_s"] is not None]
        out[name] = {
            "step_s": statistics.median(r["step_s"] for r in ok),
            "samples_per_s": statistics.median(r["samples_per_s"] for r in ok),
            "wait_share": [
                statistics.median(w) for w in zip(*(r["wait_share"] for r in ok), strict=True)
            ],
            "final_batch_sizes": ok[-1]["final_shares"],
            "time_to_target_s": statistics.median(reached) if reached else None,
            "reps": len(ok),
        }
    # Each repetition's ratio to the `equal` run of the same rotation, which ran minutes apart
    # at most: the machine's speed drifts by 20% over a bench (other tenants, clocks), and a
    # ratio of medians taken over the whole bench would carry that drift into the figure.
    equal = runs.get("equal", [])
    for name, figures in out.items():
        pairs = [
            run["samples_per_s"] / base["samples_per_s"]
            for run, base in zip(runs[name], equal, strict=False)
            if "error" not in run and "error" not in base
        ]
        if pairs:
            figures["vs_equal"] = statistics.median(pairs)
            figures["vs_equal_range"] = [min(pairs), max(pairs)]
    return out


def plot(runs: dict[int, dict[str, list[dict]]], path: Path) -> None:
    """Each rank's work per step (forward and backward, a slowed rank's sleep included) over
    the run, one panel per world size and variant, from each variant's last repetition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds, names = sorted(runs), list(next(iter(runs.values())))
    fig, axes = plt.subplots(
        len(worlds), len(names), figsize=(3.6 * len(names), 2.8 * len(worlds)), squeeze=False
    )
    for row, world in zip(axes, worlds, strict=True):
        for ax, name in zip(row, names, strict=True):
            last = [r for r in runs[world][name] if "error" not in r]
            ax.set_title(f"{name}, {world} ranks", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel("work per step (ms)", fontsize=8)
            if not last:
                continue
            for rank, work in enumerate(last[-1]["work_s"]):
                slow = " (2x slower)" if rank == world - 1 else ""
                ax.plot([1000 * w for w in work], label=f"rank {rank}{slow}", linewidth=0.9)
            ax.legend(fontsize=7)
            ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio(figures: dict) -> str:
    if "vs_equal" not in figures:
        return "-"
    low, high = figures["vs_equal_range"]
    return f"{figures['vs_equal']:.2f}x ({low:.2f}-{high:.2f})"


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=130)
    for world, variants in result["worlds"].items():
        device = result["device_factor"][world]
        stretched = f", every rank's work {device}x its CPU time" if device > 1 else ""
        table = Table(title=f"{world} ranks, rank {int(world) - 1} 2x slower per sample{stretched}")
        columns = ("variant", "step", "samples/s", "vs equal (range)", "waiting, per rank")
        for col in (*columns, "final batch sizes", "time to target"):
            table.add_column(col, justify="right")
        for name, f in variants.items():
            if "error" in f:
                table.add_row(name, "-", "-", "-", f["error"], "-", "-")
                continue
            reached = f["time_to_target_s"]
            table.add_row(
                name,
                f"{1000 * f['step_s']:.0f} ms",
                f"{f['samples_per_s']:,.0f}",
                _ratio(f),
                " ".join(f"{100 * w:.0f}%" for w in f["wait_share"]),
                str(f["final_batch_sizes"]),
                "-" if reached is None else f"{reached:.1f} s",
            )
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench balance")
    parser.add_argument("--worlds", default="2,3", help="world sizes, comma-separated")
    parser.add_argument("--variants", default="equal,weighted,dynamic,queue")
    parser.add_argument("--steps", type=int, default=60, help="steps per job")
    parser.add_argument("--reps", type=int, default=5, help="rotating repetitions")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.variants.split(",")
    for name in names:
        variant_sets(name, 2, args.steps)  # an unknown name fails before any job runs
    runs: dict[int, dict[str, list[dict]]] = {}
    for world in (int(w) for w in args.worlds.split(",")):
        runs[world] = {name: [] for name in names}
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                runs[world][name].append(run_job(out, name, world, args.steps, rep))
                print(f"shardwise: bench balance: {world} ranks, {name}, rep {rep + 1}", flush=True)
    result = {
        "bench": "balance",
        "steps": args.steps,
        "reps": args.reps,
        "worlds": {str(w): summarise(v) for w, v in runs.items()},
        "device_factor": {str(w): device_factor(w) for w in runs},
    }
    plot(runs, out / "work_per_step.png")
    _print_table(result)
    print(json.dumps(result))
    (out / "result.json").write_text(json.dumps(result) + "\n")
    print(f"shardwise: plot in {out / 'work_per_step.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
