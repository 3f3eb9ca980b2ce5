"""Benchmark: what each strategy costs at one rank, against plain torch with no wrapper.

A job on one rank (a laptop, one GPU) must pay nothing for being written with shardwise. Each
of our strategies wraps an identical copy of the model and steps through `sw.train_step`
(the loop every strategy shares; a pipeline runs its one stage's schedule, tensor parallel its
one shard); the baseline is the same model and AdamW with `loss.backward()`, no wrapper. All
are timed in one process, step by step (shuffled), `reps` rounds; reported per strategy and model:
step time and its ratio to plain torch (the median of each round's ratio), each round's ratio,
and one JSON line.

Run: shardwise bench overhead --world-size 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.bench.common import emit, interleaved_times, make_workload, medians, train_step
from shardwise.bench.floor import by_rep
from shardwise.nn.models import num_parameters

STRATEGIES = {
    "ddp": lambda: sw.DDP(),
    **{f"zero{s}": (lambda s=s: sw.ZeRO(stage=s)) for s in (1, 2, 3)},
    "local_sgd": lambda: sw.LocalSGD(period=4),
    "gossip": lambda: sw.Gossip(),
    "adaptive": lambda: sw.AdaptiveSync(threshold=0.02),
    "tp": lambda: sw.TensorParallel(),
    "pp": lambda: sw.Pipeline(stages=1, microbatches=1),
}
NEEDS_A_PLAN = {"tp"}  # tensor parallel splits the models that have a plan (the GPT)


def our_step(model, opt, batch, loss_fn):
    """One step through `sw.train_step` (the global batch is this rank's: no collective)."""
    x, y = batch

    def step() -> None:
        sw.train_step(model, x, y, loss_fn, total=x.shape[0])
        opt.step()
        opt.zero_grad()

    return step


def bench_model(name: str, steps: int, reps: int) -> dict:
    factory, batch, loss_fn = make_workload(name, 0)
    torch.manual_seed(0)
    plain = factory()
    steps_of = {"torch": train_step(plain, torch.optim.AdamW(plain.parameters()), batch, loss_fn)}
    wrapped = {}
    for key, strategy in STRATEGIES.items():
        if key in NEEDS_A_PLAN and name != "gpt":
            continue
        torch.manual_seed(0)
        wrapped[key] = sw.prepare(factory(), strategy(), optimizer=torch.optim.AdamW)
        steps_of[key] = our_step(*wrapped[key], batch, loss_fn)
    times = interleaved_times(steps_of, steps, reps)
    step_times = medians(times)
    result = {"model": name, "params": num_parameters(plain), "batch": batch[0].shape[0]}
    result["torch"] = {"step_time_s": step_times["torch"]}
    for key in wrapped:
        ratios = by_rep(times, key, "torch")
        result[key] = {
            "step_time_s": step_times[key],
            "over_torch": statistics.median(ratios),
            "over_torch_by_rep": ratios,
        }
    for model, _ in wrapped.values():
        model.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="shardwise bench overhead --world-size 1")
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    sw.init()
    if dist.get_world_size() != 1:
        raise SystemExit(
            "shardwise: bench overhead compares strategies at one rank: --world-size 1"
        )
    results = [bench_model(m.strip(), args.steps, args.reps) for m in args.models.split(",")]
    for result in results:
        base = result["torch"]["step_time_s"]
        print(f"shardwise: {result['model']}: plain torch {1000 * base:.1f} ms/step")
        for key, v in result.items():
            if isinstance(v, dict) and "over_torch" in v:
                rounds = " ".join(f"{r:.3f}" for r in v["over_torch_by_rep"])
                print(
                    f"  {key:>10}: {1000 * v['step_time_s']:7.1f} ms  "
                    f"{v['over_torch']:.3f}x plain torch  (by round: {rounds})"
                )
    line = {"bench": "overhead", "world_size": 1, "threads": torch.get_num_threads()}
    line["results"] = results
    emit(line, args.out)
    sw.shutdown()


if __name__ == "__main__":
    main()
