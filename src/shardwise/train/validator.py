"""The validator: loss and accuracy over a test set, each sample scored exactly once, on any
strategy, from the trainer or a user's loop.

    validator = sw.Validator(test_set, loss_fn, batch_size=256, every=100)
    if validator.due(step):
        scored = validator(model)          # collective: every rank calls it
        print(scored.loss, scored.accuracy)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from shardwise import api, comm
from shardwise.data.datasets import PAD_TARGET
from shardwise.data.sharded_loader import loader as make_loader


class Evaluation(NamedTuple):
    loss: float  # mean over the scored targets
    accuracy: float
    targets: int  # scored: each test sample once (a token per target, for sequences)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, dataset, loss_fn, batch_size: int, everyone: bool = True
) -> Evaluation:
    """Loss and accuracy over the whole of `dataset`, each sample scored exactly once. With
    `everyone`, each rank of the job scores its data shard and the sums are added over the
    world; otherwise this process scores all of it (a parameter-server worker, or the
    supervisor), with no message."""
    shard = api.data_shard(model) if everyone else (1, 0)
    loader = make_loader(dataset, batch_size, shuffle=False, drop_last=False, shard=shard)
    loss_fn = api.parallel_loss(model, loss_fn)
    device = next(model.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    was_training = model.training
    model.eval()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        if loader.last_repeats:  # a last batch smaller than the ranks wrapped around: every
            y = y.clone()  # rank still runs the forward (ZeRO-3 gathers in it), scoring none
            y[y.shape[0] - loader.last_repeats :] = PAD_TARGET
        logits = model(x)
        count = (y != PAD_TARGET).sum().item()  # targets that count: padding's do not
        if count:
            sums[0] += loss_fn(logits, y).item() * count
        sums[1] += (api.predict(model, logits) == y).sum().item()
        sums[2] += count
    if everyone:
        # Ranks that split one model scored the same samples: every sample counts as often
        # as the others, so the world-wide sums still give the mean.
        comm.all_reduce(sums)
    model.train(was_training)
    copies = dist.get_world_size() // shard[0] if everyone else 1  # ranks scoring each sample
    return Evaluation(
        (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item(), round(sums[2].item() / copies)
    )


class Validator:
    """Evaluation of a model on `dataset` every `every` steps (0: only when asked)."""

    def __init__(self, dataset, loss_fn, batch_size: int, every: int = 0) -> None:
        if batch_size < 1 or every < 0:
            raise ValueError(f"batch_size must be >= 1 and every >= 0: {batch_size}, {every}")
        self.dataset, self.loss_fn = dataset, loss_fn
        self.batch_size, self.every = batch_size, every

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def __call__(self, model: torch.nn.Module, everyone: bool = True) -> Evaluation:
        return evaluate(model, self.dataset, self.loss_fn, self.batch_size, everyone)
