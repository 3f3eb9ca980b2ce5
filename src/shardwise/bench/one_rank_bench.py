"""Benchmark: what each strategy costs at one rank, against plain torch with no wrapper.

A job on one rank (a laptop, one GPU) must pay nothing for being written with shardwise. Each
of our strategies wraps an identical copy of the model and steps through `sw.train_step`
(the loop every strategy shares; a pipeline runs its one stage's schedule, tensor parallel its
one shard); the baseline is the same model and AdamW with `loss.backward()`, no wrapper. All
are timed in one process, step by step (shuffled), `reps` rounds; reported per strategy and model:
step time, its ratio to plain torch and each round's, and one JSON line. The ratio is the
median over every step of the strategy's step over plain torch's of the same turn (each pair
ran within a second of each other): at one rank each strategy is plain training, and a round's
ratio of mean steps moved by 5-8 % round to round on this 2-core VM (0.92-1.05 for DDP, which
adds nothing there), a step that stalled deciding it. The ratio of the rounds' means is
reported beside it (`over_torch_of_means`).

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
    each_step: dict[str, list[float]] = {}
    times = interleaved_times(steps_of, steps, reps, each_step)
    step_times = medians(times)
    result = {"model": name, "params": num_parameters(plain), "batch": batch[0].shape[0]}
    result["torch"] = {"step_time_s": step_times["torch"]}
    for key in wrapped:
        paired = [a / b for a, b in zip(each_step[key], each_step["torch"], strict=True)]
        by_round = [paired[r * steps : (r + 1) * steps] for r in range(reps)]
        result[key] = {
            "step_time_s": step_times[key],
            "over_torch": statistics.median(paired),
            "over_torch_by_rep": [statistics.median(r) for r in by_round],
            "over_torch_of_means": statistics.median(by_rep(times, key, "torch")),
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
                    f"{v['over_torch']:.3f}x plain torch, step by step (by round: {rounds}; "
                    f"of the rounds' means {v['over_torch_of_means']:.3f}x)"
                )
    line = {"bench": "overhead", "world_size": 1, "threads": torch.get_num_threads()}
    line["results"] = results
    emit(line, args.out)
    sw.shutdown()


if __name__ == "__main__":
    main()
