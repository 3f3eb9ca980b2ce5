"""Evaluation scores every test sample exactly once, whatever the world size and strategy.

Each case's evaluation batch is chosen so the test split does not divide into whole global
batches, and where it can, so the last global batch holds fewer samples than data-parallel
ranks (the loader then wraps around, as torch's DistributedSampler does, and the repeats must
not count). The reference is the same initial model scoring the whole split in one process.
"""

from __future__ import annotations

import copy

import pytest

import shardwise as sw
import spawn
from call_records import assert_same_calls, my_calls
from shardwise.config import load_config
from shardwise.jobs import build_job
from shardwise.train.validator import evaluate

DIGITS_TEST = 359  # the digits' test split


def _wrapping_batch(samples: int, replicas: int) -> int:
    """A per-rank batch whose last global batch holds 1..replicas-1 samples (some rank gets
    none of its own), or merely a ragged one where no such batch exists."""
    for b in range(samples // replicas, 0, -1):
        if 0 < samples % (b * replicas) < replicas:
            return b
    return 7


STRATEGIES = {
    "ddp": lambda: sw.DDP(),
    "zero3": lambda: sw.ZeRO(stage=3),
    "pipeline": lambda: sw.Pipeline(stages=2, microbatches=2),
    "dp2_pp2": lambda: sw.MeshParallel(dp=2, pp=2, data=sw.DDP(), pipeline=sw.Pipeline()),
    "dp2_tp2": lambda: sw.MeshParallel(dp=2, tp=2, data=sw.DDP()),
    "tp": lambda: sw.TensorParallel(),
}


def _scores(config: str, sets: list[str], strategy: str) -> dict:
    cfg = load_config(config, sets)
    job = build_job(cfg)
    reference = evaluate(
        copy.deepcopy(job.model), job.splits.test, job.loss_fn, 100_000, everyone=False
    )
    model, _ = sw.prepare(job.model, STRATEGIES[strategy]())
    replicas = sw.data_shard(model)[0]
    batch = _wrapping_batch(len(job.splits.test), replicas)
    return {
        "reference": reference,
        "scored": evaluate(model, job.splits.test, job.loss_fn, batch),
        "batch": batch,
        "calls": my_calls(),  # (a rank with no sample of its own in the last batch too)
    }


CASES = [
    ("digits", [], "ddp", 1),
    ("digits", [], "ddp", 2),
    ("digits", [], "ddp", 3),
    ("digits", [], "ddp", 4),
    ("digits", [], "zero3", 3),
    ("digits", [], "pipeline", 2),
    ("digits", [], "dp2_pp2", 4),
    ("tiny_gpt", ["data.seq_len=32", "model.n_layer=1"], "dp2_tp2", 4),
    ("tiny_gpt", ["data.seq_len=32", "model.n_layer=1"], "tp", 2),
]


@pytest.mark.parametrize(("config", "sets", "strategy", "world"), CASES)
def test_evaluation_scores_each_test_sample_once(config, sets, strategy, world):
    results = spawn.run(_scores, world, config, sets, strategy)
    if world > 1:
        assert_same_calls([got["calls"] for got in results])
    reference = results[0]["reference"]
    if config == "digits":
        assert reference.targets == DIGITS_TEST
    for got in results:  # every rank reports the same whole-split figures
        assert got["scored"].targets == reference.targets, got["batch"]
        assert round(got["scored"].accuracy * reference.targets) == round(
            reference.accuracy * reference.targets
        )
        assert got["scored"].loss == pytest.approx(reference.loss, rel=1e-5)


def test_a_plain_module_is_validated_and_checked_as_one_process():
    """A user's loop on a plain module, no job started: the public parts treat it as one
    replica of itself (they raised on it: no runtime, no process group)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    scored = sw.Validator(TensorDataset(x, y), F.cross_entropy, batch_size=4)(model)
    assert scored.targets == 10
    assert scored.loss == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert sw.NonFinitePolicy().check(model, loss) == {}
    assert sw.NonFinitePolicy().check(model, loss * float("nan")) == {0: "loss"}
