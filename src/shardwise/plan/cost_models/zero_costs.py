"""ZeRO's cost model, stages 1-3 (Rajbhandari et al., 2020): flat units padded to a multiple
of N (S = ceil(U / N) elements per rank); stage 1 keeps full gradients, 2 only the reduced
slice, 3 frees the full parameters after each use; one reduce-scatter per unit, one
all-gather per unit after the step (stage 3: before each forward and backward instead, once
per micro-batch under accumulation). A gradient codec (`compression`) sends what it encodes in
the reduce-scatter's place (`comm.compression`'s wire layouts). Its peak emulates the units'
buffers on fake tensors as `strategies.zero` makes and frees them (`Stage1Emulation` and its
subclasses).

Hybrid (HSDP, `shard_group=K`): all of the above inside a shard group of K ranks (N is K,
S = ceil(U / K): 16P/K at stage 3 with fp32 Adam), plus one all-reduce of each unit's reduced
slice (S elements) among the N/K replicas: 2(N/K - 1)/(N/K) x S x bytes per unit and step."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shardwise.comm import shared_memory
from shardwise.comm.accounting import native_volume
from shardwise.comm.compressed_collectives import make_codec
from shardwise.comm.compression import WireCodec, wire_nbytes
from shardwise.comm.shared_memory import SharedMemoryCollectives
from shardwise.plan.cost_models import CostModel
from shardwise.plan.cost_models.ddp_costs import _powersgd_bytes, codec_state
from shardwise.plan.costs import (
    DTYPES,
    FP32,
    HALF,
    CostJob,
    Costs,
    numels,
    optimizer_bytes,
    replica_activations,
    replica_costs,
)
from shardwise.plan.peaks import step_peak
from shardwise.plan.work import data_parallel_compute
from shardwise.strategies.grad_buckets import assign_buckets
from shardwise.strategies.section import StrategySection
from shardwise.strategies.zero.stage2 import staging_buffers
from shardwise.strategies.zero.stage3 import kept_units, stage3_units, unit_groups


@dataclass(frozen=True)
class _Units:
    """How a rank's parameters are cut into ZeRO's flat units."""

    params: list[list[nn.Parameter]]  # each unit's parameters
    modules: list[str]  # stage 3: the module each unit after the rest wraps
    rest: bool  # stage 3: unit 0 holds the parameters outside every unit's module
    shards: list[int]  # S: each unit's elements per rank, padded
    kept: frozenset[int] = frozenset()  # stage 3: units kept gathered from forward to backward


def _units(job: CostJob, s: StrategySection) -> _Units:
    """Stage 3: one unit per `stage3_units` module (and the rest before them); stages 1-2: the
    gradient buckets of bucket_mb."""
    params, modules, rest = job.params(), [], []
    if s.stage == 3:
        # As the strategy cuts them: a parameter two units share (tied embeddings) is the rest's.
        found = stage3_units(job.model)
        kept = [(m, g) for m, g in zip(found, unit_groups(job.model, found), strict=True) if g]
        units = [g for _, g in kept]
        covered = {id(p) for unit in units for p in unit}
        rest = [p for p in params if id(p) not in covered]
        units = [rest, *units] if rest else units
        names = {id(m): name for name, m in job.model.named_modules()}
        modules = [names[id(m)] for m, _ in kept]
    else:
        units = assign_buckets(params, int(s.bucket_mb * 2**20))
    k = shard_size(job, s)
    shards = [-(-sum(numels(unit)) // k) for unit in units]
    kept = set()
    if s.stage == 3:  # as the strategy picks (`kept_units`; None: the default budget)
        first, unit_bytes = int(bool(rest)), DTYPES.get(s.mixed_precision, torch.float32).itemsize
        sizes = [S * k * unit_bytes for S in shards[first:]]
        keep = s.keep_gathered_mb
        kept = kept_units(sizes, None if keep is None else keep * 2**20, first)
    return _Units(units, modules, bool(rest), shards, frozenset(kept))


def shard_size(job: CostJob, s: StrategySection) -> int:
    """K: the ranks a unit is sharded over (the shard group; by default the world)."""
    return s.shard_group or job.world_size


def zero_state(job: CostJob, s: StrategySection) -> tuple[_Units, dict[str, int], int]:
    """The units of `job`'s model over its `world_size` ranks (a mesh's data axis: the ranks
    holding the same piece), this rank's model state by category, and the bytes of every
    unit's padded compute buffer."""
    units = _units(job, s)
    return (units, *_memory(job, s, units.shards))


