"""The parameter-server tests' small model, their global batches, and single-process training
on those batches: what a PS job that is exact must end with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.nn.models import MLP

BATCH = 4  # per worker
STEPS = 20


def mlp(sizes=(13, 16, 9, 5)) -> MLP:
    """The model, seeded: every rank builds the same one."""
    torch.manual_seed(0)
    return MLP(list(sizes))


def global_batch(step: int, workers: int):
    """Step `step`'s global batch of `workers` x BATCH samples; worker w trains on slice w."""
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(workers * BATCH, 13, generator=g)
    return x, torch.randint(0, 5, (workers * BATCH,), generator=g)


def single_process_weights(
    workers: int, steps: int = STEPS, skips: dict | None = None, schedule=None
) -> dict:
    """Single-process training on the global batches; `skips`: worker -> the steps whose
    slice it left out (a non-finite gradient: the step is the others' mean, or none at all);
    `schedule`: the rate's multiplier by step."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (schedule(step) if schedule else 1.0)
        x, y = global_batch(step, workers)
        kept = [w for w in range(workers) if step not in (skips or {}).get(w, ())]
        if not kept:
            continue
        rows = torch.cat([torch.arange(w * BATCH, (w + 1) * BATCH) for w in kept])
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train_on_slices(model, opt, index: int, workers: int, steps: int = STEPS) -> None:
    """A sync worker's loop: slice `index` of global batch `clock`, until `steps` clocks."""
    client = model.client
    while client.clock < steps:
        x, y = global_batch(client.clock, workers)
        part = slice(index * BATCH, (index + 1) * BATCH)
        F.cross_entropy(model(x[part]), y[part]).backward()
        opt.step()
        opt.zero_grad()
