"""What the benchmarks that measure whole `shardwise train` jobs share: run one, read its times."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path


def default_out(suite: str) -> str:
    """Where a suite that writes several files puts them unless told: under runs/."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return str(Path("runs") / f"bench-{suite}-{stamp}")


def train_job(
    run_dir: Path, config: str, sets: list[str], env: dict | None = None, extra=()
) -> subprocess.CompletedProcess:
    """`shardwise train CONFIG --set ... --run-dir RUN_DIR` (afresh) as a subprocess, for the
    suites that measure whole jobs; its output is captured."""
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "shardwise", "train", config, *extra]
    argv += [x for kv in sets for x in ("--set", kv)] + ["--run-dir", str(run_dir)]
    return subprocess.run(
        argv,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=1800,
    )


def median_step_time(run_dir: Path, skip: int) -> float:
    """A finished run's median step time from its metrics.jsonl, the first `skip` steps (lazy
    set-up, allocation) left out."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([x["step_time_s"] for x in lines if "loss" in x][skip:])
