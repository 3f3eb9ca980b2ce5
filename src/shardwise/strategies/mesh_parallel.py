"""Composition on a device mesh: a model-parallel strategy inside, data parallel across.

With `dp=2, tp=2` on 4 ranks, ranks {0, 1} and {2, 3} each hold one tensor-parallel copy of
the model, and ranks {0, 2} and {1, 3} (same slice, different data) average their gradients.
With `dp=2, pp=2`, each pipeline stage is data parallel with its twin in the other pipeline.
The mesh (`shardwise.mesh`) creates the groups once; each strategy sees only its dimension's
group through the runtime it is given, so DDP or ZeRO run unchanged along the data dimension.

Order of wrapping: the model-parallel strategy splits the model first; data parallel then wraps
what this rank holds (the tensor-parallel model, or the pipeline's stage). Gradients of a
split parameter are averaged only with the ranks that hold the same slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.mesh import DeviceMesh, build_mesh
from shardwise.runtime import Runtime
from shardwise.strategies.base import LossFn, Strategy, UnsplitCheckpointsOnly
from shardwise.strategies.ddp import DDP
from shardwise.strategies.pipeline import Pipeline
from shardwise.strategies.tensor_parallel import TensorParallel
from shardwise.strategies.zero import ZeRO


@dataclass
class MeshParallel(UnsplitCheckpointsOnly, Strategy):
    """Options for a composed run.

    dp, tp, pp: mesh sizes; dp=None takes what is left of the world. Their product must be the
        world size. One of tp and pp may be above 1 (TP x PP is not composed yet).
    data: the strategy along the data dimension: sw.DDP() (native all-reduce) or sw.ZeRO(stage=1
        or 2).
    tensor: TensorParallel options when tp > 1 (size is set from the mesh).
    pipeline: Pipeline options when pp > 1 (stages is set from the mesh).
    """

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    data: Strategy = field(default_factory=DDP)
    tensor: TensorParallel = field(default_factory=TensorParallel)
    pipeline: Pipeline = field(default_factory=Pipeline)
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp > 1 and self.pp > 1:
            raise ValueError("tensor x pipeline parallel on one mesh is not supported yet")
        if not isinstance(self.data, (DDP, ZeRO)):
            raise ValueError(f"data must be sw.DDP() or sw.ZeRO(stage=1|2), got {self.data!r}")
        if isinstance(self.data, ZeRO) and self.data.stage == 3:
            raise ValueError("ZeRO stage 3 along a mesh's data dimension is not supported yet")

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        self.mesh = mesh = build_mesh(self.dp, self.tp, self.pp)
        data_rt = mesh.runtime("dp", runtime)
        if mesh.pp > 1:
            self.pipeline.stages = mesh.pp
            inner = self.pipeline.wrap(model, mesh.runtime("pp", runtime))
            inner.stage = self.data.wrap(inner.stage, data_rt)
            return inner
        if mesh.tp > 1:
            self.tensor.size = mesh.tp
            model = self.tensor.wrap(model, mesh.runtime("tp", runtime))
        return self.data.wrap(model, data_rt)

    def _model_parallel(self) -> Strategy | None:
        assert self.mesh is not None, "prepare() the model first"
        if self.mesh.pp > 1:
            return self.pipeline
        return self.tensor if self.mesh.tp > 1 else None

    def _inner(self, model: nn.Module) -> nn.Module:
        """What the model-parallel strategy wrapped (under the data-parallel wrapper)."""
        return model if self.mesh.pp > 1 else model.module

    def make_optimizer(
        self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> torch.optim.Optimizer:
        target = model.stage if self.mesh.pp > 1 else model
        return self.data.make_optimizer(target, optimizer_cls, **kwargs)

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # Along the data dimension every replica holds the same values (ZeRO 1/2 all-gather
        # the updated slices after each step), so the model-parallel strategy reassembles them.
        inner = self._model_parallel()
        if inner is None:
            return self.data.full_state_dict(model)
        return inner.full_state_dict(self._inner(model))

    def train_step(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn):
        if self.mesh.pp > 1:
            return model.train_step(inputs, targets, loss_fn)
        return super().train_step(model, inputs, targets, loss_fn)

    def adapt_loss(self, model: nn.Module, loss_fn: LossFn) -> LossFn:
        if self.mesh.tp > 1:
            return self.tensor.adapt_loss(self._inner(model), loss_fn)
        return loss_fn

    def predict(self, model: nn.Module, output: torch.Tensor) -> torch.Tensor:
        if self.mesh.tp > 1:
            return self.tensor.predict(self._inner(model), output)
        return output.argmax(-1)

    def data_shard(self, model: nn.Module) -> tuple[int, int]:
        return self.mesh.dp, self.mesh.coords["dp"]

    def grad_square_sum(self, model: nn.Module) -> torch.Tensor:
        if isinstance(self.data, ZeRO):
            raise ValueError("clip_grad_norm_ on a mesh needs DDP along the data dimension")
        inner = self._model_parallel()
        if inner is None:
            return self.data.grad_square_sum(model)
        # DDP leaves every replica the same averaged gradients: the model-parallel rule holds.
        return inner.grad_square_sum(self._inner(model))

    def local_grads(self, model: nn.Module) -> list[torch.Tensor]:
        params = model.stage.parameters() if self.mesh.pp > 1 else model.parameters()
        return [p.grad for p in params if p.grad is not None]

    def close(self, model: nn.Module) -> None:
        self.data.close(model.stage if self.mesh.pp > 1 else model)
        comm.barrier()
