"""Benchmark: our pipeline schedules against torch.distributed.pipelining's of the same names.

Tiny GPT (4 blocks, d_model 256, seq 128) on 2 ranks, global batch 16, AdamW. Schedules: GPipe,
1F1B, interleaved 1F1B (v = 2: chunks [embedding, block 0], [block 1], [block 2], [block 3,
head], ranks holding chunks 0, 2 and 1, 3) and ZB-H1 (the backward split into the input's
gradient and the weights', deferred); torch's rivals are ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1's order),
on the same cuts. For each schedule and number of micro-batches M (2, 4, 8), ours and torch's are
timed step by step in alternation (ours then torch's, then torch's then ours, ...), so that the
machine's drift hits both alike and each pair of neighbouring steps gives one speed ratio. In
the ZB-H1 cells torch's 1F1B runs in the same alternation: zero bubble's gain over the schedule
it replaces. Reported per (schedule, M, implementation) and per rank:

- step time (median) and samples/s (single-process training of the same batch as the baseline);
- ours over torch's speed: the geometric mean of the paired ratios with its 95% confidence
  interval; and, as a control, torch's schedule against a second copy of itself at one
  (schedule, M) (`--control`): what identical code measures as, i.e. the noise floor (step
  times drift together, so the interval alone is too narrow). "Not slower" holds when ours'
  interval reaches 1 or its ratio is within the control's interval;
- bubble fraction, measured: 1 - (the rank's CPU time in the step) / (step time). Each rank
  computes on its own thread (one thread per rank) and sleeps while it waits for a message, so
  its CPU time is its compute, split backward or not, by the same yardstick for both
  implementations; beside it the schedule's formula (`pipeline_schedule.bubble_formula`:
  (S-1)/(M+S-1), interleaved (S-1)/(v*M+S-1), ZB-H1 (S-1)/(3M+S-1)), which assumes equal
  stages, F = B = W and free messages;
- peak activation memory: the most bytes autograd held for backward at once
  (`observe.memory.ActivationMeter`), measured in a separate step (its hooks cost time, so
  timed steps run without them).

torch's 1F1B refuses M < S (reported as such); its schedules divide gradients by M, so the loss
function returns micro-batch means there, as ours does internally.

Run: shardwise bench pipeline    (2 ranks)
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.bench.common import emit, gpt_batch, gpt_model
from shardwise.comm.named_tensors import all_gather_named
from shardwise.nn.models import lm_loss
from shardwise.observe.memory import ActivationMeter
from shardwise.strategies.pipeline_schedule import bubble_formula
from shardwise.strategies.pipeline_stages import PipelineStage, pipeline_layers

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
CHUNKS = 2  # interleaved's v
SPLITS = {"interleaved": [2, 3, 4]}  # start layers of chunks 1.. (the others: one cut, at 3)
TORCH_NAMES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}

_model, _batch = gpt_model, gpt_batch


def _split(schedule: str) -> list[int]:
    return SPLITS.get(schedule, [3])


def build_ours(schedule: str, m: int):
    strategy = sw.Pipeline(stages=2, schedule=schedule, microbatches=m, split=_split(schedule))
    model, opt = sw.prepare(_model(), strategy, lr=1e-4)

    def step(x, y) -> None:
        sw.train_step(model, x, y, lm_loss)
        opt.step()
        opt.zero_grad()

    return step


def build_torch(schedule: str, m: int):
    from torch.distributed import pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = pipeline_layers(_model())
    bounds = [0, *_split(schedule), len(layers)]
    mine = range(rank, len(bounds) - 1, world)  # this rank's chunks of the model
    modules = [PipelineStage(layers[bounds[g] : bounds[g + 1]]) for g in mine]
    stages = [
        pipelining.PipelineStage(mod, g, len(bounds) - 1, torch.device("cpu"))
        for mod, g in zip(modules, mine, strict=True)
    ]
    cls = getattr(pipelining, TORCH_NAMES[schedule])
    # The interleaved classes take a list of stages (one per chunk this rank holds).
    single = schedule in ("gpipe", "1f1b")
    sched = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=lm_loss)
    opt = torch.optim.AdamW([p for mod in modules for p in mod.parameters()], lr=1e-4)

    def step(x, y) -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()

    return step


def activation_peak(step, batch) -> int:
    """The most activation bytes this rank holds at once during one step."""
    meter = ActivationMeter()
    with meter:
        step(*batch)
    return meter.peak


def timed_step(step, batch) -> tuple[float, float]:
    """(seconds, CPU seconds) of one step on this rank, starting together with the others."""
    dist.barrier()
    t0, busy0 = time.perf_counter(), time.thread_time()
    step(*batch)
    return time.perf_counter() - t0, time.thread_time() - busy0


def speed_ratio(ours: list[float], rival: list[float]) -> tuple[float, float, float]:
    """Ours over the rival's speed from paired step times: geometric mean and 95% interval."""
    logs = [math.log(r / o) for o, r in zip(ours, rival, strict=True)]
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def gather(stats: dict[str, tuple[list[float], list[float], int]]) -> list[dict]:
    """Every stage's {impl: (step seconds, CPU seconds, activation peak)}, as tensors."""
    local = []
    for key, (seconds, busy, peak) in stats.items():
        local.append((("seconds", key), torch.tensor(seconds, dtype=torch.float64)))
        local.append((("busy", key), torch.tensor(busy, dtype=torch.float64)))
        local.append((("peak", key), torch.tensor(peak, dtype=torch.int64)))
    out = []
    for part in all_gather_named(local):
        got = {(what, key): t for (what, key), t in part}
        out.append(
            {
                key: (
                    got["seconds", key].tolist(),
                    got["busy", key].tolist(),
                    int(got["peak", key]),
                )
                for key in stats
            }
        )
    return out