def _memory(job: CostJob, s: StrategySection, shards: list[int]) -> tuple[dict[str, int], int]:
    """The rank's model state by category, and the bytes of every unit's padded compute
    buffer."""
    n, compute = shard_size(job, s), HALF.get(s.mixed_precision, FP32)
    fp32_masters = s.mixed_precision is not None or s.offload is not None
    full = sum(S * n for S in shards) * compute
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
    return memory, full


def zero_costs(job: CostJob, s: StrategySection) -> Costs:
    """One ZeRO rank: its shards' state, its step's peak, and its units' collectives."""
    if job.world_size == 1 and not (s.mixed_precision or s.offload or s.compression):
        return sole_rank_costs(job)
    units, memory, full = zero_state(job, s)
    costs = Costs(memory=memory, optimizer_numels=units.shards)
    costs.activations = replica_activations(job, DTYPES.get(s.mixed_precision))
    names = {id(p): name for name, p in job.model.named_parameters()}
    # Stage 3 over a shard group of one, without fp32 masters, keeps its one shard as the
    # model (`ResidentStage3`): stage 2's steps.
    resident = s.stage == 3 and shard_size(job, s) == 1 and not (s.mixed_precision or s.offload)
    emulation = EMULATIONS[2 if resident else s.stage](
        job.model,
        [[names[id(p)] for p in unit] for unit in units.params],
        units.modules,
        shard_size(job, s),
        DTYPES.get(s.mixed_precision, torch.float32),
        s.mixed_precision is not None or s.offload is not None,
        job.backend == "gloo",
        exchanges=job.shared_cores and shard_size(job, s) > 1 and not s.compression,
    )
    emulation.kept = units.kept  # (stage 3)
    k = shard_size(job, s)
    ranks = k if k < job.world_size else None
    # Over the whole world of one host's CPU ranks, units are gathered through shared memory,
    # each rank's slice through one of two slots the size of the largest (stage 3: from the
    # shards where they lie); and gradients are reduced there (no codec): stage 1's in the
    # full buffers it keeps, stages 2/3's in staging buffers the size of the largest unit. All
    # are made with the model.
    compute = HALF.get(s.mixed_precision, FP32)
    shared = job.shared_cores and k > 1 and ranks is None and shared_memory.supported()
    staged = shared and emulation.exchanges
    fp32_masters = s.mixed_precision is not None or s.offload is not None
    largest = max(units.shards, default=0) * compute
    budget = int(s.bucket_mb * 2**20)
    slots = staging_buffers(s.stage, bool(units.rest), len(units.shards), largest * k, budget)
    emulation.staged_slots = slots if staged and s.stage >= 2 else 0
    emulation.in_place = staged and s.stage == 1
    # (stage 3's shards, without fp32 masters, live in shared memory: gathered from there)
    slotted = shared and not (s.stage == 3 and not fp32_masters)
    staging = (emulation.staged_slots * k + SharedMemoryCollectives.SLOTS * slotted) * largest
    costs.peak = step_peak(
        job,
        memory,
        units.shards,
        job.global_batch // job.world_size,
        # Gradients made each step: the shards' (stage 1 keeps its full buffers).
        made_grads=memory["grads"] - (full if s.stage == 1 else 0),
        dtype=DTYPES.get(s.mixed_precision),
        emulation=emulation,
        # Stages 1 and 2 gather every unit after the step, from compute copies of the slices
        # (in shared memory without fp32 masters: from the slices where they lie).
        after_step=0
        if s.stage == 3 or (shared and not fp32_masters)
        else sum(units.shards) * compute,
        buffers=codec_state(s.compression, [p.shape for u in units.params for p in u]) + staging,
        # Under accumulation stages 2 and 3 keep every unit's full gradient (no_sync).
        accumulated=full if s.stage >= 2 else None,
    )
    zero_traffic(
        costs, units, k, s, job.accumulate, ranks, job.shared_cores, staged, shared_gathers=shared
    )
    replicas = job.world_size // k
    for S in units.shards:  # HSDP: each reduced slice averaged across the replicas
        volume = native_volume("all_reduce", S * compute, replicas)
        costs.add_comm("all_reduce", volume, ranks=replicas)
    if s.stage == 3 and job.accumulate > 1:  # (measured 12-16% above the unit-less bound)
        costs.peak = None
        costs.notes.append("ZeRO-3 under accumulation: its gathers in no_sync not emulated")
    if s.mixed_precision == "fp16":
        costs.notes.append("fp16 loss scaling: its overflow all-reduce is not counted")
    return costs


