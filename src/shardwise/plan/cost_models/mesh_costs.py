"""The device mesh's cost model (`strategies.mesh_parallel`): dp replicas of a model split by
tensor parallel (tp), by pipeline stages (pp), or both. Each rank costs what its model piece
costs (`tensor_parallel`, `pipeline`; under both, the pipeline's stage of the tensor-parallel
slices, `tp_local`, with its share of tensor parallel's all-reduces), on its replica's share of
the batch, plus its data axis's: DDP's all-reduce of that piece's gradients in its buckets
(Narayanan et al., 2021's "PTD-P"), or ZeRO's shards of the piece over the dp ranks that hold
it, its units' reduce-scatters and gathers (`zero_costs`; stage 3 gathers for each of the
pipeline's micro-batches, the reduction runs once after the last)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

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
from shardwise.plan.cost_models.zero_costs import zero_costs, zero_state, zero_traffic
from shardwise.plan.costs import FP32, CostJob, Costs, bucket_sizes
from shardwise.plan.rates import call_seconds
from shardwise.plan.work import Compute, replica_compute
from shardwise.strategies.ddp import DDPConfig
from shardwise.strategies.pipeline_stages import PipelineStage
from shardwise.strategies.section import StrategySection
from shardwise.strategies.zero import ZeROConfig


def sizes(s: StrategySection, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp): the options' tp and pp, and the replicas they leave of the world."""
    return world_size // (s.tp * s.pp), s.tp, s.pp


def mesh_costs(job: CostJob, s: StrategySection) -> Costs:
    """This rank's model piece, and its data axis's collectives."""
    dp, tp, pp = sizes(s, job.world_size)
    where = coordinates(job.rank, {"dp": dp, "tp": tp, "pp": pp})
    samples = job.global_batch // dp
    zero = data_axis_zero(s)
    if tp > 1 and pp > 1:
        costs = tp_pp_costs(job, s, (tp, where["tp"]), (pp, where["pp"]), samples, dp > 1)
    elif tp > 1:
        costs = tp_costs(job, s, tp, where["tp"], samples, data_parallel=dp > 1)
    elif pp > 1:
        costs = pp_costs(job, s, pp, where["pp"], samples, data_parallel=dp > 1)
    elif zero is not None:
        return zero_costs(replace(job, world_size=dp), zero)
    else:
        return ddp_costs(replace(job, world_size=dp), DDPConfig())
    if dp == 1:
        return costs
    if zero is not None:
        _zero_data_axis(costs, _piece(job, s, where), s, zero, dp)
        return costs
    pieces = costs.optimizer_numels[::-1]  # this rank's tensors, reverse registration order
    for numel in bucket_sizes(pieces, FP32, DDPConfig().bucket_mb, job.shared_cores):
        costs.add_comm("all_reduce", native_volume("all_reduce", numel * FP32, dp), ranks=dp)
    return costs


def data_axis_zero(s: StrategySection) -> ZeROConfig | None:
    """The ZeRO options along the data axis (None: DDP), as the mesh builds them."""
    if s.data == "ddp":
        return None
    options = {"mixed_precision": s.mixed_precision, "offload": s.offload}
    # (along a mesh axis ZeRO-3 keeps no unit gathered by default: `ZeRO._keep_gathered_bytes`)
    return ZeROConfig(stage=int(s.data[-1]), keep_gathered_mb=0.0, **options)


def _piece(job: CostJob, s: StrategySection, where: dict[str, int]) -> CostJob:
    """The job whose model is what this rank's data axis wraps: its tensor-parallel slices
    (`tp_local`), and of them its pipeline stage's layers (interleaved: its chunks)."""
    dp, tp, pp = sizes(s, job.world_size)
    local = tp_local(job, s.loss_parallel, tp, where["tp"]) if tp > 1 else job
    if pp > 1:
        v = num_chunks(s)
        layers, starts = pipeline_stages(local, pp * v, None)
        bounds = [*starts, len(layers)]
        chunks = [layers[bounds[g] : bounds[g + 1]] for g in rank_chunks(where["pp"], pp, v)]
        stage = [PipelineStage(c) for c in chunks]
        local = replace(local, model=stage[0] if v == 1 else nn.ModuleList(stage))
    return replace(local, world_size=dp)


