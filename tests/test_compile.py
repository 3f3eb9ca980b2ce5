"""Our strategies compose with `torch.compile` (the inductor backend, on the CPU): DDP under a
model compiled whole, ZeRO-3 under each block's forward compiled (the blocks
are its units: the gather and free hooks on them run around the compiled code, as FSDP2's
users compile per block). Each trains a small GPT on 2 ranks and ends where one process
training the same model eagerly on the global batch ends (inductor fuses and reorders fp32
arithmetic: a tight tolerance, not bits)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import shardwise as sw
from shardwise.nn.models import TinyGPT, lm_loss
from spawn import run

STEPS, BATCH, VOCAB = 3, 8, 37
# (found, not imported: importing inductor costs every process that collects this file 1.5 s)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch._inductor") is None, reason="no inductor in this torch"
)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (BATCH, 17), generator=g) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, seq_len=16, d_model=24, n_layer=2, n_head=2)


def _compile_once() -> None:
    """Compiles what both ranks will, in one process: the ranks after it find every kernel in
    inductor's cache on disk. Compiled by both at once, each kernel took g++ twice: 26 s of a
    core each, the test's whole cost on 2 cores. (Without the cache, the ranks compile.)"""
    x, y = _batches()[0]
    mine = slice(0, BATCH // 2)
    whole, per_block = _model(), _model()
    whole.compile()
    for block in per_block.blocks:
        block.forward = torch.compile(block.forward)
    for model in (whole, per_block):
        lm_loss(model(x[mine]), y[mine]).backward()


def _compiled(strategy_name: str) -> dict[str, torch.Tensor]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch._dynamo.utils.counters.clear()  # (this strategy's graphs, not the one's before)
    model = _model()
    if strategy_name == "zero3":
        for block in model.blocks:  # the units' forwards; the hooks on them stay outside
            block.forward = torch.compile(block.forward)
        strategy = sw.ZeRO(stage=3)
    else:
        model.compile()
        strategy = sw.DDP() if strategy_name == "ddp" else sw.ZeRO(stage=int(strategy_name[-1]))
    model, opt = sw.prepare(model, strategy, optimizer=torch.optim.SGD, lr=0.1)
    share = BATCH // world
    for x, y in _batches():
        mine = slice(rank * share, (rank + 1) * share)
        sw.train_step(model, x[mine], y[mine], lm_loss, total=BATCH)
        opt.step()
        opt.zero_grad()
    state = sw.full_state_dict(model)
    model.close()
    # (the graphs dynamo compiled: none would mean the model ran eagerly after all)
    return state, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _one_process() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _both() -> list:
    return [_compiled(name) for name in ("ddp", "zero3")]


def test_compiled_models_train_under_our_strategies_as_one_eager_process():
    """DDP stands for ZeRO-1/2 too: theirs are the same gradient hooks on a model compiled
    whole (the optimizer step aside)."""
    want = _one_process()
    run(_compile_once, 1, timeout_s=300)
    for results in run(_both, 2, timeout_s=300):
        for got, graphs in results:
            assert graphs >= 1
            assert got.keys() == want.keys()
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