def sole_rank_costs(job: CostJob) -> Costs:
    """ZeRO alone in the world, in fp32 (`SoleRankStage1`): plain training. The optimizer steps
    the parameters with the gradients autograd makes each step; nothing is sent."""
    costs = replica_costs(job)
    held = numels(job.params())
    made = costs.memory["grads"]
    costs.peak = step_peak(job, costs.memory, held, job.global_batch, made_grads=made)
    return costs


def zero_traffic(
    costs: Costs,
    units: _Units,
    n: int,
    s: StrategySection,
    passes: int = 1,
    ranks=None,
    exchanges: bool = False,
    staged: bool = False,
    shared_gathers: bool = False,
) -> None:
    """Each unit's reduce-scatter (or its codec's messages; `exchanges`, gloo on one host:
    an all-to-all of its slices, `ZeroStage1.exchanges_slices`, or where also `staged`, a
    reduce-scatter in shared memory, `StagedGradients`) and all-gathers (`shared_gathers`:
    in shared memory), and which of them a unit's compute hides, among `ranks` ranks (None:
    every rank) of which `n` shard.
    Stage 3 gathers for each of `passes` forwards and backwards (micro-batches) of a step; the
    reduction runs once, after the last."""
    stage, compute = s.stage, HALF.get(s.mixed_precision, FP32)
    shards = units.shards
    for k, S in enumerate(shards):
        unit_bytes = S * n * compute
        # Backward makes the first unit's gradients last: the others' reductions run while it
        # computes, and all are waited for after it. (Stage 3's root unit is launched last,
        # right after the first block's: only the root's own modules, embeddings, compute in
        # between, so that block's reduction is waited for at once too.)
        hidden = k > (1 if units.rest else 0)
        if getattr(s, "compression", None):
            _encoded(costs, s.compression, units.params[k], S, n, prefetched=hidden)
        elif staged:  # (calibrated as a kind of its own)
            # Stage 1's reductions overlap backward as any; stages 2/3's wait, staged, for
            # the buffers to run out or backward to end, and run then, one after the other
            # (`ZeroStage2._flush`).
            volume = native_volume("reduce_scatter", unit_bytes, n)
            costs.add_comm(
                "reduce_scatter",
                volume,
                prefetched=hidden and stage == 1,
                kind="shared_reduce_scatter",
            )
        else:
            op = "all_to_all" if exchanges and n > 1 else "reduce_scatter"
            costs.add_comm(op, native_volume(op, unit_bytes, n), ranks=ranks, prefetched=hidden)
        volume = native_volume("all_gather", unit_bytes, n)
        gather = partial(costs.add_comm, "all_gather", ranks=ranks)
        if shared_gathers:
            gather = partial(gather, kind="shared_all_gather")
        if stage < 3 or (k == 0 and units.rest):
            # (stage 3's rest, gathered before forward, stays gathered through backward)
            gathers = passes if stage == 3 else 1  # (stages 1-2: once, after the step)
            gather(gathers * volume, calls=gathers)
            continue
        # Stage 3 gathers each other unit twice a pass (once where it is kept gathered from
        # forward to backward). A unit's gather starts in the hook of the unit before it
        # (forward: the previous, backward: the next) and is waited for after that unit's
        # compute; forward's first block (started with the rest, only the rest's embeddings
        # between) and backward's first, the last unit, are waited for on the spot.
        kept = k in units.kept
        first_forward, first_backward = k == (1 if units.rest else 0), k == len(shards) - 1
        exposed = passes * (first_forward + (first_backward and not kept))
        hidden = (1 if kept else 2) * passes - exposed
        gather(exposed * volume, calls=exposed)
        gather(hidden * volume, calls=hidden, prefetched=True)


