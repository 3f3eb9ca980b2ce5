"""Sharded checkpoints: resume on another world size, export, and corruption errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

import shardwise as sw
from harness import run_cli
from shardwise.checkpoint.reshardable import CheckpointError, read_full_state
from shardwise.nn.models import MLP
from spawn import run

GLOBAL_BATCH = 8  # fixed, so runs at different world sizes see the same global batches


def _model():
    torch.manual_seed(0)
    return MLP([13, 16, 9, 5])  # 427 parameters: every world size pads


def _strategy(name: str):
    if name.startswith("ddp"):
        return sw.DDP(compression="topk:0.3" if name == "ddp_topk" else None)
    return sw.ZeRO(stage=int(name[-1]), bucket_mb=0.0005)


def train_segment(strategy: str, start: int, stop: int, load_from: str | None, save_to: str):
    """Steps [start, stop) of one training run, optionally resumed from a checkpoint."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, opt = sw.prepare(_model(), _strategy(strategy), lr=1e-2)
    if load_from:
        assert sw.load_checkpoint(model, opt, load_from) == start
    local = GLOBAL_BATCH // world
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(GLOBAL_BATCH, 13, generator=g),
            torch.randint(0, 5, (GLOBAL_BATCH,), generator=g),
        )
        F.cross_entropy(
            model(x[rank * local : (rank + 1) * local]), y[rank * local : (rank + 1) * local]
        ).backward()
        opt.step()
        opt.zero_grad()
    sw.save_checkpoint(model, opt, save_to, step=stop)
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}


def _assert_same_training_state(a, b):
    params_a, states_a, step_a = read_full_state(a)
    params_b, states_b, step_b = read_full_state(b)
    assert step_a == step_b
    assert params_a.keys() == params_b.keys() and states_a.keys() == states_b.keys()
    for k in params_a:
        torch.testing.assert_close(params_a[k], params_b[k], atol=1e-5, rtol=0)
    for k in states_a:
        assert states_a[k].keys() == states_b[k].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in states_a[k]:
            torch.testing.assert_close(states_a[k][key], states_b[k][key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])  # zero2: in the chain below
def test_reshard_4_to_2_equals_uninterrupted_training(tmp_path, strategy):
    run(train_segment, 4, strategy, 0, 20, None, str(tmp_path / "straight"))
    run(train_segment, 4, strategy, 0, 10, None, str(tmp_path / "half"))
    run(train_segment, 2, strategy, 10, 20, str(tmp_path / "half"), str(tmp_path / "resumed"))
    _assert_same_training_state(tmp_path / "straight", tmp_path / "resumed")


def test_reshard_chain_4_2_1_and_2_to_4_across_strategies(tmp_path):
    run(train_segment, 4, "zero3", 0, 20, None, str(tmp_path / "straight"))
    run(train_segment, 4, "zero3", 0, 5, None, str(tmp_path / "a"))
    run(train_segment, 2, "zero2", 5, 10, str(tmp_path / "a"), str(tmp_path / "b"))
    run(train_segment, 1, "zero1", 10, 15, str(tmp_path / "b"), str(tmp_path / "c"))
    run(train_segment, 4, "ddp", 15, 20, str(tmp_path / "c"), str(tmp_path / "d"))
    _assert_same_training_state(tmp_path / "straight", tmp_path / "d")


def test_checkpoint_restores_strategy_state_for_an_exact_resume(tmp_path):
    """Top-k's error-feedback residuals travel in the checkpoint: resumed on the same ranks,
    training continues bit-identically (without them, the next steps would differ)."""
    (straight,) = run(train_segment, 2, "ddp_topk", 0, 8, None, str(tmp_path / "straight"))[:1]
    run(train_segment, 2, "ddp_topk", 0, 4, None, str(tmp_path / "half"))
    half = str(tmp_path / "half")
    (resumed,) = run(train_segment, 2, "ddp_topk", 4, 8, half, str(tmp_path / "resumed"))[:1]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_export_gives_plain_safetensors_weights(tmp_path):
    (full,) = run(train_segment, 2, "zero3", 0, 3, None, str(tmp_path / "ckpt"))[:1]
    result = run_cli("export", str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors"), timeout=120)
    assert result.returncode == 0, result.stderr
    plain = _model()
    plain.load_state_dict(load_file(str(tmp_path / "w.safetensors")))  # no shardwise involved
    for k, v in plain.state_dict().items():
        assert torch.equal(v, full[k])


def test_corrupt_or_incomplete_checkpoint_is_a_clear_error(tmp_path):
    run(train_segment, 2, "zero2", 0, 1, None, str(tmp_path / "ckpt"))
    shard = tmp_path / "ckpt" / "rank1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    with pytest.raises(CheckpointError, match=r"rank1\.safetensors"):
        read_full_state(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest"):
        read_full_state(tmp_path / "ckpt")


def local_sgd_counter(save: bool, checkpoint: str, run_dir: str):
    """LocalSGD's step count (its warm-up and averaging period follow it): saved after five
    steps, or what each way of loading restores on this number of ranks; and the rate after
    five steps of a cosine schedule of a base rate scaled by the ranks (`optim.scale_lr`)."""
    strategy, world = sw.LocalSGD(period=3, warmup_steps=2), dist.get_world_size()
    model, opt = sw.prepare(_model(), strategy, lr=1e-2 * world)
    schedule = sw.lr_scheduler(opt, "cosine", total_steps=20)
    if save:
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 13, generator=g), torch.randint(0, 5, (4,), generator=g)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
        sw.save_checkpoint(model, opt, checkpoint, step=5)
        saver = sw.Checkpointer(run_dir, model, opt, schedule, asynchronous=False)
        saver.save(5)
        saver.close()
        return model.steps
    sw.load_checkpoint(model, opt, checkpoint)
    loaded = model.steps
    model, opt = sw.prepare(_model(), strategy, lr=1e-2 * world)
    schedule = sw.lr_scheduler(opt, "cosine", total_steps=20)
    resumer = sw.Checkpointer(run_dir, model, opt, schedule, asynchronous=False)
    assert resumer.resume()[0] == 5
    resumer.close()
    return loaded, model.steps, opt.param_groups[0]["lr"] / (1e-2 * world)


def test_a_resume_on_another_number_of_ranks_keeps_what_every_rank_held_alike(tmp_path):
    """Strategy state shared by every rank (a counter, the loss scale) is restored on another
    number of ranks too (it started over: LocalSGD warmed up again, averaging late); the
    schedule goes on from its step, from this job's base rate (it kept the saved world's)."""
    where = (str(tmp_path / "ckpt"), str(tmp_path / "run"))
    assert run(local_sgd_counter, 2, True, *where) == [5, 5]
    ((loaded, resumed, rate),) = run(local_sgd_counter, 1, False, *where)
    assert (loaded, resumed) == (5, 5)
    assert rate == pytest.approx(sw.Schedule("cosine", total_steps=20)(5), rel=1e-12)
