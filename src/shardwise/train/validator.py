"""The validator: loss and accuracy over a test set, each sample scored exactly once, on any
strategy, from the trainer or a user's loop.

    validator = sw.Validator(test_set, loss_fn, batch_size=256, every=100)
    if validator.due(step):
        scored = validator(model)          # collective: every rank calls it
        print(scored.loss, scored.accuracy)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from shardwise import api, comm
from shardwise.data.datasets import PAD_TARGET
from shardwise.data.sharded_loader import loader as make_loader
from shardwise.nn.dict_batches import LABELS, class_logits
from shardwise.observe.memory import model_device


class Evaluation(NamedTuple):
    loss: float  # mean over the scored targets
    accuracy: float | None  # None: the outputs are not a classifier's (`dict_batches`)
    targets: int  # scored: each test sample once (a token per target, for sequences)


def pairs(batch) -> tuple[Any, torch.Tensor]:
    """An (inputs, targets) batch as it is."""
    x, y = batch
    return x, y


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset,
    loss_fn,
    batch_size: int,
    everyone: bool = True,
    inputs_targets: Callable = pairs,
) -> Evaluation:
    """Loss and accuracy over the whole of `dataset`, each sample scored exactly once. With
    `everyone`, each rank of the job scores its data shard and the sums are added over the
    world; otherwise this process scores all of it (a parameter-server worker, or the
    supervisor), with no message. `inputs_targets(batch)` splits a batch into what the model
    is called with and the targets (`jobs.Job.inputs_targets` for dict samples)."""
    if len(dataset) == 0:  # (scored, it gave a loss and accuracy of NaN)
        raise ValueError("evaluate: the dataset holds no sample")
    shard = api.data_shard(model) if everyone else (1, 0)
    loader = make_loader(dataset, batch_size, shuffle=False, drop_last=False, shard=shard)
    loss_fn = api.parallel_loss(model, loss_fn)
    device = model_device(model)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    classified = True  # every output a classifier's: accuracy means something
    was_training = model.training
    model.eval()
    # (replicas that drift apart between averagings are scored as the run's model: averaged)
    scoring = getattr(model, "weights_for_evaluation", None) if everyone else None
    with scoring() if scoring is not None else contextlib.nullcontext():
        for batch in loader:
            # A last batch smaller than the ranks wrapped around: every rank still runs the
            # forward (ZeRO-3 gathers in it), scoring none of the repeats.
            x, y = inputs_targets(_unscored(batch, loader.last_repeats))
            x, y = tree_map_only(torch.Tensor, lambda t: t.to(device), (x, y))
            output = model(x)
            count = (y != PAD_TARGET).sum().item()  # targets that count: padding's do not
            if count:
                sums[0] += loss_fn(output, y).item() * count
            logits = output if isinstance(output, torch.Tensor) else class_logits(output, y)
            predicted = None if logits is None else api.predict(model, logits)
            # (not one class per target: a regression's output, which compared, broadcast
            # N x N, or scored its float targets against argmaxes)
            if predicted is None or predicted.shape != y.shape or y.is_floating_point():
                classified = False
            else:
                sums[1] += (predicted == y).sum().item()
            sums[2] += count
    world = dist.get_world_size() if everyone and dist.is_initialized() else 1
    if world > 1:
        # Ranks that split one model scored the same samples: every sample counts as often
        # as the others, so the world-wide sums still give the mean.
        comm.all_reduce(sums)
    model.train(was_training)
    copies = world // shard[0]  # ranks scoring each sample (a plain module: this process)
    accuracy = (sums[1] / sums[2]).item() if classified else None
    return Evaluation((sums[0] / sums[2]).item(), accuracy, round(sums[2].item() / copies))


def _unscored(batch, repeats: int):
    """The batch with the targets of its last `repeats` samples set to padding (a dict
    sample's labels: the model's own loss leaves them out too)."""
    if not repeats:
        return batch
    if isinstance(batch, Mapping):
        labels = batch[LABELS].clone()
        labels[labels.shape[0] - repeats :] = PAD_TARGET
        return {**batch, LABELS: labels}
    x, y = batch
    y = y.clone()
    y[y.shape[0] - repeats :] = PAD_TARGET
    return x, y


class Validator:
    """Evaluation of a model on `dataset` every `every` steps (0: only when asked)."""

    def __init__(
        self, dataset, loss_fn, batch_size: int, every: int = 0, inputs_targets: Callable = pairs
    ) -> None:
        if batch_size < 1 or every < 0:
            raise ValueError(f"batch_size must be >= 1 and every >= 0: {batch_size}, {every}")
        self.dataset, self.loss_fn = dataset, loss_fn
        self.batch_size, self.every = batch_size, every
        self.inputs_targets = inputs_targets

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def __call__(self, model: torch.nn.Module, everyone: bool = True) -> Evaluation:
        return evaluate(
            model, self.dataset, self.loss_fn, self.batch_size, everyone, self.inputs_targets
        )
