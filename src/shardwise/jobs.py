"""Turn a `Config` into the pieces of a job: model, data splits, loss, optimizer, schedule.

A model is a built-in one (`model.name`), the user's (`model.factory`: `module:function`), or a
Hugging Face one (`model.hf_config`, `model.hf_pretrained`); the data a built-in dataset, the
user's (`data.factory`) or a token file (`data.tokens`). Samples are (input, target) pairs, or
dicts of tensors, which the model takes as keyword arguments (`nn/dict_batches.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import user_code
from shardwise.config import Config
from shardwise.data import datasets
from shardwise.data.augment import Augmented, shift_pixels
from shardwise.data.token_file import TokenWindows, token_splits
from shardwise.job_sections import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    resolve_data_path,
)
from shardwise.nn import dict_batches, hf_loading
from shardwise.nn.dict_batches import LABELS
from shardwise.nn.meta_init import ParameterSource, materialize
from shardwise.nn.models import MLP, ConvNet, TinyGPT, lm_loss
from shardwise.nn.recompute import checkpoint_activations
from shardwise.nn.schedules import Schedule, scaled_lr
from shardwise.optim import LAMB, LARS

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "lars": LARS,
    "lamb": LAMB,
}


@dataclass
class Job:
    model: nn.Module
    splits: datasets.Splits
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    # The loss is a mean per target token over padded sequences of unequal real length: ranks
    # are weighed by their real tokens, not their rows.
    per_token: bool = False
    # Samples are dicts of tensors (the model is called as model(**batch)). With `labels_apart`
    # (a loss of the user's), their labels are the loss's target and the model gets the rest;
    # otherwise the model gets them all and computes its own loss.
    dict_batches: bool = False
    labels_apart: bool = False
    # Where the model's parameter values are when it was built on the meta device (a Hugging
    # Face folder, `model.hf_pretrained`): each rank's strategy reads only its own part.
    source: ParameterSource | None = None

    def materialized(self) -> Job:
        """The job with every parameter read whole (for what keeps the whole model anyway)."""
        if self.source is not None:
            materialize(self.model, self.source, torch.device("cpu"))
        return dataclasses.replace(self, source=None)

    def inputs_targets(self, batch, device: torch.device | str | None = None):
        """A collated batch as (what the model is called with, the targets), on `device`."""
        if not self.dict_batches:
            x, y = batch
            return (x, y) if device is None else (x.to(device), y.to(device))
        inputs = {k: v if device is None else v.to(device) for k, v in batch.items()}
        return inputs, (inputs.pop(LABELS) if self.labels_apart else inputs[LABELS])

    def batch_like(self) -> Callable[[int], tuple[Any, torch.Tensor]]:
        """Makes batches of n samples shaped as the training data's, for tracing (zeros:
        valid token ids and class labels), inside a fake mode or out."""
        sample = self.splits.train[0]
        if not self.dict_batches:
            sample = {0: sample[0], 1: sample[1]}
        like = {k: (v.shape, v.dtype) for k, v in map(_as_tensor, sample.items())}
        made = lambda n: {k: torch.zeros((n, *s), dtype=t) for k, (s, t) in like.items()}  # noqa: E731
        if not self.dict_batches:
            return lambda n: tuple(made(n).values())
        return lambda n: self.inputs_targets(made(n))


def _as_tensor(item: tuple[Any, Any]) -> tuple[Any, torch.Tensor]:
    return item[0], torch.as_tensor(item[1])  # (a class label may be a plain int)


def build_splits(cfg: Config, run_text: str | None = None) -> datasets.Splits:
    """The data `data` names, split into training and test data; the training data augmented
    where `data.augment` says. `run_text`: a character model's text, where `data` is a later
    stage's (`run_text_of`)."""
    splits = _splits(cfg, run_text)
    data = cfg.data
    if data.augment is None:
        return splits
    # ('shift': the config allows it on the digits only)
    augment = shift_pixels(8) if data.augment == "shift" else user_code.load(data.augment)
    train = Augmented(splits.train, augment, cfg.train.seed, data.augment_repeats)
    return dataclasses.replace(splits, train=train)


