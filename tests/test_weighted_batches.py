"""Per-rank batches of different sizes: data parallel must still step on the mean gradient of
the global batch. Each strategy trains with rank r holding sizes[r] samples of every step's
global batch and is compared with single-process training on the concatenated batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from call_records import assert_same_calls, my_calls
from shardwise.nn.models import MLP, ConvNet
from spawn import run
from state_diff import max_abs_diff

STEPS = 20
TOL = 1e-5


def _model(kind: str = "mlp") -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP([13, 17, 9, 5]) if kind == "mlp" else ConvNet(channels=(4, 6), num_classes=5)


def _global_batch(step: int, size: int, kind: str = "mlp"):
    g = torch.Generator().manual_seed(500 + step)
    shape = (size, 13) if kind == "mlp" else (size, 1, 8, 8)
    return torch.randn(*shape, generator=g), torch.randint(0, 5, (size,), generator=g)


def _reference(size: int, kind: str = "mlp") -> dict[str, torch.Tensor]:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = _global_batch(step, size, kind)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(
    strategy: sw.Strategy, sizes: list[int], how: str, kind: str = "mlp"
) -> dict[str, torch.Tensor]:
    """`how`: 'count' (train_step sums the sizes over ranks), 'given' (train_step is told the
    global batch) or 'declared' (a hand-written loop declares its batch, then backward)."""
    rank, total = dist.get_rank(), sum(sizes)
    begin = sum(sizes[:rank])
    model, opt = sw.prepare(_model(kind), strategy, lr=1e-2)
    for step in range(STEPS):
        x, y = (t[begin : begin + sizes[rank]] for t in _global_batch(step, total, kind))
        if how == "count":
            sw.train_step(model, x, y, F.cross_entropy)
        elif how == "given":
            sw.train_step(model, x, y, F.cross_entropy, total=total)
        else:
            sw.declare_batch(model, len(x))
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = sw.full_state_dict(model)
    model.close()
    return state


def _all_variants(sizes: list[int]) -> dict[str, float]:
    expected = _reference(sum(sizes))
    group = 2 if len(sizes) % 2 == 0 else 1  # 1: a ring between groups of one
    variants = {
        # (shared memory on one host: a bucket of equal shares is averaged by the all-reduce,
        # so every rank must agree whether the shares are equal)
        "ddp shared memory": (sw.DDP(), "count"),
        "ddp shared memory, total given": (sw.DDP(bucket_mb=0.0005), "given"),
        "ddp native": (sw.DDP(algorithm="native", bucket_mb=0.0005), "count"),
        "ddp ring": (sw.DDP(algorithm="ring", bucket_mb=0.0005), "given"),
        "ddp hierarchical": (sw.DDP(algorithm="hierarchical", group_size=group), "declared"),
        "ddp fp16 codec": (sw.DDP(compression="fp16"), "count"),
        "zero-1": (sw.ZeRO(stage=1, bucket_mb=0.0005), "given"),
        "zero-2": (sw.ZeRO(stage=2, bucket_mb=0.0005), "count"),
        "zero-3": (sw.ZeRO(stage=3), "declared"),
    }
    diffs = {
        name: max_abs_diff(_train(strategy, sizes, how), expected)
        for name, (strategy, how) in variants.items()
    }
    # SyncBatchNorm couples the ranks' backward passes: its sums are weighted too.
    cnn = _train(sw.DDP(), sizes, "count", kind="cnn")
    diffs["ddp syncbn"] = max_abs_diff(cnn, _reference(sum(sizes), kind="cnn"))
    return diffs, my_calls()


# [2, 5, 8]: the second rank's share is 1/3 exactly, the others' are not
@pytest.mark.parametrize("sizes", [[3, 9], [2, 5, 8]])
def test_uneven_batches_equal_single_process_on_the_global_batch(sizes):
    results = run(_all_variants, len(sizes), sizes, timeout_s=300)
    assert_same_calls([calls for _, calls in results])  # whatever each rank's batch size
    for diffs, _ in results:
        # The fp16 codec rounds each gradient to 11 significant bits before the sum.
        assert diffs.pop("ddp fp16 codec") <= 2e-3, diffs
        assert max(diffs.values()) <= TOL, diffs


def _unweighted_would_differ(sizes: list[int]) -> float:
    """The same run with every rank declaring an equal share: the plain mean over ranks."""
    expected = _reference(sum(sizes))
    rank, total = dist.get_rank(), sum(sizes)
    begin = sum(sizes[:rank])
    model, opt = sw.prepare(_model(), sw.DDP(), lr=1e-2)
    for step in range(STEPS):
        x, y = (t[begin : begin + sizes[rank]] for t in _global_batch(step, total))
        sw.train_step(model, x, y, F.cross_entropy, samples=1, total=len(sizes))
        opt.step()
        opt.zero_grad()
    return max_abs_diff(sw.full_state_dict(model), expected)


def test_averaging_over_ranks_instead_of_samples_is_measurably_wrong():
    # The test above can fail: the mean over ranks of uneven batches is far from the answer.
    assert min(run(_unweighted_would_differ, 2, [3, 9])) > 100 * TOL


def _bad_declarations() -> list[str]:
    model, _ = sw.prepare(_model(), sw.DDP(), lr=1e-2)
    errors = []
    for samples, total in [(-1, None), (5, 4), (2.5, None)]:
        try:
            sw.declare_batch(model, samples, total)
        except ValueError as e:
            errors.append(str(e))
    model.close()
    return errors


def test_bad_declarations_are_one_line_errors():
    (errors,) = run(_bad_declarations, 1)
    assert errors == [
        "samples must be a whole number >= 0, got -1",
        "total samples must be a whole number >= 5, got 4",
        "samples must be a whole number >= 0, got 2.5",
    ]
