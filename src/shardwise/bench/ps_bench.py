"""Benchmark: parameter-server consistency modes against our DDP, with a straggler.

The default job (an MLP on the digits) on 3 data-parallel workers, one of them made slower by
an artificial delay per step (`--delay`; default: twice a normal step period, measured in a
short calibration run, so that worker runs 3x slower): sync, async and SSP(s=2) parameter
servers with 2 servers, and our DDP on 3 ranks, each for the same number of steps per worker.
Two straggler scenarios, each with all four variants:

- persistent: worker 0 is the slow one on every step (a slower machine);
- transient: the delay moves one worker on every step, so each worker is slow one step in three
  and at any time one of them is (pauses, noisy neighbours: what stale-synchronous training was
  designed to absorb).

With a persistent straggler, SSP cannot beat sync for long: the slow worker's clock advances at
a third of the others', and no worker may be more than s clocks ahead of it, so after a few
steps everyone moves at its pace (only async lets the fast workers go on). With transient ones,
sync waits for a slow worker on every step while SSP lets the lead change hands.

Reported per scenario and variant: samples/s and its ratio to sync, wall-clock to a target test
accuracy (evaluated every few steps), final test accuracy, staleness distribution of the applied
updates; a PNG (accuracy against wall-clock, staleness histograms) and one JSON line.

Run: shardwise bench ps
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from shardwise.config import load_config
from shardwise.launch.job_runner import fit_ranks, run_job

VARIANTS = {
    "ps_sync": ["strategy.name=ps", "strategy.mode=sync"],
    "ps_async": ["strategy.name=ps", "strategy.mode=async"],
    "ps_ssp2": ["strategy.name=ps", "strategy.mode=ssp", "strategy.staleness=2"],
    "ddp": ["strategy.name=ddp", "launch.nproc=3"],
}


def normal_step_s(out: Path) -> float:
    """A worker's step period in this very setting (5 processes, messages included), from a
    short synchronous run without a straggler: what "3x slower" is measured against."""
    run_variant("ps_sync", out / "calibration", 40, 0.0, 0)
    periods = []
    for path in (out / "calibration" / "ps_sync" / "ps").glob("worker*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        periods.append(rows[-1]["t"] / len(rows))
    return sorted(periods)[len(periods) // 2]


SCENARIOS = {"persistent": "train.delay_rotate=false", "transient": "train.delay_rotate=true"}


def run_variant(
    key: str, out: Path, steps: int, delay: float, eval_every: int, scenario: str = "persistent"
) -> dict:
    run_dir = out / key
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun must not append to the last one's logs
    sets = [*VARIANTS[key], SCENARIOS[scenario]]
    if key != "ddp":
        sets += ["strategy.servers=2", "strategy.workers=3"]
    sets += [
        f"train.steps={steps}",
        f"train.delay_s=[{delay}]",
        f"train.eval_every={eval_every}",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "launch.threads_per_rank=1",
    ]
    cfg = fit_ranks(load_config("digits", sets))
    started = time.perf_counter()
    code = run_job(cfg, run_dir)
    wall = time.perf_counter() - started
    if code:
        return {"error": f"exit code {code}"}
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = accuracy_curve(run_dir, key)
    return {
        "samples_per_s": summary["samples_per_s"],
        "final_accuracy": summary["eval_accuracy"],
        "staleness_histogram": summary.get("staleness_histogram", {"0": 0}),
        "curve": curve,
        "wall_s": wall,
    }


def accuracy_curve(run_dir: Path, key: str) -> list[tuple[float, float]]:
    """(seconds since training started, test accuracy), from whichever rank evaluated first."""
    files = (
        sorted((run_dir / "ps").glob("worker*.jsonl"))
        if key != "ddp"
        else [run_dir / "metrics.jsonl"]
    )
    points = []
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "eval_accuracy" in row:
                points.append((row["t"], row["eval_accuracy"]))
    return sorted(points)


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target), None)


def plot(scenarios: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scenarios), 2, figsize=(11, 4.2 * len(scenarios)), squeeze=False)
    for (scenario, results), (left, right) in zip(scenarios.items(), axes, strict=True):
        _plot_scenario(scenario, results, left, right)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_scenario(scenario: str, results: dict, left, right) -> None:
    for key, r in results.items():
        if r.get("curve"):
            t, acc = zip(*r["curve"], strict=True)
            left.plot(t, acc, marker=".", label=key)
    left.set_xlabel("wall-clock (s)")
    left.set_ylabel("test accuracy")
    left.set_title(f"accuracy, {scenario} 3x straggler")
    left.grid(alpha=0.3)
    left.legend()
    width = 0.25
    for i, key in enumerate(k for k in results if k.startswith("ps_")):
        hist = results[key].get("staleness_histogram", {})
        xs = [int(k) + (i - 1) * width for k in hist]
        right.bar(xs, list(hist.values()), width=width, label=key)
    right.set_xlabel("staleness of an applied update")
    right.set_ylabel("updates")
    right.set_title(f"staleness distribution, {scenario} straggler")
    right.legend()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench ps")
    parser.add_argument("--steps", type=int, default=150, help="steps per worker")
    parser.add_argument("--delay", type=float, help="seconds added to the slow worker's steps")
    parser.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--scenarios", default="persistent,transient")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    delay = args.delay if args.delay is not None else round(2 * normal_step_s(out), 4)
    scenarios = {}
    for scenario in args.scenarios.split(","):
        results = scenarios[scenario] = {}
        for key in VARIANTS:
            r = run_variant(key, out / scenario, args.steps, delay, args.eval_every, scenario)
            r["time_to_target_s"] = time_to(r.get("curve", []), args.target)
            results[key] = r
        sync = results["ps_sync"].get("samples_per_s") or float("nan")
        for r in results.values():
            if "samples_per_s" in r:
                r["speed_over_sync"] = r["samples_per_s"] / sync
        print_table(results, delay, args.target, scenario)
    plot(scenarios, out / "ps.png")
    line = {
        "bench": "ps",
        "servers": 2,
        "workers": 3,
        "slow_worker_delay_s": delay,
        "steps_per_worker": args.steps,
        "target_accuracy": args.target,
        "results": {
            scenario: {
                k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in results.items()
            }
            for scenario, results in scenarios.items()
        },
    }
    (out / "ps.json").write_text(json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


def print_table(results: dict, delay: float, target: float, scenario: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"parameter server vs DDP, 3 workers, {scenario} straggler: "
        f"{delay * 1000:.1f} ms added to its steps"
    )
    for col in ("variant", "samples/s", "x sync", f"to {target:.0%} s", "final acc.", "staleness"):
        t.add_column(col, justify="right")
    for key, r in results.items():
        if "error" in r:
            t.add_row(key, r["error"], "", "", "", "")
            continue
        reached = r["time_to_target_s"]
        t.add_row(
            key,
            f"{r['samples_per_s']:,.0f}",
            f"{r['speed_over_sync']:.2f}",
            f"{reached:.1f}" if reached is not None else "never",
            f"{100 * r['final_accuracy']:.1f} %",
            str(r["staleness_histogram"]) if key != "ddp" else "-",
        )
    Console(width=130).print(t)


if __name__ == "__main__":
    raise SystemExit(main())
