"""The full mesh: data x tensor x pipeline parallel at once, ZeRO-3 along the data axis, against
single-process training after 10 AdamW steps on the same global batches, clipped by the global
norm; its full state dict, exact resume and a reshardable checkpoint loaded into another layout
(one 8-rank spawn: our TinyGPT, and a Hugging Face Llama with transformers' TP plan and
hf_stages' cut); dp x tp and dp x pp with ZeRO-3 on that Llama, and the shapes that do not fit,
refused in one line (one 4-rank spawn); ZeRO offloaded to host memory and to disk along the
data axis of dp x tp and dp x pp (another)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.checkpoint.reshardable import full_weights
from shardwise.nn.models import TinyGPT, lm_loss
from shardwise.strategies.mesh_parallel import MeshConfig
from spawn import run
from state_diff import max_abs_diff

STEPS, RESUME_AT = 10, 5
BATCH = 8  # global batch: 2 replicas x 4 samples, 2 micro-batches of 2 per replica
VOCAB = 11  # splits unevenly over 2 tensor-parallel ranks (6 + 5)
MAX_NORM = 0.3  # below the gradients' norm at every step (checked): clipping acts each step
# fp32 throughout. Split matmuls, the tp all-reduces and ZeRO's reduce-scatter add in other
# orders than one process does (a few ulps per step); AdamW's m/sqrt(v) keeps each update
# below lr, so after 10 steps the weights differ by ~1e-7 (measured figures in the report).
TOL = 1e-5


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, seq_len=8, d_model=16, n_layer=2, n_head=4)


def _batch(step: int):
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> tuple[list[dict], list[float]]:
    """One process on the whole batches, clipped as the mesh clips: the state after each step
    and the gradient norm before each clip."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        lm_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states, norms


def _steps(model, opt, steps: range) -> list[float]:
    """Train `steps` of the global batches, this rank on its replica's share; the norms."""
    replicas, index = sw.data_shard(model)
    share = BATCH // replicas
    norms = []
    for step in steps:
        x, y = (t[index * share : (index + 1) * share] for t in _batch(step))
        sw.train_step(model, x, y, lm_loss)
        norms.append(sw.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return norms


def _mesh(data: sw.Strategy | None = None, **sizes) -> sw.MeshParallel:
    pipeline = sw.Pipeline(schedule="1f1b", microbatches=2)
    return sw.MeshParallel(**sizes, data=data or sw.ZeRO(stage=3), pipeline=pipeline)


def _full_mesh(directory: str) -> dict:
    """dp 2 x tp 2 x pp 2 with ZeRO-3 on 8 ranks: straight, resumed exactly from its own
    state at step 5, and resumed from its reshardable checkpoint on dp 4 x tp 2 (ZeRO-3)."""
    states, ref_norms = _reference()
    model, opt = sw.prepare(_gpt(), _mesh(dp=2, tp=2, pp=2), lr=1e-3)
    norms = _steps(model, opt, range(RESUME_AT))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # (torch's holds the live tensors)
    sw.save_checkpoint(model, opt, directory, step=RESUME_AT)
    at_save = sw.full_state_dict(model)
    norms += _steps(model, opt, range(RESUME_AT, STEPS))
    straight = sw.full_state_dict(model)
    model.close()

    resumed, opt = sw.prepare(_gpt(), _mesh(dp=2, tp=2, pp=2), lr=1e-3)
    resumed.load_state_dict(saved)
    opt.load_state_dict(saved_opt)
    _steps(resumed, opt, range(RESUME_AT, STEPS))
    exact = sw.full_state_dict(resumed)
    resumed.close()

    other, opt = sw.prepare(_gpt(), _mesh(dp=4, tp=2), lr=1e-3)
    assert sw.load_checkpoint(other, opt, directory) == RESUME_AT
    _steps(other, opt, range(RESUME_AT, STEPS))
    resharded = sw.full_state_dict(other)
    other.close()

    # DDP along the data axis: its replicas' gradients are counted once in the norm.
    ddp, opt = sw.prepare(_gpt(), _mesh(sw.DDP(), dp=2, tp=2, pp=2), lr=1e-3)
    ddp_norms = _steps(ddp, opt, range(STEPS))
    ddp_state = sw.full_state_dict(ddp)
    ddp.close()
    # A Hugging Face model on the full mesh, where transformers (the optional extra) is.
    llama = None
    if importlib.util.find_spec("transformers"):
        llama = _llama_trained({"dp2_tp2_pp2": _mesh(dp=2, tp=2, pp=2)})["dp2_tp2_pp2"]
    return {
        "straight": max_abs_diff(straight, states[-1]),
        "at_save": max_abs_diff(at_save, states[RESUME_AT - 1]),
        "checkpoint_file": max_abs_diff(full_weights(directory), states[RESUME_AT - 1]),
        "norms": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
        "clipped": min(ref_norms) > MAX_NORM,
        "exact_resume": all(torch.equal(straight[k], exact[k]) for k in straight),
        "resharded": max_abs_diff(resharded, states[-1]),
        "ddp": max_abs_diff(ddp_state, states[-1]),
        "ddp_norms": max(abs(a - b) / b for a, b in zip(ddp_norms, ref_norms, strict=True)),
        "llama": llama,
    }


def test_dp2_tp2_pp2_zero3_equals_one_process_and_resumes(tmp_path):
    results = run(_full_mesh, 8, str(tmp_path / "ckpt"), timeout_s=600)
    for r in results:
        # The norm is summed in another order (per shard, then over the mesh): relative 1e-6.
        assert r["clipped"] and r["norms"] <= 1e-6 and r["ddp_norms"] <= 1e-6, r
        assert r["exact_resume"], r
        for key in ("straight", "at_save", "checkpoint_file", "resharded", "ddp"):
            assert r[key] <= TOL, (key, r)
        assert r["llama"] is None or r["llama"] <= TOL, r


# ---- a Hugging Face model: dp 2 x tp 2 and dp 2 x pp 2, ZeRO-3 -------------------------------
def _llama_trained(meshes: dict[str, sw.MeshParallel]) -> dict[str, float]:
    """A Hugging Face Llama (transformers' TP plan, hf_stages' cut) on each mesh against one
    process: max abs difference of the full state dicts after STEPS AdamW steps."""
    H = pytest.importorskip("hf_models")
    reference = H.build("llama")
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(STEPS):
        reference(**H.make_batch("llama", 4, step)).loss.backward()
        opt.step()
        opt.zero_grad()
    expected, out = reference.state_dict(), {}
    for name, strategy in meshes.items():
        model, opt = sw.prepare(H.build("llama"), strategy, lr=1e-3)
        replicas, index = sw.data_shard(model)
        assert replicas == 2
        for step in range(STEPS):
            mine = H.rows(H.make_batch("llama", 4, step), 2 * index, 2 * index + 2)
            if strategy.pp > 1:  # a pipeline runs its schedule: HF's loss on the last stage
                sw.train_step(model, mine, None, lambda out, _: out.loss)
            else:  # the HF idiom
                model(**mine).loss.backward()
            opt.step()
            opt.zero_grad()
        out[name] = max_abs_diff(sw.full_state_dict(model), expected)
        model.close()
    return out


def _llama_meshes() -> dict:
    H = pytest.importorskip("hf_models")
    out = _llama_trained({"dp2_tp2": _mesh(dp=2, tp=2), "dp2_pp2": _mesh(dp=2, pp=2)})
    out["refusals"] = [
        _refusal(H.build("llama"), sw.MeshParallel(dp=1, tp=4)),
        _refusal(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), sw.MeshParallel(dp=1, pp=4)),
        _refusal(H.build("llama"), sw.MeshParallel(dp=2, tp=2, pp=2)),
        _refusal(H.build("gpt2"), _mesh(dp=2, pp=2)),  # its embedding is its head
    ]
    return out if dist.get_rank() == 0 else {}


