"""DDP's cost model: parameters, gradients in flat buckets (bucket_mb, reverse registration
order) and Adam's two moments, 4P + 4P + 8P bytes; one all-reduce per bucket (native, `comm.ring`'s
or the hierarchical one), or what its gradient codec sends instead (`comm.compression`)."""

from __future__ import annotations

import math

from shardwise.comm.accounting import native_volume
from shardwise.plan.cost_models import CostModel
from shardwise.plan.costs import FP32, CostJob, Costs, bucket_sizes, numels, replica_costs
from shardwise.plan.peaks import step_peak
from shardwise.plan.work import data_parallel_compute
from shardwise.strategies.ddp import resolve_all_reduce
from shardwise.strategies.section import StrategySection


def ddp_costs(job: CostJob, s: StrategySection) -> Costs:
    """One DDP rank: the whole model state, its step's peak, and its buckets' collectives."""
    held = numels(job.params())
    costs = replica_costs(job)
    n, elem = job.world_size, FP32
    shapes = [p.shape for p in job.params()][::-1]  # reverse registration order
    costs.peak = step_peak(
        job,
        costs.memory,
        held,
        job.global_batch // n,
        made_grads=None,
        buffers=codec_state(s.compression, shapes),
    )
    buckets = bucket_sizes(held[::-1], elem, s.bucket_mb, job.shared_cores)
    if s.compression is not None:
        codec_bytes(costs, s.compression, buckets, shapes, n)
    elif s.algorithm in (None, "native", "shared_memory"):  # (one sum per bucket, either way)
        # Each bucket's all-reduce starts as backward fills it; only the last one's (the first
        # layers', filled as backward ends) is waited for with nothing left to compute. On one
        # host's CPU the default sums in shared memory, calibrated as a kind of its own.
        shared = resolve_all_reduce(s.algorithm, job.shared_cores, n) == "shared_memory"
        for i, numel in enumerate(buckets):
            volume = native_volume("all_reduce", numel * elem, n)
            costs.add_comm(
                "all_reduce",
                volume,
                prefetched=i < len(buckets) - 1,
                kind="shared_all_reduce" if shared else None,
            )
    elif s.algorithm == "ring":
        for numel in buckets:
            costs.add_comm("ring_all_reduce", ring_bytes(numel, n, job.rank) * elem, 2 * (n - 1))
    else:
        hierarchical_bytes(costs, buckets, s.group_size or n, n, job.rank)
    return costs


def hierarchical_bytes(costs: Costs, buckets: list[int], group: int, n: int, rank: int) -> None:
    """The hierarchical all-reduce of each bucket (`comm.algorithms`): reduce to each group's
    leader, all-reduce among the leaders, broadcast back to the group."""
    leaders = -(-n // group)
    for numel in buckets:
        if rank % group == 0:
            volume = native_volume("all_reduce", numel * FP32, leaders)
            costs.add_comm("all_reduce", volume, ranks=leaders)
            members = min(group, n - rank)
            volume = native_volume("broadcast", numel * FP32, members, True)
            costs.add_comm("broadcast", volume, ranks=members)
        else:
            costs.add_comm("reduce", numel * FP32)


def ring_bytes(numel: int, n: int, rank: int) -> int:
    """Elements rank `rank` sends in `comm.ring`'s all-reduce of `numel` elements: the tensor
    cut into n chunks (the first numel % n one longer); n-1 reduce-scatter sends (every chunk
    but chunk rank+1) and n-1 all-gather sends (every chunk but chunk rank+2)."""
    if n == 1:
        return 0
    chunks = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    return 2 * numel - chunks[(rank + 1) % n] - chunks[(rank + 2) % n]


def codec_bytes(costs: Costs, spec: str, buckets: list[int], shapes: list, n: int) -> None:
    """Bytes of DDP's gradient codecs (`comm.compression`), per bucket of `numel` elements:
    casts all-reduce half the bytes; int8, top-k, random-k and sign all-gather their payload
    (values and a scale, or indices and values, or packed signs and a scale: one message, the
    encoding's bytes end to end) from every rank;
    PowerSGD all-reduces the uncompressed tensors with the P factors, then the Q factors."""
    name, _, arg = spec.partition(":")
    if n == 1:
        return
    offset = 0
    for numel in buckets:
        mine = _take(shapes, offset, numel)
        offset += len(mine)
        if name in ("fp16", "bf16"):
            costs.add_comm("all_reduce", native_volume("all_reduce", 2 * numel, n))
        elif name == "int8":
            costs.add_comm("all_gather", (n - 1) * (numel + FP32))
        elif name in ("topk", "randomk"):
            k = max(1, int(numel * (float(arg) if arg else 0.01)))
            costs.add_comm("all_gather", (n - 1) * 8 * k)  # int32 indices, fp32 values
        elif name == "sign":
            costs.add_comm("all_gather", (n - 1) * (FP32 * -(-numel // 32) + FP32))
        else:
            _powersgd_bytes(costs, arg, mine, n)


def _powersgd_bytes(costs: Costs, arg: str, shapes: list, n: int) -> None:
    """PowerSGD's two all-reduces of a bucket of tensors of `shapes` (Vogels et al., 2019)."""
    rank_spec, _, start = arg.partition(":")
    if start and int(start) > 0:
        costs.notes.append("powersgd start_iter: its first plain all-reduces not counted")
    first, second = powersgd_elements(shapes, int(rank_spec) if rank_spec else 4)
    for elements in (first, second):
        if elements:
            costs.add_comm("all_reduce", native_volume("all_reduce", FP32 * elements, n))


def codec_state(spec: str | None, shapes: list) -> int:
    """Bytes a gradient codec keeps between steps: error feedback's residual (the whole
    gradient, fp32) for the biased codecs, and PowerSGD's Q factors (its warm start)."""
    name, _, arg = (spec or "").partition(":")
    if name not in ("topk", "randomk", "sign", "powersgd"):
        return 0
    residual = FP32 * sum(math.prod(shape) for shape in shapes)
    if name != "powersgd":
        return residual
    rank = arg.partition(":")[0]
    return residual + FP32 * powersgd_elements(shapes, int(rank) if rank else 4)[1]


def _take(shapes: list, offset: int, numel: int) -> list:
    """The shapes from `offset` on that fill a bucket of `numel` elements."""
    taken, total = [], 0
    for shape in shapes[offset:]:
        if total >= numel:
            break
        taken.append(shape)
        total += math.prod(shape)
    return taken


def powersgd_elements(shapes: list, rank: int, min_rate: float = 2.0) -> tuple[int, int]:
    """Elements of PowerSGD's two all-reduces for a bucket of tensors of `shapes`: the tensors
    left uncompressed plus every P (rows x r), then every Q (columns x r)."""
    first = second = 0
    for shape in shapes:
        rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (0, 0)
        r = min(rows, cols, rank)
        if len(shape) >= 2 and (rows + cols) * r * min_rate < rows * cols:
            first, second = first + rows * r, second + cols * r
        else:
            first += math.prod(shape)
    return first, second


MODEL = CostModel(ddp_costs, data_parallel_compute)
