"""Activation checkpointing: the same training as without it, in less activation memory.

Under DDP, ZeRO-3 and the pipeline (2 ranks), the tiny GPT trained with its blocks recomputed
ends at the same parameters (max abs diff <= 1e-6), and the peak of the bytes a step's forward
and backward allocate and hold, seen by a dispatch mode that watches every operator's outputs
(recomputed ones included), is lower; so is the ActivationMeter's peak of saved activations.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

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
        "ddp-buckets": sw.DDP(bucket_mb=0.01),  # (a bucket a block or so)
        "zero2": sw.ZeRO(stage=2, bucket_mb=0.01),
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


def _reentrant(gpt: TinyGPT) -> TinyGPT:
    """`gpt` with the user's own reentrant checkpoints (torch's `use_reentrant=True`, which runs
    each region's backward as a backward of its own, nested in the outer one): each block and
    the head (whose gradient backward makes first: inside a nested backward)."""
    for module in [*gpt.blocks, gpt.head]:
        module.forward = partial(checkpoint, module.forward, use_reentrant=True)
    return gpt


class _AllInOneCheckpoint(torch.nn.Module):
    """Every parameter used inside one reentrant checkpoint, and one not used at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x.requires_grad_(), use_reentrant=True)


class _TiedAcrossACheckpoint(torch.nn.Module):
    """An embedding whose weight is also the head's, the head in a reentrant checkpoint: the
    weight's gradient is accumulated twice in one backward (the nested one's, the outer's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(10, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        head = partial(torch.nn.functional.linear, weight=self.embed)
        return checkpoint(
            head, torch.nn.functional.embedding(tokens, self.embed), use_reentrant=True
        )


def _train_reentrant(name: str) -> tuple[float, list[str], float]:
    """Trained with each block and the head in reentrant checkpoints, against the same without;
    a backward whose gradients all come from one nested backward, a parameter unused: the
    step's error, and (DDP, with leave for unused parameters) its step against one process."""
    states = []
    for wrap in (lambda m: m, _reentrant):
        model, opt = sw.prepare(wrap(_gpt()), _strategy(name), lr=1e-3)
        replicas, index = sw.data_shard(model)
        share = BATCH // replicas
        for step in range(STEPS):
            x, y = (t[index * share : (index + 1) * share] for t in _batch(step))
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        states.append(sw.full_state_dict(model))
        model.close()
    diff = max((states[0][k] - states[1][k]).abs().max().item() for k in states[0])
    # Every gradient of ours made in one nested backward, one parameter with none: the end of
    # that backward is the step's. Without leave for unused parameters, the usual error there.
    model, opt = sw.prepare(_AllInOneCheckpoint(), _strategy(name), lr=1e-3)
    model(torch.randn(4, 8)).square().mean().backward()
    refused = []
    for go_on in (lambda: model(torch.randn(4, 8)), opt.step):  # (a forward cannot tell)
        try:
            go_on()
            refused.append("")
        except RuntimeError as e:
            refused.append(str(e))
    model.close()
    # A parameter whose gradient a nested backward and the outer one both accumulate.
    model, opt = sw.prepare(_TiedAcrossACheckpoint(), _strategy(name), lr=1e-3)
    try:
        model(torch.arange(6).view(2, 3)).square().mean().backward()
        refused.append("")
    except RuntimeError as e:
        refused.append(str(e))
    model.close()
    # With leave (DDP's find_unused_parameters), a zero gradient for it: one process's step.
    rank = torch.distributed.get_rank()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    model, opt = sw.prepare(
        _AllInOneCheckpoint(),
        sw.DDP(bucket_mb=0.01, find_unused_parameters=True),
        optimizer=torch.optim.SGD,
        lr=0.5,
    )
    model(x[rank * 4 : (rank + 1) * 4]).square().mean().backward()
    opt.step()
    reference = _AllInOneCheckpoint()
    reference(x).square().mean().backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * (p.grad if p.grad is not None else 0)
    state = sw.full_state_dict(model)
    unused_diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    model.close()
    return diff, refused, unused_diff


@pytest.mark.parametrize("name", ["ddp-buckets", "zero2", "zero3"])
def test_the_users_reentrant_checkpoints_train_the_same(name):
    """A reentrant checkpoint's nested backward ends before the outer one has made every
    gradient: the strategy's reductions wait for the outer one (they ended at the first nested
    end: "parameter(s) received no gradient"). Where the outer one makes none of ours after a
    nested end that left a parameter without, the step ends that backward: a zero gradient for
    it where unused parameters have leave, else the usual error."""
    for diff, (forward, step, tied), unused_diff in run(_train_reentrant, 2, name):
        assert diff <= 1e-6
        assert "the last backward's end was not told (2 parameter(s) without a gradient" in forward
        assert "2 parameter(s) received no gradient in this backward pass (unused." in step
        assert "embed received its gradient twice in one backward: it is used both" in tied
        assert unused_diff <= 1e-6


def test_true_finds_the_blocks_of_models_that_keep_them_deeper():
    # Hugging Face models (their `_no_split_modules`) and a stack of blocks kept under a
    # submodule: before, `true` found nothing there and recomputed nothing, without a word.
    from torch import nn

    import hf_models as H

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.encoder.layers:
                x = torch.tanh(layer(x))
            return x

    assert default_regions(Nested()) == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    batch = H.make_batch("gpt2", 2, 0)
    grads = []
    for spec in (False, True):
        torch.manual_seed(0)
        model = H.build("gpt2")
        regions = checkpoint_activations(model, spec)
        model(**batch).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert regions == ["transformer.h.0", "transformer.h.1"]
    # Inside a module of the user's, its cache on: its blocks still recompute (the cache is
    # not handed to them while training), and its config, which an export writes, is as made.
    wrapper = nn.Module()
    wrapper.hf = H.build("gpt2")
    assert checkpoint_activations(wrapper, True) == ["hf.transformer.h.0", "hf.transformer.h.1"]
    wrapper.hf(**batch).loss.backward()
    assert wrapper.hf.config.use_cache
    for plain, recomputed in zip(*grads, strict=True):  # (the cache off: another kernel path)
        torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="finds no blocks in Linear") as err:
        checkpoint_activations(nn.Linear(2, 2), True)
    assert "\n" not in str(err.value)
