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


def _local_sgd_scored():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model, opt = sw.prepare(torch.nn.Linear(4, 3), sw.LocalSGD(period=100), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())  # (each replica drifts its own way)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        sw.train_step(model, x, y, F.cross_entropy)
        opt.step()
        opt.zero_grad()
    own = {k: v.clone() for k, v in model.module.state_dict().items()}
    test = torch.randn(10, 4), torch.randint(0, 3, (10,))
    scored = sw.Validator(TensorDataset(*test), F.cross_entropy, batch_size=3)(model)
    averaged = torch.nn.Linear(4, 3)
    averaged.load_state_dict(sw.full_state_dict(model))
    kept = all(torch.equal(v, model.module.state_dict()[k]) for k, v in own.items())
    return scored.loss, F.cross_entropy(averaged(test[0]), test[1]).item(), kept


def test_replicas_that_drift_are_scored_as_their_average():
    """Local SGD between averagings: the evaluation scores the run's model (the replicas'
    average, what it saves) on every sample, each rank's own weights back after (each rank
    scored its own replica on its shard: a mix)."""
    for scored, of_average, kept in spawn.run(_local_sgd_scored, 2):
        assert scored == pytest.approx(of_average, rel=1e-6)
        assert kept