def _refusal(model: nn.Module, strategy: sw.Strategy) -> str:
    try:
        sw.prepare(model, strategy, lr=1e-3)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_dp2_tp2_and_dp2_pp2_zero3_on_llama_equal_one_process():
    pytest.importorskip("transformers")
    result = run(_llama_meshes, 4, timeout_s=300)[0]
    assert result["dp2_tp2"] <= TOL and result["dp2_pp2"] <= TOL, result
    assert result["refusals"] == [
        "model.layers.0.self_attn.k_proj: 2 attention heads do not split over 4 "
        "tensor-parallel ranks",
        "cannot split 2 layers into 4 pipeline stages",
        "mesh dp=2 x tp=2 x pp=2 = 8 ranks, but the world has 4",
        "a weight tied across pipeline stages needs sw.DDP() along the data axis, not ZeRO",
    ], result["refusals"]


def test_mesh_config_takes_zero3_and_all_three_axes():
    built = MeshConfig(dp=2, tp=2, pp=2, data="zero3", microbatches=2).build(8, Path("."))
    assert (built.dp, built.tp, built.pp) == (2, 2, 2) and built.data == sw.ZeRO(stage=3)
    assert built.pipeline.microbatches == 2
    with pytest.raises(ValueError, match=r"data must be sw.DDP\(\) or sw.ZeRO\(stage=1\|2\|3\)"):
        sw.MeshParallel(tp=2, data=sw.Pipeline())


# ---- ZeRO offload along a mesh's data axis ------------------------------------------------
def _offloaded(directory: str) -> dict[str, float]:
    """dp 2 x tp 2 with ZeRO-2 offloaded to host memory, dp 2 x pp 2 with ZeRO-3 offloaded to
    disk (fp32 masters apart from the compute copy): max abs difference from one process."""
    states, _ = _reference()
    meshes = {
        "dp2_tp2_zero2_cpu": _mesh(sw.ZeRO(stage=2, offload="cpu"), dp=2, tp=2),
        "dp2_pp2_zero3_disk": _mesh(
            sw.ZeRO(stage=3, offload="disk", offload_dir=directory), dp=2, pp=2
        ),
    }
    out = {}
    for name, strategy in meshes.items():
        model, opt = sw.prepare(_gpt(), strategy, lr=1e-3)
        _steps(model, opt, range(STEPS))
        out[name] = max_abs_diff(sw.full_state_dict(model), states[-1])
        model.close()
    out["disk_files_left"] = len(list(Path(directory).iterdir()))  # (each rank's, removed)
    return out


def test_zero_offload_along_the_data_axis_equals_one_process(tmp_path):
    result = run(_offloaded, 4, str(tmp_path), timeout_s=300)[0]
    assert result.pop("disk_files_left") == 0, result
    assert all(diff <= TOL for diff in result.values()), result
    built = MeshConfig(dp=2, tp=2, data="zero3", mixed_precision="bf16", offload="disk")
    data = built.build(4, tmp_path).data
    assert (data.stage, data.mixed_precision, data.offload) == (3, "bf16", "disk")
    assert data.offload_dir == str(tmp_path)  # (`shardwise train`: the run directory)
    with pytest.raises(ValueError, match="offload='cpu' is ZeRO's: set data to zero1"):
        MeshConfig(dp=2, tp=2, offload="cpu")
