"""ZeRO: data parallel without the redundancy (Rajbhandari et al., SC 2020).

Plain data parallel keeps 16 bytes per parameter on every rank with fp32 Adam: parameters (4),
gradients (4) and optimizer state (8). ZeRO shards them over the N ranks, stage by stage, each
stage a short extension of the one before:

- `stage1.py`: the optimizer state (4P + 4P + 8P/N);
- `stage2.py`: + the gradients (4P + 12P/N);
- `stage3.py`: + the parameters, gathered unit by unit around forward and backward (16P/N).

`shard_group=K` makes any stage hybrid (HSDP): the state is sharded over groups of K consecutive
ranks and replicated across the N/K groups (`distributed/shard_groups.py`); gradients are
reduce-scattered inside a group, then each slice is all-reduced across the groups (16P/K with
stage 3, the inter-node traffic 1/K of the gradients).

`units.py` holds the flat, padded buffers every stage shards; `masters.py` what the optimizer
steps (the buffer's slices, or fp32 master weights with loss scaling, offloadable). Alone in the
world, in fp32, any stage is plain training saved in ZeRO's layout (`sole_rank.py`).
Any element-wise `torch.optim` optimizer (SGD, Adam, AdamW, ...) works unchanged on the slices.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from shardwise.comm.compressed_collectives import CODEC_PATTERN, CODEC_SPEC, make_codec
from shardwise.distributed.runtime import Runtime
from shardwise.distributed.same_everywhere import PER_RANK
from shardwise.distributed.shard_groups import build_shard_groups, check_shard_size
from shardwise.nn.meta_init import (
    ParameterSource,
    load_buffers_from,
    placeholders,
    read_whole,
    swap_parameters,
)
from shardwise.nn.sync_batchnorm import convert_sync_batchnorm
from shardwise.strategies.base import Strategy
from shardwise.strategies.ddp import broadcast_module_state
from shardwise.strategies.section import StrategySection, check_options
from shardwise.strategies.zero.masters import FP32Masters, ShardViews
from shardwise.strategies.zero.sole_rank import SOLE_RANK
from shardwise.strategies.zero.stage1 import ZeroStage1
from shardwise.strategies.zero.stage2 import ZeroStage2
from shardwise.strategies.zero.stage3 import ResidentStage3, ZeroStage3, stage3_units

STAGES: dict[int, type[ZeroStage1]] = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


@dataclass(frozen=True)
class ZeRO(Strategy):
    """Options for ZeRO.

    stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters) sharded over the ranks.
    bucket_mb: stages 1/2: size of the flat units gradients are reduce-scattered in; stages 2/3
        where every rank is on one host's CPU, also how much the gradient staging buffers in
        shared memory may hold (`stage2.staging_buffers`).
    mixed_precision: None (fp32), 'bf16' or 'fp16' compute and communication, with fp32 master
        weights in the sharded optimizer; 'fp16' adds dynamic loss scaling.
    offload: None, 'cpu' (master weights, their gradients and optimizer state in host memory
        while training on a GPU) or 'disk' (the same in memory-mapped files, stepped and paged
        in shard by shard).
    offload_dir: offload='disk': where each rank makes a fresh directory of its own for those
        files (removed when the model is closed); default: the system's temporary directory
        (`shardwise train` uses the run directory).
    sync_batchnorm: replace BatchNorm layers by SyncBatchNorm (global-batch statistics), as
        DDP does: data parallel then trains as one process on the global batch would.
    compression: a gradient codec for the reduce-scatter ('fp16', 'bf16', 'int8',
        'topk:RATIO', 'randomk:RATIO', 'sign', 'powersgd:RANK[:WARMUP]'; see
        `shardwise.comm.compression`), whole-world ZeRO only.
    shard_group: None (shard over all ranks) or K: hybrid sharding (HSDP), the state sharded
        over each group of K consecutive ranks (a node) and replicated across the N/K groups;
        K must divide the world size. Whole-world ZeRO only (not along a device-mesh axis).
    keep_gathered_mb: stage 3: how many MiB of gathered units may stay from their forward to
        their backward instead of being freed and gathered again (the last units first: their
        backward comes first). Each kept unit spares one all-gather, a third of its traffic;
        None (the default) keeps the last unit, whose backward follows its forward at once,
        and the units before it while they fit 1 GiB (`stage3.DEFAULT_KEEP_BYTES`; DeepSpeed
        keeps up to 1e9 parameters live by default) (whole-world ZeRO; along a device-mesh
        axis, where a pipeline's micro-batches interleave forwards and backwards, none);
        0 (FSDP2's `reshard_after_forward=True`) re-gathers every unit, a budget at least the
        model's size keeps them all (FSDP2's `False`: the whole model gathered during a step).
    """

    stage: int = 1
    bucket_mb: float = 25.0
    mixed_precision: str | None = None
    offload: str | None = None
    offload_dir: str | None = field(default=None, metadata={PER_RANK: True})
    sync_batchnorm: bool = True
    compression: str | None = None
    shard_group: int | None = None
    keep_gathered_mb: float | None = None

    def __post_init__(self) -> None:
        check_options(self, ZeROConfig)
        if self.compression is not None and self.shard_group is not None:
            raise ValueError(
                f"ZeRO compression={self.compression!r} with shard_group={self.shard_group}: "
                "codecs run on whole-world ZeRO only (no shard_group)"
            )
        if self.compression is not None:
            make_codec(self.compression)  # validates the spec
            if self.mixed_precision == "fp16":  # (an overflow's inf would stay in a residual)
                raise ValueError(
                    f"ZeRO compression={self.compression!r} with mixed_precision='fp16' (loss "
                    "scaling): use 'bf16', or no compression"
                )
        if self.keep_gathered_mb and self.stage != 3:
            raise ValueError(
                f"keep_gathered_mb={self.keep_gathered_mb} applies to stage 3 (stages 1/2 keep "
                f"the parameters gathered anyway), not stage {self.stage}"
            )

    def wrap(self, model: nn.Module, runtime: Runtime) -> ZeroStage1:
        self._check_compression(runtime)
        self._check_shard_group(runtime)
        if self.sync_batchnorm and runtime.world_size > 1 and runtime.group is None:
            model = convert_sync_batchnorm(model)
        broadcast_module_state(model, group=runtime.group)
        return self._stage(model, runtime)

    def wrap_from(self, model: nn.Module, runtime: Runtime, source: ParameterSource) -> ZeroStage1:
        """Stage 3: each rank reads only its slice of each unit from `source`, and the frozen
        parameters and buffers whole; no rank ever holds the whole model. Stages 1/2 keep
        whole parameters, so they read them whole."""
        if self.stage != 3:
            return super().wrap_from(model, runtime, source)
        self._check_compression(runtime)
        self._check_shard_group(runtime)
        if self.sync_batchnorm and runtime.world_size > 1 and runtime.group is None:
            model = convert_sync_batchnorm(model)
        trainable = {p for p in model.parameters() if p.requires_grad}
        swap_parameters(model, lambda _n, p: p if p in trainable else read_whole(p, _n, source))
        load_buffers_from(model, source)
        placeholders(model, runtime.device)
        return self._stage(model, runtime, source)

    def _check_compression(self, runtime: Runtime) -> None:
        if self.compression is not None and runtime.group is not None:
            raise ValueError(
                f"ZeRO compression={self.compression!r} applies to whole-world ZeRO only, "
                "not along a device-mesh axis"
            )

    def _check_shard_group(self, runtime: Runtime) -> None:
        check_shard_size(self.shard_group, runtime.world_size)
        if self.shard_group is not None and runtime.group is not None:
            raise ValueError(
                f"ZeRO shard_group={self.shard_group} applies to whole-world ZeRO only, not "
                "along a device-mesh axis"
            )

    def _keep_gathered_bytes(self, runtime: Runtime) -> float | None:
        """The stage-3 budget in bytes; None: whole-world ZeRO's default (`kept_units`)."""
        if self.keep_gathered_mb is None:
            return None if runtime.group is None else 0.0
        return self.keep_gathered_mb * 2**20

    def _stage(
        self, model: nn.Module, runtime: Runtime, source: ParameterSource | None = None
    ) -> ZeroStage1:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(
                "ZeRO: the model has no trainable parameter (every one is frozen): nothing to "
                "shard or to step"
            )
        # Without mixed precision the units compute in the model's one dtype.
        dtype = _one_dtype(trainable) if self.mixed_precision is None else None
        if self.offload is not None and dtype not in (None, torch.float32):
            raise ValueError(
                f"ZeRO offload={self.offload!r} keeps fp32 masters and computes in fp32 without "
                f"mixed_precision: for a {str(dtype).removeprefix('torch.')} model, pass "
                "mixed_precision='bf16' or 'fp16'"
            )
        # fp32 masters apart from the compute copy: with mixed precision, and with offload.
        if self.mixed_precision is None and self.offload is None:
            masters = ShardViews(dtype)
        else:
            device = torch.device("cpu") if self.offload else None
            masters = FP32Masters(self.mixed_precision, device, runtime.device)
        offload_dir = None  # (its rank's own directory is made in it with the optimizer)
        if self.offload == "disk":
            offload_dir = Path(self.offload_dir or tempfile.gettempdir())
        stage = STAGES[self.stage]
        bucket_bytes = int(self.bucket_mb * 2**20)
        groups = build_shard_groups(self.shard_group, runtime)  # (collective)
        keep = (
            {"keep_gathered_bytes": self._keep_gathered_bytes(runtime)} if self.stage == 3 else {}
        )
        if sole_rank(runtime, masters, source, self.offload, self.compression):
            stage, keep = SOLE_RANK[self.stage], {}
        elif self.stage == 3 and resident(groups, masters, source):
            stage, keep = ResidentStage3, {}
        return stage(
            *(model, runtime, masters, bucket_bytes, offload_dir, source, self.compression),
            groups=groups,
            **keep,
        )


def sole_rank(
    runtime: Runtime,
    masters: ShardViews | FP32Masters,
    source: ParameterSource | None,
    offload: str | None,
    compression: str | None,
) -> bool:
    """Whether ZeRO runs alone in the world as plain training (`SoleRankStage1`): one rank, not
    a device mesh's axis, no fp32 masters, offload or codec (each has its own work to do even
    alone), values already in the model."""
    alone = runtime.world_size == 1 and runtime.group is None
    plain = isinstance(masters, ShardViews) and offload is None and compression is None
    return alone and plain and source is None


def resident(groups, masters: ShardViews | FP32Masters, source: ParameterSource | None) -> bool:
    """Whether stage 3's one shard is the whole model, kept as it is (`ResidentStage3`): a shard
    group of one, no fp32 masters beside the compute copy, values already in the model."""
    return groups.shard_size == 1 and isinstance(masters, ShardViews) and source is None


class ZeROConfig(StrategySection):
    name: Literal["zero"] = Field("zero", description="the parallelism strategy")
    stage: Literal[1, 2, 3] = Field(
        1, description="1: optimizer state, 2: + gradients, 3: + parameters sharded"
    )
    bucket_mb: float = Field(
        25.0,
        gt=0,
        description="stages 1/2: flat unit size in MiB; stages 2/3 on one host's CPU, also the "
        "gradient staging buffers' budget",
    )
    mixed_precision: Literal["bf16", "fp16"] | None = Field(
        None, description="compute dtype over fp32 master weights; fp16 adds loss scaling"
    )
    offload: Literal["cpu", "disk"] | None = Field(
        None, description="master weights and optimizer state in host memory, or on disk"
    )
    offload_dir: str | None = Field(
        None,
        description="offload=disk: where each rank makes its own directory of memory-mapped "
        "files (default: the run directory)",
    )
    sync_batchnorm: bool = Field(True, description="BatchNorm statistics over the global batch")
    compression: str | None = Field(
        None,
        description=f"gradient codec for the reduce-scatter: {CODEC_SPEC}",
        pattern=CODEC_PATTERN,
    )
    shard_group: int | None = Field(
        None,
        ge=1,
        description="hybrid sharding (HSDP): shard over groups of this many consecutive ranks "
        "(a node), replicate across the groups; must divide the world size (default: all ranks)",
    )
    keep_gathered_mb: float | None = Field(
        None,
        ge=0,
        description="stage 3: MiB of gathered units kept from forward to backward (the last "
        "units first), each sparing one all-gather; default: the last unit, and those before "
        "it while they fit 1 GiB; 0 gathers every unit again for backward",
    )

    @model_validator(mode="after")
    def _keep_needs_stage3(self) -> ZeROConfig:
        if self.keep_gathered_mb and self.stage != 3:
            raise ValueError(f"keep_gathered_mb applies to stage 3, not stage {self.stage}")
        return self

    def check_world(self, world_size: int) -> None:
        check_shard_size(self.shard_group, world_size)

    def disk_offload_dir(self) -> str | None:
        return self.offload_dir if self.offload == "disk" else None

    def build(self, world_size: int, run_dir: Path) -> ZeRO:
        check_shard_size(self.shard_group, world_size)
        offload_dir = self.offload_dir or str(run_dir)
        return ZeRO(**self.options(exclude={"offload_dir"}), offload_dir=offload_dir)

    def describe(self) -> str:
        hybrid = f" (hsdp {self.shard_group})" if self.shard_group else ""
        keep = ""  # (the default's budget, or stages 1/2 that keep everything: unnamed)
        if self.stage == 3 and self.keep_gathered_mb == 0:
            keep = " (regather)"  # (every unit gathered again for backward)
        elif self.stage == 3 and self.keep_gathered_mb is not None:
            keep = f" (keep {self.keep_gathered_mb:g} MiB)"
        codec = f" ({self.compression})" if self.compression else ""
        return f"zero-{self.stage}{codec}{hybrid}{keep}"


__all__ = ["STAGES", "ZeRO", "ZeROConfig", "ZeroStage1", "ZeroStage2", "ZeroStage3", "stage3_units"]


def _one_dtype(named: list[tuple[str, nn.Parameter]]) -> torch.dtype:
    """The dtype every trainable parameter has (ZeRO's units compute in one, without
    `mixed_precision`); a one-line error naming one parameter of each where they differ."""
    first = {}
    for name, p in named:
        first.setdefault(p.dtype, name)
    if len(first) > 1:
        found = ", ".join(f"{str(d).removeprefix('torch.')} ({n})" for d, n in first.items())
        raise ValueError(
            f"ZeRO: trainable parameters of several dtypes ({found}): cast the model to one, "
            "or train with mixed_precision='bf16' or 'fp16'"
        )
    return next(iter(first))
