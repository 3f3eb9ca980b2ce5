"""Data parallel, our own: bucketed gradient all-reduce overlapped with the backward pass.

Every rank holds the whole model and sees its own slice of the global batch. After backward,
gradients are averaged over ranks, so every rank takes the same optimizer step and the replicas
never drift (Li et al., "PyTorch Distributed", VLDB 2020, describes the bucketing we follow).

How it works, top to bottom:
1. `wrap` broadcasts rank 0's parameters and buffers, so all replicas start equal.
2. Gradients live in flat buckets (about `bucket_mb` each, parameters in reverse registration
   order, since backward produces the last layers' gradients first; after the first backward,
   in the order it actually made them, rank 0's for all). Each `param.grad` is a view into its
   bucket, so there is no second gradient copy: 16 bytes/parameter with fp32 AdamW. A fresh
   gradient is weighed (divided by the world) as it is copied in: one pass over it; where the
   all-reduce divides as it sums (shared memory, equal shares), it is copied in as it is. An
   `nn.Linear` with a weight of 2 MiB or more writes that gradient into the bucket itself
   (`linear_into_bucket`): no copy at all.
3. A post-accumulate-grad hook per parameter counts down its bucket; when a bucket is complete
   (and every earlier bucket has been launched, so all ranks launch in the same order), its
   asynchronous all-reduce starts while backward continues on earlier layers. Where all ranks
   compute on one host's CPU, the buckets live in shared memory and are summed there
   (`comm.shared_memory`): gloo's loopback sockets cost 4x the time.
4. At the end of backward an autograd callback launches any remaining bucket and waits for all,
   so gradients are averaged by the time `loss.backward()` returns. The last bucket's
   all-reduce, waited for at once, runs on the training thread (`start_last`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from shardwise import comm
from shardwise.comm import shared_memory
from shardwise.comm.algorithms import (
    AllReduceAlgorithm,
    AllReduceName,
    NativeAllReduce,
    make_all_reduce,
)
from shardwise.comm.compressed_collectives import CODEC_PATTERN, CompressedAllReduce, make_codec
from shardwise.comm.flat import flatten, unflatten
from shardwise.distributed.runtime import Runtime
from shardwise.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from shardwise.strategies.base import (
    DistributedModel,
    Strategy,
    clear_grads,
    prefixed,
    unprefixed,
)
from shardwise.strategies.batch_share import BatchShare, WeighedOnArrival
from shardwise.strategies.grad_buckets import (
    BucketCallbacks,
    BucketedBackward,
    assign_buckets,
    bucket_bytes,
    shares_cores,
)
from shardwise.strategies.linear_into_bucket import MIN_BYTES, WritesIntoSlots
from shardwise.strategies.section import StrategySection, check_options

# The slot of a gradient of `ALIGNED_BYTES` or more (those `linear_into_bucket` writes from the
# GEMM) starts on a cache line. Packed end to end, the bench MLP's 16.8 MB weight gradient
# started 40 bytes past one, and its GEMM into the slot took 7.7 ms against 7.0 aligned (in
# 1 MiB slabs, as `linear_into_bucket` writes; 12.4 against 7.1 in one GEMM), on one core.
# Smaller ones stay packed: a bucket's bytes are its gradients' bytes, but a few.
ALIGN_BYTES = 64
ALIGNED_BYTES = MIN_BYTES


@dataclass
class Bucket:
    """A flat gradient buffer and the parameters whose `.grad` are views into it."""

    buffer: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    # Whether its all-reduce divides the sum by the world as it sums (`sums_to_mean`): with
    # equal shares, its gradients are then not weighed before (no pass of their own).
    averaged: bool
    # Where each parameter's slot starts in `buffer`, then where the last ends (the padding
    # after a slot, zeros summed with it, counts as its own).
    starts: list[int]
    handle: comm.Handle | None = None


def broadcast_module_state(
    module: nn.Module, src: int = 0, group: comm.ProcessGroup | None = None
) -> None:
    """Copy group rank `src`'s parameters and buffers to the group, one flat message per dtype."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.numel()]
    # An ordered set: a plain set's order can differ between processes, and so would the messages.
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = flatten(same)
        comm.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for t, chunk in zip(same, unflatten(flat, same), strict=True):
                t.copy_(chunk)


