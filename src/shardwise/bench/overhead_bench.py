"""Benchmark: what the default measurements cost (`train.measure`: per-phase timing, gradient
norm, activation memory, TensorBoard).

The default job (the digits MLP) and the tiny GPT, each on 2 ranks (`--nproc`), run with the
measurements on and off, alternating, `--reps` times. Reported: the median over the runs of
each one's median step time (first steps left out), and the overhead, on / off - 1. What stays
on either way (each step's time, waiting and bytes, the timing line) is not part of the comparison.

Run: shardwise bench overhead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from shardwise.bench.whole_jobs import median_step_time, train_job

JOBS = {"digits": ("digits", []), "tiny_gpt": ("tiny_gpt", ["data.seq_len=64"])}
SKIP = 5  # first steps: allocation, lazy set-up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench overhead")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (1 on a single GPU)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    times: dict[str, dict[str, list[float]]] = {j: {"on": [], "off": []} for j in JOBS}
    for rep in range(args.reps):
        for job, (config, sets) in JOBS.items():
            order = ("on", "off") if rep % 2 == 0 else ("off", "on")
            for state in order:
                run_dir = out / f"{job}-{state}-{rep}"
                flags = [*sets, f"train.steps={args.steps}", f"train.measure={state == 'on'}"]
                done = train_job(run_dir, config, flags, extra=["--nproc", str(args.nproc)])
                if done.returncode != 0:
                    print(done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)
                    return 1
                times[job][state].append(median_step_time(run_dir, SKIP))
            print(f"shardwise: bench overhead: {job}, rep {rep + 1}", flush=True)
    result = {"bench": "overhead", "steps": args.steps, "reps": args.reps, "jobs": {}}
    for job, by_state in times.items():
        on, off = statistics.median(by_state["on"]), statistics.median(by_state["off"])
        result["jobs"][job] = {"step_s_on": on, "step_s_off": off, "overhead": on / off - 1}
        print(
            f"shardwise: {job}: {1000 * on:.2f} ms/step measured, {1000 * off:.2f} ms not: "
            f"overhead {100 * (on / off - 1):+.1f}%"
        )
    print(json.dumps(result))
    (out / "result.json").write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
