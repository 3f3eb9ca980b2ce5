"""The Python API misused, as a probe of it found: each case is refused in one line on every rank
it concerns, nothing is lost, and training goes on right after. Before, each of these trained on
in silence (replicas apart, gradients dropped or misweighted, optimizer state lost) or failed
far from its cause (a hang until the timeout, a `KeyError`, an mmap error)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
import spawn
from harness import run_python
from shardwise.checkpoint.reshardable import CheckpointError
from shardwise.comm import shared_memory
from shardwise.distributed import runtime


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: sw.DDP(group_size=0), "DDP(group_size=0): Input should be greater than"),
        (lambda: sw.DDP(group_size=2.5), "DDP(group_size=2.5): Input should be a valid integer"),
        (lambda: sw.DDP(bucket_mb="25"), "DDP(bucket_mb='25'): Input should be a valid number"),
        (lambda: sw.ZeRO(stage=True), "ZeRO(stage=True): takes numbers, not booleans"),
        (lambda: sw.ZeRO(stage=3, keep_gathered_mb=math.inf), "a finite number"),
        (lambda: sw.Pipeline(microbatches=2.0), "Pipeline(microbatches=2.0): Input should be"),
        (lambda: sw.Gossip(topology="star"), "Gossip(topology='star'): Input should be 'ring'"),
        (lambda: sw.ParameterServer(timeout_s=math.nan), "ParameterServer(timeout_s=nan)"),
        (lambda: sw.TensorParallel(size=True), "TensorParallel(size=True): takes numbers"),
    ],
)
def test_a_strategy_refuses_options_its_yaml_section_would(make, said):
    """The same types and bounds as the YAML's sections (`shardwise config`), strictly: before,
    `group_size=0` or `2.5`, `stage=True` (stage 1) and `bucket_mb="25"` were taken."""
    with pytest.raises(ValueError, match=r"^[^\n]+$") as refused:
        make()
    assert said in str(refused.value)


def test_options_given_as_the_yaml_would_still_build():
    assert sw.Pipeline(split=(1, 2)).split == (1, 2)  # (a tuple where the section lists)
    assert sw.MeshParallel(dp=2, data=sw.ZeRO(stage=3)).data.stage == 3  # (an object: as is)
    assert sw.DDP(bucket_mb=4).bucket_mb == 4  # (an int where a float goes: as pydantic's)


def test_bad_arguments_to_init_and_prepare_are_one_line():
    """Before: torch's own errors, from deep inside (`timeout_s=nan` got as far as the group's
    bring-up; `nccl` on a machine without a GPU; an optimizer's `lr="a"`)."""
    try:
        with pytest.raises(ValueError, match="timeout_s must be a finite number, got nan"):
            sw.init(timeout_s=math.nan)
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="backend 'nccl' needs a CUDA GPU"):
                sw.init(backend="nccl")
        with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got NoneType"):
            sw.prepare(None, sw.DDP())
        with pytest.raises(ValueError, match=r"the model \(ReLU\) has no parameters"):
            sw.prepare(nn.ReLU(), sw.DDP())
        with pytest.raises(TypeError, match=r"^AdamW\(lr='a'\): "):
            sw.prepare(nn.Linear(2, 2), sw.DDP(), lr="a")
    finally:
        runtime.shutdown()


_NEVER_CLOSED = """
import sys, torch, torch.nn.functional as F
import shardwise as sw
model, opt = sw.prepare(torch.nn.Linear(4, 3), sw.ZeRO(offload="disk", offload_dir=sys.argv[1]))
F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 3)).backward()
opt.step()
print(sum(1 for _ in model.disk_step.store.directory.iterdir()))
"""


