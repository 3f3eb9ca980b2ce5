"""Predicted per-rank costs of a job before it runs: model-state bytes by category and the bytes
each collective sends per step, for a model and the strategy of a config (issue #16).

The model may live on the meta device: only parameter shapes, dtypes and module structure are
read. Each strategy's costs follow from how it lays its state out, stated here as formulas
over those shapes:

    DDP          parameters, gradients in flat buckets (bucket_mb, reverse registration order),
                 Adam's two moments: 4P + 4P + 8P; one all-reduce per bucket
    ZeRO 1/2/3   flat units padded to a multiple of N (S = ceil(U / N) elements per rank);
                 stage 1 keeps full gradients, 2 only the reduced slice, 3 frees the full
                 parameters after each use; one reduce-scatter per unit, one all-gather per
                 unit after the step (stage 3: before forward and before backward instead)
    local SGD    DDP's memory without buckets; every `period` steps, one all-reduce of all
                 parameters

Bytes follow `comm.accounting`: what this rank sends, the textbook volume for native
collectives (an all-reduce of b bytes over n ranks: 2(n-1)b/n, rounded down per call). The
memory categories are `memory.memory_report`'s, at its moment (after backward, before the
step): parameters, master weights, gradients, optimizer state.

The trainer's own per-step collective (one all-reduce of 3 + N float64 that agrees on the loss
and on whether to go on) is `trainer_comm`; every `log_every` steps a gradient norm adds one
more small all-reduce for strategies that shard gradients, left out here.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from shardwise.comm.accounting import native_volume
from shardwise.comm.collectives import TraceGroup
from shardwise.comm.flat import split_bounds
from shardwise.distributed.mesh import coordinates
from shardwise.nn.recompute import copy_model, recomputed
from shardwise.plan.activations import fake_state, saved_bytes
from shardwise.plan.peaks import ZeroEmulation, pipeline_peak, step_peak
from shardwise.strategies.ddp import DDPConfig
from shardwise.strategies.grad_buckets import assign_buckets
from shardwise.strategies.pipeline_stages import balanced_split, pipeline_layers
from shardwise.strategies.relaxed import neighbours
from shardwise.strategies.section import StrategySection
from shardwise.strategies.tensor_parallel import TensorParallel, vocab_parallel_loss
from shardwise.strategies.zero.stage3 import stage3_units

FP32 = 4
# Optimizer state per parameter tensor: bytes per element held, and bytes of scalar state
# (Adam's step counter is a float32 tensor per parameter).
OPTIMIZER_STATE = {"adamw": (2, FP32), "adam": (2, FP32), "sgd": (1, 0)}
HALF = {"bf16": 2, "fp16": 2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Calls:
    """Calls of one collective per step, alike in payload: what the step-time model prices."""

    op: str
    nbytes: float  # sent by this rank over all of them
    calls: float
    ranks: int | None  # the group's size (None: every rank)
    prefetched: bool = False  # started one unit ahead and waited for after its compute


@dataclass
class Costs:
    """One rank's predicted model state (bytes by category) and collectives per step."""

    memory: dict[str, int] = field(default_factory=dict)
    traffic: list[Calls] = field(default_factory=list)  # per step, averaged over a sync period
    activations: int | None = None  # peak bytes saved for backward (None: no batch given)
    peak: int | None = None  # the most bytes alive at once in a step (None: no batch given)
    optimizer_numels: list[int] = field(default_factory=list)  # the tensors its optimizer steps
    notes: list[str] = field(default_factory=list)

    def add_comm(
        self,
        op: str,
        nbytes: float,
        calls: float = 1,
        ranks: int | None = None,
        prefetched: bool = False,
    ) -> None:
        """`calls` of `op` sending `nbytes` in all, among `ranks` ranks (None: every rank)."""
        if nbytes:  # (a collective over one rank sends nothing)
            self.traffic.append(Calls(op, nbytes, calls, ranks, prefetched))

    @property
    def comm(self) -> dict[str, float]:
        """Bytes sent per step, by op."""
        return _by_op(self.traffic, lambda t: t.nbytes)

    @property
    def calls(self) -> dict[str, float]:
        """Collective calls per step, by op."""
        return _by_op(self.traffic, lambda t: t.calls)

    def as_dict(self) -> dict:
        memory = {**self.memory, "total": sum(self.memory.values())}
        return {
            "memory": memory,
            "activations": self.activations,
            "peak": self.peak,
            "comm": dict(sorted(self.comm.items())),
            "calls": dict(sorted(self.calls.items())),
            "notes": self.notes,
        }