def run_text_of(data: DataConfig) -> str | None:
    """The text whose characters a run's character model reads (its data.path's), or None."""
    if data.dataset in ("text", "verses"):
        return datasets.read_text_file(resolve_data_path(data.path))
    return None


def _splits(cfg: Config, run_text: str | None) -> datasets.Splits:
    data = cfg.data
    if data.factory is not None:
        return _user_splits(data)
    splits = _builtin_splits(cfg, run_text)
    if len(splits.test) == 0:  # (evaluated, it reports NaN: a run that looks fine)
        raise ValueError(
            f"data.test_fraction {data.test_fraction} holds out no evaluation sample of this "
            "data: give a larger one"
        )
    return splits


def _builtin_splits(cfg: Config, run_text: str | None) -> datasets.Splits:
    data = cfg.data
    if data.tokens is not None:
        hf = cfg.model.hf_config is not None or cfg.model.hf_pretrained is not None
        as_dicts = data.windows == "dicts" or (data.windows == "auto" and hf)
        eval_path = resolve_data_path(data.eval_tokens) if data.eval_tokens else None
        return token_splits(
            *(resolve_data_path(data.tokens), data.dtype, data.seq_len, data.test_fraction),
            eval_path=eval_path,
            as_dicts=as_dicts,
            vocab_size=data.vocab_size or 0,
        )
    if data.dataset == "digits":
        return datasets.digits(data.test_fraction, seed=cfg.train.seed)
    path = resolve_data_path(data.path)
    if data.dataset == "verses":
        seed = cfg.train.seed
        return datasets.verses(path, data.seq_len, data.test_fraction, data.packing, seed, run_text)
    return datasets.text(path, data.seq_len, data.test_fraction, run_text)


def _user_splits(data: DataConfig) -> datasets.Splits:
    """`data.factory(**data.args)`: (train, eval), or {"train": ..., "eval": ...}."""
    made = user_code.call(data.factory, data.args, "data.factory")
    if isinstance(made, Mapping) and {"train", "eval"} <= made.keys():
        made = (made["train"], made["eval"])
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ValueError(
            f"data.factory {data.factory}: returned a {type(made).__name__}, not a pair "
            "(train, eval) of datasets or a dict with keys 'train' and 'eval'"
        )
    for split, dataset in zip(("train", "eval"), made, strict=True):
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ValueError(
                f"data.factory {data.factory}: its {split} data is a {type(dataset).__name__}, "
                "not a map-style dataset (__getitem__ and __len__)"
            )
        if len(dataset) == 0:
            raise ValueError(f"data.factory {data.factory}: its {split} data is empty")
        _check_sample(dataset[0], f"data.factory {data.factory}: {split} sample 0")
    return datasets.Splits(made[0], made[1], num_classes=0, input_dim=0)


def _check_sample(sample: Any, what: str) -> None:
    if isinstance(sample, Mapping):
        if LABELS not in sample:
            raise ValueError(f"{what} is a dict without a {LABELS!r} entry (the targets)")
        if not all(isinstance(v, torch.Tensor) for v in sample.values()):
            raise ValueError(f"{what}: every entry of a dict sample must be a tensor")
    elif not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise ValueError(f"{what} is a {type(sample).__name__}: (input, target) or a dict")