def _zero_data_axis(costs: Costs, piece: CostJob, s, zero: ZeROConfig, dp: int) -> None:
    """ZeRO's state and collectives for the piece in place of the replica's; under stage 1
    the piece's peak moves by as much (stages 2-3: their units' gradient and gathered buffers
    are not emulated on a piece: no peak)."""
    units, memory, _ = zero_state(piece, zero)
    replica = sum(costs.memory.values())
    costs.memory, costs.optimizer_numels = memory, units.shards
    if costs.peak is not None and zero.stage == 1:
        costs.peak += sum(memory.values()) - replica
    elif costs.peak is not None:  # (measured 16-31% above the shifted bound at stage 3)
        costs.peak = None
        costs.notes.append(f"mesh ZeRO-{zero.stage}: its units' buffers not emulated, no peak")
    passes = s.microbatches if s.pp > 1 else piece.accumulate  # forwards and backwards a step
    zero_traffic(costs, units, dp, zero, passes, ranks=dp, exchanges=piece.shared_cores)
    if s.mixed_precision is not None:
        costs.notes.append("mesh ZeRO bf16: activations and messages priced in fp32")


def tp_pp_costs(job: CostJob, s, tp: tuple, pp: tuple, samples: int, data_parallel) -> Costs:
    """Stage pp[1] of pp[0] of the model as tp rank tp[1] of tp[0] holds it (its slices), and
    that stage's share of tensor parallel's all-reduces (the share of the split layers it holds:
    the blocks' are alike)."""
    local = tp_local(job, s.loss_parallel, *tp)
    costs = pp_costs(local, s, pp[0], pp[1], samples, data_parallel)
    tokens = _tokens(job, samples)
    if tokens is not None:
        # The stages are cut on the unsplit model (as `MeshParallel.wrap` cuts them): this
        # stage's split layers run their all-reduces, the last's the loss's too.
        layers, starts = pipeline_stages(job, pp[0] * num_chunks(s), None)
        bounds = [*starts, len(layers)]
        held = {
            id(module)
            for g in rank_chunks(pp[1], pp[0], num_chunks(s))
            for layer in layers[bounds[g] : bounds[g + 1]]
            for module in layer.modules()
        }
        # Each micro-batch runs its own all-reduces (the bytes of the batch in all, M times
        # the calls): on two cores a call's latency, not its bytes, is most of its time.
        m = s.microbatches
        for nbytes, calls in tp_calls(job.model, tp[0], tokens, only=held):
            costs.add_comm("all_reduce", nbytes * calls, calls * m, ranks=tp[0], in_path=True)
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
        in_ops = _tp_seconds_per_op(job, s, tp, pp, job.global_batch // dp, cal)
        return pipeline_compute(local, s, pp, dp, cal, shared, in_ops)
    if pp > 1:
        return pipeline_compute(job, s, pp, dp, cal, shared)
    if tp > 1:
        return tp_compute(job, s, costs, tp, dp, cal, shared)
    return replica_compute(job, job.global_batch // dp, costs.optimizer_numels, cal, shared)


def _tp_seconds_per_op(
    job: CostJob, s: StrategySection, tp: int, pp: int, samples: int, cal: dict
) -> list[float] | None:
    """Each model chunk's tensor-parallel all-reduces in one micro-batch's forward and
    backward, in seconds: they block the chunk's op, so they lie on the pipeline's path (its
    bubbles repeat them) rather than beside it."""
    tokens = _tokens(job, samples // s.microbatches)
    if tokens is None:
        return None
    layers, starts = pipeline_stages(job, pp * num_chunks(s), None)
    bounds = [*starts, len(layers)]
    seconds = []
    for g in range(len(starts)):
        held = {id(m) for layer in layers[bounds[g] : bounds[g + 1]] for m in layer.modules()}
        calls = tp_calls(job.model, tp, tokens, only=held)
        seconds.append(sum(n * call_seconds(cal, "all_reduce", b, tp) for b, n in calls))
    return seconds


MODEL = CostModel(mesh_costs, mesh_compute, sizes)
