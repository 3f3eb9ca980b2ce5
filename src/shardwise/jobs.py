"""Turn a `Config` into the pieces of a job: model, data splits, loss, optimizer, schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config import Config
from shardwise.data import datasets
from shardwise.job_sections import OptimConfig, TrainConfig, resolve_data_path
from shardwise.nn.models import MLP, ConvNet, TinyGPT, lm_loss
from shardwise.nn.recompute import checkpoint_activations
from shardwise.nn.schedules import Schedule, scaled_lr

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


@dataclass
class Job:
    model: nn.Module
    splits: datasets.Splits
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # The loss is a mean per target token over padded sequences of unequal real length: ranks
    # are weighed by their real tokens, not their rows.
    per_token: bool = False

    def batch_like(self) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """Makes batches of n samples shaped as the training data's, for tracing (zeros:
        valid token ids and class labels), inside a fake mode or out."""
        x, y = self.splits.train[0]
        (xs, xt), (ys, yt) = (x.shape, x.dtype), (y.shape, y.dtype)
        return lambda n: (torch.zeros((n, *xs), dtype=xt), torch.zeros((n, *ys), dtype=yt))


def build_splits(cfg: Config) -> datasets.Splits:
    """The dataset named by `data.dataset`, split into training and test data."""
    data = cfg.data
    if data.dataset == "digits":
        return datasets.digits(data.test_fraction, seed=cfg.train.seed)
    path = resolve_data_path(data.path)
    if data.dataset == "verses":
        return datasets.verses(path, data.seq_len, data.test_fraction, data.packing, cfg.train.seed)
    return datasets.text(path, data.seq_len, data.test_fraction)


def build_job(cfg: Config, device: torch.device | str | None = None) -> Job:
    """Data first (the model's sizes depend on it), then a model seeded by `train.seed`, its
    activations recomputed where `strategy.activation_checkpointing` says. With `device`, the
    model is made there: "meta" gives its shapes without storage (what the planner prices)."""
    splits = build_splits(cfg)
    torch.manual_seed(cfg.train.seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        job = _model_job(cfg, splits)
    checkpoint_activations(job.model, cfg.strategy.activation_checkpointing)
    return job


def _model_job(cfg: Config, splits: datasets.Splits) -> Job:
    m = cfg.model
    if m.name == "gpt":
        if cfg.data.dataset == "digits":
            raise ValueError("model 'gpt' needs data.dataset 'text' or 'verses'")
        # Packed rows need the document mask; a row of one document is plain causal attention.
        bos = splits.bos_token if cfg.data.packing == "pack" else None
        model = TinyGPT(
            *(splits.num_classes, cfg.data.seq_len, m.d_model, m.n_layer, m.n_head), bos_token=bos
        )
        return Job(model, splits, lm_loss, per_token=cfg.data.dataset == "verses")
    if cfg.data.dataset != "digits":
        raise ValueError(f"model {m.name!r} needs data.dataset 'digits'")
    if m.name == "cnn":
        model = ConvNet(m.channels, splits.num_classes)
    else:
        model = MLP([splits.input_dim, *m.hidden, splits.num_classes])
    return Job(model, splits, F.cross_entropy)


def optimizer_kwargs(cfg: OptimConfig) -> dict:
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.name == "sgd":
        kwargs["momentum"] = cfg.momentum
    return kwargs


def base_lr(cfg: OptimConfig, batch_size: int, replicas: int) -> float:
    """`optim.lr`, or with `scale_lr: linear` the rate scaled from `base_batch` (default: one
    rank's `batch_size`) to the global batch of `replicas` such batches."""
    if cfg.scale_lr == "none":
        return cfg.lr
    return scaled_lr(cfg.lr, batch_size * replicas, cfg.base_batch or batch_size)


def schedule(cfg: OptimConfig, total_steps: int) -> Schedule:
    """The configured learning-rate multiplier per step (`shardwise.nn.schedules`)."""
    return Schedule(
        cfg.schedule,
        total_steps=total_steps,
        warmup_steps=cfg.warmup_steps,
        step_size=cfg.step_size,
        gamma=cfg.gamma,
        min_ratio=cfg.min_lr_ratio,
    )


def straggler_delay(train: TrainConfig, index: int, ranks: int, step: int) -> float:
    """Seconds to add to step `step` of data-parallel rank (or worker) `index` of `ranks`:
    `train.delay_s[index]`, or, with `delay_rotate`, the delay of rank (index - step) mod N,
    so that every rank takes its turn as the slow one."""
    delays = list(train.delay_s) + [0.0] * max(0, ranks - len(train.delay_s))
    return delays[(index - step) % ranks] if train.delay_rotate else delays[index]