def build_job(cfg: Config, device: torch.device | str | None = None) -> Job:
    """Data first (the model's sizes depend on it), then a model seeded by `train.seed`, its
    activations recomputed where `strategy.activation_checkpointing` says. With `device`, the
    model is made there: "meta" gives its shapes without storage (what the planner prices)."""
    splits = build_splits(cfg)
    torch.manual_seed(cfg.train.seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        job = _model_job(cfg, splits) if cfg.model.name else _user_job(cfg, splits, device)
    checkpoint_activations(job.model, cfg.strategy.activation_checkpointing)
    return job


def _user_job(cfg: Config, splits: datasets.Splits, device) -> Job:
    """The user's or a Hugging Face model, and its loss: `model.loss`; for dict samples the
    model's own; else cross-entropy over the output's last dimension (or its `.logits`)."""
    (model, source), m = _user_model(cfg.model, device), cfg.model
    _fit_windows(model, splits)
    dicts = isinstance(splits.train[0], Mapping)
    if dicts:
        dict_batches.call_with_keywords(model)
    if m.loss is not None:
        loss = user_code.load(m.loss)
    else:
        loss = dict_batches.output_loss if dicts else logits_loss
    apart = dicts and m.loss is not None
    return Job(model, splits, loss, dict_batches=dicts, labels_apart=apart, source=source)


def _fit_windows(model: nn.Module, splits: datasets.Splits) -> None:
    """A token file fed to a Hugging Face model: each window's ids checked against the config's
    vocab_size as it is read, and seq_len against a GPT-2's learned positions (`n_positions`),
    each in one line, as the built-in GPT's are (an embedding's IndexError of 80-170 lines,
    before). (A rotary model's max_position_embeddings is no hard bound: not checked.)"""
    config = getattr(model, "config", None)
    windows = [s for s in (splits.train, splits.test) if isinstance(s, TokenWindows)]
    if config is None or not windows:
        return
    vocab = getattr(config, "vocab_size", None)
    for w in windows:
        if not w.vocab_size and isinstance(vocab, int) and vocab > 0:
            w.vocab_size, w.vocab_named = vocab, "the model's vocab_size"
    positions = getattr(config, "n_positions", None)
    if isinstance(positions, int) and windows[0].seq_len > positions:
        raise ValueError(
            f"data.seq_len {windows[0].seq_len} is past the model's {positions} positions "
            "(its config's n_positions)"
        )


def _user_model(m: ModelConfig, device) -> tuple[nn.Module, ParameterSource | None]:
    """The model, and where its values are if it holds none yet (`hf_pretrained`)."""
    if m.hf_pretrained is not None and str(device) != "meta":
        return hf_loading.load_pretrained(m.hf_pretrained)
    return _built_model(m), None


def _built_model(m: ModelConfig) -> nn.Module:
    if m.factory is not None:
        model = user_code.call(m.factory, m.args, "model.factory")
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"model.factory {m.factory}: returned a {type(model).__name__}, not a "
                "torch.nn.Module"
            )
        return model
    # (hf_pretrained for the planner: its shapes only, made on the meta device)
    return hf_loading.from_config(m.hf_config or m.hf_pretrained)


def logits_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the output (or its `.logits`) over its last dimension, -100 ignored:
    a classifier's (rows of classes) or a language model's (a row per token)."""
    return lm_loss(dict_batches.logits_of(output), targets)


def _model_job(cfg: Config, splits: datasets.Splits) -> Job:
    m = cfg.model
    if m.name == "gpt":  # (the config checked the model against the data: `Config`)
        if isinstance(splits.train[0], Mapping):
            raise ValueError("model 'gpt' takes (input, target) windows: data.windows 'pairs'")
        # Packed rows need the document mask; a row of one document is plain causal attention.
        bos = splits.bos_token if cfg.data.packing == "pack" else None
        model = TinyGPT(
            *(splits.num_classes, cfg.data.seq_len, m.d_model, m.n_layer, m.n_head), bos_token=bos
        )
        return Job(model, splits, lm_loss, per_token=cfg.data.dataset == "verses")
    if m.name == "cnn":
        model = ConvNet(m.channels, splits.num_classes)
    else:
        model = MLP([splits.input_dim, *m.hidden, splits.num_classes])
    return Job(model, splits, F.cross_entropy)


def optimizer_kwargs(cfg: OptimConfig) -> dict:
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.name in ("sgd", "lars"):
        kwargs["momentum"] = cfg.momentum
    if cfg.name == "lars":
        kwargs["eta"] = cfg.eta
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