def resolve_all_reduce(
    algorithm: AllReduceName | None, shared_cores: bool, world_size: int
) -> AllReduceName:
    """`algorithm`, or where None: shared memory where every rank computes on one host's CPU
    (`shared_cores`: gloo's all-reduce there is a copy through loopback sockets, 4x slower on
    23 MB), else the backend's own. The cost model prices DDP's default by this too."""
    if algorithm is not None:
        return algorithm
    if shared_cores and world_size > 1 and shared_memory.supported():
        return "shared_memory"
    return "native"


def _make_bucket(params: list[nn.Parameter], all_reduce: AllReduceAlgorithm) -> Bucket:
    # A large gradient starts on a cache line (`ALIGN_BYTES`), but where a codec reads the
    # bucket as its tensors end to end (`describe`).
    packed = isinstance(all_reduce, CompressedAllReduce)
    align = 1 if packed else max(1, ALIGN_BYTES // params[0].element_size())
    starts, end = [], 0
    for p in params:
        large = p.numel() * p.element_size() >= ALIGNED_BYTES
        start = -(-end // align) * align if large else end
        starts.append(start)
        end = start + p.numel()
    buffer = all_reduce.new_buffer(end, params[0].dtype, params[0].device)
    views = [buffer[s : s + p.numel()].view_as(p) for s, p in zip(starts, params, strict=True)]
    for p, v in zip(params, views, strict=True):
        if p.grad is not None:
            v.copy_(p.grad)
        p.grad = v
    return Bucket(buffer, params, views, all_reduce.sums_to_mean(buffer), [*starts, end])


def _by_identity(groups: list[list[nn.Parameter]]) -> list[list[int]]:
    return [[id(p) for p in group] for group in groups]


class GradientReducer:
    """Owns the buckets; averages gradients over the world during backward."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        all_reduce,
        share: BatchShare,
        bucket_bytes: int,
        find_unused_parameters: bool,
    ) -> None:
        self.all_reduce = all_reduce
        self.share = share
        # One replica's gradient is already the sum over the world: no buckets, no hooks, the
        # gradients left where autograd puts them (a codec still runs: its error feedback is
        # part of what it computes).
        self.alone = share.runtime.world_size == 1 and not isinstance(
            all_reduce, CompressedAllReduce
        )
        params = [p for _, p in reversed(named_params)]
        self.params, self.bucket_bytes = params, bucket_bytes
        # Buckets are cut in reverse registration order, then once more in the order the first
        # backward made the gradients (`_follow_backward_order`); a codec keeps state per
        # bucket, so its buckets stay as first cut.
        groups = [] if self.alone else assign_buckets(params, bucket_bytes)
        # (one bucket completes when backward ends, whatever the order: nothing to cut again)
        recut = len(groups) > 1 and not isinstance(all_reduce, CompressedAllReduce)
        self.arrival: list[nn.Parameter] | None = [] if recut else None
        self.buckets = [_make_bucket(ps, all_reduce) for ps in groups]
        self._index_slots()
        # Weights whose Linear layer wrote this backward's gradient straight into the slot
        # (`claim_slot`), until their hook takes it.
        self.written_in_slot: set[nn.Parameter] = set()
        for b in self.buckets:  # codecs keep state per bucket; PowerSGD needs the shapes
            all_reduce.describe(b.buffer, [p.shape for p in b.params])
        self.weighing = WeighedOnArrival(share)
        callbacks = BucketCallbacks(self._move_into_bucket, self._launch, self._zero, self._wait)
        self.backward = BucketedBackward(
            [b.params for b in self.buckets],
            {p: name for name, p in named_params},
            callbacks,
            find_unused_parameters,
        )

    def _index_slots(self) -> None:
        self.view_of = {p: v for b in self.buckets for p, v in zip(b.params, b.views, strict=True)}
        self.span_of = {
            p: (b, b.starts[i], b.starts[i + 1])
            for b in self.buckets
            for i, p in enumerate(b.params)
        }

    def _weighs(self, bucket: Bucket) -> bool:
        """Whether `bucket`'s gradients are weighed before its all-reduce, which otherwise
        averages them (equal shares)."""
        return not bucket.averaged or self.share.uneven_weight() is not None

    def _move_into_bucket(self, p: nn.Parameter) -> None:
        if self.arrival is not None:
            self.arrival.append(p)
        view, grad = self.view_of[p], p.grad
        bucket, start, stop = self.span_of[p]
        weigh = self.backward.enabled and self._weighs(bucket)
        if grad.data_ptr() == view.data_ptr():
            if p in self.written_in_slot:  # a fresh gradient its Linear layer wrote in place
                self.written_in_slot.discard(p)
                self.weighing.weigh_in_place(p, view, weigh)
            # else accumulated in place (no_sync, or zero_grad(set_to_none=False))
        else:
            self.written_in_slot.discard(p)  # (summed with another use's: a fresh tensor)
            self.weighing.move_in(p, view, weigh)  # a fresh gradient
            p.grad = view
        if self.backward.enabled and not weigh:  # (final: nothing weighs it at the launch)
            self.all_reduce.written(bucket.buffer, start, stop)

    def claim_slot(self, weight: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
        """`weight`'s bucket slot, for its Linear layer to write the fresh gradient into
        (`linear_into_bucket`): where it has none yet, and this is the weight's first use to
        claim it in this backward (a second use's gradient is summed with the first's)."""
        view = self.view_of.get(weight)
        if (
            view is None
            or weight.grad is not None
            or weight in self.written_in_slot
            or view.dtype != grad.dtype
            or view.device != grad.device
        ):
            return None
        self.written_in_slot.add(weight)
        return view

    def _zero(self, p: nn.Parameter) -> None:
        if p.grad is None or p.grad.data_ptr() != self.view_of[p].data_ptr():
            self.view_of[p].zero_()
            p.grad = self.view_of[p]
            self.weighing.zeroed(p)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        # Weigh (divide by the world, for equal batches) before summing, as torch DDP does, so
        # fp16 sums do not overflow: what was not weighed as it moved in.
        weighs = self._weighs(bucket)
        if weighs:
            self.weighing.weigh_rest(bucket.params, bucket.buffer, self.view_of.__getitem__)
        # (else equal shares: the all-reduce divides as it sums, no pass of ours)
        if self.backward.launching_last:
            bucket.handle = self.all_reduce.start_last(bucket.buffer, mean=not weighs)
        elif weighs:
            bucket.handle = self.all_reduce.start(bucket.buffer)
        else:
            bucket.handle = self.all_reduce.start_mean(bucket.buffer)

    def _wait(self) -> None:
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
        self.all_reduce.commit()  # (a codec's state: the next backward that raises returns here)
        self.weighing.clear()
        self.share.done()
        if self.arrival is not None:
            self._follow_backward_order()

    def _follow_backward_order(self) -> None:
        """Cut the buckets again in the order the first backward made the gradients (torch DDP
        rebuilds its buckets so too): a bucket then completes as early as it can, and its
        all-reduce overlaps more of backward. Rank 0's order is every rank's (a broadcast, once),
        so all ranks cut the same buckets; the reduced gradients move into the new ones."""
        first = dict.fromkeys(self.arrival)  # (once each, by identity; unused parameters last)
        self.arrival = None
        index = {p: i for i, p in enumerate(self.params)}
        order = [index[p] for p in first] + [i for i, p in enumerate(self.params) if p not in first]
        agreed = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
        comm.broadcast(agreed, src=0, group=self.share.runtime.group)
        groups = assign_buckets([self.params[i] for i in agreed.tolist()], self.bucket_bytes)
        if _by_identity(groups) == _by_identity([b.params for b in self.buckets]):
            return  # (the usual case: backward runs in reverse registration order)
        self.buckets = [_make_bucket(ps, self.all_reduce) for ps in groups]  # (`.grad`s along)
        self._index_slots()
        self.backward.rebucket([b.params for b in self.buckets])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. With `set_to_none` (the default) nothing is written: autograd hands
        each hook a fresh gradient that is copied into its bucket slot, cheaper than zeroing the
        buckets and adding into them. Either way, gradients live in the buckets after backward.
        """
        self.weighing.clear()  # (a backward that raised never reached `_wait`)
        self.written_in_slot.clear()
        self.backward.take_back(self._take_back_abandoned)  # (a backward that raised)
        if self.alone:  # (no buckets: as a plain module)
            clear_grads(self.params, set_to_none)
            return
        for bucket in self.buckets:
            if not set_to_none:
                bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = None if set_to_none else view

    def _take_back_abandoned(self) -> None:
        """What a backward that raised left behind (on every rank: the same hook or loss raised
        on each), undone for the next: the all-reduces it launched are waited for, so none
        still reads a bucket the next backward writes, and what it wrote is forgotten."""
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
        self.all_reduce.forget_written([b.buffer for b in self.buckets])
        if self.arrival is not None:  # (the first backward's order: the next one's, whole)
            self.arrival.clear()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.backward.paused()

    def remove(self) -> None:
        self.backward.remove()
        self.all_reduce.close()


class DataParallelModel(DistributedModel):
    """Every rank holds the whole model; gradients are averaged during backward."""

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        reducer: GradientReducer,
        linears: WritesIntoSlots | None = None,
    ) -> None:
        super().__init__(module, runtime)
        self.reducer = reducer
        self.linears = linears

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.reducer.backward.check_ended()
        return self.module(*args, **kwargs)

    def settle_gradients(self) -> None:
        self.reducer.backward.end_deferred()
        self.reducer.backward.check_reduced()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no communication) for the backward passes inside."""
        return self.reducer.no_sync()

    def declare_batch(self, samples: int, total: int | None = None) -> None:
        self.reducer.share.declare(samples, total)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients stay views into the buckets instead of being freed.
        self.reducer.zero_grad(set_to_none)

    def extra_state(self) -> dict[str, torch.Tensor]:
        return prefixed("comm.", self.reducer.all_reduce.state_dict())

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.reducer.all_reduce.load_state_dict(unprefixed("comm.", state))

    def checkpoint_name(self) -> str:
        return "ddp"

    def release(self) -> None:
        if self.linears is not None:
            self.linears.remove()
        self.reducer.remove()


@dataclass(frozen=True)
class DDP(Strategy):
    """Options for our data parallel.

    bucket_mb: gradient bucket size in MiB; smaller buckets start communicating earlier (None:
        an eighth of the gradients, within 1-25 MiB: `grad_buckets.default_bucket_bytes`).
    algorithm: 'native' (the backend's all-reduce), 'shared_memory', 'ring' or 'hierarchical'
        (ours); None: shared memory where the ranks share one host's CPU, else native.
    group_size: ranks per group for 'hierarchical' (default: ranks per node).
    find_unused_parameters: allow parameters that get no gradient (treated as zero).
    sync_batchnorm: replace BatchNorm layers by SyncBatchNorm (global-batch statistics).
    linear_grads_in_buckets: `nn.Linear` layers write their weight gradients straight into the
        buckets instead of autograd making them for DDP to copy in (`linear_into_bucket`).
    compression: a gradient codec ('fp16', 'bf16', 'int8', 'topk:RATIO', 'randomk:RATIO',
        'sign', 'powersgd:RANK'; see `shardwise.comm.compression`) used instead of `algorithm`.
    """

    bucket_mb: float | None = None
    algorithm: AllReduceName | None = None
    group_size: int | None = None
    find_unused_parameters: bool = False
    sync_batchnorm: bool = True
    linear_grads_in_buckets: bool = True
    compression: str | None = None

    def __post_init__(self) -> None:
        check_options(self, DDPConfig)
        if self.compression is not None:
            make_codec(self.compression)  # validates the spec

    def all_reduce_name(self, runtime: Runtime) -> AllReduceName:
        """The all-reduce this job's DDP uses (`resolve_all_reduce`)."""
        shared = shares_cores(runtime.device, runtime.num_nodes)
        return resolve_all_reduce(self.algorithm, shared, runtime.world_size)

    def wrap(self, model: nn.Module, runtime: Runtime) -> DataParallelModel:
        if runtime.group is not None and (
            self.compression or self.algorithm not in (None, "native")
        ):
            raise ValueError(
                "along a device-mesh axis DDP uses the native all-reduce: "
                "algorithm and compression apply to whole-world data parallel only"
            )
        if self.algorithm == "shared_memory" and runtime.num_nodes > 1:
            raise ValueError(
                f"algorithm 'shared_memory' sums on one host; this job spans "
                f"{runtime.num_nodes} nodes (leave algorithm unset: native there)"
            )
        if self.sync_batchnorm and runtime.world_size > 1 and runtime.group is None:
            model = convert_sync_batchnorm(model)
        broadcast_module_state(model, group=runtime.group)
        if runtime.group is not None:
            all_reduce = NativeAllReduce(runtime.group)
        elif self.compression is not None:
            all_reduce = CompressedAllReduce(make_codec(self.compression), runtime.timeout)
        else:
            all_reduce = make_all_reduce(
                self.all_reduce_name(runtime),
                self.group_size or runtime.local_world_size,
                runtime.timeout,
            )
        share = BatchShare(runtime)
        for module in model.modules():
            if isinstance(module, SyncBatchNorm):
                module.batch_share = share  # its backward weighs uneven batches too
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() * p.element_size() for _, p in named)
        reducer = GradientReducer(
            named,
            all_reduce,
            share,
            bucket_bytes(
                self.bucket_mb, grad_bytes, shares_cores(runtime.device, runtime.num_nodes)
            ),
            self.find_unused_parameters,
        )
        linears = None
        if self.linear_grads_in_buckets and reducer.buckets:
            linears = WritesIntoSlots(model, reducer, set(reducer.view_of))
        return DataParallelModel(model, runtime, reducer, linears)