def single_process_rate(batch, steps: int) -> float:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return x.shape[0] * steps / (time.perf_counter() - t0)


def bench_cell(schedule: str, m: int, stages: int, batch, args) -> list[dict]:
    """One (schedule, M): ours, torch's (and the control, and in ZB-H1's cells torch's 1F1B),
    timed step by step in alternation."""
    impls = {"ours": build_ours(schedule, m)}
    refused = None
    if schedule in ("1f1b", "zb-h1") and m < stages:
        refused = f"torch's {TORCH_NAMES[schedule]} refuses M={m} < {stages} stages"
    else:
        impls["torch"] = build_torch(schedule, m)
        if args.control == f"{schedule}:{m}":  # the same code twice: the noise floor
            impls["torch (control)"] = build_torch(schedule, m)
    if schedule == "zb-h1" and m >= stages:
        impls["torch 1f1b"] = build_torch("1f1b", m)
    peaks = {}
    for key, step in impls.items():
        step(*batch)  # warm-up (and torch's shape inference)
        peaks[key] = activation_peak(step, batch)
    times = {k: ([], []) for k in impls}  # per step: (seconds, CPU seconds)
    for i in range(args.steps * args.reps):  # alternating: ours, torch, torch, ours...
        for key in list(impls)[:: 1 if i % 2 == 0 else -1]:
            seconds, busy = timed_step(impls[key], batch)
            times[key][0].append(seconds)
            times[key][1].append(busy)
    per_stage = gather({k: (*v, peaks[k]) for k, v in times.items()})
    # A step lasts as long as its slowest stage.
    step_times = {
        k: [max(s[k][0][i] for s in per_stage) for i in range(len(v[0]))] for k, v in times.items()
    }
    rows = []
    for key in impls:
        step_s = statistics.median(step_times[key])
        measured_as = "1f1b" if key == "torch 1f1b" else schedule
        row = {
            "schedule": schedule,
            "microbatches": m,
            "impl": key,
            "step_time_s": step_s,
            "samples_per_s": args.batch / step_s,
            "bubble_measured": [
                1 - statistics.fmean(s[key][1]) / statistics.fmean(step_times[key])
                for s in per_stage
            ],
            "bubble_formula": bubble_formula(measured_as, stages, m, CHUNKS),
            "activation_peak_bytes": [s[key][2] for s in per_stage],
        }
        if key == "ours":
            for rival in ("torch", "torch 1f1b"):
                if rival in impls:
                    suffix = "" if rival == "torch" else "_1f1b"
                    ratio = speed_ratio(step_times[key], step_times[rival])
                    row[f"speed_over_torch{suffix}"] = ratio
        elif key == "torch (control)":
            row["speed_over_torch"] = speed_ratio(step_times[key], step_times["torch"])
        rows.append(row)
    if refused:
        rows.append({"schedule": schedule, "microbatches": m, "impl": "torch", "refused": refused})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="shardwise bench pipeline (one rank)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--control", default="1f1b:4", help="SCHEDULE:M timed torch vs torch")
    parser.add_argument("--out")
    args = parser.parse_args()
    rt = sw.init()
    stages = rt.world_size
    batch = _batch(args.batch)
    rows = []
    for schedule in args.schedules.split(","):
        for m in (int(v) for v in args.microbatches.split(",")):
            rows += bench_cell(schedule, m, stages, batch, args)
    single = single_process_rate(batch, args.steps)
    if rt.is_main:
        result = {
            "bench": "pipeline",
            "model": "gpt",
            "stages": stages,
            "batch": args.batch,
            "threads_per_rank": torch.get_num_threads(),
            "single_process_samples_per_s": single,
            "rows": rows,
            "checks": checks(rows),
        }
        print_table(result)
        emit(result, args.out)
    sw.shutdown()


