"""ZeRO stage 1: the optimizer state sharded over the N ranks (Rajbhandari et al., SC 2020).

Parameters are flattened into units (padded so N divides them); rank r owns slice r of every
unit and its optimizer sees only those slices, so Adam's 8 bytes per parameter become 8/N.
During backward each unit's full gradient is reduce-scattered as soon as it is complete (the
bucket scheduling DDP uses): every rank receives the averaged slice it owns. The rank steps its
slices, then every unit's updated slices are all-gathered into the full parameters.

Memory with fp32 Adam: 4P parameters + 4P gradients (kept, as in DDP: the parameters' `.grad`
are views into each unit's full gradient buffer) + 8P/N optimizer state. Communication:
reduce-scatter + all-gather, the volume of one all-reduce, as DDP. With a gradient codec
(`compression`, `comm/compression.py`) the reduce-scatter runs through it on a communication
thread; its error feedback is kept per unit and saved with the model's extra state.

Hybrid (HSDP, `shard_group=K`): everything above happens inside a shard group of K ranks (N
becomes K), and each reduced slice is then all-reduced across the N/K replicas of its owner
(`groups.replicate`) before the shard takes it; replicas step identical slices.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.comm import shared_memory
from shardwise.comm.compressed_collectives import CompressedReduceScatter, make_codec
from shardwise.comm.shared_memory import SharedMemoryCollectives
from shardwise.distributed.runtime import Runtime
from shardwise.distributed.shard_groups import ShardGroups, whole
from shardwise.nn.meta_init import ParameterSource
from shardwise.nn.sync_batchnorm import SyncBatchNorm
from shardwise.optim.layerwise import LayerwiseOptimizer, ParameterNorms, Piece
from shardwise.strategies.base import (
    EXTRA,
    DistributedModel,
    DistributedOptimizer,
    buffer_tensors,
    load_buffers,
    prefixed,
    replicated,
    square_sum,
    unprefixed,
)
from shardwise.strategies.batch_share import BatchShare, WeighedOnArrival
from shardwise.strategies.grad_buckets import (
    BucketCallbacks,
    BucketedBackward,
    assign_buckets,
    shares_cores,
)
from shardwise.strategies.offload import DiskOffloadedStep, DiskStore
from shardwise.strategies.zero.masters import FP32Masters, ShardViews
from shardwise.strategies.zero.units import FlatUnit, Place


class ZeroStage1(DistributedModel):
    """Units, the optimizer's shards and the hooks that reduce gradients into them."""

    stage = 1
    keeps_full_grads = True  # the full gradient buffers persist between steps (stage 1 only)
    shard_is_view = True  # the shard is a view of the compute buffer (not stage 3)

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        masters: ShardViews | FP32Masters,
        bucket_bytes: int,
        offload_dir: Path | None = None,
        source: ParameterSource | None = None,
        compression: str | None = None,
        groups: ShardGroups | None = None,
    ) -> None:
        super().__init__(module, runtime)
        self.masters, self.offload_dir = masters, offload_dir
        self.bucket_bytes = bucket_bytes
        self.groups = groups or whole(runtime)  # whom the units are sharded over
        shard_over = (self.groups.shard_rank, self.groups.shard_size)
        # Where gloo's ranks share one host, a unit is reduce-scattered as an exchange of its
        # slices (an all-to-all: every rank receives each rank's copy of the slice it owns,
        # the bytes of a reduce-scatter) and their sum here: gloo's own reduce-scatter of 12 MB
        # took 13.7 ms there, its all-reduce 9.4, the exchange and sum 5.2 (world 2; world 4:
        # 27.6, 20.9 and 12.3; docs/strategies.md); over the whole world, summed where they
        # lie in shared memory instead (`shared`, below). A codec sends its own encoding.
        one_host_cpu = shares_cores(runtime.device, runtime.num_nodes)
        self.exchanges_slices = one_host_cpu and self.groups.shard_size > 1 and compression is None
        # There, too, units are all-gathered by direct messages (`comm.all_gather_pairwise`: the
        # same bytes; gloo's own all-gather of 24 MB took 14.5 ms there, the messages 10.1), or
        # in shared memory where they are sharded over the whole world (`shared`, below).
        self.gathers_by_messages = one_host_cpu
        self.shared: SharedMemoryCollectives | None = None
        self.disk_step: DiskOffloadedStep | None = None
        n = self.groups.shard_size
        whole_world = runtime.group is None and n == runtime.world_size > 1
        if one_host_cpu and whole_world and shared_memory.supported():
            # Every rank a process of this host's CPU: units gathered (and, without a codec,
            # gradients reduced) through shared memory, no byte through a socket.
            self.shared = SharedMemoryCollectives(runtime.timeout)
        place = self.place_shards()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = {p: n for n, p in named}
        self.units = [
            FlatUnit(
                *(params, *shard_over, masters.compute_dtype, self.groups.shard),
                all_gather=self.all_gather,
                source=None if source is None else (source, [self.names[p] for p in params]),
                place=place,
            )
            for params in self.unit_params([p for _, p in named], bucket_bytes)
        ]
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.shards = [masters.make_shard(u, self.shard_is_view, place) for u in self.units]
        # (stage 3's shards where `place` made them: gathered from there, in no slot)
        self.resident_shards = (
            place is not None
            and self.shared is not None
            and all(map(self.shared.resident, [u.full for u in self.units], self.shards))
        )
        if self.shared is not None and not self.resident_shards:
            # The gather slots hold the largest unit's slice in the compute dtype (what the
            # ranks gather).
            largest = max(u.shard_numel for u in self.units)
            self.shared.reserve_gathers(largest * masters.compute_dtype.itemsize)
        for u in self.units:
            u.initial = u.master_init = None  # in the shards now
        # Gradients become ready roughly in reverse forward order: reduce units in that order.
        order = list(reversed(range(len(self.units))))
        self.backward = BucketedBackward(
            self.backward_buckets(order),
            self.names,
            BucketCallbacks(
                self._on_grad, lambda k: self._launch(order[k]), self._zero, self._finish
            ),
            find_unused_parameters=False,
            if_intended="freeze them (requires_grad_(False)): ZeRO needs a gradient for every "
            "trainable parameter in each backward (sw.DDP takes find_unused_parameters=True)",
        )
        self.batch_share = BatchShare(runtime)
        self.weighing = WeighedOnArrival(self.batch_share)
        for m in module.modules():
            if isinstance(m, SyncBatchNorm):
                m.batch_share = self.batch_share  # its backward weighs uneven batches too
        self.hooks: list = []  # module hooks the strategy added, removed by close()
        self.codec = None if compression is None else self._codec(compression)
        self.prepare_units()
        self.hooks += masters.install(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.backward.check_ended()
        return self.module(*args, **kwargs)

    def _codec(self, spec: str) -> CompressedReduceScatter:
        """The codec's reduce-scatter, told each unit's tensors (PowerSGD compresses each
        matrix; the padding is one more, uncompressed, vector)."""
        codec = CompressedReduceScatter(make_codec(spec), self.runtime.timeout)
        for key, unit in enumerate(self.units):
            padding = unit.full.numel() - sum(unit.numels)
            shapes = [p.shape for p in unit.params] + [torch.Size([padding])] * (padding > 0)
            codec.describe(key, shapes)
        return codec

    def place_shards(self) -> Place | None:
        """Where the shards are made, where not as any tensor (stage 3: `ZeroStage3`)."""
        return None

    def unit_params(self, params: list[nn.Parameter], bucket_bytes: int) -> list[list]:
        """Which parameters share a unit: buckets by size, in reverse registration order."""
        return assign_buckets(params, bucket_bytes)

    def all_gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        group: comm.ProcessGroup | None,
        async_op: bool = False,
    ) -> comm.Handle:
        """A unit's all-gather (`output` from every rank's `shard`): in shared memory where it
        can (`shared`), by direct messages where gloo's ranks share a host, else the
        backend's. (The same choice on every rank: it depends on sizes and placement alone.)"""
        # (stage 3's shards, read where they lie: only where every shard lies there, which is
        # where stage 3 has the ranks meet before reading them)
        if self.resident_shards and self.shared.resident(output, shard):
            return self.shared.start_gather_resident(output, shard, here=not async_op)
        if self.shared is not None and self.shared.gathers(output, shard):
            return self.shared.start_all_gather(output, shard, here=not async_op)
        if self.gathers_by_messages:
            return comm.all_gather_pairwise(output, shard, group, async_op=async_op)
        return comm.all_gather_into_tensor(output, shard, group, async_op=async_op)

    def backward_buckets(self, order: list[int]) -> list[list[nn.Parameter]]:
        """The parameters whose gradients backward reduces, unit by unit in `order`."""
        return [self.units[i].params for i in order]

    def prepare_units(self) -> None:
        # Kept for the job: in shared memory where the units are sharded over the whole world
        # of one host's CPU ranks and no codec encodes them, each reduced where it lies into
        # its own slice (`_launch`).
        in_shared_memory = self.exchanges_slices and self.shared is not None
        for u in self.units:
            if in_shared_memory:
                u.grad_full = self.shared.new_buffer(u.full.numel(), u.full.dtype, u.full.device)
            else:
                u.grad_full = torch.zeros_like(u.full)
            u.keep_slots(u.grad_full)

    # ---- gradients: fill the unit's full gradient buffer, reduce-scatter it, keep our slice
    def _on_grad(self, p: nn.Parameter) -> None:
        # Gradients stay views into the persistent buffer (as in DDP).
        slot = self.unit_of[p].slot(self.unit_of[p].grad_full, p)
        if p.grad.data_ptr() != slot.data_ptr():
            self.weighing.move_in(p, slot, weigh=self.backward.enabled)
            p.grad = slot

    def _zero(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        if unit.grad_full is None:
            unit.grad_full = torch.zeros_like(unit.full)
        unit.slot(unit.grad_full, p).zero_()
        self.weighing.zeroed(p)

    def _launch(self, index: int) -> None:
        # (the backward's last reduction, waited for next: run on this thread)
        self._reduce(index, here=self.backward.launching_last)

    def _reduce(self, index: int, here: bool) -> None:
        """Start reducing unit `index`'s full gradient into this rank's slice (`here`: through
        shared memory, on this thread, done when this returns)."""
        unit = self.units[index]
        # The mean, before summing (fp16-safe): what was not weighed as it moved in.
        self.weighing.weigh_rest(
            unit.params, unit.grad_full, lambda p: unit.slot(unit.grad_full, p)
        )
        if self.groups.shard_size == 1 and self.codec is None:
            unit.reduced = unit.grad_full  # (a slice of one: the whole, summed over itself)
            unit.handle = comm.Handle("reduce_scatter", None, None)  # done: no message
            return
        if self.shared is not None and self.shared.placed(unit.grad_full):
            # Summed where it lies in shared memory: stage 1 into its own slice of the buffer
            # it keeps (whose values no peer reads), stages 2/3 into a slice of their own (the
            # staging buffer is another unit's next).
            if self.keeps_full_grads:
                unit.reduced = unit.own(unit.grad_full)
            else:
                unit.reduced = torch.empty(unit.shard_numel, dtype=unit.full.dtype)
            unit.handle = self.shared.start_reduce_scatter(
                unit.grad_full, unit.reduced, here, key=index
            )
            return
        if self.exchanges_slices:  # (summed as it completes: `_sum_received`)
            unit.received = torch.empty_like(unit.grad_full)
            unit.handle = comm.all_to_all_single(
                unit.received, unit.grad_full, group=self.groups.shard, async_op=True
            )
            return
        unit.reduced = torch.empty(unit.shard_numel, dtype=unit.full.dtype, device=unit.full.device)
        if self.codec is not None:
            unit.handle = self.codec.start(unit.grad_full, unit.reduced, key=index)
            return
        unit.handle = comm.reduce_scatter_tensor(
            unit.reduced, unit.grad_full, group=self.groups.shard, async_op=True
        )

    def _finish(self) -> None:
        for i in range(len(self.units)):
            self._complete(i)
        if self.codec is not None:  # (its state: the next backward that raises returns here)
            self.codec.commit()
        self.weighing.clear()
        self.batch_share.done()

    def _complete(self, index: int) -> None:
        """Wait for unit `index`'s reduce-scatter and hand its slice to the shard."""
        unit = self.units[index]
        if unit.handle is None:
            return  # completed already
        unit.handle.wait()
        unit.handle = None
        if unit.received is not None:
            unit.reduced = self._sum_received(unit)
        if self.groups.is_hybrid:
            # HSDP: sum the slice over its owners in every shard group. `batch_share` weighed
            # each rank's gradient as its share of the whole world's batch: the sum is the mean.
            comm.all_reduce(unit.reduced, group=self.groups.replicate)
        self.masters.take_grad(unit, self.shards[index], self.keeps_full_grads)
        self.release_full_grad(unit)
        unit.reduced = None

    def _sum_received(self, unit: FlatUnit) -> torch.Tensor:
        """The sum of every rank's copy of this rank's slice (the exchange's), in rank order.
        Stage 1 keeps the unit's full gradient buffer: the sum goes into its own slice of it,
        whose values went out in the exchange."""
        copies = unit.received.view(self.groups.shard_size, -1)
        total = unit.own(unit.grad_full) if self.keeps_full_grads else torch.empty_like(copies[0])
        torch.add(copies[0], copies[1], out=total)
        for more in copies[2:]:
            total.add_(more)
        unit.received = None
        return total

    def declare_batch(self, samples: int, total: int | None = None) -> None:
        self.batch_share.declare(samples, total)

    def release_full_grad(self, unit: FlatUnit) -> None:
        """Stage 1 keeps the unit's full gradient buffer (the parameters' .grad live in it)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.backward.take_back(self._take_back_abandoned)  # (a backward that raised)
        self.weighing.clear()  # (a backward that raised never reached `_finish`)
        for unit, shard in zip(self.units, self.shards, strict=True):
            shard.grad = None
            if not set_to_none:
                unit.grad_full.zero_()
            for p in unit.params:
                p.grad = None if set_to_none else unit.slot(unit.grad_full, p)

    def _take_back_abandoned(self) -> None:
        """What a backward that raised left behind (on every rank: the same hook or loss raised
        on each), undone for the next: the reductions it launched are waited for, so none
        still reads a buffer the next backward writes, and their slices dropped."""
        for unit in self.units:
            if unit.handle is not None:
                unit.handle.wait()
            unit.handle = unit.reduced = unit.received = None
        if self.codec is not None:  # (what its reductions left unsent goes with them)
            self.codec.roll_back()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no communication) for the backward passes inside."""
        return self.backward.paused()

    def grad_shards(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards if s.grad is not None]

    # ---- the step: skip on fp16 overflow, step the shards, all-gather the parameters
    def optimizer_params(self) -> list[nn.Parameter]:
        return self.shards

    def make_optimizer(self, optimizer_cls, **kwargs: Any) -> DistributedOptimizer:
        optimizer = super().make_optimizer(optimizer_cls, **kwargs)
        if self.offload_dir is not None and isinstance(optimizer.inner, LayerwiseOptimizer):
            raise ValueError(
                f"{optimizer_cls.__name__} needs every shard's norms at once: use offload='cpu' "
                "rather than 'disk' (which steps the shards one page at a time)"
            )
        if self.offload_dir is not None:  # masters and optimizer state in memory-mapped files
            # A directory unique to this rank and job, even in a shared parent; made only now
            # (not at wrap), so that an optimizer refused above leaves nothing behind.
            store = DiskStore.fresh(self.offload_dir, f"shardwise-offload-rank{self.runtime.rank}-")
            self.disk_step = DiskOffloadedStep(optimizer.inner, self.shards, store)
        return optimizer

    def parameter_norms(self) -> ParameterNorms:
        """Each shard's pieces of its unit's parameters (its padding in none), their squares
        summed over the shard group (its replicas hold the same slices)."""
        params = [p for unit in self.units for p in unit.params]
        index = {id(p): i for i, p in enumerate(params)}
        pieces = {}
        for unit, shard in zip(self.units, self.shards, strict=True):
            low = unit.rank * unit.shard_numel  # this rank's slice of the unit's flat buffer
            pieces[id(shard)] = [
                Piece(index[id(p)], start - low, stop - low, start - unit.offset_of[p])
                for p in unit.params
                if (start := max(unit.offset_of[p], low))
                < (stop := min(unit.offset_of[p] + p.numel(), low + unit.shard_numel))
            ]
        group, device = self.groups.shard, self.units[0].full.device  # (offload: shards on CPU)

        def over_shards(x: torch.Tensor) -> None:
            comm.all_reduce(x, group=group)

        return ParameterNorms(pieces, params, over_shards, device=device, join=over_shards)

    def settle_gradients(self) -> None:
        self.backward.end_deferred()
        self.backward.check_reduced()

    def before_step(self) -> bool:
        return self.masters.step_allowed(self.grad_shards())

    def step_optimizer(self, inner: torch.optim.Optimizer, closure) -> Any:
        return self.disk_step(closure) if self.disk_step else inner.step(closure)

    def after_step(self) -> None:
        self.gather_parameters()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every unit's full compute buffer from all ranks' updated slices."""
        if self.groups.shard_size == 1:  # the slice is the whole: at most a cast, no message
            for u, s in zip(self.units, self.shards, strict=True):
                if s.data_ptr() != u.full.data_ptr():  # (not a view of it: fp32 masters)
                    u.full.copy_(s.detach())
            return
        # Through shared memory each is gathered on this thread, one after the other: it
        # waits for all of them next, with nothing to compute meanwhile.
        handles = [
            self.all_gather(
                u.full, self._gathered(u, s), self.groups.shard, async_op=self.shared is None
            )
            for u, s in zip(self.units, self.shards, strict=True)
        ]
        for h in handles:
            h.wait()

    def _gathered(self, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
        """What the ranks all-gather of `shard`: the shard itself where it is this rank's slice
        of the compute buffer and shared memory gathers it (it is copied into a slot first),
        else its compute copy (gloo's messages would read the buffer they receive into)."""
        own = unit.own(unit.full)
        is_own = shard.data_ptr() == own.data_ptr()  # (a view of it: no fp32 masters)
        if is_own and self.shared is not None and self.shared.gathers(unit.full, own):
            return own
        return self._compute_copy(shard)

    def _compute_copy(self, shard: torch.Tensor) -> torch.Tensor:
        """What the ranks all-gather: the master slice in the compute dtype."""
        device = self.units[0].full.device
        return shard.detach().to(device, self.masters.compute_dtype, copy=True)

    # ---- gradients' norm and the state
    def local_grads(self) -> list[torch.Tensor]:
        self.settle_gradients()
        return self.grad_shards()

    def grad_square_sum(self) -> torch.Tensor:
        device = self.units[0].full.device  # offloaded shards are on the CPU
        squares = square_sum(self.local_grads(), device).to(device)
        # Disjoint shards: sum over the shard group (its replicas hold the same slices).
        comm.all_reduce(squares, group=self.groups.shard)
        return squares

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters all-gathered from the shards the optimizer steps (fp32 masters under
        mixed precision), buffers as the module holds them."""
        full = {}
        for unit, shard in zip(self.units, self.shards, strict=True):
            # Gather on the compute device: offloaded masters live on the CPU, NCCL does not.
            device = unit.full.device
            flat = torch.empty(unit.full.numel(), dtype=shard.dtype, device=device)
            comm.all_gather_into_tensor(
                flat, shard.detach().to(device).contiguous(), self.groups.shard
            )
            for p in unit.params:
                full[p] = unit.slot(flat, p).clone()
        # By identity: a tied parameter is one value under each of its names.
        state = self.module.state_dict(keep_vars=True)
        return {k: full[v] if v in full else v.detach().clone() for k, v in state.items()}

    def extra_state(self) -> dict[str, torch.Tensor]:
        # The loss scale (fp16) and the codec's per-unit residuals and generator.
        codec = {} if self.codec is None else self.codec.state_dict()
        return {**self.masters.state_dict(), **prefixed("comm.", codec)}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.masters.load_state_dict({k: v for k, v in state.items() if not k.startswith("comm.")})
        if self.codec is not None:
            self.codec.load_state_dict(unprefixed("comm.", state))

    def shared_extra_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items() if not k.startswith("comm.")}  # (the loss scale)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's shards (fp32 masters where kept), the buffers and frozen parameters, the
        loss scale."""
        state = {f"shard{i}": s.detach() for i, s in enumerate(self.shards)}
        state.update({f"buffer.{n}": b for n, b in replicated(self.module, frozen=True)})
        return {**state, **prefixed(EXTRA, self.extra_state())}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign=False):
        """This rank's state from `state_dict()`, or a full single-process state dict (the
        shards are cut from it). Collective: the compute copies are gathered from all ranks."""
        if "shard0" not in state_dict:
            self.load_full_params(state_dict)
            return
        for i, shard in enumerate(self.shards):
            shard.copy_(state_dict[f"shard{i}"])
        load_buffers(self.module, unprefixed("buffer.", state_dict))
        if extra := unprefixed(EXTRA, state_dict):
            self.load_extra_state(extra)
        self.gather_parameters()

    def checkpoint_name(self) -> str:
        # Hybrid: another shard size at the same world size holds other slices (`state_dict`).
        hybrid = f"-hsdp{self.groups.shard_size}" if self.groups.is_hybrid else ""
        return f"zero-{self.stage}{hybrid}"

    def scales_loss(self) -> bool:
        return getattr(self.masters, "scaler", None) is not None

    def loss_scale(self) -> float | None:
        scaler = getattr(self.masters, "scaler", None)
        return None if scaler is None else scaler.scale

    def checkpoint_shard(
        self, optimizer: torch.optim.Optimizer, every_rank: bool = False
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        layout = {
            "num_shards": self.groups.shard_size,
            "strategy": self.checkpoint_name(),
            "units": [
                {"params": [[self.names[p], list(p.shape)] for p in u.params]} for u in self.units
            ],
        }
        if self.runtime.rank >= self.groups.shard_size and not every_rank:
            return layout, None  # a replica of the first shard group's slices: written there
        own_buffers = self.runtime.rank == 0 or every_rank
        tensors = buffer_tensors(self.module, frozen=True) if own_buffers else {}
        for i, shard in enumerate(self.shards):
            tensors[f"unit{i}/param"] = shard.detach()
            for key, value in optimizer.state.get(shard, {}).items():
                if torch.is_tensor(value):
                    tensors[f"unit{i}/{key}"] = value
        return layout, tensors

    @torch.no_grad()
    def load_full_params(self, params: dict[str, torch.Tensor]) -> None:
        """Take this rank's slices of full, single-process parameters (and the buffers)."""
        load_buffers(self.module, params)
        for unit, shard in zip(self.units, self.shards, strict=True):
            full = unit.flatten([params[self.names[p]] for p in unit.params], shard.dtype)
            shard.copy_(unit.own(full))
            self.take_full_params(unit, full)

    @torch.no_grad()
    def load_full_state(self, optimizer, params, states) -> None:
        self.load_full_params(params)
        for unit, shard in zip(self.units, self.shards, strict=True):
            names = [self.names[p] for p in unit.params]
            optimizer.state[shard] = {
                key: value.clone().to(shard.device)
                if value.dim() == 0
                else unit.own(unit.flatten([states[n][key] for n in names], shard.dtype)).clone()
                for key, value in states.get(names[0], {}).items()
            }

    def take_full_params(self, unit: FlatUnit, full: torch.Tensor) -> None:
        unit.full.copy_(full)  # the model's parameters are views of it

    def release(self) -> None:
        self.backward.remove()
        if self.codec is not None:
            self.codec.close()
        if self.shared is not None:
            self.shared.close()
        for hook in self.hooks:
            hook.remove()
        if self.disk_step is not None:
            self.disk_step.store.remove()
