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
from shardwise.comm.named_tensors import all_gather_named
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
from shardwise.strategies.pipeline_messages import StepMessages
from shardwise.strategies.pipeline_schedule import schedule_order
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
from shardwise.strategies.section import StrategySection, check_options
from shardwise.strategies.zero_bubble import (
    NOTHING_DEFERRED,
    DeferredWeights,
    input_gradient,
    split_backward,
)


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
        num_chunks: int = 1,
        cut_from_hf: tuple[Any, str] | None = None,
    ) -> None:
        super().__init__(stage, runtime)
        # A Hugging Face model's (config, class name): what its checkpoints are exported with
        # (`checkpoint/hf_export.py`), which no stage's modules carry.
        self.cut_from_hf = cut_from_hf
        self.index, self.stages, self.group = runtime.rank, runtime.world_size, runtime.group
        self.schedule, self.microbatches = schedule, microbatches
        self.num_chunks = num_chunks  # chunks of the model on this rank: interleaved's v
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
        if self.schedule not in ("gpipe", "1f1b") and getattr(strategy, "stage", 1) > 1:
            raise ValueError(  # (they reduce once, after the last W: gradients accumulate)
                f"the {self.schedule} schedule needs sw.DDP() or sw.ZeRO(stage=1) along the data "
                f"axis, not ZeRO stage {strategy.stage}"
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
    def no_sync(self):
        """Refused: the schedule already accumulates gradients over its micro-batches."""
        raise ValueError(
            "a pipeline already accumulates gradients over its micro-batches: raise the "
            "strategy's microbatches (K times as many) instead of accumulating K steps"
        )

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
        order = schedule_order(self.schedule, self.index, self.stages, m, self.num_chunks)
        messages = StepMessages(self)  # receives posted one op ahead
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        deferred: dict[tuple[int, int], DeferredWeights] = {}
        step_loss = torch.zeros((), device=self.device)
        self.tied.begin_step()
        for k, (op, i, c) in enumerate(order):
            if op == "F":
                first = messages.boundary_in(c) < 0
                x = feeds[i].x if first else messages.activation(i, c)
                messages.prefetch(order, k + 1, saved)  # (the next message lands meanwhile)
                out = self._forward_microbatch(i, c, x, feeds[i], loss_fn, step_loss, messages)
                saved[(i, c)] = (None if first else x, out)
            elif op == "B":
                x, out = saved.pop((i, c))
                last = messages.boundary_out(c) == self.stages * self.num_chunks - 1
                grad = None if last else messages.gradient(i, c, out)
                messages.prefetch(order, k + 1, saved)
                with self._accumulating(i):
                    input_grad, deferred[(i, c)] = self._backward(out, grad, x, c)
                loss = messages.loss(c) if i == m - 1 and not last else None
                step_loss = step_loss if loss is None else loss  # (it follows the last gradient)
                if x is not None:
                    messages.send_gradient(input_grad, i, c, step_loss)
            else:
                with self._accumulating(i):
                    deferred.pop((i, c)).run()
        self._reduce_data_axis()
        self.tied.sum_grads()
        messages.wait_sends()
        # Every rank now holds the loss: it travelled back with the gradients, stage by stage,
        # which costs no synchronising collective at the end of the step.
        return step_loss

    def _chunk(self, c: int) -> nn.Module:
        """This rank's chunk `c` (the stage itself, through its data-parallel wrapper, if one)."""
        return self.stage if self.num_chunks == 1 else _unwrapped(self.stage)[c]

    def _forward_microbatch(
        self, i: int, c: int, x, feed: Microbatch, loss_fn: LossFn, step_loss, messages
    ) -> torch.Tensor:
        """Micro-batch `i` through chunk `c`: the model's last adds its loss to `step_loss`."""
        out = self._chunk(c)(x, *feed.context)
        if messages.boundary_out(c) == self.stages * self.num_chunks - 1:
            out = loss_fn(out, feed.target) / feed.parts
            step_loss += out.detach()
        else:
            messages.send_activation(out, i, c)
        return out

    def _backward(self, out, grad, x, c: int) -> tuple[torch.Tensor | None, DeferredWeights]:
        """Micro-batch's backward through chunk `c` (`grad`: its output's gradient, None for
        the loss): the input's gradient, and the weights' gradient still to run (zb-h1)."""
        if self.schedule == "zb-h1":
            params = [p for p in _unwrapped(self.stage).parameters() if p.requires_grad]
            return split_backward(out, grad, x, params)
        if out.requires_grad:  # (not so where nothing before it trains: a frozen first stage)
            out.backward(grad)
        return input_gradient(x), NOTHING_DEFERRED

    def _accumulating(self, i: int) -> contextlib.AbstractContextManager:
        """Data parallel along a mesh reduces gradients once a step. GPipe and 1F1B end with
        micro-batch M-1's backward, which reduces; the chunks of interleaved and the deferred
        weight gradients of zb-h1 end elsewhere: everything accumulates, then
        `_reduce_data_axis`."""
        if not hasattr(self.stage, "no_sync"):
            return contextlib.nullcontext()
        if i == self.microbatches - 1 and self.schedule in ("gpipe", "1f1b"):
            return contextlib.nullcontext()
        return self.stage.no_sync()

    def _reduce_data_axis(self) -> None:
        """Reduce a data-parallel stage's gradients after a schedule that does not end in one
        backward over all of them: one backward that adds zero to every weight's gradient,
        in which the wrapper's gradient hooks see each weight once and reduce (the sum is
        unchanged: g + 0 == g)."""
        if self.schedule in ("gpipe", "1f1b") or not hasattr(self.stage, "no_sync"):
            return
        params = [p for p in self.stage.parameters() if p.requires_grad]
        zeros = [torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p) for p in params]
        torch.autograd.backward(params, zeros)

    @torch.no_grad()
    def forward(self, inputs: Any = None, **batch: Any) -> Any:
        """The output of the batch on every rank (a Hugging Face model: `model(**batch)`, its
        output with logits, and loss where the batch has labels), always without gradients:
        an evaluation's forward (a pipeline trains through `sw.train_step`)."""
        x, context = self.feed.whole(batch or inputs)
        for c in range(self.num_chunks):  # chunk c is the model's chunk c*S + this rank
            if c > 0 or not self.is_first:
                x = self._recv_activation((self.index - 1) % self.stages)
            x = self._chunk(c)(x, *context)
            if c < self.num_chunks - 1 or not self.is_last:
                self._send(x, (self.index + 1) % self.stages, header=True)
        self._wait_sends()
        tensors = self.feed.pack(x) if self.is_last else [None] * self.feed.count(context)
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
        return self.gather_stages(_unwrapped(self.stage).state_dict())

    @torch.no_grad()
    def gather_stages(self, stage_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's `stage_state` (keyed as this stage's state dict; on a mesh, whole
        along the other axes) under the unsplit model's keys, on every rank of the pipeline."""
        # (A tied weight is under each of its names, from every stage that holds it.)
        local = [((n,), v) for k, v in stage_state.items() for n in self.names[k]]
        parts = all_gather_named(local, self.group, self.device)
        return {key[0]: v.to(self.device) for part in parts for key, v in part}

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
    schedule: 'gpipe', '1f1b', 'interleaved' or 'zb-h1' (`pipeline_schedule.py` compares them).
    microbatches: micro-batches per step (the batch must divide into them; interleaved: a
        multiple of the stages).
    virtual_stages: interleaved only: chunks of the model per rank, v (default 2); the model is
        cut into stages * v chunks, rank s holding chunks s, s + stages, ...
    split: start layer of stages 1..S-1 (e.g. [3] for 2 stages; interleaved: of chunks
        1..S*v-1); None balances automatically.
    balance: 'params' (equal parameter counts) or 'time' (measured forward+backward time per
        layer on `sample_input`).
    """

    stages: int = 2
    schedule: str = "1f1b"
    microbatches: int = 4
    split: list[int] | None = None
    balance: str = "params"
    sample_input: torch.Tensor | None = None
    virtual_stages: int | None = None

    def __post_init__(self) -> None:
        check_options(self, PPConfig)
        if self.stages is None:  # (the YAML's None is the world's size: here it is given)
            raise ValueError("Pipeline(stages=None): give the number of stages")
        if self.schedule == "interleaved" and self.num_chunks < 2:
            raise ValueError(
                f"interleaved needs virtual_stages >= 2 (with 1 it is '1f1b'), got "
                f"{self.virtual_stages}"
            )
        if self.schedule != "interleaved" and self.num_chunks != 1:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved', not "
                f"{self.schedule!r}"
            )
        if self.balance not in ("params", "time"):
            raise ValueError(f"balance must be 'params' or 'time', got {self.balance!r}")
        if self.balance == "time" and self.sample_input is None and self.split is None:
            raise ValueError("balance='time' measures layers on sample_input: pass one")

    @property
    def num_chunks(self) -> int:
        """Chunks of the model per rank: v under interleaved, else 1."""
        default = 2 if self.schedule == "interleaved" else 1
        return default if self.virtual_stages is None else self.virtual_stages

    def stage_starts(self, layers: list[nn.Module]) -> list[int]:
        """The first layer of each of the stages * v chunks, in the model's order."""
        parts = self.stages * self.num_chunks
        if self.split is not None:
            starts = [0, *self.split]
            if len(starts) != parts or starts != sorted(set(starts)) or starts[-1] >= len(layers):
                raise ValueError(
                    f"split {self.split} must give {parts - 1} increasing start layers "
                    f"in 1..{len(layers) - 1}"
                )
            return starts
        if self.balance == "time":
            weights = measure_layer_times(layers, self.sample_input)
        else:
            weights = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
        return balanced_split(weights, parts)

    def rank_share(self, layers: list[nn.Module], bounds: list[int], rank: int):
        """Rank `rank`'s module (its stage, or under interleaved a list of its chunks) and
        its weights that other ranks hold too (`pipeline_tied.py`)."""
        chunks = [layers[bounds[c] : bounds[c + 1]] for c in range(len(bounds) - 1)]
        per_rank = [[x for c in chunks[s :: self.stages] for x in c] for s in range(self.stages)]
        starts = [sum(len(r) for r in per_rank[:s]) for s in range(self.stages + 1)]
        tied = shared_parameters([x for r in per_rank for x in r], starts, rank)
        if self.num_chunks == 1:
            return PipelineStage(chunks[rank]), tied
        return nn.ModuleList(PipelineStage(c) for c in chunks[rank :: self.stages]), tied

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
        mine, tied = self.rank_share(layers, starts, runtime.rank)
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
        mine, tied = self.rank_share(layers, starts, runtime.rank)  # (found on the meta ones)
        read = read_stage(model, mine, source, runtime.device)
        tied = [(read.get(p, p), holders) for p, holders in tied]
        return self.stage_model(model, mine, runtime, feed, tied)

    def check_world(self, runtime: Runtime) -> None:
        if self.stages != runtime.world_size:
            raise ValueError(
                f"Pipeline(stages={self.stages}) needs {self.stages} ranks, got "
                f"{runtime.world_size} (use a device mesh to combine it with data parallel)"
            )
        if self.schedule == "interleaved" and (self.stages < 2 or self.microbatches % self.stages):
            raise ValueError(
                f"interleaved runs micro-batches in rounds of one per stage: microbatches="
                f"{self.microbatches} must be a multiple of stages={self.stages} (>= 2)"
            )

    def stage_model(self, model, mine: nn.Module, runtime, feed, tied) -> PipelineModel:
        """The pipeline model of this rank's stage `mine` (its keys mapped to `model`'s)."""
        full_names: dict[int, list[str]] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            full_names.setdefault(id(t), []).append(name)  # a tied weight has two names
        names = {k: full_names[id(t)] for k, t in mine.state_dict(keep_vars=True).items()}
        hf = (model.config, type(model).__name__) if is_hf_model(model) else None
        return PipelineModel(
            mine, runtime, self.schedule, self.microbatches, names, feed, tied, self.num_chunks, hf
        )

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
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = Field(
        "1f1b", description="pipeline schedule (docs/strategies.md compares them)"
    )
    microbatches: int = Field(4, ge=1, description="micro-batches per step")
    virtual_stages: int | None = Field(
        None, ge=1, description="interleaved: model chunks per rank (default 2)"
    )
    split: list[int] | None = Field(
        None, description="first layer of stages 1..S-1; default: balanced by parameters"
    )

    def build(self, world_size: int, run_dir: Path) -> Pipeline:
        return Pipeline(stages=self.stages or world_size, **self.options(exclude={"stages"}))

    def ranks_needed(self) -> int | None:
        return self.stages

    def data_parallel_ranks(self, world_size: int) -> int:
        return 1  # (the stages pass one batch's micro-batches along)

    def describe(self) -> str:
        return f"pipeline ({self.schedule}, {self.microbatches} micro-batches)"
