"""Gradient accumulation (`train.accumulate`, `sw.train_step(..., accumulate=K)`): K micro-batches
per optimizer step train as one process on the global batch does, and the gradients travel once
per step, as many bytes as without accumulation."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from harness import run_cli, train_args
from shardwise import comm
from shardwise.comm import shared_memory
from shardwise.config import ConfigError, validate
from shardwise.nn.models import MLP, TinyGPT, lm_loss
from shardwise.strategies.accumulation import check_accumulate
from spawn import run
from state_diff import max_abs_diff

STEPS = 10
SIZES = [5, 4]  # rank batches: uneven between ranks, and 5 splits unevenly into 2 (3 + 2)
TOL = 1e-5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP([13, 16, 9, 5])  # 427 parameters: neither they nor its units divide by 2


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=11, seq_len=8, d_model=16, n_layer=2, n_head=2)


def _mlp_batch(step: int):
    g = torch.Generator().manual_seed(700 + step)
    n = sum(SIZES)
    return torch.randn(n, 13, generator=g), torch.randint(0, 5, (n,), generator=g)


def _gpt_batch(step: int):
    """Sequences with padded targets (-100) at random: a per-token loss's batch."""
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, 11, (sum(SIZES), 9), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < 0.4] = -100
    return tokens[:, :-1], targets


def _mine(batch):
    start = sum(SIZES[: dist.get_rank()])
    return tuple(t[start : start + SIZES[dist.get_rank()]] for t in batch)


