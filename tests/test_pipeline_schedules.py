"""Interleaved 1F1B and ZB-H1 against one process on the same batches, and against
torch.distributed.pipelining's schedules of the same names (ScheduleInterleaved1F1B;
ScheduleInterleavedZeroBubble with one stage per rank, which is ZB-H1's order) on one step's loss
and gradients; on a plain nn.Sequential of odd widths, on a Hugging Face GPT-2 whose embedding is
tied to its head across the ranks, read from the meta device, and data parallel on a mesh."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.strategies.pipeline_schedule import SCHEDULES, schedule_order
from shardwise.strategies.pipeline_stages import PipelineStage
from spawn import run
from state_diff import max_abs_diff

STEPS, BATCH, LR = 10, 12, 1e-2
# fp32 summation order (micro-batches, stages) over 10 AdamW steps: the exactness bar.
TOL = 1e-5
# One step against torch: the same kernels on the same micro-batches.
TORCH_TOL = 1e-6
ACCUMULATE_REFUSED = (
    "a pipeline already accumulates gradients over its micro-batches: raise the strategy's "
    "microbatches (K times as many) instead of accumulating K steps"
)


def _sequential() -> nn.Sequential:
    """Odd widths (every boundary a different shape), six layers with weights: 2 ranks x 3
    chunks at most."""
    torch.manual_seed(0)
    widths = [7, 13, 11, 9, 10, 6, 5]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 7, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _reference() -> dict[str, torch.Tensor]:
    model = _sequential()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(strategy: sw.Strategy, model: nn.Module | None = None, source=None) -> dict:
    """10 steps of `strategy`, each replica on its share of the global batch."""
    model, opt = sw.prepare(model or _sequential(), strategy, lr=LR, source=source)
    replicas, index = sw.data_shard(model)
    share = BATCH // replicas
    for step in range(STEPS):
        x, y = (t[index * share : (index + 1) * share] for t in _batch(step))
        sw.train_step(model, x, y, F.cross_entropy)
        opt.step()
        opt.zero_grad()
    state = sw.full_state_dict(model)
    model.close()
    return state


class DictSource:
    """Tensors from a state dict in memory, for a model built on the meta device."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def read(self, name: str) -> torch.Tensor:
        return self.state[name].clone()


def _one_step_ours(schedule: str, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Our loss and this rank's gradients (under the model's names) after one step."""
    model, _ = sw.prepare(_sequential(), sw.Pipeline(stages=2, schedule=schedule, microbatches=m))
    loss = sw.train_step(model, *_batch(0), F.cross_entropy)
    stage = model.stage.named_parameters()
    return loss.item(), {model.names[k][0]: p.grad for k, p in stage}


def _one_step_torch(schedule: str, m: int, chunks: int) -> tuple[float | None, dict]:
    """torch.distributed.pipelining's schedule of the same name, on the same cut."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import (
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _sequential()
    layers = list(model)
    bounds = [*sw.Pipeline(stages=world, schedule=schedule).stage_starts(layers), len(layers)]
    stages = [
        TorchStage(PipelineStage(layers[bounds[g] : bounds[g + 1]]), g, len(bounds) - 1, "cpu")
        for g in range(rank, len(bounds) - 1, world)
    ]
    assert len(stages) == chunks
    cls = ScheduleInterleaved1F1B if schedule == "interleaved" else ScheduleInterleavedZeroBubble
    pipeline = cls(stages, n_microbatches=m, loss_fn=F.cross_entropy)
    x, y = _batch(0)
    losses: list[torch.Tensor] = []
    if rank == 0:
        pipeline.step(x)
    else:
        pipeline.step(target=y, losses=losses)
    names = {p: n for n, p in model.named_parameters()}
    grads = {names[p]: p.grad for s in stages for p in s.submod.parameters()}
    return (torch.stack(losses).mean().item() if losses else None), grads


