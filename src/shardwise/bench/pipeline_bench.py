"""Benchmark: our pipeline schedules against torch.distributed.pipelining, same split, same run.

Tiny GPT (4 blocks, d_model 256, seq 128) in 2 stages ([embedding, block 0, block 1] and
[block 2, block 3, head]), global batch 16, AdamW. For each schedule (GPipe, 1F1B) and number of
micro-batches M in {1, 2, 4, 8}, ours and torch's are timed step by step in alternation (ours
then torch's, then torch's then ours, ...), so that the machine's drift hits both alike and each
pair of neighbouring steps gives one speed ratio. Reported per (schedule, M, implementation) and
per stage:

- step time (median) and samples/s (single-process training of the same batch as the baseline);
- ours over torch's speed: the geometric mean of the paired ratios with its 95% confidence
  interval; and, as a control, torch's schedule against a second copy of itself at one
  (schedule, M) (`--control`): what identical code measures as, i.e. the noise floor (step
  times drift together, so the interval alone is too narrow). "Not slower" holds when ours'
  interval reaches 1 or its ratio is within the control's interval;
- bubble fraction, measured: 1 - (time the stage computes) / (step time), where compute time
  is the sum of its forward and backward passes (module hooks: forward pre/post, backward from
  the output gradient's arrival to the last parameter gradient), the same yardstick for both
  implementations; beside it the formula (S-1)/(M+S-1), which assumes equal stages and free
  messages;
- peak activation memory: the most bytes autograd held for backward at once
  (`observe.memory.ActivationMeter`), which 1F1B bounds by S - stage micro-batches, measured
  in a separate step (its hooks cost time, so timed steps run without them).

torch's 1F1B refuses M < S (reported as such); its schedules divide gradients by M, so the loss
function returns micro-batch means there, as ours does internally.

Run: shardwise bench pipeline    (2 ranks)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.bench.common import gpt_batch, gpt_model
from shardwise.nn.models import lm_loss
from shardwise.observe.memory import ActivationMeter
from shardwise.strategies.pipeline_stages import PipelineStage, pipeline_layers

SPLIT = 3  # stage 1 starts at layer 3 (block 2)


_model, _batch = gpt_model, gpt_batch


class BusyTimer:
    """Seconds a stage module spends computing: forward passes plus backward passes."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.busy = 0.0
        self._start: float | None = None
        self._bwd_start: float | None = None
        self._bwd_end: float | None = None
        module.register_forward_pre_hook(self._fwd_pre)
        module.register_forward_hook(self._fwd_post)
        module.register_full_backward_pre_hook(self._bwd_pre)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._grad_done)

    def _fwd_pre(self, *_):
        self._start = time.perf_counter()

    def _fwd_post(self, *_):
        self.busy += time.perf_counter() - self._start

    def _bwd_pre(self, *_):
        self.flush()
        self._bwd_start = time.perf_counter()

    def _grad_done(self, _p):
        self._bwd_end = time.perf_counter()

    def flush(self) -> None:
        """Close the backward in progress (call at the end of a step)."""
        if self._bwd_start is not None and self._bwd_end is not None:
            self.busy += max(0.0, self._bwd_end - self._bwd_start)
        self._bwd_start = self._bwd_end = None

    def take(self) -> float:
        self.flush()
        busy, self.busy = self.busy, 0.0
        return busy


def build_ours(schedule: str, m: int):
    strategy = sw.Pipeline(stages=2, schedule=schedule, microbatches=m, split=[SPLIT])
    model, opt = sw.prepare(_model(), strategy, lr=1e-4)
    timer = BusyTimer(model.stage)

    def step(x, y) -> None:
        sw.train_step(model, x, y, lm_loss)
        opt.step()
        opt.zero_grad()

    return step, timer


def build_torch(schedule: str, m: int):
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    layers = pipeline_layers(_model())
    module = PipelineStage(layers[:SPLIT] if rank == 0 else layers[SPLIT:])
    stage = TorchStage(module, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    timer = BusyTimer(module)

    def step(x, y) -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()

    return step, timer


def activation_peak(step, batch) -> int:
    """The most activation bytes this rank holds at once during one step."""
    meter = ActivationMeter()
    with meter:
        step(*batch)
    return meter.peak


def timed_step(step, timer: BusyTimer, batch) -> tuple[float, float]:
    """(seconds, busy seconds) of one step on this rank, starting together with the others."""
    dist.barrier()
    t0 = time.perf_counter()
    step(*batch)
    return time.perf_counter() - t0, timer.take()


def speed_ratio(ours: list[float], rival: list[float]) -> tuple[float, float, float]:
    """Ours over the rival's speed from paired step times: geometric mean and 95% interval."""
    logs = [math.log(r / o) for o, r in zip(ours, rival, strict=True)]
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def gather(stats: dict) -> list[dict]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, stats)
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
    """One (schedule, M): ours, torch's (and the control), timed step by step in alternation."""
    impls = {"ours": build_ours(schedule, m)}
    if schedule == "1f1b" and m < stages:
        refused = f"torch's 1F1B refuses M={m} < {stages} stages"
    else:
        impls["torch"], refused = build_torch(schedule, m), None
        if args.control == f"{schedule}:{m}":  # the same code twice: the noise floor
            impls["torch (control)"] = build_torch(schedule, m)
    peaks = {}
    for key, (step, timer) in impls.items():
        step(*batch)  # warm-up (and torch's shape inference)
        peaks[key] = activation_peak(step, batch)
        timer.take()
    times = {k: ([], []) for k in impls}  # per step: (seconds, busy seconds)
    for i in range(args.steps * args.reps):  # alternating: ours, torch, torch, ours...
        for key in list(impls)[:: 1 if i % 2 == 0 else -1]:
            seconds, busy = timed_step(*impls[key], batch)
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
            "bubble_formula": (stages - 1) / (m + stages - 1),
            "activation_peak_bytes": [s[key][2] for s in per_stage],
        }
        if key != "torch" and "torch" in impls:
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
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--control", default="1f1b:4", help="SCHEDULE:M timed torch vs torch")
    parser.add_argument("--out")
    args = parser.parse_args()
    rt = sw.init()
    stages = rt.world_size
    batch = _batch(args.batch)
    rows = []
    for schedule in ("gpipe", "1f1b"):
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
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result) + "\n")
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
        gpipe = by.get(("gpipe", m, "ours"))
        if schedule == "1f1b" and m >= 4 and gpipe:
            out[f"m{m}_1f1b_peak_below_gpipe"] = max(r["activation_peak_bytes"]) < max(
                gpipe["activation_peak_bytes"]
            )
    return out


def speed_cell(row: dict) -> str:
    if "speed_over_torch" not in row:
        return ""
    ratio, low, high = row["speed_over_torch"]
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
    ):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        if "refused" in r:
            t.add_row(
                r["schedule"], str(r["microbatches"]), r["impl"], "-", "-", r["refused"], "", "", ""
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
        )
    Console(width=140).print(t)
    for k, v in result["checks"].items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")


if __name__ == "__main__":
    main()
