"""Benchmark: what failures cost, measured on real jobs with injected faults.

- Kill and restart, for a few checkpoint intervals: the default job (digits, our DDP, 2 ranks)
  loses rank 1 at step `--kill-step` and torchrun's agent restarts it (`--max-restarts 1`).
  Reported: seconds from the kill to the first step trained after the restart (restart, process
  group, loading), and steps of work lost (done before the kill, after the checkpoint resumed).
- Checkpoint stall: the tiny GPT (2 ranks) saving every 5 steps, asynchronously and
  synchronously; the training loop's stall per save (the state copy, against the whole write).
  Then the rival on one state, interleaved: our saver against torch's Distributed Checkpoint
  (`dcp.async_save`, `dcp.save`), the tiny GPT under our DDP on 2 ranks (`checkpoint_stall.py`).
- Hang detection: a rank that stops issuing collectives in a 3-rank job, with
  `launch.hang_timeout_s`; seconds from the hang until every rank has exited with the report.

Every time comes from outside the code it measures: fault markers (written when a fault fires),
the metrics' wall-clock time of each step, the launcher's exit.

Run: shardwise bench faults
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

from shardwise.bench.whole_jobs import train_job


def _job(run_dir: Path, config: str, sets: list[str], env: dict | None = None, extra=()) -> str:
    result = train_job(run_dir, config, sets, env, extra)
    return result.stdout + result.stderr


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _fired_at(run_dir: Path) -> float:
    (marker,) = (run_dir / "faults").iterdir()
    return float(marker.read_text())


def kill_and_restart(out: Path, every: int, steps: int, kill_step: int) -> dict:
    run_dir = out / f"kill-every{every}"
    fault = {"SHARDWISE_FAULT": f"kill:rank=1:step={kill_step}"}
    sets = [f"train.steps={steps}", f"train.checkpoint_every={every}"]
    output = _job(run_dir, "digits", sets, fault, extra=["--max-restarts", "1"])
    found = re.search(r"resumed from \S+ \(step (\d+)", output)
    if not found:
        return {"error": "did not resume", "output": output[-2000:]}
    resumed = int(found.group(1))
    first = next(r for r in _metrics(run_dir) if r.get("step") == resumed + 1 and "loss" in r)
    return {
        "checkpoint_every": every,
        "killed_at_step": kill_step,
        "resumed_from_step": resumed,
        "steps_lost": kill_step - 1 - resumed,
        "kill_to_training_s": first["wall_time"] - _fired_at(run_dir),
    }


def checkpoint_stall(out: Path, sync: bool, steps: int) -> dict:
    run_dir = out / ("stall-sync" if sync else "stall-async")
    sets = [
        f"train.steps={steps}",
        "train.checkpoint_every=5",
        f"train.async_checkpoint={str(not sync).lower()}",
    ]
    output = _job(run_dir, "tiny_gpt", sets)
    rows = _metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    stalls = [r["checkpoint_stall_s"] for r in rows if "checkpoint_stall_s" in r]
    writes = [r["checkpoint_write_s"] for r in rows if "checkpoint_write_s" in r]
    steps_s = [r["step_time_s"] for r in rows if "step_time_s" in r][3:]
    if not stalls:
        return {"error": "no checkpoint saved", "output": output[-2000:]}
    return {
        "mode": "sync" if sync else "async",
        "saves": len(stalls),
        "stall_s_median": statistics.median(stalls),
        "write_s_median": statistics.median(writes) if writes else None,
        "step_s_median": statistics.median(steps_s),
    }


def stall_against_dcp(out: Path) -> dict:
    """Medians of our save and torch DCP's, async and sync, on one state (2 ranks)."""
    from shardwise.distributed.launcher import launch

    where = out / "stall-vs-dcp"
    shutil.rmtree(where, ignore_errors=True)
    launch(["shardwise.bench.checkpoint_stall", "--out", str(where)], 2)
    return json.loads((where / "result.json").read_text())