def _by_op(traffic: list[Calls], value: Callable[[Calls], float]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for t in traffic:
        totals[t.op] = totals.get(t.op, 0) + value(t)
    return totals


@dataclass(frozen=True)
class Job:
    """What the costs depend on besides the strategy's options."""

    model: nn.Module
    world_size: int
    rank: int = 0
    optimizer: str = "adamw"
    # (inputs, targets) of n samples, made inside the fake mode, and the loss: for activations.
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    global_batch: int = 0  # samples per step over all replicas
    backend: str = "gloo"  # torch.distributed's (gloo's reduce-scatter copies its buffer)

    @classmethod
    def of(cls, job, cfg, world_size: int, rank: int, global_batch: int) -> Job:
        """The costs' view of a training job (`jobs.Job`) under a config (`config.Config`)."""
        return cls(
            job.model,
            world_size,
            rank,
            cfg.optim.name,
            batch=job.batch_like(),
            loss_fn=job.loss_fn,
            global_batch=global_batch,
            backend=torch.distributed.get_backend()
            if torch.distributed.is_initialized()
            else "gloo",
        )

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def activations(
        self, samples: int, dtype: torch.dtype | None = None, layers=None
    ) -> tuple[int, list[int]] | None:
        """Bytes saved by one forward of `samples` through `layers` (default: the model), and
        per layer; None without a batch to trace."""
        if self.batch is None or samples < 1:
            return None
        made: dict[str, torch.Tensor] = {}

        def inputs() -> torch.Tensor:
            made["x"], made["y"] = self.batch(samples)
            return made["x"]

        def loss(out: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(out, made["y"])

        return saved_bytes(self.model if layers is None else layers, inputs, dtype, loss)


def optimizer_bytes(numels: list[int], optimizer: str, elem: int = FP32) -> int:
    """The optimizer's state for parameter tensors of `numels` elements each."""
    per_element, scalar = OPTIMIZER_STATE[optimizer]
    return sum(per_element * n * elem + scalar for n in numels)


def replicated_memory(numels: list[int], optimizer: str, elem: int = FP32) -> dict[str, int]:
    """A rank that holds parameter tensors of `numels` elements whole, with their gradients
    (DDP's are views into its buckets: the same bytes) and the optimizer's state."""
    total = sum(numels) * elem
    return {
        "params": total,
        "master_weights": 0,
        "grads": total,
        "optimizer": optimizer_bytes(numels, optimizer, elem),
    }


def bucket_sizes(numels: list[int], elem: int, bucket_mb: float) -> list[int]:
    """`grad_buckets.assign_buckets` on element counts, in the order given: a bucket closes
    when the next tensor would take it past bucket_mb."""
    limit, buckets, size = int(bucket_mb * 2**20), [], 0
    for n in numels:
        if size and (size + n) * elem > limit:
            buckets.append(size)
            size = 0
        size += n
    return [*buckets, size] if size else buckets


def _numels(params) -> list[int]:
    return [p.numel() for p in params]


def _replica_activations(job: Job, dtype: torch.dtype | None = None) -> int | None:
    """Data parallel: one forward of this rank's share of the global batch."""
    traced = job.activations(job.global_batch // job.world_size, dtype)
    return None if traced is None else traced[0]


# ---- data parallel -----------------------------------------------------------------------------
def ddp_costs(job: Job, s: StrategySection) -> Costs:
    numels = _numels(job.params())
    costs = Costs(memory=replicated_memory(numels, job.optimizer), optimizer_numels=numels)
    costs.activations = _replica_activations(job)
    n, elem = job.world_size, FP32
    costs.peak = step_peak(
        job,
        costs.memory,
        numels,
        job.global_batch // n,
        made_grads=None,
        buffers=codec_state(s.compression, [p.shape for p in job.params()][::-1]),
    )
    buckets = bucket_sizes(numels[::-1], elem, s.bucket_mb)  # reverse registration order
    if s.compression is not None:
        shapes = [p.shape for p in job.params()][::-1]
        codec_bytes(costs, s.compression, buckets, shapes, n)
    elif s.algorithm == "native":
        for numel in buckets:
            costs.add_comm("all_reduce", native_volume("all_reduce", numel * elem, n))
    elif s.algorithm == "ring":
        for numel in buckets:
            costs.add_comm("ring_all_reduce", ring_bytes(numel, n, job.rank) * elem, 2 * (n - 1))
    else:  # hierarchical: reduce to each group's leader, all-reduce among leaders, broadcast
        group = s.group_size or n
        leaders = -(-n // group)
        for numel in buckets:
            if job.rank % group == 0:
                volume = native_volume("all_reduce", numel * elem, leaders)
                costs.add_comm("all_reduce", volume, ranks=leaders)
                members = min(group, n - job.rank)
                volume = native_volume("broadcast", numel * elem, members, True)
                costs.add_comm("broadcast", volume, ranks=members)
            else:
                costs.add_comm("reduce", numel * elem)
    return costs


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
    (values and a scale, or indices and values, or packed signs and a scale) from every rank;
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
            costs.add_comm("all_gather", (n - 1) * (numel + FP32), calls=2)
        elif name in ("topk", "randomk"):
            k = max(1, int(numel * (float(arg) if arg else 0.01)))
            costs.add_comm("all_gather", (n - 1) * 8 * k, calls=2)  # int32 indices, fp32 values
        elif name == "sign":
            costs.add_comm("all_gather", (n - 1) * (FP32 * -(-numel // 32) + FP32), calls=2)
        else:
            rank_spec, _, start = arg.partition(":")
            if start and int(start) > 0:
                costs.notes.append("powersgd start_iter: its first plain all-reduces not counted")
            first, second = powersgd_elements(mine, int(rank_spec) if rank_spec else 4)
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


def zero_costs(job: Job, s: StrategySection) -> Costs:
    n, params = job.world_size, job.params()
    unit_modules, rest = [], []
    if s.stage == 3:
        modules = stage3_units(job.model)
        units = [[p for p in m.parameters() if p.requires_grad] for m in modules]
        covered = {id(p) for unit in units for p in unit}
        rest = [p for p in params if id(p) not in covered]
        units = [rest, *units] if rest else units
        module_names = {id(m): name for name, m in job.model.named_modules()}
        unit_modules = [module_names[id(m)] for m in modules]
    else:
        units = assign_buckets(params, int(s.bucket_mb * 2**20))
    unit_numels = [sum(_numels(unit)) for unit in units]
    shards = [-(-u // n) for u in unit_numels]  # S per unit
    compute = HALF.get(s.mixed_precision, FP32)
    fp32_masters = s.mixed_precision is not None or s.offload is not None
    full = sum(S * n for S in shards) * compute  # every unit's padded compute buffer
    shard = sum(shards) * FP32
    memory = {
        "params": 0 if s.stage == 3 else full,
        # Stage 3's shards are copies (the full buffers come and go); with mixed precision or
        # offload, fp32 masters live beside the compute copy. Otherwise the optimizer steps
        # views of the parameters: no bytes of their own.
        "master_weights": shard if fp32_masters or s.stage == 3 else 0,
        "grads": shard if s.stage >= 2 else full + (shard if fp32_masters else 0),
        "optimizer": optimizer_bytes(shards, job.optimizer),
    }
    if s.stage == 1 and not fp32_masters:
        memory["grads"] = full  # the reduced slice is a view of the full gradient buffer
    costs = Costs(memory=memory, optimizer_numels=shards)
    costs.activations = _replica_activations(job, DTYPES.get(s.mixed_precision))
    names = {id(p): name for name, p in job.model.named_parameters()}
    emulation = ZeroEmulation(
        job.model,
        [[names[id(p)] for p in unit] for unit in units],
        unit_modules,
        n,
        s.stage,
        DTYPES.get(s.mixed_precision, torch.float32),
        fp32_masters,
        job.backend == "gloo",
    )
    costs.peak = step_peak(
        job,
        memory,
        shards,
        job.global_batch // n,
        # Gradients made each step: the shards' (stage 1 keeps its full buffers).
        made_grads=memory["grads"] - (full if s.stage == 1 else 0),
        dtype=DTYPES.get(s.mixed_precision),
        emulation=emulation,
        # Stages 1 and 2 gather every unit after the step, from compute copies of the slices.
        after_step=0 if s.stage == 3 else sum(shards) * compute,
    )
    for k, S in enumerate(shards):
        unit_bytes = S * n * compute
        # Backward makes the first unit's gradients last: the others' reduce-scatters run
        # while it computes, and all are waited for after it.
        reduced = native_volume("reduce_scatter", unit_bytes, n)
        costs.add_comm("reduce_scatter", reduced, prefetched=k > 0)
        volume = native_volume("all_gather", unit_bytes, n)
        if s.stage < 3:
            costs.add_comm("all_gather", volume)
            continue
        # Stage 3 gathers each unit twice. A unit's gather starts in the hook of the unit
        # before it (forward: the previous, backward: the next) and is waited for after that
        # unit's compute; forward's first block (and the rest before it) and backward's
        # first, the last unit, are gathered on the spot.
        exposed = (k < (2 if rest else 1)) + (k == len(shards) - 1)
        costs.add_comm("all_gather", exposed * volume, calls=exposed)
        costs.add_comm("all_gather", (2 - exposed) * volume, calls=2 - exposed, prefetched=True)
    if s.mixed_precision == "fp16":
        costs.notes.append("fp16 loss scaling: its overflow all-reduce is not counted")
    return costs


# ---- relaxed synchronisation -------------------------------------------------------------------
def _relaxed(job: Job) -> tuple[Costs, int]:
    """Memory as one process; the bytes of one all-reduce of every parameter."""
    numels = _numels(job.params())
    costs = Costs(memory=replicated_memory(numels, job.optimizer), optimizer_numels=numels)
    costs.activations = _replica_activations(job)
    return costs, native_volume("all_reduce", sum(numels) * FP32, job.world_size)


def _relaxed_peak(job: Job, costs: Costs, copies: int, buffers: int = 0) -> int | None:
    """A relaxed strategy's peak: its synchronisation holds `copies` flat copies of the
    parameters (the flattened parameters, what it receives, the average) after the step."""
    full = FP32 * sum(costs.optimizer_numels)
    return step_peak(
        job,
        costs.memory,
        costs.optimizer_numels,
        job.global_batch // job.world_size,
        made_grads=costs.memory["grads"],
        buffers=buffers,
        after_step=copies * full,
    )


def local_sgd_costs(job: Job, s: StrategySection) -> Costs:
    costs, average = _relaxed(job)
    costs.peak = _relaxed_peak(job, costs, 2)  # the flattened parameters and their mean
    costs.add_comm("all_reduce", average / s.period, 1 / s.period)  # an average every period
    if s.warmup_steps:
        costs.notes.append("warm-up steps all-reduce gradients every step: not in the average")
    return costs


def gossip_costs(job: Job, s: StrategySection) -> Costs:
    costs, average = _relaxed(job)
    peers = neighbours(s.topology, job.rank, job.world_size)
    # Gossip holds its flattened parameters, one copy from each peer, and two partial sums.
    costs.peak = _relaxed_peak(job, costs, 2 if s.global_every == 1 else len(peers) + 3)
    exchange = len(peers) * sum(_numels(job.params())) * FP32  # its parameters to each peer
    if s.global_every:
        k = s.global_every
        costs.add_comm("gossip", exchange * (k - 1) / k, (k - 1) / k)
        costs.add_comm("all_reduce", average / k, 1 / k)
    else:
        costs.add_comm("gossip", exchange)
    return costs


def adaptive_costs(job: Job, s: StrategySection) -> Costs:
    costs, _ = _relaxed(job)
    # The anchor (the parameters at the last average) lasts; the check flattens the parameters
    # and takes their difference from it.
    costs.peak = _relaxed_peak(job, costs, 2, buffers=FP32 * sum(costs.optimizer_numels))
    costs.add_comm("all_reduce", native_volume("all_reduce", FP32, job.world_size))
    costs.notes.append("adaptive: averages when the replicas drift; those are data-dependent")
    return costs


# ---- model parallel ----------------------------------------------------------------------------
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


def tp_calls(model: nn.Module, parts: int, tokens: int, elem: int = FP32) -> list[tuple[int, int]]:
    """(bytes per call, calls) of tensor parallel's all-reduces per step over `tokens` rows of
    activations: forward after each row-parallel layer and the vocabulary embedding (twice
    inside a checkpointed region, but for its last row-parallel layer), backward before each
    column-parallel layer and the head, and three of one float per token in the
    vocabulary-parallel loss (max, sum of exponentials, target logit)."""
    plan = getattr(model, "TP_PLAN", {})
    regions = recomputed(model)
    # torch's recompute stops at the region's last saved tensor: the region's final
    # row-parallel layer (whose output only joins the residual) is not run again.
    rowwise = [n for n in dict(model.named_modules()) if _style(plan, n) == "rowwise"]
    final = {max((n for n in rowwise if n.startswith(r + ".")), default=None) for r in regions}
    calls = []
    for name, module in model.named_modules():
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
    job: Job,
    s: StrategySection,
    parts: int | None = None,
    rank: int | None = None,
    samples: int | None = None,
    data_parallel: bool = False,
) -> Costs:
    parts = parts or job.world_size
    rank = job.rank if rank is None else rank
    numels = tp_shard_numels(job.model, parts, rank)
    costs = Costs(memory=replicated_memory(numels, job.optimizer), optimizer_numels=numels)
    if not s.loss_parallel:
        costs.notes.append("tp without loss_parallel: the logits' gather is not counted")
    samples = job.global_batch if samples is None else samples
    tokens = _tokens(job, samples)
    if tokens is not None:
        for nbytes, calls in tp_calls(job.model, parts, tokens):
            costs.add_comm("all_reduce", nbytes * calls, calls, ranks=parts)
        local = tp_local(job, s.loss_parallel, parts, rank)
        costs.activations = local.activations(samples)[0]
        # Its gradients are plain ones, made each step (a mesh's data axis keeps them in
        # buckets).
        made = None if data_parallel else costs.memory["grads"]
        costs.peak = step_peak(local, costs.memory, numels, samples, made_grads=made)
    return costs


def tp_local(job: Job, loss_parallel: bool, parts: int, rank: int) -> Job:
    """The job as rank `rank` of `parts` runs it: a copy of the (meta) model with its layers
    replaced by the tensor-parallel ones of its plan, on a stand-in group that moves nothing,
    and the loss it computes from vocabulary slices (`loss_parallel`)."""
    model = copy_model(job.model)
    group = TraceGroup(parts, rank)
    runtime = SimpleNamespace(world_size=parts, rank=rank, group=group)
    head = TensorParallel().apply_plan(model, model.TP_PLAN, runtime)
    loss_fn = vocab_parallel_loss(job.loss_fn, head if loss_parallel else None, group)
    return replace(job, model=model, loss_fn=loss_fn)


def _tokens(job: Job, samples: int) -> int | None:
    """Rows of activations a batch of `samples` makes (tokens for a sequence model)."""
    if job.batch is None:
        return None
    with FakeTensorMode():
        x, _ = job.batch(samples)
    return x.numel() if not x.is_floating_point() else samples


def pipeline_stages(job: Job, stages: int, split: list[int] | None) -> tuple[list, list[int]]:
    """The model's pipeline layers and the start layer of each stage (balanced by parameters,
    as `Pipeline.stage_starts` does, unless `split` gives them)."""
    layers = pipeline_layers(job.model)
    if split:
        return layers, [0, *split]
    weights = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    return layers, balanced_split(weights, stages)


def pp_costs(
    job: Job,
    s: StrategySection,
    stages: int | None = None,
    stage: int | None = None,
    samples: int | None = None,
    data_parallel: bool = False,
) -> Costs:
    stages = stages or s.stages or job.world_size
    stage = job.rank if stage is None else stage
    samples = job.global_batch if samples is None else samples
    m = s.microbatches
    layers, starts = pipeline_stages(job, stages, getattr(s, "split", None))
    bounds = [*starts, len(layers)]
    mine = layers[bounds[stage] : bounds[stage + 1]]
    numels = [p.numel() for layer in mine for p in layer.parameters() if p.requires_grad]
    costs = Costs(memory=replicated_memory(numels, job.optimizer), optimizer_numels=numels)
    traced = job.activations(samples // m, layers=layers)
    if traced is not None:
        _, per_layer = traced
        per_micro = sum(per_layer[bounds[stage] : bounds[stage + 1]])
        in_flight = m if s.schedule == "gpipe" else min(m, stages - stage)
        costs.activations = per_micro * in_flight
        # Per micro-batch: its activations forward to the next stage, the gradient of its
        # input back to the previous one; per step, a header (8 int64) and the loss (fp32)
        # from the last stage back.
        boundary = boundary_bytes(job, layers, bounds, samples // m)
        if stage < stages - 1:
            costs.add_comm("send", 64 + m * boundary[stage], m + 1)
        if stage > 0:
            costs.add_comm("send", m * boundary[stage - 1] + FP32, m + 1)
        # Its gradients are made each step, accumulating over the micro-batches (a mesh's
        # data axis keeps them in buckets, into which each fresh one is moved).
        schedule = pipeline_peak(job, layers, bounds, stage, s.schedule, m, samples, data_parallel)
        made = None if data_parallel else costs.memory["grads"]
        costs.peak = step_peak(
            job, costs.memory, numels, samples, made_grads=made, backward=schedule
        )
    return costs


def boundary_bytes(job: Job, layers: list, bounds: list[int], samples: int) -> list[int]:
    """Bytes of the activation each stage hands the next, for one micro-batch."""
    sizes = []
    with FakeTensorMode():
        x, _ = job.batch(samples)
        states = [fake_state(layer, None) for layer in layers]
        with torch.no_grad():
            for i, layer in enumerate(layers):
                x = functional_call(layer, states[i], (x,))
                if i + 1 in bounds[1:-1]:
                    sizes.append(x.numel() * x.element_size())
    return sizes


def mesh_costs(job: Job, s: StrategySection) -> Costs:
    dp, tp, pp = mesh_sizes(s, job.world_size)
    where = coordinates(job.rank, {"dp": dp, "tp": tp, "pp": pp})
    samples = job.global_batch // dp
    if tp > 1:
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


def trainer_comm(world_size: int) -> dict[str, int]:
    """The trainer's own collective per step: the loss-and-flags all-reduce (`trainer._agree`)."""
    return {"all_reduce": native_volume("all_reduce", 8 * (3 + world_size), world_size)}


MODEL_STATE = ("params", "master_weights", "grads", "optimizer")


def mesh_sizes(strategy: StrategySection, world_size: int) -> tuple[int, int, int]:
    """(data-parallel replicas, tensor-parallel size, pipeline stages) of `strategy`."""
    tp = pp = 1
    if strategy.name == "tp":
        tp = strategy.size or world_size
    elif strategy.name == "pp":
        pp = strategy.stages or world_size
    elif strategy.name == "mesh":
        tp, pp = strategy.tp, strategy.pp
    return world_size // (tp * pp), tp, pp


def replicas(strategy: StrategySection, world_size: int) -> int:
    """How many different batches one step of `strategy` consumes (data-parallel replicas)."""
    return mesh_sizes(strategy, world_size)[0]
