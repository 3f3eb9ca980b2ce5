"""The device mesh's cost model (`strategies.mesh_parallel`): dp replicas of a model split by
tensor parallel (tp), by pipeline stages (pp), or both. Each rank costs what its model piece
costs (`tensor_parallel`, `pipeline`; under both, the pipeline's stage of the tensor-parallel
slices, `tp_local`, with its share of tensor parallel's all-reduces), on its replica's share of
the batch, plus the data axis's all-reduce of that piece's gradients in DDP's buckets
(Narayanan et al., 2021's "PTD-P")."""

from __future__ import annotations

from dataclasses import replace

from shardwise.comm.accounting import native_volume
from shardwise.distributed.mesh import coordinates
from shardwise.plan.cost_models import CostModel
from shardwise.plan.cost_models.ddp_costs import ddp_costs
from shardwise.plan.cost_models.pipeline_costs import (
    num_chunks,
    pipeline_compute,
    pipeline_stages,
    pp_costs,
    rank_chunks,
)
from shardwise.plan.cost_models.tensor_parallel_costs import (
    _tokens,
    tp_calls,
    tp_compute,
    tp_costs,
    tp_local,
)
from shardwise.plan.costs import FP32, CostJob, Costs, bucket_sizes
from shardwise.plan.work import Compute, replica_compute
from shardwise.strategies.ddp import DDPConfig
from shardwise.strategies.section import StrategySection


def sizes(s: StrategySection, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp): the options' tp and pp, and the replicas they leave of the world."""
    return world_size // (s.tp * s.pp), s.tp, s.pp


def mesh_costs(job: CostJob, s: StrategySection) -> Costs:
    """This rank's model piece, and its data axis's all-reduces."""
    dp, tp, pp = sizes(s, job.world_size)
    where = coordinates(job.rank, {"dp": dp, "tp": tp, "pp": pp})
    samples = job.global_batch // dp
    if tp > 1 and pp > 1:
        costs = tp_pp_costs(job, s, (tp, where["tp"]), (pp, where["pp"]), samples, dp > 1)
    elif tp > 1:
        costs = tp_costs(job, s, tp, where["tp"], samples, data_parallel=dp > 1)
    elif pp > 1:
        costs = pp_costs(job, s, pp, where["pp"], samples, data_parallel=dp > 1)
    else:
        costs = ddp_costs(replace(job, world_size=dp, global_batch=job.global_batch), DDPConfig())
    if s.data != "ddp":
        costs.notes.append(f"mesh data axis {s.data}: only DDP's bytes and memory predicted")
    if dp > 1 and (tp > 1 or pp > 1):  # the data axis all-reduces each model piece's gradients
        pieces = costs.optimizer_numels[::-1]  # this rank's tensors, reverse registration order
        for numel in bucket_sizes(pieces, FP32, DDPConfig().bucket_mb):
            costs.add_comm("all_reduce", native_volume("all_reduce", numel * FP32, dp), ranks=dp)
    return costs


def tp_pp_costs(job: CostJob, s, tp: tuple, pp: tuple, samples: int, data_parallel) -> Costs:
    """Stage pp[1] of pp[0] of the model as tp rank tp[1] of tp[0] holds it (its slices), and
    that stage's share of tensor parallel's all-reduces (the share of the split layers it holds:
    the blocks' are alike)."""
    local = tp_local(job, s.loss_parallel, *tp)
    costs = pp_costs(local, s, pp[0], pp[1], samples, data_parallel)
    tokens = _tokens(job, samples)
    if tokens is not None:
        layers, starts = pipeline_stages(local, pp[0] * num_chunks(s), None)
        bounds = [*starts, len(layers)]
        held = [
            x
            for g in rank_chunks(pp[1], pp[0], num_chunks(s))
            for x in layers[bounds[g] : bounds[g + 1]]
        ]
        share = _split_layers(held) / max(_split_layers(layers), 1)
        for nbytes, calls in tp_calls(job.model, tp[0], tokens):
            costs.add_comm("all_reduce", nbytes * calls * share, calls * share, ranks=tp[0])
    return costs


def _split_layers(layers: list) -> int:
    return sum(1 for layer in layers for m in layer.modules() if hasattr(m, "splits"))


def mesh_compute(
    job: CostJob, s: StrategySection, costs: Costs, cal: dict, shared: dict | None
) -> Compute:
    """This rank's model piece's step, on its replica's share of the batch."""
    dp, tp, pp = sizes(s, job.world_size)
    if pp > 1 and tp > 1:  # the pipeline of this rank's tensor-parallel slices
        local = tp_local(job, s.loss_parallel, tp, job.rank % tp)
        return pipeline_compute(local, s, pp, dp, cal, shared)
    if pp > 1:
        return pipeline_compute(job, s, pp, dp, cal, shared)
    if tp > 1:
        return tp_compute(job, s, costs, tp, dp, cal, shared)
    return replica_compute(job, job.global_batch // dp, costs.optimizer_numels, cal, shared)


MODEL = CostModel(mesh_costs, mesh_compute, sizes)
