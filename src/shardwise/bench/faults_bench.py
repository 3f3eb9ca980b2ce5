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
- Recovery by kind, in the same run: the default job on 4 ranks loses rank 3 at
  `--recovery-kill-step`, and goes on by a restart from its newest checkpoint (every
  `--recovery-every` steps), by shrinking (`train.on_failure: shrink`), or by shrinking and
  taking the launcher's replacement in (`replace`); beside an uninterrupted run, each kind
  repeated `--repeats` times, interleaved. Reported: seconds from the kill to the next step
  trained, steps lost (trained again), global samples/s before the failure, while the job is
  short of a rank, after it is whole again, and over the whole run (the outage included), and
  the final loss against the uninterrupted run's.

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


RECOVERY_KINDS = {  # kind -> (sets, extra arguments): the default job, 4 ranks
    "uninterrupted": ([], []),
    "restart": (["train.checkpoint_every={every}"], ["--max-restarts", "1"]),
    "shrink": (["train.on_failure=shrink"], []),
    "shrink and grow": (["train.on_failure=replace"], []),
}


def recovery(out: Path, kind: str, repeat: int, steps: int, kill_step: int, every: int) -> dict:
    run_dir = out / f"recovery-{kind.replace(' ', '-')}-{repeat}"
    sets, extra = RECOVERY_KINDS[kind]
    sets = [f"train.steps={steps}", "train.measure=false", *(s.format(every=every) for s in sets)]
    env = {} if kind == "uninterrupted" else {"SHARDWISE_FAULT": f"kill:rank=3:step={kill_step}"}
    output = _job(run_dir, "digits", sets, env, extra=["--nproc", "4", *extra])
    if not (run_dir / "summary.json").exists():
        return {"kind": kind, "error": "did not finish", "output": output[-2000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [r for r in _metrics(run_dir) if "loss" in r and "wall_time" in r]
    wall = {r["step"]: r["wall_time"] for r in rows}
    batch = round(rows[-1]["samples_per_s"] * rows[-1]["step_time_s"])  # global, per step
    result = {"kind": kind, "final_loss": summary["final_train_loss"], "global_batch": batch}

    def rate(first: int, last: int) -> float | None:  # global samples/s, steps first+1..last
        if last - first < 2 or first not in wall or last not in wall:
            return None
        return batch * (last - first) / (wall[last] - wall[first])

    result["overall_samples_per_s"] = rate(3, steps)
    if kind == "uninterrupted":
        return result
    fired = _fired_at(run_dir)
    changes = [r for r in _metrics(run_dir) if "membership" in r]
    if kind == "restart":
        found = re.search(r"resumed from \S+ \(step (\d+)", output)
        back_to = int(found.group(1)) + 1 if found else kill_step
    else:
        back_to = changes[0]["step"]
    grown = next((c["step"] for c in changes if c["joined"]), None)
    whole_again = back_to if kind == "restart" else grown
    result.update(
        {
            "kill_to_training_s": wall[back_to] - fired,
            "steps_lost": kill_step - back_to,
            "before_samples_per_s": rate(3, kill_step - 1),
            "short_samples_per_s": rate(back_to, (whole_again or steps + 1) - 1)
            if kind != "restart"
            else None,
            "whole_again_at_step": whole_again,
            "after_samples_per_s": rate(whole_again, steps) if whole_again else None,
        }
    )
    return result


def recovery_by_kind(out: Path, repeats: int, steps: int, kill_step: int, every: int) -> list:
    """Every kind once per repeat, interleaved; per kind, the median of each figure."""
    runs: dict[str, list[dict]] = {kind: [] for kind in RECOVERY_KINDS}
    for repeat in range(repeats):
        for kind in RECOVERY_KINDS:
            runs[kind].append(recovery(out, kind, repeat, steps, kill_step, every))
    table = []
    for kind, results in runs.items():
        good = [r for r in results if "error" not in r]
        if not good:
            table.append(results[0])
            continue
        row = {"kind": kind, "runs": len(good)}
        for key in good[0]:
            values = [r[key] for r in good if isinstance(r.get(key), (int, float))]
            if key not in ("kind",) and values:
                row[key] = statistics.median(values)
        table.append(row)
    base = next((r for r in table if r["kind"] == "uninterrupted" and "final_loss" in r), None)
    for row in table:
        if base and "final_loss" in row:
            row["loss_vs_uninterrupted"] = row["final_loss"] - base["final_loss"]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shardwise bench faults")
    parser.add_argument("--intervals", default="5,10,20", help="checkpoint intervals (steps)")
    parser.add_argument("--steps", type=int, default=60, help="steps of the killed job")
    parser.add_argument("--kill-step", type=int, default=37)
    parser.add_argument("--stall-steps", type=int, default=30, help="tiny GPT steps per mode")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--recovery-steps", type=int, default=3000)
    parser.add_argument("--recovery-kill-step", type=int, default=500)
    parser.add_argument("--recovery-every", type=int, default=250, help="restart's checkpoints")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each recovery kind")
    parser.add_argument(
        "--only", choices=["recovery"], help="only the recovery table (the rest is skipped)"
    )
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recovered = recovery_by_kind(
        out, args.repeats, args.recovery_steps, args.recovery_kill_step, args.recovery_every
    )
    if args.only == "recovery":
        result = {"bench": "faults", "recovery": recovered}
        _print_recovery(recovered, args.recovery_kill_step)
        print(json.dumps(result))
        (out / "result.json").write_text(json.dumps(result) + "\n")
        return 0
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
        "recovery": recovered,
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
    _print_recovery(result["recovery"], None)
    hang = result["hang"]
    console.print(
        f"hang (timeout {hang['hang_timeout_s']:.0f} s): every rank exited "
        f"{hang['hang_to_all_exited_s']:.1f} s after the hang\n  {hang['report'][:300]}"
    )


def _print_recovery(rows: list[dict], kill_step: int | None) -> None:
    from rich.console import Console
    from rich.table import Table

    at = f" at step {kill_step}" if kill_step else ""
    table = Table(title=f"recovery by kind: digits, DDP, 4 ranks, rank 3 killed{at} (medians)")
    columns = (
        "kind",
        "kill -> training",
        "steps lost",
        "samples/s before",
        "short a rank",
        "whole again",
        "overall",
        "final loss",
        "vs uninterrupted",
    )
    for col in columns:
        table.add_column(col, justify="right")

    def rate(row, key):
        return f"{row[key]:,.0f}" if row.get(key) is not None else "-"

    for row in rows:
        if "error" in row:
            table.add_row(row["kind"], row["error"], *["-"] * 7)
            continue
        whole = rate(row, "after_samples_per_s")
        if row.get("whole_again_at_step"):
            whole += f" (step {row['whole_again_at_step']:.0f})"
        table.add_row(
            row["kind"],
            f"{row['kill_to_training_s']:.2f} s" if "kill_to_training_s" in row else "-",
            f"{row['steps_lost']:.0f}" if "steps_lost" in row else "-",
            rate(row, "before_samples_per_s"),
            rate(row, "short_samples_per_s"),
            whole,
            rate(row, "overall_samples_per_s"),
            f"{row['final_loss']:.6f}",
            f"{row.get('loss_vs_uninterrupted', 0.0):+.1e}",
        )
    Console(width=140).print(table)


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