def test_disk_offload_files_go_with_a_script_that_never_closes(tmp_path):
    """Before: a script that never called `model.close()` left its offloaded state on disk."""
    done = run_python("-c", _NEVER_CLOSED, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0  # (the files were there as it ended)
    assert list(tmp_path.iterdir()) == []


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _step(model, opt, step: int, **kwargs) -> None:
    x, y = _batch(step, model.runtime.rank)
    sw.train_step(model, x, y, F.cross_entropy, **kwargs)
    opt.step()
    opt.zero_grad()


def _refused(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return "taken"


def _flat(model) -> torch.Tensor:
    return torch.cat([v.flatten().float() for v in sw.full_state_dict(model).values()])


def _alone(steps: range) -> torch.Tensor:
    """One process on the global batch (both ranks' batches) of `steps`: the reference."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in steps:
        x, y = (torch.cat(pair) for pair in zip(_batch(step, 0), _batch(step, 1), strict=True))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([v.flatten().float() for v in model.state_dict().values()])


def _misused_steps(name: str, strategy: sw.Strategy, rank: int) -> dict[str, object]:
    said: dict[str, object] = {}
    model, opt = sw.prepare(_model(), strategy, lr=1e-2)
    x, y = _batch(1, rank)
    # A step after a backward inside no_sync() only: its gradients were never reduced.
    with model.no_sync():
        sw.train_step(model, x, y, F.cross_entropy)
    said[f"{name} no_sync step"] = _refused(opt.step)
    said[f"{name} no_sync clip"] = _refused(lambda: sw.clip_grad_norm_(model, 1.0))
    opt.zero_grad()
    # A total of the step's samples on one rank only, then a wrong one on both.
    one = {"total": 8} if rank == 0 else {}
    said[f"{name} total on one"] = _refused(
        lambda: sw.train_step(model, x, y, F.cross_entropy, **one)
    )
    opt.zero_grad()
    said[f"{name} wrong total"] = _refused(
        lambda: sw.train_step(model, x, y, F.cross_entropy, total=9)
    )
    opt.zero_grad()
    said[f"{name} other totals"] = _refused(
        lambda: sw.train_step(model, x, y, F.cross_entropy, total=8 + rank)
    )
    opt.zero_grad()
    _step(model, opt, 2, total=8)  # (right: and then as before)
    _step(model, opt, 3)
    said[f"{name} trained"] = _flat(model)
    model.close()
    said[f"{name} closed forward"] = _refused(lambda: model(x))
    said[f"{name} closed step"] = _refused(opt.step)
    return said


def _misuse(directory: str, token: int) -> dict[str, object]:
    rank = sw.init().rank
    said: dict[str, object] = {}
    # Different models on different ranks: the same parameter count, then another. (Their
    # shared memory named by `token`: what a refused prepare may leave is seen, only it.)
    randbits, shared_memory.secrets.randbits = shared_memory.secrets.randbits, lambda _: token
    other = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))  # (51 + ... = 57 too)
    said["models"] = _refused(lambda: sw.prepare(_model() if rank == 0 else other, sw.DDP()))
    bigger = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 3))
    said["sizes"] = _refused(lambda: sw.prepare(_model() if rank == 0 else bigger, sw.ZeRO()))
    shared_memory.secrets.randbits = randbits
    torch.distributed.barrier()
    said["left in shared memory"] = sorted(Path("/dev/shm").glob(f"shardwise-{token:x}-*"))
    said["strategies"] = _refused(
        lambda: sw.prepare(_model(), sw.DDP() if rank == 0 else sw.ZeRO(stage=2))
    )
    for name, strategy in [
        ("ddp", sw.DDP()),
        ("zero2", sw.ZeRO(stage=2)),
        ("zero3", sw.ZeRO(stage=3)),
    ]:
        said.update(_misused_steps(name, strategy, rank))
    # Checkpoints: one directory for every rank; the model's own optimizer; the same class.
    model, opt = sw.prepare(_model(), sw.ZeRO(stage=2), lr=1e-2)
    _step(model, opt, 0)
    said["directories"] = _refused(
        lambda: sw.save_checkpoint(model, opt, f"{directory}/rank{rank}", step=1)
    )
    other_model, other_opt = sw.prepare(_model(), sw.ZeRO(stage=2), lr=1e-2)
    said["saved with another's"] = _refused(
        lambda: sw.save_checkpoint(model, other_opt, f"{directory}/ckpt", step=1)
    )
    said["steps"] = _refused(
        lambda: sw.save_checkpoint(model, opt, f"{directory}/ckpt", step=1 + rank)
    )
    sw.save_checkpoint(model, opt, f"{directory}/ckpt", step=1)
    said["loaded with another's"] = _refused(
        lambda: sw.load_checkpoint(model, other_opt, f"{directory}/ckpt")
    )
    other_model.close()
    sgd_model, sgd = sw.prepare(
        _model(), sw.ZeRO(stage=2), optimizer=torch.optim.SGD, lr=0.1, momentum=0.9
    )
    _step(sgd_model, sgd, 0)
    said["another class"] = _refused(
        lambda: sw.load_checkpoint(sgd_model, sgd, f"{directory}/ckpt")
    )
    said["same class"] = sw.load_checkpoint(model, opt, f"{directory}/ckpt")
    sgd_model.close()
    model.close()
    return said


def test_misuse_across_ranks_is_refused_on_every_rank(tmp_path):
    token = int.from_bytes(os.urandom(7), "little")
    ranks = spawn.run(_misuse, 2, str(tmp_path), token)
    alone = _alone(range(2, 4))  # (what the steps after the refused ones must give)
    for said in ranks:  # (every rank: one refused alone would leave the other waiting)
        assert said["models"].startswith(
            "NotTheSame: sw.prepare: the model or strategy differs between ranks"
        )
        mine, theirs = "parameter '0.weight' float32[5, 6]", "parameter '0.weight' float32[6, 5]"
        assert f"rank 0 has {mine}, rank 1 has {theirs}" in said["models"]
        assert (
            "rank 1 has parameter '3.weight'" in said["sizes"]
            and "nothing in its place" in said["sizes"]
        )
        assert (
            "rank 0 has strategy DDP(" in said["strategies"]
            and "rank 1 has strategy ZeRO(stage=2" in said["strategies"]
        )
        for name in ("ddp", "zero2", "zero3"):
            for call in ("step", "clip"):
                assert (
                    "RuntimeError: the gradients of the last backward were never reduced"
                    in said[f"{name} no_sync {call}"]
                ), (name, call)
            assert "declared on 1 of the 2 data-parallel ranks" in said[f"{name} total on one"], (
                name
            )
            assert (
                "total=9 samples declared, but the 2 data-parallel ranks declared 8"
                in said[f"{name} wrong total"]
            ), name
            assert "ranks declared different totals" in said[f"{name} other totals"], name
            assert torch.allclose(said[f"{name} trained"], alone, rtol=0, atol=1e-6), name
            for call in ("forward", "step"):
                assert "was closed (model.close() released" in said[f"{name} closed {call}"], (
                    name,
                    call,
                )
        given = "NotTheSame: save_checkpoint: what was given differs between ranks: rank 0 has"
        assert said["directories"].startswith(f"{given} directory {tmp_path}/rank0, rank 1")
        assert said["steps"] == f"{given} step 1, rank 1 has step 2"
        for case in ("saved with another's", "loaded with another's"):
            assert (
                "the optimizer is not this model's: pass the one sw.prepare returned" in said[case]
            ), case
        assert "ckpt: holds AdamW state, not this SGD's" in said["another class"]
        assert said["same class"] == 1
        assert said["left in shared memory"] == []  # (before: a segment a prepare made)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # (no half-written .tmp)