def _encoded(costs: Costs, spec: str, params: list, S: int, n: int, prefetched: bool) -> None:
    """A unit's reduce-scatter through the codec `spec` (`comm.compression`): a cast codec's
    reduce-scatter in its dtype; a wire codec's all-to-all of each rank's encoding of every
    slice; PowerSGD's two all-reduces of the whole unit's factors (then this rank's slice)."""
    codec = make_codec(spec)
    name, _, arg = spec.partition(":")
    if name in ("fp16", "bf16"):
        reduced = native_volume("reduce_scatter", 2 * S * n, n)
        costs.add_comm("reduce_scatter", reduced, prefetched=prefetched)
    elif isinstance(codec, WireCodec):
        message = wire_nbytes(codec.layout(S))
        sent = native_volume("all_to_all", n * message, n)
        costs.add_comm("all_to_all", sent, prefetched=prefetched)
    else:
        padding = S * n - sum(p.numel() for p in params)
        shapes = [p.shape for p in params] + [(padding,)] * (padding > 0)
        _powersgd_bytes(costs, arg, shapes, n)


class Stage1Emulation:
    """ZeRO's buffers through forward and backward, made and freed as `strategies.zero` does,
    on fake tensors; stage 1's here, stages 2 and 3 in the subclasses, as the strategy's own
    stages extend one another.

    Units (lists of parameter names) are reduced in reverse order, each once all its
    gradients are in and every later unit has been launched: a reduced slice (S elements) is
    made at the launch. All are completed at the end of backward (fp32 masters: the slice
    copied to fp32 becomes the shard's gradient). On gloo a completion surfaces the backend's
    copy of the whole buffer. Exchanged instead (`exchanges`: an all-to-all of the slices, gloo
    on one host), a unit's launch makes the buffer that receives every rank's copy of the
    slice (S x N), and its completion their sum (stage 1: into its full buffer's own slice).
    Reduced in shared memory (`in_place`, stage 1 where the whole world is one host's CPU
    ranks), a unit makes nothing: its slice is summed into its full buffer's own.
    """

    in_place = False

    def __init__(
        self,
        model: nn.Module,
        units: list[list[str]],
        unit_modules: list[str],
        world_size: int,
        compute: torch.dtype,
        fp32_masters: bool,
        gloo: bool,
        exchanges: bool = False,
    ) -> None:
        self.model, self.units, self.unit_modules = model, units, unit_modules
        self.n, self.compute = world_size, compute
        self.fp32_masters, self.gloo, self.exchanges = fp32_masters, gloo, exchanges
        self.numels = [0] * len(units)
        self.order = list(reversed(range(len(units))))

    def _reset(self) -> None:
        count = len(self.units)
        self.pending = [len(names) for names in self.units]
        self.next_launch = 0
        self.grad_full: list = [None] * count
        self.reduced: list = [None] * count
        self.received: list = [None] * count
        self.shard_grads: list = [None] * count
        self.in_flight: list[int] = []
        self.queued = False
        self.staged_in: set[int] = set()  # units whose full gradient is in a staging buffer

    def _shard(self, i: int) -> int:
        return -(-self.numels[i] // self.n)

    def __call__(self, params: dict[str, nn.Parameter]) -> list:
        """Install the hooks on the fake parameters `params` (by name) and, where the stage
        needs them, on the model's modules; the handles to remove afterwards."""
        self._reset()
        self.numels = [sum(params[name].numel() for name in names) for names in self.units]
        unit_of = {name: i for i, names in enumerate(self.units) for name in names}
        for name, p in params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, i=unit_of[name]: self._grad(p, i))
        return self._module_hooks()

    def _module_hooks(self) -> list:
        return []  # (stage 3 gathers parameters around each unit's module)

    def _grad(self, p: nn.Parameter, i: int) -> None:
        self._gradient_arrives(i)
        p.grad = None  # moved into the unit's buffer
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.pending[i] -= 1
        while (
            self.next_launch < len(self.units) and self.pending[self.order[self.next_launch]] == 0
        ):
            self._launch(self.order[self.next_launch])
            self.next_launch += 1

    def _gradient_arrives(self, i: int) -> None:
        """Stage 1 accumulates into the full flat gradient buffers it keeps: nothing is made."""

    def _launch(self, i: int) -> None:
        earlier = list(self.in_flight)
        if self.in_place:  # (stage 1: into its own slice of the full buffer, a view)
            self.reduced[i] = None
        elif self.exchanges:
            self.received[i] = torch.empty(self._shard(i) * self.n, dtype=self.compute)
        else:
            self.reduced[i] = torch.empty(self._shard(i), dtype=self.compute)
        self.in_flight.append(i)
        self._launched(i, earlier)

    def _launched(self, i: int, earlier: list[int]) -> None:
        """Stage 1 waits for its reductions at the end of backward only."""

    def _complete(self, i: int) -> None:
        if self.gloo and not self.exchanges:  # (its reduce-scatter's copy of the input)
            torch.empty(self._shard(i) * self.n, dtype=self.compute)  # seen, then let go
        reduced = self.reduced[i]
        if self.exchanges and i not in self.staged_in and not self.in_place:  # the copies summed
            reduced = self._own_slice(i)
            self.received[i] = None
        if self.fp32_masters and reduced is not None:
            reduced = reduced.to(torch.float32)
        elif self.fp32_masters:  # (stage 1: a view of the full buffer, copied to fp32)
            reduced = torch.empty(self._shard(i), dtype=torch.float32)
        self._keep(i, reduced)
        self.grad_full[i] = self.reduced[i] = None
        self.staged_in.discard(i)
        self.in_flight.remove(i)

    def _own_slice(self, i: int) -> torch.Tensor | None:
        """Stage 1 keeps its full gradient buffers: the summed slice is written into one."""
        return None

    def _flush(self) -> None:
        """Stage 1 defers no reduction."""

    def _keep(self, i: int, reduced: torch.Tensor | None) -> None:
        if self.fp32_masters:  # (otherwise the slice is a view of its full buffer)
            self.shard_grads[i] = reduced

    def _finish(self) -> None:
        while self.next_launch < len(self.units):
            self._launch(self.order[self.next_launch])
            self.next_launch += 1
        self._flush()
        for i in list(self.in_flight):
            self._complete(i)


