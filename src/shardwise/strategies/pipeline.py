"""Pipeline parallel: the model cut into S consecutive stages, one per rank, with micro-batches
flowing through them.

Each step splits the batch into M micro-batches. Stage s receives a micro-batch's activations
from stage s-1, runs its layers and sends the result to stage s+1; backward runs the other way,
each stage receiving the gradient of its output and sending the gradient of its input. The last
stage computes the loss. Two schedules decide the order of the forwards (F) and backwards (B):

- GPipe (Huang et al., 2019): all M forwards, then all M backwards. Simple; every stage holds the
  activations of all M micro-batches at its peak.
- 1F1B (PipeDream-Flush, Narayanan et al., 2021; Megatron-LM's default): stage s runs S-s-1
  warm-up forwards, then alternates one forward and one backward, then drains. It holds at most
  S-s micro-batches' activations, whatever M is.

Both leave every stage idle for (S-1) of the M+S-1 slots of a step: the bubble fraction
(S-1)/(M+S-1), which more micro-batches shrink. Each micro-batch loss is divided by M, so the
accumulated gradients are those of the whole batch's mean loss, as in single-process training.

Messages are point-to-point: the sends are asynchronous (kept alive until the step ends), the
receives block, and each activation is preceded by a small header with its shape and dtype.

A Hugging Face model is cut into its embeddings, blocks, final norm and head (`hf_stages.py`);
every stage is then handed the batch, a dict of the model's forward arguments, and the last
stage's output is the model's own (`output.loss` is HF's loss). A weight two stages hold (GPT-2's
embedding, tied to its head) stays one parameter (`pipeline_tied.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from shardwise import comm
from shardwise.comm.messages import (
    header,
    read_tensor_header,
    recv_header,
    send_header,
    tensor_header,
)
from shardwise.distributed.runtime import Runtime
from shardwise.nn.meta_init import ParameterSource
from shardwise.strategies.base import (
    DistributedModel,
    LossFn,
    Strategy,
    UnsplitCheckpointsOnly,
    square_sum,
)
from shardwise.strategies.ddp import DDP, broadcast_module_state
from shardwise.strategies.hf_stages import hf_layers, is_hf_model
from shardwise.strategies.pipeline_schedule import Inbox, schedule_order
from shardwise.strategies.pipeline_stages import (
    Microbatch,
    PipelineStage,
    TensorFeed,
    balanced_split,
    measure_layer_times,
    pipeline_layers,
    read_stage,
)
from shardwise.strategies.pipeline_tied import TiedWeights, shared_parameters
from shardwise.strategies.section import StrategySection

SCHEDULES = ("gpipe", "1f1b")


def _unwrapped(module: nn.Module) -> nn.Module:
    """The stage under a data-parallel wrapper (a mesh wraps stages in DDP or ZeRO)."""
    return getattr(module, "module", module)


class PipelineModel(UnsplitCheckpointsOnly, DistributedModel):
    """This rank's stage, and the schedule that trains the whole pipeline through it.

    `train_step(inputs, targets, loss_fn)` runs one step's schedule (forward and backward of
    every micro-batch) and returns the batch's mean loss on every rank. Calling the model
    (`model(x)`, without gradients) runs one forward through all stages and returns the output
    on every rank: what evaluation needs. For a Hugging Face model, every rank passes the batch
    dict (`train_step(batch, None, lambda out, _: out.loss)`, `model(**batch)`).
    """

    def __init__(
        self,
        stage: nn.Module,
        runtime: Runtime,
        schedule: str,
        microbatches: int,
        names: dict[str, list[str]],
        feed: Any = None,
        tied: list[tuple[nn.Parameter, list[int]]] = (),
    ) -> None:
        super().__init__(stage, runtime)
        self.index, self.stages, self.group = runtime.rank, runtime.world_size, runtime.group
        self.schedule, self.microbatches = schedule, microbatches
        self.names = names  # stage state-dict key -> the unsplit model's key(s)
        self.feed = feed or TensorFeed()  # how a batch becomes micro-batches
        self.tied = TiedWeights(list(tied), self.index, self.group)  # held by other stages too
        self.is_first, self.is_last = self.index == 0, self.index == self.stages - 1
        self.device = next(iter(stage.parameters())).device
        self._sends: list[tuple[comm.Handle, torch.Tensor]] = []

    @property
    def stage(self) -> nn.Module:
        """This rank's layers (under a data-parallel model on a device mesh)."""
        return self.module

    def wrap_stage(self, strategy: Strategy, runtime: Runtime) -> DistributedModel:
        """Make the stage data parallel along a mesh axis (`runtime`): the composition."""
        if self.tied and not isinstance(strategy, DDP):  # ZeRO's gradients are not whole
            raise ValueError(
                f"a weight tied across pipeline stages needs sw.DDP() along the data axis, "
                f"not {type(strategy).__name__}"
            )
        self.module = strategy.wrap(self.module, runtime)
        return self.module

    # ---- messages
    def _send(self, tensor: torch.Tensor, dst: int, header: bool) -> None:
        tensor = tensor.detach().contiguous()
        if header:
            head = tensor_header(tensor)
            self._sends.append((send_header(head, dst, self.group), head))
        self._sends.append((comm.send(tensor, dst, self.group), tensor))

    def _recv_activation(self, src: int) -> torch.Tensor:
        shape, dtype = read_tensor_header(recv_header(src, self.group, self.device))
        out = torch.empty(shape, dtype=dtype, device=self.device)
        comm.recv(out, src, self.group)
        return out

    def _wait_sends(self) -> None:
        for handle, _ in self._sends:
            handle.wait()
        self._sends.clear()

    # ---- training
    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        samples: int | None = None,
        total: int | None = None,
    ) -> torch.Tensor:
        # samples / total: one pipeline is one replica; a mesh declares them along its data axis.
        m = self.microbatches
        feeds = self.feed.split(inputs, targets, m, self.is_first, self.is_last)
        order = schedule_order(self.schedule, self.index, self.stages, m)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        inbox = Inbox(self)  # receives posted one message ahead
        step_loss = torch.zeros((), device=self.device)
        self.tied.begin_step()
        for k, (op, i) in enumerate(order):
            if op == "F":
                x = feeds[i].x if self.is_first else inbox.activation(i)
                inbox.prefetch(order, k + 1, saved)  # (the next message lands while this runs)
                out = self._forward_microbatch(i, x, feeds[i], loss_fn, step_loss)
                saved[i] = (None if self.is_first else x, out)
            else:
                x, out = saved.pop(i)
                grad = None if self.is_last else inbox.gradient(i, out)
                inbox.prefetch(order, k + 1, saved)
                step_loss = self._backward_microbatch(i, x, out, grad, inbox, step_loss)
        self.tied.sum_grads()
        self._wait_sends()
        # Every rank now holds the loss: it travelled back with the gradients, stage by stage,
        # which costs no synchronising collective at the end of the step.
        return step_loss

    def _forward_microbatch(
        self, i: int, x, feed: Microbatch, loss_fn: LossFn, step_loss
    ) -> torch.Tensor:
        """Micro-batch `i` through the stage: the last adds its loss to `step_loss`."""
        out = self.stage(x, *feed.context)
        if self.is_last:
            out = loss_fn(out, feed.target) / feed.parts
            step_loss += out.detach()
        else:  # micro-batches have one shape: a header with the first one only
            self._send(out, self.index + 1, header=i == 0)
        return out

    def _backward_microbatch(self, i: int, x, out, grad, inbox: Inbox, step_loss) -> torch.Tensor:
        """Micro-batch `i` back through the stage (`grad`: its output's gradient, None on the
        last stage), its input's gradient sent back; returns the step's loss, which the stages
        before the last receive after the last micro-batch's gradient and pass back."""
        last = i == self.microbatches - 1
        # Data parallel along a mesh: reduce gradients once, after the last micro-batch.
        sync = last or not hasattr(self.stage, "no_sync")
        with contextlib.nullcontext() if sync else self.stage.no_sync():
            if self.is_last:
                out.backward()
            else:
                out.backward(grad)
        if last and not self.is_last:  # the step's loss follows the last gradient
            step_loss = inbox.loss()
        if x is not None:
            self._send(x.grad, self.index - 1, header=False)
            if last:
                self._send(step_loss.reshape(1), self.index - 1, header=False)
        return step_loss

    @torch.no_grad()
    def forward(self, inputs: Any = None, **batch: Any) -> Any:
        """The output of the batch on every rank (a Hugging Face model: `model(**batch)`, its
        output with logits, and loss where the batch has labels)."""
        if torch.is_grad_enabled():
            raise RuntimeError("a pipeline model trains through model.train_step(x, y, loss_fn)")
        x, context = self.feed.whole(batch or inputs)
        if not self.is_first:
            x = self._recv_activation(self.index - 1)
        out = self.stage(x, *context)
        if not self.is_last:
            self._send(out, self.index + 1, header=True)
            self._wait_sends()
        tensors = self.feed.pack(out) if self.is_last else [None] * self.feed.count(context)
        return self.feed.unpack([self._from_last(t) for t in tensors])

    def _from_last(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's `tensor` on every rank: its shape, then the values."""
        head = tensor_header(tensor) if self.is_last else header(device=self.device)
        comm.broadcast(head, src=self.stages - 1, group=self.group)
        if not self.is_last:
            shape, dtype = read_tensor_header(head)
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        comm.broadcast(tensor, src=self.stages - 1, group=self.group)
        return tensor

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's tensors, under the unsplit model's keys, on every rank."""
        stage_state = _unwrapped(self.stage).state_dict()
        # (A tied weight is under each of its names, from every stage that holds it.)
        local = {n: v.detach().cpu() for k, v in stage_state.items() for n in self.names[k]}
        parts = comm.all_gather_object(local, group=self.group)
        return {k: v.to(self.device) for part in parts for k, v in part.items()}

    def grad_square_sum(self) -> torch.Tensor:
        grads = [
            p.grad
            for p in self.stage.parameters()
            if p.grad is not None and self.tied.counted_here(p)
        ]
        squares = square_sum(grads, self.device)
        comm.all_reduce(squares, group=self.group)  # stages hold disjoint parameters
        return squares

    def data_shard(self) -> tuple[int, int]:
        return 1, 0  # every stage works on the same batch


def check_stages(layers: list[nn.Module], bounds: list[int]) -> None:
    """Every stage must hold parameters (a stage of a lone ReLU has nothing to train or to
    tell its device by): one line naming the stage otherwise."""
    for s in range(len(bounds) - 1):
        stage = layers[bounds[s] : bounds[s + 1]]
        if not any(True for layer in stage for _ in layer.parameters()):
            names = ", ".join(type(layer).__name__ for layer in stage)
            raise ValueError(
                f"pipeline stage {s} would hold only layers without parameters ({names}): "
                f"use fewer stages or give split"
            )


@dataclass(frozen=True)
class Pipeline(Strategy):
    """Options for pipeline parallel.

    stages: number of stages (= ranks along the pipeline).
    schedule: 'gpipe' or '1f1b'.
    microbatches: micro-batches per step (the batch must divide into them).
    split: start layer of stages 1..S-1 (e.g. [3] for 2 stages); None balances automatically.
    balance: 'params' (equal parameter counts) or 'time' (measured forward+backward time per
        layer on `sample_input`).
    """

    stages: int = 2
    schedule: str = "1f1b"
    microbatches: int = 4
    split: list[int] | None = None
    balance: str = "params"
    sample_input: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.stages < 1:
            raise ValueError(f"pipeline stages must be >= 1, got {self.stages}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.balance not in ("params", "time"):
            raise ValueError(f"balance must be 'params' or 'time', got {self.balance!r}")
        if self.balance == "time" and self.sample_input is None and self.split is None:
            raise ValueError("balance='time' measures layers on sample_input: pass one")

    def stage_starts(self, layers: list[nn.Module]) -> list[int]:
        if self.split is not None:
            starts = [0, *self.split]
            if (
                len(starts) != self.stages
                or starts != sorted(set(starts))
                or starts[-1] >= len(layers)
            ):
                raise ValueError(
                    f"split {self.split} must give {self.stages - 1} increasing start layers "
                    f"in 1..{len(layers) - 1}"
                )
            return starts
        if self.balance == "time":
            weights = measure_layer_times(layers, self.sample_input)
        else:
            weights = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
        return balanced_split(weights, self.stages)

    def wrap(self, model: nn.Module, runtime: Runtime) -> PipelineModel:
        self.check_world(runtime)
        layers, feed = self.model_layers(model)  # (refusals come before any collective)
        starts = [*self.stage_starts(layers), len(layers)]
        if self.balance == "time" and self.split is None:
            # Each rank timed the layers itself and may cut elsewhere: rank 0's cut for all.
            cut = torch.tensor(starts, dtype=torch.int64, device=runtime.device)
            comm.broadcast(cut, src=0, group=runtime.group)
            starts = cut.tolist()
        check_stages(layers, starts)
        broadcast_module_state(model, group=runtime.group)
        mine = PipelineStage(layers[starts[runtime.rank] : starts[runtime.rank + 1]])
        tied = shared_parameters(layers, starts, runtime.rank)
        return self.stage_model(model, mine, runtime, feed, tied)

    def wrap_from(self, model: nn.Module, runtime: Runtime, source: ParameterSource):
        """A meta-device model: the stages are cut on its shapes, then each rank reads only
        its own stage's parameters (a tied weight where this stage holds it) and buffers from
        `source`; the other stages' stay on the meta device. Every rank reads the same
        values, so nothing is broadcast."""
        if self.balance == "time" and self.split is None:
            raise ValueError(
                "balance='time' runs the layers, which a meta-device model cannot: use "
                "balance='params' or give split"
            )
        self.check_world(runtime)
        layers, feed = self.model_layers(model)
        starts = [*self.stage_starts(layers), len(layers)]
        check_stages(layers, starts)
        mine = PipelineStage(layers[starts[runtime.rank] : starts[runtime.rank + 1]])
        tied = shared_parameters(layers, starts, runtime.rank)  # (found on the meta ones)
        read = read_stage(model, mine, source, runtime.device)
        tied = [(read.get(p, p), holders) for p, holders in tied]
        return self.stage_model(model, mine, runtime, feed, tied)

    def check_world(self, runtime: Runtime) -> None:
        if self.stages != runtime.world_size:
            raise ValueError(
                f"Pipeline(stages={self.stages}) needs {self.stages} ranks, got "
                f"{runtime.world_size} (use a device mesh to combine it with data parallel)"
            )

    def stage_model(self, model, mine: PipelineStage, runtime, feed, tied) -> PipelineModel:
        """The pipeline model of this rank's stage `mine` (its keys mapped to `model`'s)."""
        full_names: dict[int, list[str]] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            full_names.setdefault(id(t), []).append(name)  # a tied weight has two names
        names = {k: full_names[id(t)] for k, t in mine.state_dict(keep_vars=True).items()}
        return PipelineModel(mine, runtime, self.schedule, self.microbatches, names, feed, tied)

    def model_layers(self, model: nn.Module) -> tuple[list[nn.Module], Any]:
        """The model's layers in order, and the feed that brings its batches to them."""
        if not is_hf_model(model) or hasattr(model, "pipeline_layers"):
            return pipeline_layers(model), TensorFeed()
        if self.balance == "time" and self.split is None:
            raise ValueError(
                f"balance='time' times layers on one tensor, and {type(model).__name__}'s take "
                "its batch: use balance='params' or give split"
            )
        return hf_layers(model)


class PPConfig(StrategySection):
    name: Literal["pp"] = Field("pp", description="the parallelism strategy")
    stages: int | None = Field(None, ge=1, description="pipeline stages (default: the world)")
    schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="pipeline schedule")
    microbatches: int = Field(4, ge=1, description="micro-batches per step")
    split: list[int] | None = Field(
        None, description="first layer of stages 1..S-1; default: balanced by parameters"
    )

    def build(self, world_size: int, run_dir: Path) -> Pipeline:
        return Pipeline(stages=self.stages or world_size, **self.options(exclude={"stages"}))

    def ranks_needed(self) -> int | None:
        return self.stages

    def describe(self) -> str:
        return f"pipeline ({self.schedule}, {self.microbatches} micro-batches)"
