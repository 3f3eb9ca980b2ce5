"""Composition on a device mesh: a model-parallel strategy inside, data parallel across.

With `dp=2, tp=2` on 4 ranks, ranks {0, 1} and {2, 3} each hold one tensor-parallel copy of
the model, and ranks {0, 2} and {1, 3} (same slice, different data) average their gradients.
With `dp=2, pp=2`, each pipeline stage is data parallel with its twin in the other pipeline.
The mesh (`distributed/mesh.py`) creates the groups once; each strategy sees only its axis's group
through the runtime it is given, so DDP or ZeRO run unchanged along the data axis.

Order of wrapping (`MeshParallel.wrap`, the one place where they are composed): the
model-parallel strategy splits the model first; data parallel then wraps what this rank holds
(the tensor-parallel model, or the pipeline's stage). Gradients of a split parameter are
averaged only with the ranks that hold the same slice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from shardwise import comm
from shardwise.distributed.mesh import DeviceMesh, build_mesh
from shardwise.distributed.runtime import Runtime
from shardwise.strategies.base import DistributedModel, LossFn, Strategy, UnsplitCheckpointsOnly
from shardwise.strategies.ddp import DDP
from shardwise.strategies.pipeline import Pipeline
from shardwise.strategies.section import StrategySection
from shardwise.strategies.tensor_parallel import TensorParallel
from shardwise.strategies.zero import ZeRO, ZeroStage1


class MeshModel(UnsplitCheckpointsOnly, DistributedModel):
    """A model split along the tp or pp axis (`split`, or None) and data parallel along dp
    (`data`). Questions about the split model go to `split`; gradients and the optimizer are
    `data`'s (its wrapper is inside the pipeline, or around the tensor-parallel model)."""

    def __init__(
        self,
        outer: DistributedModel,
        runtime: Runtime,
        mesh: DeviceMesh,
        split: DistributedModel | None,
        data: DistributedModel,
    ) -> None:
        super().__init__(outer, runtime)
        self.mesh = mesh
        # Plain references (not submodules): both already sit inside `outer`.
        self.__dict__.update(split=split, data=data)

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        samples: int | None = None,
        total: int | None = None,
    ) -> torch.Tensor:
        if self.split is None:
            return super().train_step(inputs, targets, loss_fn, samples, total)
        self.declare_batch_of(inputs, targets, samples, total)
        return self.split.train_step(inputs, targets, loss_fn)

    def declare_batch(self, samples: int, total: int | None = None) -> None:
        self.data.declare_batch(samples, total)  # the weights are along the data axis

    def no_sync(self):
        """Gradient accumulation: the data axis's (a pipeline's are its micro-batches)."""
        return self.data.no_sync()

    def adapt_loss(self, loss_fn: LossFn) -> LossFn:
        return loss_fn if self.split is None else self.split.adapt_loss(loss_fn)

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(-1) if self.split is None else self.split.predict(output)

    def data_shard(self) -> tuple[int, int]:
        return self.mesh.dp_size, self.mesh.coords["dp"]

    def local_grads(self) -> list[torch.Tensor]:
        return self.data.local_grads()

    def grad_square_sum(self) -> torch.Tensor:
        if isinstance(self.data, ZeroStage1):
            raise ValueError("clip_grad_norm_ on a mesh needs DDP along the data axis")
        # DDP leaves every replica the same averaged gradients: the model-parallel rule holds.
        return (self.split or self.data).grad_square_sum()

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        return self.data.make_optimizer(optimizer_cls, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.data.zero_grad(set_to_none)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # Along the data axis every replica holds the same values (ZeRO 1/2 all-gather the
        # updated slices after each step), so the model-parallel model reassembles them.
        return (self.split or self.data).full_state_dict()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.data.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign=False):
        return self.data.load_state_dict(state_dict, strict=strict, assign=assign)

    def close(self) -> None:
        self.data.close()
        comm.barrier(self.runtime.group)  # every rank of the mesh


@dataclass(frozen=True)
class MeshParallel(Strategy):
    """Options for a composed run.

    dp, tp, pp: mesh sizes; dp=None takes what is left of the world. Their product must be the
        world size. One of tp and pp may be above 1 (TP x PP is not composed yet).
    data: the strategy along the data axis: sw.DDP() (native all-reduce) or sw.ZeRO(stage=1
        or 2).
    tensor: TensorParallel options when tp > 1 (its size is the mesh's).
    pipeline: Pipeline options when pp > 1 (its stages are the mesh's).
    """

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    data: Strategy = field(default_factory=DDP)
    tensor: TensorParallel = field(default_factory=TensorParallel)
    pipeline: Pipeline = field(default_factory=Pipeline)

    def __post_init__(self) -> None:
        if self.tp > 1 and self.pp > 1:
            raise ValueError("tensor x pipeline parallel on one mesh is not supported yet")
        if not isinstance(self.data, (DDP, ZeRO)):
            raise ValueError(f"data must be sw.DDP() or sw.ZeRO(stage=1|2), got {self.data!r}")
        if isinstance(self.data, ZeRO) and self.data.stage == 3:
            raise ValueError("ZeRO stage 3 along a mesh's data axis is not supported yet")

    def wrap(self, model: nn.Module, runtime: Runtime) -> MeshModel:
        mesh = build_mesh(self.dp, self.tp, self.pp, runtime)
        data_rt = mesh.runtime("dp", runtime)
        if mesh.pp_size > 1:
            pipeline = dataclasses.replace(self.pipeline, stages=mesh.pp_size)
            split = pipeline.wrap(model, mesh.runtime("pp", runtime))
            data = split.wrap_stage(self.data, data_rt)
            return MeshModel(split, runtime, mesh, split, data)
        split = None
        if mesh.tp_size > 1:
            tensor = dataclasses.replace(self.tensor, size=mesh.tp_size)
            model = split = tensor.wrap(model, mesh.runtime("tp", runtime))
        data = self.data.wrap(model, data_rt)
        return MeshModel(data, runtime, mesh, split, data)


class MeshConfig(StrategySection):
    name: Literal["mesh"] = Field("mesh", description="the parallelism strategy")
    dp: int | None = Field(None, ge=1, description="data-parallel size (default: the rest)")
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline stages")
    data: Literal["ddp", "zero1", "zero2"] = Field(
        "ddp", description="strategy along the data dimension"
    )
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = Field(
        "1f1b", description="pp > 1: schedule"
    )
    microbatches: int = Field(4, ge=1, description="pp > 1: micro-batches per step")
    loss_parallel: bool = Field(True, description="tp > 1: loss from vocabulary slices")

    @model_validator(mode="after")
    def _one_model_dimension(self) -> MeshConfig:
        if self.tp > 1 and self.pp > 1:
            raise ValueError("tensor x pipeline parallel on one mesh is not supported yet")
        return self

    def build(self, world_size: int, run_dir: Path) -> MeshParallel:
        data = DDP() if self.data == "ddp" else ZeRO(stage=int(self.data[-1]))
        return MeshParallel(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            data=data,
            tensor=TensorParallel(loss_parallel=self.loss_parallel),
            pipeline=Pipeline(schedule=self.schedule, microbatches=self.microbatches),
        )

    def ranks_needed(self) -> int | None:
        return None if self.dp is None else self.dp * self.tp * self.pp

    def describe(self) -> str:
        sizes = f"dp={self.dp or 'rest'} x tp={self.tp} x pp={self.pp}"
        return f"mesh ({sizes}, {self.data}" + (f", {self.schedule})" if self.pp > 1 else ")")