class Stage2Emulation(Stage1Emulation):
    """Stage 2 makes each unit's full gradient buffer (S x N) at its first gradient and,
    launching a unit, completes the ones launched before it: their full buffers go, their
    slices become the shard's gradients. A unit staged in shared memory is reduced later,
    with the others staged, when a unit finds every staging buffer taken or backward ends
    (`ZeroStage2._flush`)."""

    staged_slots = 0  # shared-memory buffers for full gradients (`StagedGradients`), lasting

    def _reset(self) -> None:
        super()._reset()
        self.deferred: list[int] = []

    def _gradient_arrives(self, i: int) -> None:
        if self.grad_full[i] is None and len(self.staged_in) == self.staged_slots:
            self._flush()  # (frees the deferred units' staging buffers, if any)
        if self.grad_full[i] is None and len(self.staged_in) < self.staged_slots:
            self.staged_in.add(i)  # (in a buffer that outlives the step: nothing made)
            self.grad_full[i] = torch.empty(0)
        elif self.grad_full[i] is None:
            self.grad_full[i] = torch.zeros(self._shard(i) * self.n, dtype=self.compute)

    def _launch(self, i: int) -> None:
        if i in self.staged_in:
            self.deferred.append(i)
            self._launched(i, [])
            return
        super()._launch(i)

    def _flush(self) -> None:
        deferred, self.deferred = self.deferred, []
        for i in deferred:  # (each summed into a slice of its own)
            self.reduced[i] = torch.empty(self._shard(i), dtype=self.compute)
            self.in_flight.append(i)
        for i in deferred:
            self._complete(i)

    def _launched(self, i: int, earlier: list[int]) -> None:
        for j in earlier:
            self._complete(j)

    def _own_slice(self, i: int) -> torch.Tensor:
        return torch.empty(self._shard(i), dtype=self.compute)

    def _keep(self, i: int, reduced: torch.Tensor) -> None:
        self.shard_grads[i] = reduced


