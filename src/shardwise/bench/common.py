"""What every benchmark shares: the workloads, interleaved timing and state accounting."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.distributed import boot
from shardwise.nn.models import MLP, TinyGPT, lm_loss
from shardwise.observe.memory import model_state_bytes

WARMUP_STEPS = 3
VERBOSE = bool(int(os.environ.get("SHARDWISE_BENCH_VERBOSE", "0")))
GPT_VOCAB = 65  # tiny-shakespeare-sized vocabulary: ~3.3M parameters


def make_workload(name: str, rank: int):
    """Model factory, one batch for this rank, and the loss (the issue's benchmark jobs)."""
    g = torch.Generator().manual_seed(1234 + rank)
    if name == "mlp":  # 784-2048-2048-10, 5.8M parameters, batch 64 per rank
        x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
        return (lambda: MLP([784, 2048, 2048, 10])), (x, y), F.cross_entropy
    if name == "gpt":  # 4 layers, d_model 256, seq 128, batch 8 per rank
        tokens = torch.randint(0, GPT_VOCAB, (8, 129), generator=g)
        model = lambda: TinyGPT(GPT_VOCAB, seq_len=128, d_model=256, n_layer=4, n_head=4)  # noqa: E731
        return model, (tokens[:, :-1], tokens[:, 1:]), lm_loss
    raise ValueError(f"unknown benchmark model {name!r}; choose mlp or gpt")


def gpt_model() -> TinyGPT:
    """The benchmarks' tiny GPT (4 blocks, d_model 256, seq 128), the same weights every call."""
    torch.manual_seed(0)
    return TinyGPT(GPT_VOCAB, seq_len=128, d_model=256, n_layer=4, n_head=4)


def gpt_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` sequences of 128 tokens and their next-token targets, the same every call."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, GPT_VOCAB, (size, 129), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def backward(opt, loss: torch.Tensor) -> None:
    """`loss.backward()`, or the engine's own backward where a rival needs it (DeepSpeed)."""
    if hasattr(opt, "backward"):
        opt.backward(loss)
    else:
        loss.backward()


def train_step(model, opt, batch, loss_fn) -> Callable[[], None]:
    """One training step of `model` on `batch`, as a call: forward, backward, step."""
    x, y = batch

    def step() -> None:
        backward(opt, loss_fn(model(x), y))
        opt.step()
        opt.zero_grad()

    return step


def timed(step: Callable[[], None], steps: int) -> float:
    """Seconds per call of `step` on the slowest rank (the ranks start together)."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def interleaved_times(
    variants: dict[str, Callable[[], None]],
    steps: int,
    reps: int,
    each_step: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Warm every variant up, then time them in `reps` rounds of `steps` steps each: one step of
    every variant in turn, in an order shuffled afresh each time (the same on every rank), each
    after a barrier that is not timed. Returns each round's seconds per step by variant: its
    mean step on each rank, the slowest rank's. `each_step`: also every step's seconds on this
    rank, by variant, in the order run (step s of round r at `r * steps + s`).

    Step by step, not a block of steps per variant: this machine's speed drifts within seconds,
    and a round's variants then share its every second (the GPT's DDP step over its floor
    ranged 1.015-1.058 over 15 rounds so, 0.929-1.105 in blocks of 10 steps). Shuffled, not
    rotated: a step pays for what ran just before it (DDP's MLP step took 2-3 ms longer after
    23 MB of gloo traffic than after nothing), and in a fixed cycle each variant would always
    follow the same one.
    """
    for step in variants.values():
        timed(step, WARMUP_STEPS)
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(reps):
        spent = dict.fromkeys(names, 0.0)
        for s in range(steps):
            order = list(names)
            random.Random(f"{rep}:{s}").shuffle(order)
            for key in order:
                dist.barrier()
                t0 = time.perf_counter()
                variants[key]()
                took = time.perf_counter() - t0
                spent[key] += took
                if each_step is not None:
                    each_step.setdefault(key, []).append(took)
        means = torch.tensor([spent[key] / steps for key in names], dtype=torch.float64)
        dist.all_reduce(means, op=dist.ReduceOp.MAX)
        for key, mean in zip(names, means.tolist(), strict=True):
            times[key].append(mean)
    if dist.get_rank() == 0 and VERBOSE:
        print({k: [round(1000 * t, 1) for t in v] for k, v in times.items()}, flush=True)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def emit(line: dict, out: str | None) -> None:
    """A benchmark's one JSON line: printed, and written to `out` where given (with whether
    the ranks ran on cores of their own, `--no-bind-cores`)."""
    line = {**line, "cores_bound": boot.cores_bound()}
    print(json.dumps(line))
    if out:
        Path(out).write_text(json.dumps(line) + "\n")


def state_bytes_after_backward(model, opt, batch, loss_fn) -> dict[str, int]:
    """Model state at its fullest: gradients exist (after backward, before the step)."""
    x, y = batch
    backward(opt, loss_fn(model(x), y))
    report = opt.state_bytes() if hasattr(opt, "state_bytes") else model_state_bytes(model, opt)
    opt.step()
    opt.zero_grad()
    return report
