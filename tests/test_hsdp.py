"""HSDP: ZeRO-3 sharded over groups of K ranks and replicated across the groups
(`sw.ZeRO(stage=3, shard_group=K)`), here 4 ranks in 2 groups of 2, on a Hugging Face GPT-2
nobody here wrote (tied embeddings, a frozen parameter, gradient clipping).

One 4-rank run checks: 10 AdamW steps equal one process on the same global batches (and what
torch's DDP reaches there); the clipped norm is the one process's (each element counted once);
the bytes each collective sends per step are the formula's, from the parameter counts and the
two groups' sizes, and the planner's; each rank holds 1/K of the state; a reshardable
checkpoint saved under HSDP loads into whole-world ZeRO-3 and into a plain single-process
model and AdamW, and one more step from each matches (its exact, per-rank state round trip is
test_state's). Fast checks: the option's errors, and the planner's pricing of HSDP on a cluster
of several nodes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hf_models as H
import shardwise as sw
from shardwise.checkpoint.reshardable import read_full_state
from shardwise.plan.costs import CostJob
from shardwise.plan.predictors import predict
from shardwise.plan.search import PRESETS, ClusterSpec, Plan, candidates, price
from shardwise.strategies.zero import ZeRO, ZeROConfig
from spawn import run

STEPS, BATCH, LR, CLIP = 10, 2, 1e-3, 0.5  # BATCH samples per rank
K = 2  # ranks per shard group
FROZEN = "transformer.wpe.weight"


def _build() -> torch.nn.Module:
    model = H.build("gpt2")  # tied: lm_head.weight is transformer.wte.weight
    model.get_parameter(FROZEN).requires_grad_(False)
    return model


def _step(model, opt, step: int, rows: slice, clip: bool = True) -> float:
    """One step on `rows` of the global batch of `step`; the gradients' norm before clipping."""
    batch = H.make_batch("gpt2", 4 * BATCH, step)
    model(**{k: v[rows] for k, v in batch.items()}).loss.backward()
    norm = sw.clip_grad_norm_(model, CLIP).item() if clip else None
    opt.step()
    opt.zero_grad()
    return norm


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _bytes_formula(unit_numels: list[int], gathers: list[int], world: int) -> dict[str, int]:
    """One stage-3 HSDP step's bytes per rank, from each unit's parameter count: the unit padded
    to a multiple of K, S = its elements per rank; its gradients reduce-scattered among K ranks
    (gloo's ranks on one host: an exchange of its slices, an all-to-all) and `gathers`
    all-gathers among them, an all-reduce of S among the world / K replicas."""
    replicas, fp32 = world // K, 4
    padded = [-(-u // K) * K for u in unit_numels]
    in_group = [(K - 1) * p * fp32 // K for p in padded]
    across = sum(2 * (replicas - 1) * (p // K) * fp32 // replicas for p in padded)
    return {
        "all_to_all": sum(in_group),
        "all_gather": sum(g * b for g, b in zip(gathers, in_group, strict=True)),
        "all_reduce": across,
    }


def _odd_mlp() -> torch.nn.Sequential:
    """Units of 91 and 40 trainable elements (one not divisible by K: padded), a frozen bias."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    model[0].bias.requires_grad_(False)
    return model


def stages_on_an_odd_mlp(rank: int) -> dict[int, float]:
    """Stages 1-3 under HSDP against one process, 10 AdamW steps: max abs differences."""

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4 * BATCH, 13, generator=g), torch.randint(
            0, 5, (4 * BATCH,), generator=g
        )

    reference = _odd_mlp()
    ref_opt = _adamw(reference)
    for s in range(STEPS):
        x, y = batch(s)
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out = {}
    for stage in (1, 2, 3):
        model, opt = sw.prepare(_odd_mlp(), sw.ZeRO(stage=stage, shard_group=K), lr=LR)
        for s in range(STEPS):
            x, y = (t[rank * BATCH : (rank + 1) * BATCH] for t in batch(s))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[stage] = _max_diff(model.full_state_dict(), reference.state_dict())
        model.close()
    return out


def hsdp_run(directory: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    H.transformers.logging.set_verbosity_error()
    everything, mine = slice(None), slice(rank * BATCH, (rank + 1) * BATCH)
    reference = _build()
    ref_opt = _adamw(reference)
    ref_norms = [_step(reference, ref_opt, s, everything) for s in range(STEPS)]
    torch_ddp = DistributedDataParallel(_build())
    ddp_opt = _adamw(torch_ddp)
    for s in range(STEPS):
        _step(torch_ddp, ddp_opt, s, mine)
    # (every unit freed after its forward: the gathers for backward counted too)
    model, opt = sw.prepare(_build(), sw.ZeRO(stage=3, shard_group=K, keep_gathered_mb=0), lr=LR)
    norms = [_step(model, opt, s, mine) for s in range(STEPS)]
    out = {
        "diff": _max_diff(model.full_state_dict(), reference.state_dict()),
        "torch_ddp": _max_diff(torch_ddp.module.state_dict(), reference.state_dict()),
        "norms": (norms, ref_norms),
        "tied": model.module.lm_head.weight is model.module.transformer.wte.weight,
    }
    # Memory: each rank holds 1/K of every unit (padded), as master weights and Adam's moments.
    unit_numels = [sum(p.numel() for p in u.params) for u in model.units]
    out["held"] = (sum(s.numel() for s in model.shards), unit_numels)
    out["memory"] = sw.memory_report(model, opt)
    with torch.device("meta"):
        job = CostJob(_build(), world, rank)
    predicted = predict(job, ZeROConfig(stage=3, shard_group=K, keep_gathered_mb=0))
    out["predicted"] = (predicted.memory, predicted.comm)

    # A reshardable checkpoint, loaded into whole-world ZeRO-3 and into one plain process.
    full = model.full_state_dict()
    sw.save_checkpoint(model, opt, directory, step=STEPS)
    other, other_opt = sw.prepare(_build(), sw.ZeRO(stage=3), lr=LR)
    sw.load_checkpoint(other, other_opt, directory)
    out["loaded_exact"] = _max_diff(other.full_state_dict(), full) == 0.0
    params, states, _ = read_full_state(directory)
    plain = _build()
    plain.load_state_dict(params, strict=False)  # (GPT-2's causal mask buffers are not saved)
    plain_opt = _adamw(plain)
    for name, p in plain.named_parameters():
        if p.requires_grad:
            plain_opt.state[p] = {k: v.clone() for k, v in states[name].items()}
    out["plain_exact"] = _max_diff(plain.state_dict(), full) == 0.0

    # One more step from each (unclipped: its bytes are the strategy's alone).
    sw.comm.stats.end_step()
    _step(model, opt, STEPS, mine, clip=False)
    out["by_op"] = {op: t.bytes for op, t in sw.comm.stats.end_step().by_op.items()}
    _step(other, other_opt, STEPS, mine, clip=False)
    _step(plain, plain_opt, STEPS, everything, clip=False)
    after = model.full_state_dict()
    out["resumed"] = (
        _max_diff(other.full_state_dict(), after),
        _max_diff(plain.state_dict(), after),
    )
    # Each block is gathered for its forward and again for its backward; the tied embedding,
    # which two modules use, belongs to no block: it is gathered once, for the whole step.
    tied = model.module.lm_head.weight
    gathers = [1 if any(p is tied for p in u.params) else 2 for u in model.units]
    out["formula"] = _bytes_formula(unit_numels, gathers, world)
    for m in (model, other):
        m.close()
    out["odd_mlp"] = stages_on_an_odd_mlp(rank)
    return out


def test_hsdp_4_ranks_in_2_groups_equals_one_process(tmp_path):
    for rank, r in enumerate(run(hsdp_run, 4, str(tmp_path / "ckpt"), timeout_s=300)):
        # 1e-5 in fp32, or torch's DDP where reduction order alone moves AdamW further.
        assert r["diff"] <= max(1e-5, r["torch_ddp"]), r
        assert r["tied"]
        norms, ref_norms = r["norms"]
        assert norms[0] > CLIP  # clipping acts, with the one process's norm at every step
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        # Bytes per step: reduce-scatter and all-gathers within the group of K, the slice's
        # all-reduce across the replicas: the formula's, and the planner's.
        assert r["by_op"] == r["formula"], r["by_op"]
        memory, comm = r["predicted"]
        assert comm == pytest.approx(r["formula"])
        # Memory: 1/K of each unit (padded), stepped by AdamW (two moments of as many).
        held, unit_numels = r["held"]
        assert held == sum(-(-u // K) for u in unit_numels)
        assert held * K - sum(unit_numels) < K * len(unit_numels)  # (padding only)
        assert r["memory"]["master_weights"] == 4 * held == memory["master_weights"]
        assert r["memory"]["optimizer"] == memory["optimizer"]
        assert 8 * held <= memory["optimizer"] <= 8 * held + 8 * len(unit_numels)  # + steps
        # The checkpoint: exact in another layout and in one process; one more step agrees.
        assert r["loaded_exact"] and r["plain_exact"], rank
        assert max(r["resumed"]) <= 1e-5, r["resumed"]
        # Stages 1 and 2 shard the same way; padded units and a frozen bias.
        assert max(r["odd_mlp"].values()) <= 1e-5, r["odd_mlp"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"shard_group": 0}, r"ZeRO\(shard_group=0\): Input should be greater than or equal to 1"),
        ({"shard_group": 2, "compression": "fp16"}, "with shard_group=2: codecs run on"),
    ],
)
def test_bad_shard_groups_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message):
        ZeRO(stage=3, **options)


def test_a_shard_group_must_divide_the_world():
    with pytest.raises(ValueError, match="shard_group=3 must divide the world size 4"):
        ZeROConfig(stage=3, shard_group=3).build(4, Path("unused"))
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ZeROConfig(stage=3, shard_group=0)


def test_the_planner_prices_hsdp_where_the_world_spans_nodes():
    spec, cluster = PRESETS["70b"], ClusterSpec(devices=64, network_gbit=100)  # 8 nodes of 8
    hybrid = [p for p in candidates(spec, cluster) if p.shard_group]
    assert {(p.dp, p.tp, p.pp, p.zero, p.shard_group) for p in hybrid} == {(64, 1, 1, 3, 8)}
    assert not any(p.shard_group for p in candidates(spec, ClusterSpec(devices=8)))  # one node
    base = Plan(64, 1, 1, zero=3, micro_batch=1, microbatches=1, checkpointing=True, offload=False)
    zero3 = price(base, spec, cluster)
    hsdp = price(replace(base, shard_group=8), spec, cluster)
    assert "hsdp8" in hsdp.strategy
    for part in ("params", "grads", "optimizer"):  # model states over 8 ranks, not 64
        assert hsdp.memory[part] == pytest.approx(zero3.memory[part] * 64 / 8)
    # Bytes (one micro-batch: no accumulation, whose gathers repeat): ZeRO-3's 1.5 all-reduces
    # of G among 64; HSDP's reduce-scatter and two all-gathers of G among 8, an all-reduce of
    # G/8 among the 8 nodes.
    g = zero3.comm_bytes["data"] / (1.5 * 2 * 63 / 64)
    assert hsdp.comm_bytes["data"] == pytest.approx(g * (3 * 7 / 8 + 2 * 7 / 8 / 8))
    # Most of it over NVLink: on a slow network HSDP's exposed communication is less (16
    # micro-batches: ZeRO-3's gathers repeat and outlast the backward they overlap).
    many = replace(base, micro_batch=1, microbatches=16)
    zero3, hsdp = price(many, spec, cluster), price(replace(many, shard_group=8), spec, cluster)
    assert hsdp.time["data"] < zero3.time["data"] / 5