class Stage3Emulation(Stage2Emulation):
    """Stage 3 also gathers a unit's parameters (S x N, and the slice's compute copy until the
    gather is waited for) before its forward, with the next unit's (every kept unit's as the
    forward begins), frees them after it,
    gathers them again (with the previous unit's) when its output's gradient arrives, and
    frees them once its launch has completed the earlier unit; parameters outside every unit
    (unit 0) are gathered for the whole forward and backward."""

    kept: frozenset[int] = frozenset()  # units kept gathered from forward to backward

    def _reset(self) -> None:
        super()._reset()
        self.full: list = [None] * len(self.units)
        self.copies: list = [None] * len(self.units)

    def _module_hooks(self) -> list:
        modules = dict(self.model.named_modules())
        offset = len(self.units) - len(self.unit_modules)  # 1 where unit 0 holds the rest
        handles = []
        if offset:
            handles.append(self.model.register_forward_pre_hook(lambda *_: self._gather(0, 1)))
        if self.kept:  # (every kept unit's gather started as a forward with backward begins)
            handles.append(self.model.register_forward_pre_hook(self._gather_kept))
        for i, name in enumerate(self.unit_modules, start=offset):
            handles += [
                modules[name].register_forward_pre_hook(lambda *_, i=i: self._gather(i, 1)),
                modules[name].register_forward_hook(lambda _m, _a, out, i=i: self._after(i, out)),
            ]
        return handles

    def _gather_kept(self, *_) -> None:
        if torch.is_grad_enabled():
            for i in (0, *sorted(self.kept)):
                self._start_gather(i)

    def _start_gather(self, i: int) -> None:
        if 0 <= i < len(self.units) and self.full[i] is None:
            self.full[i] = torch.empty(self._shard(i) * self.n, dtype=self.compute)
            self.copies[i] = torch.empty(self._shard(i), dtype=self.compute)

    def _gather(self, i: int, direction: int) -> None:
        self._start_gather(i)
        if direction:
            self._start_gather(i + direction)
        self.copies[i] = None  # waited for

    def _after(self, i: int, out) -> None:
        # (any output: a tensor, a tuple, a Hugging Face ModelOutput)
        grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled():
            for t in grads:
                t.register_hook(lambda grad: self._gather(i, -1))
        if i not in self.kept or not torch.is_grad_enabled():
            self.full[i] = None

    def _launched(self, i: int, earlier: list[int]) -> None:
        super()._launched(i, earlier)
        self.full[i] = None  # (after the earlier unit's wait: alive through it)


EMULATIONS = {1: Stage1Emulation, 2: Stage2Emulation, 3: Stage3Emulation}


MODEL = CostModel(zero_costs, data_parallel_compute)
