"""Activation checkpointing: the same training as without it, in less activation memory.

Under DDP, ZeRO-3 and the pipeline (2 ranks), the tiny GPT trained with its blocks recomputed
ends at the same parameters (max abs diff <= 1e-6), and the peak of the bytes a step's forward
and backward allocate and hold, seen by a dispatch mode that watches every operator's outputs
(recomputed ones included), is lower; so is the ActivationMeter's peak of saved activations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardwise as sw
from shardwise.config import ConfigError, load_config
from shardwise.jobs import build_job
from shardwise.nn.models import MLP, TinyGPT, lm_loss
from shardwise.nn.recompute import checkpoint_activations, default_regions
from shardwise.observe.memory import ActivationMeter
from spawn import run

VOCAB, SEQ, BATCH, STEPS = 13, 32, 8, 4


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=4, n_head=4)


def _batch(step: int):
    g = torch.Generator().manual_seed(40 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _strategy(name: str) -> sw.Strategy:
    return {
        "ddp": sw.DDP(),
        "zero3": sw.ZeRO(stage=3, keep_gathered_mb=0),  # (units gathered again to recompute)
        "pipeline": sw.Pipeline(stages=2, microbatches=4, schedule="1f1b"),
    }[name]


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created inside it that are still alive, and their peak: every
    operator's outputs, recomputed ones included (what the ActivationMeter cannot see)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (storage := t.untyped_storage()).data_ptr():
                self.live.setdefault(
                    storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes())
                )
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _train(name: str, recompute: bool) -> tuple[dict, int, int]:
    """Final parameters; the peak bytes allocated in the last step's forward and backward and
    still alive; the ActivationMeter's peak of that step."""
    gpt = _gpt()
    if recompute:
        checkpoint_activations(gpt, True)
    model, opt = sw.prepare(gpt, _strategy(name), lr=1e-3)
    replicas, index = sw.data_shard(model)
    share = BATCH // replicas
    for step in range(STEPS):
        x, y = (t[index * share : (index + 1) * share] for t in _batch(step))
        if step < STEPS - 1:
            sw.train_step(model, x, y, lm_loss)
        else:
            tracker, meter = LiveBytes(), ActivationMeter()
            with tracker, meter:
                sw.train_step(model, x, y, lm_loss)
        opt.step()
        opt.zero_grad()
    state = sw.full_state_dict(model)
    model.close()
    return state, tracker.peak, meter.peak


def _compare(name: str) -> tuple[float, tuple[int, int], tuple[int, int]]:
    plain, plain_peak, plain_saved = _train(name, recompute=False)
    ckpt, ckpt_peak, ckpt_saved = _train(name, recompute=True)
    diff = max((plain[k] - ckpt[k]).abs().max().item() for k in plain)
    return diff, (plain_peak, ckpt_peak), (plain_saved, ckpt_saved)


@pytest.mark.parametrize("name", ["ddp", "zero3", "pipeline"])
def test_recompute_trains_the_same_in_less_memory(name):
    for rank, (diff, peaks, saved) in enumerate(run(_compare, 2, name, timeout_s=300)):
        assert diff <= 1e-6, (rank, diff)
        assert peaks[1] < 0.8 * peaks[0], (rank, peaks)
        assert saved[1] < 0.6 * saved[0], (rank, saved)


def test_regions_by_default_and_by_pattern_and_bad_patterns():
    assert default_regions(_gpt()) == ["blocks.*"]
    assert default_regions(MLP([4, 8, 2])) == ["0", "1", "2"]
    assert checkpoint_activations(_gpt(), ["blocks.*.mlp"]) == [f"blocks.{i}.mlp" for i in range(4)]
    with pytest.raises(ValueError, match="matches no module"):
        checkpoint_activations(_gpt(), ["layers.*"])
    with pytest.raises(ValueError, match="nested"):
        checkpoint_activations(_gpt(), ["blocks.0", "blocks.0.attn"])


def test_every_strategy_takes_it_from_the_config():
    for strategy in ("ddp", "zero", "tp", "pp", "local_sgd", "ps"):
        cfg = load_config(
            "tiny_gpt",
            [f"strategy.name={strategy}", "strategy.activation_checkpointing=[blocks.*.mlp]"],
        )
        cfg.strategy.build(2, Path("unused"))  # the option is not the strategy's own
        job = build_job(cfg)
        recomputed = [n for n, m in job.model.named_modules() if hasattr(m.forward, "recomputes")]
        assert recomputed == [f"blocks.{i}.mlp" for i in range(4)], strategy
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config("digits", ["strategy.activation_checkpointing=3"])
