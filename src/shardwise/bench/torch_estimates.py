"""torch's own estimate of a training step's peak memory: the rival to the planner's.

torch.distributed._tools' `MemTracker` follows every tensor a step makes, by category; run on
fake tensors it estimates without memory or compute, as our planner does. It knows nothing of
sharding, so it answers for the strategies whose ranks each hold the whole model and its
optimizer state (DDP, with or without activation checkpointing), at one rank's batch.

Its step-time rival, `RuntimeEstimator`, has nothing to say on a CPU: its benchmark mode times
kernels with CUDA events and its roofline mode reads the CUDA device's properties.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from shardwise.config import load_config
from shardwise.jobs import OPTIMIZERS, build_job, optimizer_kwargs


def memtracker_peak(config: str, sets: list[str], batch: int) -> int:
    """Peak bytes of one training step (forward, loss, backward, optimizer step) of the model
    `config` and `sets` describe, on `batch` samples, by torch's MemTracker on fake tensors:
    the model's state included, the batch itself not (as the trainer's own step peak)."""
    cfg = load_config(config, sets)
    job = build_job(
        cfg
    ).materialized()  # (its forwards patched for activation checkpointing where asked)
    fake = FakeTensorMode()
    _make_fake(job.model, fake)
    x, y = (fake.from_tensor(t) for t in job.batch_like()(batch))
    with fake:
        optimizer = OPTIMIZERS[cfg.optim.name](
            job.model.parameters(), **optimizer_kwargs(cfg.optim)
        )
        training_step(job, optimizer, x, y)  # (it makes the optimizer's state: not measured)
        tracker = MemTracker()
        tracker.track_external(job.model, optimizer)
        with tracker:
            training_step(job, optimizer, x, y)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    return peak["Total"]


def _make_fake(model: nn.Module, fake: FakeTensorMode) -> None:
    """The model's parameters and buffers swapped for fake tensors of the same shapes."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(
                    fake.from_tensor(p.detach()), p.requires_grad
                )
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake.from_tensor(b)


def training_step(job, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    job.loss_fn(job.model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