def hang_detection(out: Path, timeout_s: float) -> dict:
    run_dir = out / "hang"
    sets = ["train.steps=200", f"launch.hang_timeout_s={timeout_s}"]
    output = _job(
        run_dir, "digits", sets, {"SHARDWISE_FAULT": "hang:rank=1:step=10"}, ["--nproc", "3"]
    )
    ended = time.time()
    report = run_dir / "hang_report.txt"
    return {
        "hang_timeout_s": timeout_s,
        "hang_to_all_exited_s": ended - _fired_at(run_dir),
        "report": report.read_text().splitlines()[0] if report.exists() else output[-500:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench faults")
    parser.add_argument("--intervals", default="5,10,20", help="checkpoint intervals (steps)")
    parser.add_argument("--steps", type=int, default=60, help="steps of the killed job")
    parser.add_argument("--kill-step", type=int, default=37)
    parser.add_argument("--stall-steps", type=int, default=30, help="tiny GPT steps per mode")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kills = [
        kill_and_restart(out, int(every), args.steps, args.kill_step)
        for every in args.intervals.split(",")
    ]
    stalls = [checkpoint_stall(out, sync, args.stall_steps) for sync in (False, True)]
    rival = stall_against_dcp(out)
    hang = hang_detection(out, args.hang_timeout)
    result = {
        "bench": "faults",
        "kill_restart": kills,
        "checkpoint_stall": stalls,
        "stall_vs_dcp_s": rival,
        "hang": hang,
    }
    if all("error" not in s for s in stalls):
        result["async_stall_over_sync_save"] = (
            stalls[0]["stall_s_median"] / stalls[1]["stall_s_median"]
        )
    _print_tables(result)
    print(json.dumps(result))
    (out / "result.json").write_text(json.dumps(result) + "\n")
    return 0


def _print_tables(result: dict) -> None:
    from rich.console import Console

    console = Console(width=120)
    console.print(_kill_table(result["kill_restart"]))
    console.print(_stall_table(result["checkpoint_stall"]))
    console.print(_rival_table(result["stall_vs_dcp_s"]))
    if "async_stall_over_sync_save" in result:
        console.print(f"async stall / sync save: {result['async_stall_over_sync_save']:.3f}")
    hang = result["hang"]
    console.print(
        f"hang (timeout {hang['hang_timeout_s']:.0f} s): every rank exited "
        f"{hang['hang_to_all_exited_s']:.1f} s after the hang\n  {hang['report'][:300]}"
    )


def _kill_table(kills: list[dict]):
    from rich.table import Table

    table = Table(title="kill rank 1 and restart (digits, DDP, 2 ranks)")
    for col in ("checkpoint every", "killed at", "resumed from", "steps lost", "kill -> training"):
        table.add_column(col, justify="right")
    for k in kills:
        if "error" in k:
            table.add_row("-", "-", "-", "-", k["error"])
            continue
        table.add_row(
            str(k["checkpoint_every"]),
            str(k["killed_at_step"]),
            str(k["resumed_from_step"]),
            str(k["steps_lost"]),
            f"{k['kill_to_training_s']:.1f} s",
        )
    return table


def _stall_table(stalls: list[dict]):
    from rich.table import Table

    table = Table(title="checkpoint stall per save (tiny GPT, 2 ranks, every 5 steps)")
    for col in ("mode", "saves", "stall (median)", "write (median)", "step (median)"):
        table.add_column(col, justify="right")
    for s in stalls:
        if "error" in s:
            table.add_row("-", "-", s["error"], "-", "-")
            continue
        write = f"{1000 * s['write_s_median']:.1f} ms" if s["write_s_median"] else "-"
        table.add_row(
            s["mode"],
            str(s["saves"]),
            f"{1000 * s['stall_s_median']:.1f} ms",
            write,
            f"{1000 * s['step_s_median']:.1f} ms",
        )
    return table


def _rival_table(medians: dict[str, float]):
    from rich.table import Table

    table = Table(title="the same state, ours vs torch DCP (tiny GPT, our DDP, 2 ranks, medians)")
    for col in ("save", "ours", "torch DCP", "ours / DCP"):
        table.add_column(col, justify="right")
    for mode in ("async", "sync"):
        ours, dcp = medians[f"ours_{mode}"], medians[f"dcp_{mode}"]
        table.add_row(
            f"{mode} stall", f"{1000 * ours:.1f} ms", f"{1000 * dcp:.1f} ms", f"{ours / dcp:.2f}"
        )
    return table


if __name__ == "__main__":
    sys.exit(main())
