"""Composition on a device mesh: tensor and pipeline parallel inside, data parallel across.

With `dp=2, tp=2` on 4 ranks, ranks {0, 1} and {2, 3} each hold one tensor-parallel copy of
the model, and ranks {0, 2} and {1, 3} (same slice, different data) average their gradients.
With `dp=2, pp=2`, each pipeline stage is data parallel with its twin in the other pipeline.
With `dp=2, tp=2, pp=2` on 8 ranks, each stage is split over a tp pair, tp rank i of stage s
sends its activations to tp rank i of stage s+1 (the pipeline's group is the pp line of the
mesh), and each (stage, slice) is data parallel with its twin in the other replica. The mesh
(`distributed/mesh.py`) creates the groups once; each strategy sees only its axis's group
through the runtime it is given, so TP, the pipeline, DDP and ZeRO run unchanged along theirs.

Order of wrapping (`MeshParallel.wrap`, the one place where they are composed), as in
Megatron-LM and torchtitan: tensor parallel slices the layers first; the pipeline cuts the
sliced model's layers into stages (where the unsliced model would be cut, the same for every
tp rank); data parallel then wraps what this rank holds (its stage, or the tensor-parallel
model). Gradients of a slice are averaged only with the ranks that hold the same slice; ZeRO
shards that slice along the data axis (stage 3: the stage's layers are its units).

A pipeline runs several micro-batch backwards per step: the data axis's `no_sync()` keeps all
but the last micro-batch's gradients local (ZeRO-2/3 accumulate full gradients per unit), and
the last backward reduces the step's sum once (`PipelineModel._accumulating`).
`mesh_state.py` turns the state back into the single-process one (full state dicts,
reshardable checkpoints) and cuts such a state for this rank.
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
from shardwise.comm.parallel_ops import gather_split
from shardwise.distributed.mesh import DeviceMesh, build_mesh, check_sizes
from shardwise.distributed.runtime import Runtime
from shardwise.optim.layerwise import LayerwiseOptimizer, ParameterNorms
from shardwise.strategies.base import EXTRA, DistributedModel, LossFn, Strategy
from shardwise.strategies.ddp import DDP
from shardwise.strategies.mesh_state import (
    cut_state,
    data_axis_state,
    gather_stage_states,
    gather_tensor_axis,
    grad_pieces,
)
from shardwise.strategies.pipeline import Pipeline, PipelineModel
from shardwise.strategies.section import StrategySection, check_options
from shardwise.strategies.tensor_parallel import (
    TensorParallel,
    TensorParallelModel,
    count_once,
    split_parameters,
)
from shardwise.strategies.zero import ZeRO, ZeroStage1

LAYOUT = EXTRA + "mesh"  # the state dict's record of the mesh that saved it


class MeshModel(DistributedModel):
    """A model split along tp (`tensor`) and/or pp (`pipeline`), data parallel along dp
    (`data`, which wraps this rank's stage or tensor-parallel model). Gradients and the
    optimizer are `data`'s; the loss and predictions the tensor-parallel model's; the
    schedule the pipeline's."""

    def __init__(
        self,
        outer: DistributedModel,
        runtime: Runtime,
        mesh: DeviceMesh,
        data: DistributedModel,
        tensor: TensorParallelModel | None = None,
        pipeline: PipelineModel | None = None,
    ) -> None:
        super().__init__(outer, runtime)
        self.mesh = mesh
        # Plain references (not submodules): they already sit inside `outer`.
        self.__dict__.update(data=data, tensor=tensor, pipeline=pipeline)
        # The tensor-parallel slices among what `data` wraps (by its module's state-dict keys).
        self.splits = split_parameters(data.module) if tensor is not None else {}
        named = data.module.named_parameters(remove_duplicate=False)
        self.sliced = {id(p) for n, p in named if n in self.splits}

    @property
    def split(self) -> DistributedModel | None:
        """The model-parallel model: the pipeline, or the tensor-parallel model."""
        return self.pipeline or self.tensor

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        samples: int | None = None,
        total: int | None = None,
    ) -> torch.Tensor:
        if self.pipeline is None:
            return super().train_step(inputs, targets, loss_fn, samples, total)
        self.declare_batch_of(inputs, targets, samples, total)
        return self.pipeline.train_step(inputs, targets, self.adapt_loss(loss_fn))

    def declare_batch(self, samples: int, total: int | None = None) -> None:
        self.data.declare_batch(samples, total)  # the weights are along the data axis

    def no_sync(self):
        """Gradient accumulation: the data axis's; a pipeline refuses (its micro-batches are its
        accumulation)."""
        if self.pipeline is not None:
            return self.pipeline.no_sync()
        return self.data.no_sync()

    def adapt_loss(self, loss_fn: LossFn) -> LossFn:
        return loss_fn if self.tensor is None else self.tensor.adapt_loss(loss_fn)

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(-1) if self.tensor is None else self.tensor.predict(output)

    def data_shard(self) -> tuple[int, int]:
        return self.mesh.dp_size, self.mesh.coords["dp"]

    # ---- gradients and the optimizer: the data axis's
    def local_grads(self) -> list[torch.Tensor]:
        return self.data.local_grads()

    def grad_square_sum(self) -> torch.Tensor:
        """Σ g² over the whole model, each element counted once: every rank adds the squares
        of what it holds that no other rank counts (a DDP replica's at dp 0 only, a replicated
        weight's at tp 0 only, a weight tied across stages at its first holder), then one
        all-reduce over the mesh."""
        self.data.settle_gradients()  # (`grad_pieces` reads them: reduced first)
        squares = torch.zeros((), dtype=torch.float32, device=self.runtime.device)
        for p, grad in grad_pieces(self.data):
            if self._counted_here(p):
                squares += grad.detach().float().pow(2).sum().to(squares.device)
        comm.all_reduce(squares, group=self.runtime.group)
        return squares

    def _counted_here(self, p: nn.Parameter) -> bool:
        coords = self.mesh.coords
        if coords["dp"] != 0 and not isinstance(self.data, ZeroStage1):
            return False  # DDP: every replica holds the same averaged gradient
        if coords["tp"] != 0 and id(p) not in self.sliced:
            return False  # replicated over the tp group (layer norms, row-parallel biases)
        return self.pipeline is None or self.pipeline.tied.counted_here(p)

    def is_stepped_by(self, optimizer) -> bool:
        return self.data.is_stepped_by(optimizer)  # (the data axis's model makes it)

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        optimizer = self.data.make_optimizer(optimizer_cls, **kwargs)
        if isinstance(optimizer.inner, LayerwiseOptimizer):
            optimizer.inner.norms = self.parameter_norms()
        return optimizer

    def parameter_norms(self) -> ParameterNorms:
        """The data axis's pieces (ZeRO's summed over the shard group), then over the tensor-
        parallel group: a split parameter's slices, a replicated one's once. A pipeline
        stage's parameters are its own (a weight tied across stages: each holds all of it)."""
        norms = self.data.parameter_norms()
        if self.tensor is None:
            return norms
        counted = [id(p) in self.sliced or self.mesh.coords["tp"] == 0 for p in norms.params]
        return count_once(norms, counted, self.tensor.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.data.zero_grad(set_to_none)

    # ---- state
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole along the data axis (the data strategy's gather), then the tensor-parallel
        slices, then the stages: the single-process state dict, on every rank."""
        state = self.data.full_state_dict()
        if self.tensor is not None:
            group = self.tensor.group
            state = {
                k: gather_split(v, self.splits[k], group) if k in self.splits else v
                for k, v in state.items()
            }
        return state if self.pipeline is None else self.pipeline.gather_stages(state)

    def _layout(self) -> torch.Tensor:
        stage = getattr(self.data, "stage", 0)  # ZeRO's stage; 0 for DDP
        sizes = self.mesh.sizes
        return torch.tensor([sizes["dp"], sizes["tp"], sizes["pp"], stage], dtype=torch.int64)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The data strategy's state of this rank's piece, and the mesh's layout (a piece
        fits only the same place of the same mesh)."""
        return {**self.data.state_dict(*args, **kwargs), LAYOUT: self._layout()}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign=False):
        state = dict(state_dict)
        saved = state.pop(LAYOUT, None)
        if saved is not None and saved.tolist() != self._layout().tolist():
            dp, tp, pp, stage = saved.tolist()
            raise ValueError(
                f"this state is a piece of a mesh dp={dp} x tp={tp} x pp={pp} (ZeRO stage "
                f"{stage}, 0: DDP), not of this one ({self._layout().tolist()}): load a "
                "reshardable checkpoint (sw.load_checkpoint) to change the layout"
            )
        return self.data.load_state_dict(state, strict=strict, assign=assign)

    def extra_state(self) -> dict[str, torch.Tensor]:
        return self.data.extra_state()

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.data.load_extra_state(state)

    def shared_extra_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.data.shared_extra_state(state)

    def checkpoint_shard(self, optimizer: torch.optim.Optimizer):
        """The reshardable checkpoint of the unsplit model, one unit per parameter (the
        layout of a single process's): gathered onto rank 0, which alone writes it."""
        layout: dict[str, Any] = {"num_shards": 1, "strategy": self.checkpoint_name()}
        gathered = self._gathered_state(optimizer)
        if gathered is None:
            return {**layout, "units": []}, None
        params, states, names = gathered
        layout["units"] = [{"params": [[n, list(params[n].shape)]]} for n in names]
        is_param = set(names)
        tensors = {f"buffer/{k}": v for k, v in params.items() if k not in is_param}
        for i, name in enumerate(names):
            tensors[f"unit{i}/param"] = params[name].reshape(-1)
            for key, value in states.get(name, {}).items():
                tensors[f"unit{i}/{key}"] = value.reshape(-1) if value.dim() else value
        return layout, tensors

    def _gathered_state(self, optimizer):
        """The whole training state under single-process names on rank 0, None elsewhere:
        the data axis's onto dp 0, the slices onto tp 0, the stages onto pp 0."""
        state = data_axis_state(self.data, optimizer)
        if state is None:
            return None
        if self.tensor is not None:
            gather_tensor_axis(state, self.splits, self.tensor.group)
            if self.mesh.coords["tp"] != 0:
                return None
        if self.pipeline is not None:
            state = gather_stage_states(state, self.pipeline.names, self.pipeline.group)
        return state if self.runtime.rank == 0 else None

    def full_shapes(self) -> dict[str, torch.Size]:
        names = self.pipeline.names if self.pipeline is not None else {}
        shapes = {}
        for key, shape in self.data.full_shapes().items():
            split = self.splits.get(key)
            if split is not None and len(shape):  # (a tensor-parallel slice of the whole)
                shape = torch.Size([*shape[: split.dim], split.size, *shape[split.dim + 1 :]])
            shapes[names[key][0] if key in names else key] = shape
        return shapes

    @torch.no_grad()
    def load_full_state(self, optimizer, params, states) -> None:
        """This rank's part of a whole training state (any layout saved it, or one process)."""
        keys = list(self.data.module.state_dict(keep_vars=True))
        names = self.pipeline.names if self.pipeline is not None else {k: [k] for k in keys}
        full_name = {k: names[k][0] for k in keys}
        tp_rank = self.mesh.coords["tp"]
        local = cut_state(params, states, keys, full_name, self.splits, tp_rank)
        self.data.load_full_state(optimizer, *local)

    def release(self) -> None:
        self.data.close()
        comm.barrier(self.runtime.group)  # every rank of the mesh


@dataclass(frozen=True)
class MeshParallel(Strategy):
    """Options for a composed run.

    dp, tp, pp: mesh sizes; dp=None takes what is left of the world. Their product must be the
        world size; all three may be above 1.
    data: the strategy along the data axis: sw.DDP() (native all-reduce) or sw.ZeRO(stage=1,
        2 or 3).
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
        check_options(self, MeshConfig, skip=frozenset({"data"}))
        if not isinstance(self.data, (DDP, ZeRO)):
            raise ValueError(f"data must be sw.DDP() or sw.ZeRO(stage=1|2|3), got {self.data!r}")

    def wrap(self, model: nn.Module, runtime: Runtime) -> MeshModel:
        check_sizes(runtime.world_size, self.dp, self.tp, self.pp)  # before any group exists
        mesh = build_mesh(self.dp, self.tp, self.pp, runtime)
        pipeline = self._pipeline(model, mesh, runtime) if mesh.pp_size > 1 else None
        tensor = None
        if mesh.tp_size > 1:  # slices the model's layers in place
            tensor = dataclasses.replace(self.tensor, size=mesh.tp_size)
            tensor = tensor.wrap(model, mesh.runtime("tp", runtime))
        data_rt = mesh.runtime("dp", runtime)
        if pipeline is None:
            data = self.data.wrap(model if tensor is None else tensor.module, data_rt)
            return MeshModel(data, runtime, mesh, data, tensor)
        staged = pipeline.wrap(model, mesh.runtime("pp", runtime))
        data = staged.wrap_stage(self.data, data_rt)
        if tensor is not None:  # the loss and predictions, over this stage's slices only
            vocab = tensor.vocab_start, tensor.vocab_size
            tensor = TensorParallelModel(data.module, tensor.runtime, *vocab)
        return MeshModel(staged, runtime, mesh, data, tensor, staged)

    def _pipeline(self, model: nn.Module, mesh: DeviceMesh, runtime: Runtime) -> Pipeline:
        """The pipeline options with the mesh's stages. Under tensor parallel every tp rank
        must cut at the same layers, and balancing the slices would not (a vocabulary of 11
        rows over 2 ranks is 6 + 5): the unsliced model is cut, rank 0's cut for all."""
        pipeline = dataclasses.replace(self.pipeline, stages=mesh.pp_size)
        if mesh.tp_size == 1 or pipeline.split is not None:
            return pipeline
        layers, _ = pipeline.model_layers(model)
        starts = pipeline.stage_starts(layers)
        cut = torch.tensor(starts, dtype=torch.int64, device=runtime.device)
        comm.broadcast(cut, src=0, group=runtime.group)  # (balance='time' measures per rank)
        return dataclasses.replace(pipeline, split=cut.tolist()[1:])


class MeshConfig(StrategySection):
    name: Literal["mesh"] = Field("mesh", description="the parallelism strategy")
    dp: int | None = Field(None, ge=1, description="data-parallel size (default: the rest)")
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline stages")
    data: Literal["ddp", "zero1", "zero2", "zero3"] = Field(
        "ddp", description="strategy along the data dimension"
    )
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = Field(
        "1f1b", description="pp > 1: schedule"
    )
    microbatches: int = Field(4, ge=1, description="pp > 1: micro-batches per step")
    loss_parallel: bool = Field(True, description="tp > 1: loss from vocabulary slices")
    mixed_precision: Literal["bf16"] | None = Field(  # (fp16's loss scaling: whole-world ZeRO)
        None, description="data: zero*: bf16 compute over ZeRO's fp32 master weights"
    )
    offload: Literal["cpu", "disk"] | None = Field(
        None, description="data: zero*: ZeRO's master weights and optimizer state offloaded"
    )

    @model_validator(mode="after")
    def _zero_options_need_zero(self) -> MeshConfig:
        for option in ("mixed_precision", "offload"):
            if getattr(self, option) is not None and self.data == "ddp":
                raise ValueError(
                    f"{option}={getattr(self, option)!r} is ZeRO's: set data to zero1, zero2 "
                    "or zero3 (DDP along the data axis has no such option)"
                )
        return self

    def build(self, world_size: int, run_dir: Path) -> MeshParallel:
        data = DDP()
        if self.data != "ddp":  # (offload to disk: each rank's files under the run directory)
            data = ZeRO(
                stage=int(self.data[-1]),
                mixed_precision=self.mixed_precision,
                offload=self.offload,
                offload_dir=str(run_dir) if self.offload else None,
            )
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

    def check_world(self, world_size: int) -> None:
        if world_size % (self.tp * self.pp):
            raise ValueError(
                f"mesh tp={self.tp} x pp={self.pp} does not divide the world size {world_size}"
            )

    def data_parallel_ranks(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def describe(self) -> str:
        sizes = f"dp={self.dp or 'rest'} x tp={self.tp} x pp={self.pp}"
        offload = self.offload and f"offload {self.offload}"
        extras = [o for o in (self.mixed_precision, offload, self.pp > 1 and self.schedule) if o]
        return f"mesh ({', '.join([sizes, self.data, *extras])})"
