"""Single-process training on the global batches a run's sample ledger says its ranks used."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import default_collate

from shardwise.config import load_config
from shardwise.data import ledger
from shardwise.jobs import OPTIMIZERS, build_job, optimizer_kwargs, schedule


def replay_ledger(run_dir: Path, sets: list[str], steps: int) -> dict[str, torch.Tensor]:
    """Plain training of the digits job configured by `sets`: each step's batch is every
    rank's indices of that step in the ledger, in rank order; the final state dict."""
    cfg = load_config("digits", sets)
    job = build_job(cfg)
    model = job.model
    opt = OPTIMIZERS[cfg.optim.name](model.parameters(), **optimizer_kwargs(cfg.optim))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg.optim, steps))
    by_step: dict[int, dict[int, list[int]]] = {}
    for rank, lines in ledger.read(run_dir).items():
        for line in lines:
            by_step.setdefault(line["step"], {})[rank] = line["indices"]
    assert sorted(by_step) == list(range(1, steps + 1))
    data = job.splits.train
    for step in range(1, steps + 1):
        indices = [i for rank in sorted(by_step[step]) for i in by_step[step][rank]]
        x, y = default_collate([data[i] for i in indices])
        opt.zero_grad()
        job.loss_fn(model(x), y).backward()
        opt.step()
        scheduler.step()
    return model.state_dict()