def checks(rows: list[dict]) -> dict:
    """The issue's claims, evaluated on this run's numbers."""
    by = {(r["schedule"], r["microbatches"], r["impl"]): r for r in rows if "refused" not in r}
    out = {}
    control = next((r["speed_over_torch"] for r in rows if r["impl"] == "torch (control)"), None)
    if control:
        out["control_torch_over_torch"] = control[0]
        out["control_ci95"] = f"{control[1]:.3f}-{control[2]:.3f}"
    for (schedule, m, impl), r in by.items():
        if impl != "ours":
            continue
        rival = by.get((schedule, m, "torch"))
        if rival:
            ratio, low, high = r["speed_over_torch"]
            out[f"{schedule}_m{m}_speed_ours_over_torch"] = ratio
            out[f"{schedule}_m{m}_speed_ci95"] = f"{low:.3f}-{high:.3f}"
            within_noise = control is not None and ratio >= min(control[1], 1 / control[2])
            out[f"{schedule}_m{m}_ours_not_slower"] = high >= 1.0 or within_noise
            out[f"{schedule}_m{m}_activations_ours_le_torch"] = all(
                a <= b * 1.02
                for a, b in zip(
                    r["activation_peak_bytes"], rival["activation_peak_bytes"], strict=True
                )
            )
        if "speed_over_torch_1f1b" in r:  # the acceptance: >= 1.08x torch's 1F1B at M = 4
            ratio, low, high = r["speed_over_torch_1f1b"]
            out[f"zb-h1_m{m}_speed_ours_over_torch_1f1b"] = ratio
            out[f"zb-h1_m{m}_speed_over_torch_1f1b_ci95"] = f"{low:.3f}-{high:.3f}"
            if m == 4:
                out["zb-h1_m4_at_least_1.08x_torch_1f1b"] = ratio >= 1.08
        gpipe = by.get(("gpipe", m, "ours"))
        if schedule == "1f1b" and m >= 4 and gpipe:
            out[f"m{m}_1f1b_peak_below_gpipe"] = max(r["activation_peak_bytes"]) < max(
                gpipe["activation_peak_bytes"]
            )
    return out


def speed_cell(row: dict, key: str = "speed_over_torch") -> str:
    if key not in row:
        return ""
    ratio, low, high = row[key]
    return f"{ratio:.3f} ({low:.3f}-{high:.3f})"


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"pipeline, tiny GPT, {result['stages']} stages, global batch "
        f"{result['batch']}; single process "
        f"{result['single_process_samples_per_s']:.1f} samples/s"
    )
    for col in (
        "schedule",
        "M",
        "impl",
        "step ms",
        "samples/s",
        "bubble (per stage)",
        "formula",
        "act. peak MiB (per stage)",
        "ours/torch speed (95% CI)",
        "ours/torch 1F1B",
    ):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        if "refused" in r:
            t.add_row(
                r["schedule"], str(r["microbatches"]), r["impl"], "-", "-", r["refused"], *[""] * 4
            )
            continue
        t.add_row(
            r["schedule"],
            str(r["microbatches"]),
            r["impl"],
            f"{1000 * r['step_time_s']:.0f}",
            f"{r['samples_per_s']:.1f}",
            " / ".join(f"{b:.2f}" for b in r["bubble_measured"]),
            f"{r['bubble_formula']:.2f}",
            " / ".join(f"{a / 2**20:.1f}" for a in r["activation_peak_bytes"]),
            speed_cell(r),
            speed_cell(r, "speed_over_torch_1f1b"),
        )
    Console(width=170).print(t)
    for k, v in result["checks"].items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")


if __name__ == "__main__":
    main()