def _gpt2_runs() -> dict[str, float]:
    """GPT-2 (its embedding tied to its head, on different ranks) under both schedules."""
    import hf_models as H

    def train(strategy=None):
        model = H.build("gpt2")
        if strategy is not None:
            model, opt = sw.prepare(model, strategy, lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(STEPS):
            batch = H.make_batch("gpt2", 8, step)
            if strategy is None:
                model(**batch).loss.backward()
            else:
                sw.train_step(model, batch, None, lambda out, _: out.loss)
            opt.step()
            opt.zero_grad()
        return model.state_dict() if strategy is None else sw.full_state_dict(model)

    expected = train()
    return {
        f"gpt2 {s}": max_abs_diff(
            train(sw.Pipeline(stages=2, schedule=s, microbatches=4)), expected
        )
        for s in ("zb-h1", "interleaved")
    }


def _two_ranks() -> dict:
    expected = _reference()
    out: dict = {}
    runs = {
        "1f1b": sw.Pipeline(schedule="1f1b", microbatches=4),
        "zb-h1": sw.Pipeline(schedule="zb-h1", microbatches=4),
        "interleaved": sw.Pipeline(schedule="interleaved", microbatches=4),
        "interleaved v=3 M=2": sw.Pipeline(
            schedule="interleaved", microbatches=2, virtual_stages=3
        ),
    }
    states = {name: _train(strategy) for name, strategy in runs.items()}
    out.update({name: max_abs_diff(state, expected) for name, state in states.items()})
    # B and W run the kernels a whole backward runs, on the same values: bit for bit 1F1B.
    out["zb-h1 is 1f1b bitwise"] = all(
        torch.equal(states["zb-h1"][k], states["1f1b"][k]) for k in expected
    )
    with torch.device("meta"):
        meta = _sequential()
    source = DictSource(_sequential().state_dict())
    meta_run = sw.Pipeline(schedule="interleaved", microbatches=4)
    out["interleaved from meta"] = max_abs_diff(_train(meta_run, meta, source), expected)
    for schedule, m, chunks in (("interleaved", 4, 2), ("zb-h1", 4, 1), ("zb-h1", 2, 1)):
        loss, grads = _one_step_ours(schedule, m)
        torch_loss, torch_grads = _one_step_torch(schedule, m, chunks)
        assert grads.keys() == torch_grads.keys()
        out[f"torch {schedule} M={m} grads"] = max_abs_diff(grads, torch_grads)
        out[f"torch {schedule} M={m} loss"] = 0.0 if torch_loss is None else abs(loss - torch_loss)
    out.update(_gpt2_runs())
    try:
        sw.prepare(_sequential(), sw.Pipeline(schedule="interleaved", microbatches=3))
    except ValueError as e:
        out["refused"] = str(e)
    model, _ = sw.prepare(_sequential(), sw.Pipeline(microbatches=2))
    try:  # (before any forward: nothing half-run)
        sw.train_step(model, *_batch(0), F.cross_entropy, accumulate=2)
    except ValueError as e:
        out["accumulate refused"] = str(e)
    return out


def test_new_schedules_equal_one_process_and_torchs_schedules():
    for result in run(_two_ranks, 2, timeout_s=300):
        assert result.pop("zb-h1 is 1f1b bitwise") is True
        assert result.pop("accumulate refused") == ACCUMULATE_REFUSED
        assert result.pop("refused") == (
            "interleaved runs micro-batches in rounds of one per stage: microbatches=3 must be "
            "a multiple of stages=2 (>= 2)"
        )
        for name, diff in result.items():
            bound = TORCH_TOL if name.startswith("torch") else TOL
            assert diff <= bound, (name, diff)


def _mesh() -> dict[str, float]:
    """dp=2 x pp=2: each stage's gradients reduced along the data axis once, after the last
    weight gradient (a reduction too early would miss some, one per backward would fail)."""
    expected = _reference()
    out = {}
    for schedule, data in (("zb-h1", sw.DDP()), ("interleaved", sw.DDP()), ("zb-h1", sw.ZeRO())):
        pipeline = sw.Pipeline(schedule=schedule, microbatches=2)
        strategy = sw.MeshParallel(dp=2, pp=2, data=data, pipeline=pipeline)
        out[f"{schedule} {type(data).__name__}"] = max_abs_diff(_train(strategy), expected)
    pipeline = sw.Pipeline(schedule="zb-h1", microbatches=2)
    try:
        sw.prepare(
            _sequential(), sw.MeshParallel(dp=2, pp=2, data=sw.ZeRO(stage=2), pipeline=pipeline)
        )
    except ValueError as e:
        out["refused"] = str(e)
    mesh = sw.MeshParallel(dp=2, pp=2, pipeline=sw.Pipeline(microbatches=2))
    model, _ = sw.prepare(_sequential(), mesh)
    try:
        with sw.no_sync(model):
            pass
    except ValueError as e:
        out["no_sync refused"] = str(e)
    return out


def test_new_schedules_data_parallel_on_a_mesh():
    for result in run(_mesh, 4, timeout_s=300):
        assert result.pop("no_sync refused") == ACCUMULATE_REFUSED
        assert result.pop("refused") == (
            "the zb-h1 schedule needs sw.DDP() or sw.ZeRO(stage=1) along the data axis, not "
            "ZeRO stage 2"
        )
        for name, diff in result.items():
            assert diff <= TOL, (name, diff)


@pytest.mark.parametrize("stages,m", [(2, 2), (2, 8), (3, 6), (4, 8)])
def test_orders_run_every_op_once_and_zb_h1_holds_what_1f1b_holds(stages, m):
    for s in range(stages):
        for v in (2, 3):
            order = schedule_order("interleaved", s, stages, m, v)
            assert sorted(order) == sorted(
                (k, i, c) for k in "BF" for i in range(m) for c in range(v)
            )
        zb = schedule_order("zb-h1", s, stages, m)
        assert sorted(zb) == sorted((k, i, 0) for k in "BFW" for i in range(m))
        # Without its W ops, zb-h1 is 1f1b; each W comes after its own B.
        assert [op for op in zb if op[0] != "W"] == schedule_order("1f1b", s, stages, m)
        assert all(zb.index(("B", i, 0)) < zb.index(("W", i, 0)) for i in range(m))


def test_bad_schedule_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"Pipeline\(schedule='zbv'\): Input should be .*'zb-h1'"):
        sw.Pipeline(schedule="zbv")
    with pytest.raises(ValueError, match="interleaved needs virtual_stages >= 2"):
        sw.Pipeline(schedule="interleaved", virtual_stages=1)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved'"):
        sw.Pipeline(schedule="zb-h1", virtual_stages=2)
    assert "interleaved" in SCHEDULES