def _reference(model: nn.Module, batches, loss_fn, lr: float) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(STEPS):
        x, y = batches(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(strategy, k: int, build=_mlp, batches=_mlp_batch, loss_fn=F.cross_entropy, **kw):
    """The weights after STEPS steps with `accumulate=k`, and per step the bytes sent per
    collective (shardwise's accounting of every message, below any strategy)."""
    lr = 1e-2 if build is _mlp else 1e-3
    model, opt = sw.prepare(build(), strategy, lr=lr)
    sent = []
    comm.stats.end_step()
    for step in range(STEPS):
        x, y = _mine(batches(step))
        sw.train_step(model, x, y, loss_fn, accumulate=k, **kw)
        opt.step()
        opt.zero_grad()
        sent.append({op: t.bytes for op, t in comm.stats.end_step().by_op.items()})
    state, scale = sw.full_state_dict(model), getattr(model, "loss_scale", lambda: None)()
    model.close()
    return state, sent, scale


# ZeRO's gradients on one host's CPU: summed where they lie in shared memory.
REDUCE_SCATTER = "reduce_scatter" if shared_memory.supported() else "all_to_all"
STRATEGIES = {
    "ddp": lambda: sw.DDP(),
    "zero1": lambda: sw.ZeRO(stage=1, bucket_mb=0.0005),  # several units
    "zero2": lambda: sw.ZeRO(stage=2, bucket_mb=0.0005),
    "zero3": lambda: sw.ZeRO(stage=3),
    "zero3-offload": lambda: sw.ZeRO(stage=3, offload="cpu"),
    "zero2-fp16": lambda: sw.ZeRO(stage=2, bucket_mb=0.0005, mixed_precision="fp16"),
}


def accumulating_strategies() -> dict:
    reference = _reference(_mlp(), _mlp_batch, F.cross_entropy, lr=1e-2)
    out = {}
    for name, strategy in STRATEGIES.items():
        once, sent_once, scale_once = _train(strategy(), 1)
        twice, sent_twice, scale_twice = _train(strategy(), 2)
        out[name] = {
            "diff": max_abs_diff(twice, reference),
            "diff_k1": max_abs_diff(once, reference),
            "sent": (sent_once, sent_twice),
            "scales": (scale_once, scale_twice),
        }
    out["zero3-gathered-after-no_sync"] = _gathered_after_no_sync_backward()
    # A per-token loss over padded targets: each micro-batch weighed by its real tokens.
    tokens = _reference(_gpt(), _gpt_batch, lm_loss, lr=1e-3)
    count = lambda y: int((y != -100).sum())  # noqa: E731
    for name in ("ddp", "zero3"):
        state, _, _ = _train(STRATEGIES[name](), 3, _gpt, _gpt_batch, lm_loss, samples=count)
        out[f"{name}-tokens"] = {"diff": max_abs_diff(state, tokens)}
    return out


def _gathered_after_no_sync_backward() -> int:
    """ZeRO-3 still frees each unit after its backward inside no_sync(): bytes of parameter
    storage alive afterwards (0: every unit freed)."""
    model, _ = sw.prepare(_mlp(), sw.ZeRO(stage=3), lr=1e-2)
    x, y = _mine(_mlp_batch(0))
    with model.no_sync():
        F.cross_entropy(model(x), y).backward()
    alive = sum(p.untyped_storage().nbytes() for p in model.module.parameters())
    model.close()
    return alive


def test_accumulated_steps_equal_one_process_on_the_global_batch_and_send_no_more():
    results = run(accumulating_strategies, 2)
    for rank in results:
        for name in ("ddp", "zero1", "zero2", "zero3", "zero3-offload"):
            r = rank[name]
            assert r["diff"] <= TOL, (name, r["diff"])
            once, twice = r["sent"]
            # The gradients' reduction (DDP's all-reduce, ZeRO's exchange of slices: gloo's
            # ranks share a host) and the parameters' all-gather after the step (ZeRO 1/2) are
            # the same bytes with two micro-batches as with one, every step. ZeRO-3 gathers
            # each unit around every forward and backward: twice the all-gather bytes with two
            # micro-batches.
            for a, b in zip(once, twice, strict=True):
                assert a.keys() == b.keys(), name
                for op in a:
                    gathers = name.startswith("zero3") and op == "all_gather"
                    assert b[op] == (2 * a[op] if gathers else a[op]), (name, op, a[op], b[op])
            # the reduction is there at all (half of 427 fp32 per rank, at least): DDP's
            # all-reduce, ZeRO's reduce-scatter in shared memory (gloo's ranks share one
            # host's CPU)
            reduction = {"ddp": "all_reduce"}.get(name, REDUCE_SCATTER)
            assert twice[0][reduction] >= 427 * 4 // 2
        # fp16 compute with loss scaling: as near the fp32 reference as without accumulating
        # (its rounding, not the accumulation, sets the distance), and no step overflowed.
        fp16 = rank["zero2-fp16"]
        assert fp16["diff"] <= 2 * fp16["diff_k1"] + 1e-4, fp16
        assert fp16["scales"][0] == fp16["scales"][1]
        assert rank["zero3-gathered-after-no_sync"] == 0
        for name in ("ddp-tokens", "zero3-tokens"):
            assert rank[name]["diff"] <= TOL, (name, rank[name]["diff"])


def tensor_parallel_accumulates() -> float:
    """Tensor parallel (no data axis): every rank the same batch, its vocabulary-sharded loss
    weighed per micro-batch like any other."""
    reference = _reference(_gpt(), _gpt_batch, lm_loss, lr=1e-3)
    model, opt = sw.prepare(_gpt(), sw.TensorParallel(), lr=1e-3)
    count = lambda y: int((y != -100).sum())  # noqa: E731
    for step in range(STEPS):
        x, y = _gpt_batch(step)
        sw.train_step(model, x, y, lm_loss, accumulate=2, samples=count)
        opt.step()
        opt.zero_grad()
    return max_abs_diff(sw.full_state_dict(model), reference)


def test_tensor_parallel_accumulates_exactly():
    assert all(diff <= TOL for diff in run(tensor_parallel_accumulates, 2))


def test_one_process_accumulates_by_hand_with_sw_no_sync():
    """A plain module, and a user's own loop: `sw.no_sync` holds nothing back there, and the
    micro-batches' weighted losses give the whole batch's gradient."""
    x, y = _mlp_batch(0)
    whole, by_hand, stepped = _mlp(), _mlp(), _mlp()
    F.cross_entropy(whole(x), y).backward()
    with sw.no_sync(by_hand):
        (F.cross_entropy(by_hand(x[:6]), y[:6]) * 6 / 9).backward()
    (F.cross_entropy(by_hand(x[6:]), y[6:]) * 3 / 9).backward()
    loss = sw.train_step(stepped, x, y, F.cross_entropy, accumulate=4)  # 3 + 2 + 2 + 2
    for p, q, r in zip(whole.parameters(), by_hand.parameters(), stepped.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-6)
    assert math.isclose(loss.item(), F.cross_entropy(whole(x), y).item(), abs_tol=1e-6)
    # A micro-batch of padding alone weighs nothing: a finite loss, the other piece's gradient.
    padded = y.clone()
    padded[:5] = -100
    count = lambda t: int((t != -100).sum())  # noqa: E731
    again, alone = _mlp(), _mlp()
    loss = sw.train_step(again, x, padded, F.cross_entropy, samples=count, accumulate=2)
    F.cross_entropy(alone(x[5:]), padded[5:]).backward()
    assert math.isclose(loss.item(), F.cross_entropy(alone(x[5:]), padded[5:]).item(), abs_tol=1e-6)
    for p, q in zip(again.parameters(), alone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


def test_bad_accumulation_is_one_line():
    x, y = _mlp_batch(0)
    model = _mlp()
    cases = [
        (lambda: sw.train_step(model, x[:3], y[:3], F.cross_entropy, accumulate=4), "3 samples"),
        (lambda: sw.train_step(model, x, y, F.cross_entropy, accumulate=0), "a whole number >= 1"),
        (lambda: sw.train_step(model, x, y, F.cross_entropy, samples=9, accumulate=2), "function"),
        (lambda: check_accumulate(2, [7, 1]), "rank 1's batch of 1 samples"),  # rank_weights
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            call()
        assert "\n" not in str(err.value)
    for sets, words in [
        ({"strategy": {"name": "pp"}}, "microbatches"),
        ({"strategy": {"name": "mesh", "dp": 1, "pp": 2}}, "microbatches"),
        ({"data": {"batch_size": 2}}, "cannot be split"),
        ({"data": {"mode": "queue"}, "strategy": {"name": "local_sgd"}}, "queue"),
    ]:
        with pytest.raises(ConfigError, match=words) as err:
            validate({**sets, "train": {"accumulate": 3}})
        assert "\n" not in str(err.value)


@pytest.mark.usefixtures("uncalibrated")
def test_trainer_accumulates_with_the_bytes_of_one_batch(tmp_path):
    """`shardwise train digits --set train.accumulate=2`: it trains, and each step sends what
    a step without accumulation sends (test_cli's count: 26,122 fp32 gradients once, and the
    48-byte agreement)."""
    run_dir = tmp_path / "run"
    sets = ["train.accumulate=2", "train.steps=2", "data.rank_weights=[3,1]"]
    result = run_cli(*train_args(run_dir, *sets), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in lines)
    # (+ the agreement; in the first step, the check of the declared global batch)
    assert [r["comm_bytes"] for r in lines] == [26_122 * 4 + 48 + 40, 26_122 * 4 + 48]


def _batchnorm_mlp() -> nn.Module:
    torch.manual_seed(0)
    # (no bias before the norm: its gradient is 0 up to rounding, which AdamW would amplify)
    return nn.Sequential(
        nn.Linear(13, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5)
    )


def _batchnorm_reference(k: int) -> dict[str, torch.Tensor]:
    """One process: micro-batch i of the step is every rank's i-th piece together (what a
    SyncBatchNorm normalises over), each sample's loss over the global batch's."""
    model = _batchnorm_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # (`_train`'s for a model not `_mlp`)
    for step in range(STEPS):
        x, y = _mlp_batch(step)
        ranks = [(x[s : s + n], y[s : s + n]) for s, n in ((0, SIZES[0]), (SIZES[0], SIZES[1]))]
        for i in range(k):
            pieces = [[t.tensor_split(k)[i] for t in rank] for rank in ranks]  # (3+2, 2+2)
            xi, yi = (torch.cat(parts) for parts in zip(*pieces, strict=True))
            (F.cross_entropy(model(xi), yi, reduction="sum") / sum(SIZES)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_sync_batchnorm_weighs_uneven_ranks_in_every_micro_batch():
    """Rank batches of 5 and 4 in 2 micro-batches under DDP's SyncBatchNorm: each micro-batch's
    backward sums the ranks' gradients through the norm, weighed by their shares. Before, the
    share was declared before the last backward only, and the first summed them unweighed."""
    expected = _batchnorm_reference(2)
    for state, _, _ in run(_train, 2, sw.DDP(), 2, _batchnorm_mlp):
        assert max_abs_diff(state, expected) <= TOL
