"""The Python API's helpers (evaluation, schedules, loaders, distillation, balancing, metrics)
given bad or edge inputs, as a probe of them found: before, each gave a wrong result, took the
value in silence, or failed deep inside; now each is a one-line error naming the input, or the
right result. One process: shardwise runs in a world of one."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset

import shardwise as sw
from shardwise.checkpoint.reshardable import CheckpointError, export_checkpoint
from shardwise.distributed import runtime


@pytest.fixture(autouse=True)
def _alone():
    yield
    runtime.shutdown()  # leave no process group behind for the tests that follow


def one_line(error: type[Exception], match: str, call) -> None:
    with pytest.raises(error, match=match) as raised:
        call()
    assert "\n" not in str(raised.value)


def test_a_regression_is_scored_by_its_loss_alone():
    """Before: the argmax of a [N] output against [N, 1] targets broadcast to N x N, and the
    'accuracy' was 2.8."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(10, 4), torch.randn(10, 1)
    scored = sw.evaluate(model, TensorDataset(x, y), F.mse_loss, 3)
    assert scored.accuracy is None
    assert scored.loss == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-6)
    flat = sw.evaluate(model, TensorDataset(x, y[:, 0]), lambda o, t: F.mse_loss(o[:, 0], t), 3)
    assert flat.accuracy is None  # (float targets, [N] like the argmaxes: no classes either)
    classes = sw.evaluate(
        nn.Linear(4, 3), TensorDataset(x, torch.zeros(10).long()), F.cross_entropy, 3
    )
    assert 0 <= classes.accuracy <= 1  # (a classifier is scored as before)


def test_a_source_for_a_model_made_already_is_refused(tmp_path):
    """Before: `source=` was ignored where the parameters were real: the model trained from its
    own random values, and a source that did not fit was never noticed."""
    save_file(
        {"weight": torch.ones(3, 4), "bias": torch.ones(3)}, str(tmp_path / "model.safetensors")
    )
    one_line(
        ValueError,
        r"^source= gives the values of parameters on the meta device",
        lambda: sw.prepare(nn.Linear(4, 3), sw.DDP(), source=sw.HFWeights(tmp_path)),
    )


def test_distillation_refuses_a_teacher_of_another_shape_and_a_temperature_not_finite():
    """Before: [4, 6] teacher logits were reshaped into the [6, 4] student's rows, and a NaN or
    infinite temperature gave a NaN loss."""
    student, labels = torch.randn(6, 4), torch.randint(0, 4, (6,))
    one_line(
        ValueError,
        r"teacher logits of shape \[4, 6\] for student logits of 6 rows of 4 classes",
        lambda: sw.distill_loss()(student, (labels, torch.randn(4, 6))),
    )
    teacher = torch.randn(6, 4)
    loss = sw.distill_loss(temperature=2.0, alpha=1.0)(student, (labels, teacher))
    soft = F.kl_div(
        F.log_softmax(student / 2, -1), F.softmax(teacher / 2, -1), reduction="batchmean"
    )
    assert loss.item() == pytest.approx(4 * soft.item(), rel=1e-5)  # (T^2 times the soft term)
    for temperature in (math.nan, math.inf, 0.0):
        one_line(
            ValueError, "distillation temperature must be", lambda t=temperature: sw.distill_loss(t)
        )


