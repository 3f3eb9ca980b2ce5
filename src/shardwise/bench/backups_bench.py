"""Benchmark: backup workers for the synchronous parameter server, against a straggler.

The default job (an MLP on the digits), 1 server and 4 workers in sync mode, the last worker
made 3x slower by a delay per step (`--delay`; default: twice a worker's step period, measured
in a short calibration run). Four variants, run interleaved, once per seed:

- `sync`: no straggler, no backups (the speed to aim for);
- `sync_slow`: the straggler, no backups (every round waits for it);
- `backup_slow`: the straggler, `backup_workers: 1` (rounds close without it);
- `backup`: no straggler, `backup_workers: 1` (what the backups cost when nobody is slow).

Reported: applied samples per second (batches whose update was applied, over the training
time: a late worker's batch is trained again by another one and counted once), its ratio to
`sync` and to `backup`, test accuracy per seed and its difference from `sync_slow`, how often
each worker was late; a table and one JSON line.

Run: shardwise bench backups
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from shardwise.config import load_config
from shardwise.launch.job_runner import fit_ranks, run_job

WORKERS = 4
VARIANTS = {  # name -> (backup workers, straggler)
    "sync": (0, False),
    "sync_slow": (0, True),
    "backup_slow": (1, True),
    "backup": (1, False),
}


def run_variant(name: str, out: Path, steps: int, delay: float, seed: int) -> dict:
    backups, slow = VARIANTS[name]
    run_dir = out / f"{name}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun must not append to the last logs
    delays = [0.0] * (WORKERS - 1) + [delay if slow else 0.0]
    sets = [
        "strategy.name=ps",
        "strategy.mode=sync",
        f"strategy.workers={WORKERS}",
        f"strategy.backup_workers={backups}",
        f"train.delay_s={delays}",
        f"train.steps={steps}",
        f"train.seed={seed}",
        "launch.threads_per_rank=1",
    ]
    code = run_job(fit_ranks(load_config("digits", sets)), run_dir)
    if code:
        return {"error": f"exit code {code}"}
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "applied_samples_per_s": s["consumed_samples_per_s"],
        "trained_samples_per_s": s["samples_per_s"],
        "accuracy": s["eval_accuracy"],
        "late_pushes": s["late_pushes"],
        "updates": s["updates"],
    }


def step_period_s(out: Path) -> float:
    """A worker's step period in this very setting (5 processes, sync, no straggler)."""
    run_variant("sync", out / "calibration", 60, 0.0, 0)
    periods = []
    for path in (out / "calibration" / "sync-seed0" / "ps").glob("worker*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        periods.append(rows[-1]["t"] / len(rows))
    return statistics.median(periods)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench backups")
    parser.add_argument("--steps", type=int, default=300, help="steps per worker")
    parser.add_argument("--seeds", default="0,1,2", help="one interleaved round per seed")
    parser.add_argument("--delay", type=float, help="seconds added to the slow worker's steps")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    delay = args.delay if args.delay is not None else round(2 * step_period_s(out), 4)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for seed in seeds:  # interleaved: each round runs every variant once
        for name in VARIANTS:
            runs[name].append(run_variant(name, out, args.steps, delay, seed))
    results = summarise(runs, seeds)
    print_table(results, delay, seeds)
    line = {"bench": "backups", "workers": WORKERS, "slow_worker_delay_s": delay}
    line |= {"steps_per_worker": args.steps, "seeds": seeds, "results": results}
    (out / "backups.json").write_text(json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


def summarise(runs: dict[str, list[dict]], seeds: list[int]) -> dict:
    results = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if len(ok) < len(rs):
            results[name] = {"error": next(r["error"] for r in rs if "error" in r)}
            continue
        results[name] = {
            "applied_samples_per_s": statistics.median(r["applied_samples_per_s"] for r in ok),
            "accuracy": [r["accuracy"] for r in ok],
            "late_pushes": [r["late_pushes"] for r in ok],
        }
    speeds = {k: v.get("applied_samples_per_s") for k, v in results.items()}
    for name, r in results.items():
        if "error" in r:
            continue
        for base in ("sync", "backup"):
            if speeds.get(base):
                r[f"speed_over_{base}"] = speeds[name] / speeds[base]
        if "accuracy" in results.get("sync_slow", {}):
            diffs = [
                a - b for a, b in zip(r["accuracy"], results["sync_slow"]["accuracy"], strict=True)
            ]
            r["accuracy_minus_sync_slow"] = diffs
    return results


def print_table(results: dict, delay: float, seeds: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"sync parameter server, 1 server x {WORKERS} workers; the slow worker: "
        f"{delay * 1000:.1f} ms added to each step (3x); median over seeds {seeds}"
    )
    columns = ("variant", "applied samples/s", "x sync", "x backup", "accuracy per seed")
    for col in (*columns, "vs sync_slow (points)", "late pushes (rank: n)"):
        t.add_column(col, justify="right")
    for name, r in results.items():
        if "error" in r:
            t.add_row(name, r["error"], *[""] * 5)
            continue
        late = late_by_rank(r["late_pushes"])
        t.add_row(
            name,
            f"{r['applied_samples_per_s']:,.0f}",
            f"{r.get('speed_over_sync', float('nan')):.2f}",
            f"{r.get('speed_over_backup', float('nan')):.2f}",
            " / ".join(f"{100 * a:.1f}" for a in r["accuracy"]),
            " / ".join(f"{100 * d:+.1f}" for d in r.get("accuracy_minus_sync_slow", [])),
            ", ".join(f"{w}: {n}" for w, n in sorted(late.items())) or "none",
        )
    Console(width=150).print(t)


def late_by_rank(counts: list[dict]) -> dict[int, int]:
    """Late pushes per worker rank, over every seed's run."""
    total: dict[int, int] = {}
    for c in counts:
        for w, n in c.items():
            total[int(w)] = total.get(int(w), 0) + n
    return total


if __name__ == "__main__":
    raise SystemExit(main())
