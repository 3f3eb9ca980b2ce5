"""`shardwise bench all`: every strategy on the same job, a scaling series, one report.

The job is the tiny character GPT (the one model every strategy can split: tensor parallel
needs its attention heads and vocabulary, a pipeline its blocks), `--steps` steps of the same
global batch, launched once per strategy with `shardwise train` (2 ranks; the parameter server
runs 1 server and 2 workers). Then a scaling series of DDP at 1, 2 and 4 ranks:

- strong scaling: the same global batch split over N ranks; efficiency = T(1) / (N T(N));
- weak scaling: the same per-rank batch, N times the global; efficiency = T(1) / T(N),
  where T is the time per step (median, after the first steps).

This machine has 2 cores: a 4-rank run shares them, and its efficiency says so.

Every run directory lands under `--out`; the report (`shardwise report`) of every strategy
is `--out`/report.html, the scaling table goes to the terminal, `--out`/scaling.json and one
JSON line. `--quick` runs 10 steps (evaluated at the end only), without hierarchical
all-reduce and five of the codecs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shardwise.bench.whole_jobs import median_step_time, train_job

JOB = [
    *("data.seq_len=32", "model.n_layer=2", "optim.warmup_steps=5"),
    *("train.eval_batch_size=64", "train.log_every=2"),
]
BATCH = 16  # per data-parallel rank, at 2 ranks: a global batch of 32 sequences

STRATEGIES: dict[str, list[str]] = {
    "ddp": ["strategy.name=ddp"],
    "ddp-ring": ["strategy.name=ddp", "strategy.algorithm=ring"],
    "ddp-hierarchical": ["strategy.name=ddp", "strategy.algorithm=hierarchical"],
    "ddp-fp16": ["strategy.name=ddp", "strategy.compression=fp16"],
    "ddp-bf16": ["strategy.name=ddp", "strategy.compression=bf16"],
    "ddp-int8": ["strategy.name=ddp", "strategy.compression=int8"],
    "ddp-topk": ["strategy.name=ddp", "strategy.compression=topk:0.1"],
    "ddp-randomk": ["strategy.name=ddp", "strategy.compression=randomk:0.1"],
    "ddp-sign": ["strategy.name=ddp", "strategy.compression=sign"],
    "ddp-powersgd": ["strategy.name=ddp", "strategy.compression=powersgd:4"],
    "zero1": ["strategy.name=zero", "strategy.stage=1"],
    "zero2": ["strategy.name=zero", "strategy.stage=2"],
    "zero3": ["strategy.name=zero", "strategy.stage=3"],
    "tp": ["strategy.name=tp"],
    "pp-gpipe": ["strategy.name=pp", "strategy.schedule=gpipe"],
    "pp-1f1b": ["strategy.name=pp", "strategy.schedule=1f1b"],
    "mesh-dp1-tp2": ["strategy.name=mesh", "strategy.tp=2"],
    "local_sgd": ["strategy.name=local_sgd", "strategy.period=4"],
    "gossip": ["strategy.name=gossip"],
    "adaptive": ["strategy.name=adaptive"],
    "ps-sync": ["strategy.name=ps", "strategy.mode=sync"],
    "ps-async": ["strategy.name=ps", "strategy.mode=async"],
    "ps-ssp": ["strategy.name=ps", "strategy.mode=ssp"],
}
SPLIT_MODEL = {"tp", "pp-gpipe", "pp-1f1b", "mesh-dp1-tp2"}  # one data-parallel replica
QUICK_SKIPS = {"ddp-hierarchical", "ddp-bf16", "ddp-int8", "ddp-topk", "ddp-randomk", "ddp-sign"}
SCALING = (1, 2, 4)


def _ranks(name: str) -> int:
    return 3 if name.startswith("ps-") else 2


def run_strategy(out: Path, name: str, steps: int) -> dict:
    # Ranks that split one model read the same batch: the same job's global batch is theirs.
    batch = BATCH * 2 if name in SPLIT_MODEL else BATCH
    sets = [*JOB, *STRATEGIES[name], f"train.steps={steps}", f"data.batch_size={batch}"]
    sets += [f"train.eval_every={max(1, steps // 4)}"] if steps >= 20 else []
    if name == "ddp":  # one run's timeline for the report
        sets += [f"train.trace_steps=[{steps // 2}, {steps // 2 + 2}]"]
    started = time.perf_counter()
    job = train_job(out / name, "tiny_gpt", sets, extra=["--nproc", str(_ranks(name))])
    wall = time.perf_counter() - started
    if job.returncode != 0:
        return {"error": f"exit {job.returncode}", "output": (job.stdout + job.stderr)[-1500:]}
    summary = json.loads((out / name / "summary.json").read_text())
    return {"samples_per_s": summary.get("samples_per_s"), "wall_s": wall}


def run_scaling(out: Path, steps: int) -> dict:
    """DDP at 1, 2 and 4 ranks: strong (global batch fixed) and weak (per-rank batch fixed)."""
    measured: dict[tuple[int, int], float] = {}  # (ranks, per-rank batch) -> time per step

    def step_time(ranks: int, batch: int) -> float:
        if (ranks, batch) not in measured:  # (2 ranks: the strong and weak runs are one)
            run_dir = out / f"scaling-{ranks}x{batch}"
            sets = [*JOB, "strategy.name=ddp", f"train.steps={steps}", f"data.batch_size={batch}"]
            job = train_job(run_dir, "tiny_gpt", sets, extra=["--nproc", str(ranks)])
            measured[ranks, batch] = (
                median_step_time(run_dir, skip=3) if job.returncode == 0 else float("nan")
            )
        return measured[ranks, batch]

    global_batch = BATCH * 2
    times = {
        "strong": {n: step_time(n, global_batch // n) for n in SCALING},
        "weak": {n: step_time(n, BATCH) for n in SCALING},
    }
    result = {}
    for kind, by_ranks in times.items():
        base = by_ranks[1]
        result[kind] = {
            str(n): {
                "step_s": t,
                "efficiency": base / (n * t) if kind == "strong" else base / t,
            }
            for n, t in by_ranks.items()
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench all")
    parser.add_argument("--steps", type=int, default=None, help="steps per run")
    parser.add_argument("--quick", action="store_true", help="fewer steps and strategies")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    steps = args.steps or (10 if args.quick else 60)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    names = [n for n in STRATEGIES if not (args.quick and n in QUICK_SKIPS)]
    results = {}
    for i, name in enumerate(names, 1):
        results[name] = run_strategy(out, name, steps)
        state = results[name].get("error", "ok")
        print(f"shardwise: bench all: {i}/{len(names)} {name}: {state}", flush=True)
    scaling = run_scaling(out, steps)
    (out / "scaling.json").write_text(json.dumps(scaling, indent=1) + "\n")
    from shardwise.observe.report import main as report_main

    finished = [str(out / n) for n in names if "error" not in results[n]]
    report_main([*finished, "--out", str(out / "report.html")])
    for kind, rows in scaling.items():
        line = ", ".join(
            f"{n} ranks {1000 * r['step_s']:.0f} ms/step ({r['efficiency']:.0%})"
            for n, r in rows.items()
        )
        print(f"shardwise: {kind} scaling: {line}")
    wall = time.perf_counter() - started
    print(f"shardwise: bench all: {len(finished)} of {len(names)} strategies in {wall:.0f} s")
    failed = {n: r for n, r in results.items() if "error" in r}
    for name, r in failed.items():
        print(
            f"shardwise: bench all: {name} failed ({r['error']}):\n{r['output']}", file=sys.stderr
        )
    print(json.dumps({"bench": "all", "wall_s": wall, "strategies": results, "scaling": scaling}))
    return 1 if failed else 0