class DDPConfig(StrategySection):
    name: Literal["ddp"] = Field("ddp", description="the parallelism strategy")
    bucket_mb: float | None = Field(
        None,
        gt=0,
        description="gradient bucket size in MiB (default: an eighth of the "
        "gradients, within 1-25 MiB)",
    )
    algorithm: AllReduceName | None = Field(
        None,
        description="all-reduce: the backend's own, or our shared_memory / ring / hierarchical "
        "(default: shared memory where every rank is on one host's CPU, else native)",
    )
    group_size: int | None = Field(
        None, ge=1, description="hierarchical: ranks per group (default: ranks per node)"
    )
    find_unused_parameters: bool = Field(
        False, description="allow parameters that receive no gradient (treated as zero)"
    )
    sync_batchnorm: bool = Field(True, description="BatchNorm statistics over the global batch")
    linear_grads_in_buckets: bool = Field(
        True,
        description="nn.Linear layers write their weight gradients straight into the buckets "
        "(no copy)",
    )
    compression: str | None = Field(
        None,
        description="gradient codec: fp16, bf16, int8, topk:RATIO, randomk:RATIO, sign or "
        "powersgd:RANK",
        pattern=CODEC_PATTERN,
    )

    @field_validator("compression")
    @classmethod
    def _a_codec(cls, spec: str | None) -> str | None:
        if spec is not None:
            make_codec(spec)  # (what the pattern cannot say: a PowerSGD rank of 0, say)
        return spec

    def check_world(self, world_size: int) -> None:
        hierarchical = self.algorithm == "hierarchical" and self.compression is None
        if hierarchical and self.group_size is not None and world_size % self.group_size:
            raise ValueError(
                f"hierarchical group_size must divide the world size {world_size}, got "
                f"{self.group_size}"
            )

    def build(self, world_size: int, run_dir: Path) -> DDP:
        return DDP(**self.options())

    def describe(self) -> str:
        return f"ddp ({self.compression or ' '.join(filter(None, (self.algorithm, 'all-reduce')))})"