def test_schedules_and_scaling_take_whole_numbers_and_a_rate_above_zero():
    """Before: `warmup_steps=2.5` gave multipliers past 1 (0.4, 0.8, 1.2), `total_steps=True`
    was taken, `scaled_lr(-0.1, ...)` gave -0.2."""
    for options, said in [
        ({"warmup_steps": 2.5}, "warmup_steps must be a whole number >= 0, got 2.5"),
        ({"total_steps": True}, "total_steps must be a whole number >= 1, got True"),
    ]:
        one_line(ValueError, said, lambda o=options: sw.Schedule(**o))
    warm = sw.Schedule("constant", total_steps=1, warmup_steps=4)  # (a constant rate: no end)
    assert [warm(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    for lr in (-0.1, math.nan):
        one_line(ValueError, "lr must be", lambda r=lr: sw.scaled_lr(r, 64, 32))
    one_line(ValueError, "base_batch must be a whole number", lambda: sw.scaled_lr(0.1, 64, True))
    assert sw.scaled_lr(0.1, 64, 32) == pytest.approx(0.2)


def test_a_loader_refuses_a_shard_or_position_it_cannot_have():
    """Before: `shard=(2, -1)` read rank 1's slice, (2, 5) was an IndexError; a negative offset
    ended the epoch two batches in, one past the end skipped it, `{}` was a KeyError."""
    data = TensorDataset(torch.arange(23.0))
    for shard, said in [
        ((2, -1), "shard index must be a whole number >= 0, got -1"),
        ((2, 5), "shard index must be below its 2 replicas, got 5"),
        ((0, 0), "shard replicas must be a whole number >= 1, got 0"),
    ]:
        one_line(ValueError, said, lambda s=shard: sw.data.loader(data, 2, shard=s))
    one_line(ValueError, "loader seed must be", lambda: sw.data.loader(data, 2, seed=1.5))
    loader = sw.data.loader(data, 2, seed=3, drop_last=False)
    for state, said in [
        ({"epoch": 0, "offset": -5, "seed": 3}, "data position offset must be a whole number"),
        ({"epoch": 0, "offset": 24, "seed": 3}, "offset 24 is past the dataset's 23 samples"),
        ({"epoch": -1, "offset": 0, "seed": 3}, "data position epoch must be a whole number"),
        ({}, "a data position must hold epoch, offset, seed"),
    ]:
        one_line(ValueError, said, lambda s=state: loader.load_state_dict(s))
    loader.load_state_dict({"epoch": 0, "offset": 20, "seed": 3})
    assert sum(len(x) for (x,) in loader) == 3  # (the rest of the epoch: 23 - 20)


def test_policies_balancers_and_metrics_refuse_numbers_that_would_mislead(tmp_path):
    """Before: `max_bad_steps=nan` made a run that never stopped; a negative busy time gave its
    rank most of the batch; a negative step time wrote a negative rate."""
    one_line(
        ValueError,
        "max_bad_steps must be a whole number >= 1, got nan",
        lambda: sw.NonFinitePolicy("skip", max_bad_steps=math.nan),
    )
    rt = sw.init()
    loader = sw.data.loader(TensorDataset(torch.arange(16.0)), 4)
    balancer = sw.ThroughputBalancer(loader, 2, rt)
    one_line(ValueError, "busy_s must be >= 0, got -1.0", lambda: balancer.observe(4, -1.0))
    one_line(
        ValueError,
        "minimum=5 samples for each of 1 replicas",
        lambda: sw.ThroughputBalancer(loader, 2, rt, minimum=5),
    )
    partitioned = sw.data.loader(
        TensorDataset(torch.arange(16.0)), 4, partition=sw.data.partition.Contiguous()
    )
    one_line(
        TypeError,
        "re-plans a sharded loader's batch sizes",
        lambda: sw.ThroughputBalancer(partitioned, 2, rt),
    )
    writer = sw.MetricsWriter(tmp_path / "run", 10)
    try:
        one_line(ValueError, "step_time must be > 0", lambda: writer.log_step(1, 0.5, 8, -2.0))
    finally:
        writer.close()


def test_a_teacher_cache_is_written_where_asked_or_refused_first(tmp_path):
    """Before: building onto a directory left `.NAME.tmp` and a raw OS error (and the other
    ranks went on as if built); k=0 meant every class; `lookup(-1)` read the last sample."""
    torch.manual_seed(0)
    teacher = nn.Linear(4, 5)
    data = TensorDataset(torch.randn(6, 4), torch.zeros(6).long())
    (tmp_path / "taken").mkdir()
    one_line(
        ValueError,
        "it is a directory",
        lambda: sw.TeacherCache.build(teacher, data, tmp_path / "taken", 2),
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    one_line(
        ValueError,
        r"top-k k must be a whole number >= 1, got 0",
        lambda: sw.TeacherCache.build(teacher, data, tmp_path / "c", 0),
    )
    path = sw.TeacherCache.build(teacher, data, tmp_path / "cache.safetensors", 2)
    cache = sw.TeacherCache(path, 6, 5)
    values, _ = cache.lookup(torch.tensor([5]))
    assert torch.allclose(values[0], teacher(data.tensors[0][5]).detach().topk(2).values)
    one_line(
        IndexError,
        r"samples -1\.\.-1: the cache holds 0\.\.5",
        lambda: cache.lookup(torch.tensor([-1])),
    )


def test_models_without_parameters_empty_sets_and_labels_that_are_not_classes():
    """Before: `evaluate` of an empty dataset gave NaN loss and accuracy; `memory_report` and
    `evaluate` of a model with no parameters a bare `StopIteration`; stratified labels 0.5 and
    0.7 were both label 0; a teacher cache with a class twice in a sample's top-K loaded."""
    x = torch.randn(4, 3)
    one_line(
        ValueError,
        "evaluate: the dataset holds no sample",
        lambda: sw.evaluate(nn.Linear(3, 2), TensorDataset(x[:0], x[:0]), F.mse_loss, 2),
    )
    scored = sw.evaluate(nn.Identity(), TensorDataset(x, x), F.mse_loss, 3)
    assert scored.loss == 0.0 and scored.accuracy is None
    report = sw.memory_report(nn.ReLU(), torch.optim.SGD([torch.zeros(1, requires_grad=True)]))
    assert report["peak"] >= 0
    labels = sw.data.partition.Stratified([0.5, 0.7, 1.0, 0.0])
    one_line(
        ValueError,
        "stratified labels must be whole numbers, got 0.5",
        lambda: labels.split(4, 2, 0, 0),
    )
    parts = sw.data.partition.Stratified([0, 1, 0, 1]).split(4, 2, 0, 0)
    assert sorted(i for part in parts for i in part) == [0, 1, 2, 3]
    assert all(sorted(i % 2 for i in part) == [0, 1] for part in parts)  # (a label each)


def test_a_teacher_cache_with_a_class_twice_in_a_row_is_refused(tmp_path):
    path = tmp_path / "cache.safetensors"
    indices = torch.tensor([[0, 1], [2, 2]], dtype=torch.int32)
    save_file(
        {"values": torch.ones(2, 2), "indices": indices}, str(path), metadata={"classes": "3"}
    )
    one_line(
        ValueError,
        "a class repeated within a sample's top-K indices",
        lambda: sw.TeacherCache(path, 2),
    )
    fine = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    save_file({"values": torch.ones(2, 2), "indices": fine}, str(path), metadata={"classes": "3"})
    assert sw.TeacherCache(path, 2).classes == 3


def test_the_third_probe_s_inputs_are_refused_in_one_line(tmp_path):
    """Each of these failed inside torch or safetensors, or trained on: SyncBatchNorm's
    statistics of one value a channel (a variance of 0: every output the bias, where
    nn.BatchNorm refuses) and 1-D input; a pruning schedule of 1.5 steps, N:M of 2.5, another
    model's optimizer; a cosine schedule's gamma (ignored); top-k of
    no tensor; rows grown to fewer; a teacher cache of no samples; a checkpoint exported into
    /proc; a plain module saved or started from; metrics logged every 0 steps, of a tensor, or
    after close."""
    norm = sw.SyncBatchNorm(3)
    one_line(
        ValueError,
        "more than 1 value per channel over all ranks, got 1",
        lambda: norm(torch.randn(1, 3)),
    )
    one_line(ValueError, "expected at least 2D input", lambda: norm(torch.randn(3)))
    # With no process group, as in a plain script: torch's own BatchNorm (whose running
    # statistics the refused batches left alone)
    assert not torch.distributed.is_initialized()
    assert norm(torch.randn(0, 3)).shape == (0, 3)  # (no statistics: the running ones kept)
    x, reference = torch.randn(5, 3), nn.BatchNorm1d(3)
    torch.testing.assert_close(norm(x), reference(x))
    torch.testing.assert_close(norm.state_dict(), reference.state_dict())
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_line(
        ValueError,
        "pruning every must be a whole number >= 1, got 1.5",
        lambda: sw.GlobalMagnitudePruner(model, opt, 0.5, start=0, end=4, every=1.5),
    )
    one_line(
        ValueError,
        "N:M sparsity's N must be a whole number",
        lambda: sw.NMPruner(model, opt, n=2.5),
    )
    other = torch.optim.SGD(nn.Linear(8, 4).parameters(), lr=0.1)
    one_line(
        ValueError,
        "tensors that are not the model's",
        lambda: sw.GlobalMagnitudePruner(model, other, 0.5),
    )
    one_line(
        ValueError,
        "gamma decays 'step' and 'exponential' schedules, not 'cosine'",
        lambda: sw.Schedule("cosine", total_steps=10, gamma=0.5),
    )
    one_line(TypeError, "logits must be a tensor", lambda: sw.top_k_logits(None, 2))
    one_line(
        ValueError,
        "rows must be a whole number >= 4",
        lambda: sw.grow_rows(torch.ones(4, 2), 3, None),
    )
    teacher = nn.Linear(4, 5)
    empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0).long())
    one_line(
        ValueError,
        "the dataset has no samples",
        lambda: sw.TeacherCache.build(teacher, empty, tmp_path / "cache", 2),
    )
    prepared, prepared_opt = sw.prepare(nn.Linear(4, 4), sw.DDP(), lr=0.1)
    sw.save_checkpoint(prepared, prepared_opt, tmp_path / "ckpt")
    one_line(
        CheckpointError,
        "cannot write /proc/w.safetensors",
        lambda: export_checkpoint(tmp_path / "ckpt", "/proc/w.safetensors"),
    )
    plain = nn.Linear(4, 4)
    one_line(
        TypeError,
        "got a plain Linear",
        lambda: sw.save_checkpoint(plain, prepared_opt, tmp_path / "c2"),
    )
    one_line(
        TypeError,
        "got a plain Linear",
        lambda: sw.start_from(tmp_path / "ckpt", plain, prepared_opt, "finetune"),
    )
    assert not (tmp_path / "c2").exists()
    one_line(
        ValueError,
        "log_every must be a whole number >= 1, got 0",
        lambda: sw.MetricsWriter(tmp_path / "m", 5, log_every=0),
    )
    writer = sw.MetricsWriter(tmp_path / "run", 5)
    one_line(
        TypeError, "numbers, strings, lists", lambda: writer.log_step(1, 0.5, 8, 1.0, note=object())
    )
    writer.log_step(1, 0.5, 8, 1.0)
    writer.close()
    one_line(
        ValueError, "written after its writer was closed", lambda: writer.log_step(2, 0.5, 8, 1.0)
    )
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]  # (the refused line: no trace)
    prepared.close()


def test_only_shardwise_s_own_value_errors_are_refusals_of_one_line():
    """`our_refusal`, which a rank's exit and the command line follow: a ValueError raised in
    our code is a refusal (its message says it all); one raised in a user's or torch's code
    keeps its traceback."""
    from shardwise.arguments import our_refusal

    def users_loss():
        raise ValueError("corrupt record 77")

    for call, ours in [
        (lambda: sw.optim.LARS([torch.zeros(2, requires_grad=True)], lr=-1), True),
        (lambda: sw.Schedule("cosine", total_steps=0), True),
        (users_loss, False),
        (lambda: F.cross_entropy(torch.zeros(2, 3), torch.zeros(5).long()), False),
    ]:
        with pytest.raises(ValueError) as raised:
            call()
        assert our_refusal(raised.value) is ours, raised.value
