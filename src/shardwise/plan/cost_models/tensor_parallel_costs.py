"""Tensor parallel's cost model (Megatron-LM, Shoeybi et al., 2019): each rank holds its slices
of the layers its model's TP_PLAN splits and the rest whole; activations are all-reduced after
each row-parallel layer forward and before each column-parallel one backward. Its step's compute
is traced on this rank's share of the model, as it runs (`tp_local`)."""

from __future__ import annotations

import fnmatch
from dataclasses import replace
from types import SimpleNamespace

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.comm.accounting import native_volume
from shardwise.comm.collectives import TraceGroup
from shardwise.comm.flat import split_bounds
from shardwise.distributed.mesh import coordinates
from shardwise.nn.recompute import copy_model, recomputed
from shardwise.plan.cost_models import CostModel
from shardwise.plan.costs import FP32, CostJob, Costs, replicated_memory
from shardwise.plan.peaks import step_peak
from shardwise.plan.work import Compute, replica_compute
from shardwise.strategies.section import StrategySection
from shardwise.strategies.tensor_parallel import TensorParallel, vocab_parallel_loss


def tp_shard_numels(model: nn.Module, parts: int, rank: int) -> list[int]:
    """Elements of each parameter tensor rank `rank` holds under the model's TP_PLAN, in
    registration order: column-parallel layers split their output features (each of `chunks`
    parts separately), row-parallel ones their input features (bias whole), vocabulary layers
    their rows; everything else is replicated."""
    plan = getattr(model, "TP_PLAN", {})
    modules = dict(model.named_modules())
    style_of: dict[str, str] = {}
    for pattern, style in plan.items():
        for name in modules:
            if fnmatch.fnmatchcase(name, pattern):
                style_of[name] = style
    out = []
    for full_name, p in model.named_parameters():
        module_name, _, kind = full_name.rpartition(".")
        style, _, chunks = style_of.get(module_name, "").partition(":")
        rows, rest = p.shape[0], p.numel() // max(p.shape[0], 1)
        if style == "colwise":
            c = int(chunks or 1)
            out.append(sum(_part(rows // c, parts, rank) for _ in range(c)) * rest)
        elif style == "rowwise" and kind == "weight":
            out.append(rows * _part(p.shape[1], parts, rank))
        elif style in ("vocab_embedding", "vocab_head"):
            out.append(_part(rows, parts, rank) * rest)
        else:
            out.append(p.numel())
    return out


def _part(size: int, parts: int, rank: int) -> int:
    start, end = split_bounds(size, parts)[rank]
    return end - start


def tp_calls(
    model: nn.Module, parts: int, tokens: int, elem: int = FP32, only: set[int] | None = None
) -> list[tuple[int, int]]:
    """(bytes per call, calls) of tensor parallel's all-reduces per step over `tokens` rows of
    activations: forward after each row-parallel layer and the vocabulary embedding (twice
    inside a checkpointed region, but for its last row-parallel layer), backward before each
    column-parallel layer and the head, and three of one float per token in the
    vocabulary-parallel loss (max, sum of exponentials, target logit). `only`: the ids of the
    modules to count (a pipeline stage's), where not all."""
    plan = getattr(model, "TP_PLAN", {})
    regions = recomputed(model)
    # torch's recompute stops at the region's last saved tensor: the region's final
    # row-parallel layer (whose output only joins the residual) is not run again.
    rowwise = [n for n in dict(model.named_modules()) if _style(plan, n) == "rowwise"]
    final = {max((n for n in rowwise if n.startswith(r + ".")), default=None) for r in regions}
    calls = []
    for name, module in model.named_modules():
        if only is not None and id(module) not in only:
            continue
        style = _style(plan, name)
        if style == "rowwise":
            width = module.out_features
        elif style in ("colwise", "vocab_head"):
            width = module.in_features
        elif style == "vocab_embedding":
            width = module.embedding_dim
        else:
            continue
        # A forward all-reduce inside a checkpointed region runs again in its recompute.
        again = (
            style in ("rowwise", "vocab_embedding")
            and name not in final
            and any(name == r or name.startswith(r + ".") for r in regions)
        )
        calls.append((native_volume("all_reduce", tokens * width * elem, parts), 2 if again else 1))
        if style == "vocab_head":
            calls.append((native_volume("all_reduce", tokens * elem, parts), 3))
    return calls


def _style(plan: dict[str, str], name: str) -> str:
    style = next((st for pat, st in plan.items() if fnmatch.fnmatchcase(name, pat)), "")
    return style.partition(":")[0]


def tp_costs(
    job: CostJob,
    s: StrategySection,
    parts: int | None = None,
    rank: int | None = None,
    samples: int | None = None,
    data_parallel: bool = False,
) -> Costs:
    """Rank `rank` of `parts` (default: this rank of the whole world) on `samples` (default:
    the global batch); `data_parallel`: a mesh's data axis keeps its gradients in buckets."""
    parts = parts or job.world_size
    rank = job.rank if rank is None else rank
    numels = tp_shard_numels(job.model, parts, rank)
    costs = Costs(memory=replicated_memory(numels, job.optimizer), optimizer_numels=numels)
    if not s.loss_parallel:
        costs.notes.append("tp without loss_parallel: the logits' gather is not counted")
    samples = job.global_batch if samples is None else samples
    tokens = _tokens(job, job.micro(samples))  # (under accumulation: per micro-batch)
    if tokens is not None:
        k = job.accumulate
        for nbytes, calls in tp_calls(job.model, parts, tokens):
            costs.add_comm("all_reduce", k * nbytes * calls, k * calls, ranks=parts)
        local = tp_local(job, s.loss_parallel, parts, rank)
        costs.activations = local.activations(samples)[0]
        # Its gradients are plain ones, made each step (a mesh's data axis keeps them in
        # buckets).
        made = None if data_parallel else costs.memory["grads"]
        costs.peak = step_peak(local, costs.memory, numels, samples, made_grads=made)
    return costs


def tp_local(job: CostJob, loss_parallel: bool, parts: int, rank: int) -> CostJob:
    """The job as rank `rank` of `parts` runs it: a copy of the (meta) model with its layers
    replaced by the tensor-parallel ones of its plan, on a stand-in group that moves nothing,
    and the loss it computes from vocabulary slices (`loss_parallel`)."""
    model = copy_model(job.model)
    group = TraceGroup(parts, rank)
    runtime = SimpleNamespace(world_size=parts, rank=rank, group=group)
    head = TensorParallel().apply_plan(model, model.TP_PLAN, runtime)
    vocab_start = head.start if head is not None and loss_parallel else None
    loss_fn = vocab_parallel_loss(job.loss_fn, vocab_start, group)
    return replace(job, model=model, loss_fn=loss_fn)


def _tokens(job: CostJob, samples: int) -> int | None:
    """Rows of activations a batch of `samples` makes (tokens for a sequence model)."""
    if job.batch is None:
        return None
    with FakeTensorMode():
        x, _ = job.batch(samples)
    return x.numel() if not x.is_floating_point() else samples


def tp_compute(
    job: CostJob,
    s: StrategySection,
    costs: Costs,
    parts: int,
    replicas: int,
    cal: dict,
    shared: dict | None,
) -> Compute:
    """This rank's share of the model (its split layers, the replicated rest and the
    vocabulary-parallel loss), traced as it runs on its replica's batch."""
    where = coordinates(job.rank, {"dp": replicas, "tp": parts, "pp": 1})
    local = tp_local(job, s.loss_parallel, parts, where["tp"])
    samples = job.global_batch // replicas
    return replica_compute(local, samples, costs.optimizer_numels, cal, shared)


def sizes(s: StrategySection, world_size: int) -> tuple[int, int, int]:
    """`size` ranks to a model (default: the world), as many replicas as that leaves."""
    tp = s.size or world_size
    return world_size // tp, tp, 1


def _compute(
    job: CostJob, s: StrategySection, costs: Costs, cal: dict, shared: dict | None
) -> Compute:
    replicas, parts, _ = sizes(s, job.world_size)
    return tp_compute(job, s, costs, parts, replicas, cal, shared)


MODEL = CostModel(tp_costs, _compute, sizes)
