"""The shape every parallelism in shardwise has: frozen options, and a model that behaves.

A `Strategy` is a frozen, validated set of options with one method, `wrap(model, runtime)`,
that turns a plain model into a `DistributedModel`. Everything that varies by strategy lives on
that model, which owns the `Runtime` (and so the process group) it was handed:

- the training loop's hooks: `train_step`, `adapt_loss`, `predict`, `data_shard`;
- gradients: `local_grads`, `grad_square_sum`, `clip_grad_norm_`, `zero_grad`;
- the optimizer: `make_optimizer` returns a `DistributedOptimizer`, one `torch.optim.Optimizer`
  subclass for every strategy, which calls the model's `before_step` / `step_optimizer` /
  `after_step` hooks (ZeroRedundancyOptimizer is the shape: a real optimizer, so LR schedulers
  keep working, never methods patched onto the user's);
- state: `full_state_dict` (the single-process state dict, on every rank), `state_dict` /
  `load_state_dict` (everything the next step depends on that this rank's model holds: the
  `Stateful` shape of `torch.distributed.checkpoint`), and the reshardable checkpoint's
  `checkpoint_shard` / `load_full_state`;
- `close`, which releases threads and hooks.

The defaults here are those of a model every rank holds whole (data parallel).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.distributed.runtime import Runtime
from shardwise.nn.meta_init import ParameterSource, materialize
from shardwise.optim.layerwise import LayerwiseOptimizer, ParameterNorms
from shardwise.strategies.batch_share import batch_samples

LossFn = Callable[[Any, Any], torch.Tensor]
EXTRA = "_shardwise."  # state-dict keys of strategy state that is not a module tensor


class Strategy(ABC):
    """Base class; subclasses are small frozen dataclasses holding the user's options."""

    # Whether every rank of the world prepares a model with it (a parameter server's workers
    # alone do): `sw.prepare` then checks that all of them hold the same model and options.
    every_rank_prepares: ClassVar[bool] = True

    @abstractmethod
    def wrap(self, model: nn.Module, runtime: Runtime) -> DistributedModel:
        """Return the distributed model. May issue collectives (e.g. the initial broadcast)."""

    def wrap_from(
        self, model: nn.Module, runtime: Runtime, source: ParameterSource
    ) -> DistributedModel:
        """`wrap` a model whose parameters are on the meta device (`nn/meta_init.py`), their
        values read from `source`. Here each rank reads them whole; a strategy that shards
        parameters reads only its own part."""
        materialize(model, source, runtime.device)
        return self.wrap(model, runtime)

    def close(self, model: DistributedModel) -> None:
        """Release what `model` holds (kept for scripts written as `strategy.close(model)`)."""
        model.close()


class DistributedModel(nn.Module):
    """A strategy's model: forwards to `module` and owns everything the strategy changes."""

    def __init__(self, module: nn.Module, runtime: Runtime) -> None:
        super().__init__()
        self.module = module
        self.runtime = runtime
        self.closed = False  # (`close`)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ---- the training loop's hooks: what changes when the model itself is split -------------
    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        samples: int | None = None,
        total: int | None = None,
    ) -> torch.Tensor:
        """Forward, loss and backward for one batch; returns the (detached) loss. A pipeline
        runs its whole schedule here. `samples` (default: the batch's first dimension) and
        `total` go to `declare_batch`."""
        self.declare_batch_of(inputs, targets, samples, total)
        loss = self.adapt_loss(loss_fn)(self(inputs), targets)
        loss.backward()
        return loss.detach()

    def declare_batch(self, samples: int, total: int | None = None) -> None:
        """This rank holds `samples` of the step's `total` (None: summed over the replicas);
        data parallel weighs its gradient by samples / total, so the update is the mean over
        the global batch however unevenly it is split (`batch_share.py`). Call it before the
        backward that synchronises, on every replica. Nothing to weigh here (one replica, or
        a strategy that averages parameters rather than gradients)."""

    def declare_batch_of(
        self, inputs: Any, targets: Any, samples: int | None, total: int | None
    ) -> None:
        """`declare_batch` for `train_step`: samples counted from the batch unless given (from
        the targets where a pipeline's middle stage is handed no inputs)."""
        if samples is None:
            samples = batch_samples(inputs if inputs is not None else targets)
        self.declare_batch(samples, total)

    def adapt_loss(self, loss_fn: LossFn) -> LossFn:
        """The loss to use on this model's outputs (tensor parallel: from vocabulary slices)."""
        return loss_fn

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        """Predicted class per row of `output` (argmax over the last dimension)."""
        return output.argmax(-1)

    def data_shard(self) -> tuple[int, int]:
        """(replicas, index): how many different batches a step consumes, and which is ours.
        Ranks that split one model between them must see the same batch."""
        return self.runtime.world_size, self.runtime.rank

    # ---- gradients ---------------------------------------------------------------------------
    def local_grads(self) -> list[torch.Tensor]:
        """The gradients this rank holds (all of them, or its shard), reduced."""
        self.settle_gradients()
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def grad_square_sum(self) -> torch.Tensor:
        """Σ g² over the whole (global) gradient, the same on every rank: what clipping needs.

        This default is for replicated gradients; strategies that shard them sum over ranks.
        """
        return square_sum(self.local_grads(), self.runtime.device)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most `max_norm`; return the norm
        before. The formula of `torch.nn.utils.clip_grad_norm_`, over every rank's share."""
        if isinstance(max_norm, bool) or not max_norm >= 0:  # (NaN fails it too; inf: no clip)
            # (a negative one flipped every gradient's sign; NaN made them all NaN)
            raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
        total_norm = self.grad_square_sum().sqrt()
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in self.local_grads():
            g.detach().mul_(coef.to(g.device, g.dtype))  # offloaded gradients: on the CPU
        return total_norm

    # ---- the optimizer -----------------------------------------------------------------------
    def optimizer_params(self) -> list[nn.Parameter]:
        """What this rank's optimizer steps: every parameter here; ZeRO: its shards."""
        return list(self.module.parameters())

    def is_stepped_by(self, optimizer: DistributedOptimizer) -> bool:
        """Whether `optimizer` is the one `make_optimizer` made for this model."""
        return optimizer.model is self

    def make_optimizer(
        self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> DistributedOptimizer:
        try:
            inner = optimizer_cls(self.optimizer_params(), **kwargs)
        except (TypeError, ValueError) as e:  # (`lr="a"`: torch's own words, this call named)
            given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(f"{optimizer_cls.__name__}({given}): {e}") from e
        if isinstance(inner, LayerwiseOptimizer):  # LARS, LAMB: norms of whole parameters
            inner.norms = self.parameter_norms()
        return DistributedOptimizer(self, inner)

    def parameter_norms(self) -> ParameterNorms:
        """Which piece of which parameter each tensor the optimizer steps holds, and how the
        pieces' squares add up over ranks (`optim.layerwise`). This default: each a whole
        parameter, the same on every rank that holds it."""
        return ParameterNorms.whole(self.optimizer_params())

    def settle_gradients(self) -> None:
        """Finish what the last backward left to reduce, before its gradients are read (the
        step, `local_grads`): where a reentrant checkpoint hid its end (`grad_buckets`)."""

    def before_step(self) -> bool:
        """Runs before the optimizer steps; False skips the step (fp16 overflow)."""
        return True

    def step_optimizer(self, inner: torch.optim.Optimizer, closure: Callable | None) -> Any:
        """Step the inner optimizer (disk offload pages its state in shard by shard)."""
        return inner.step(closure)

    def after_step(self) -> None:
        """Runs after the optimizer stepped: all-gathers, averages, pushes, counters."""

    def weights_for_evaluation(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the module holds the weights an evaluation scores (collective): this rank's,
        where every rank's agree."""
        return contextlib.nullcontext()

    # ---- state -------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete, unsharded state dict with single-process keys, on every rank."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Strategy state the next step depends on beyond the module's tensors (codec
        residuals, counters, loss scale), as tensors."""
        return {}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `extra_state` (a part of it: `shared_extra_state`'s)."""

    def shared_extra_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Of a rank's `extra_state`, what every rank holds alike (counters, the loss scale):
        what a resume on another number of ranks restores. The rest (a codec's residuals) is
        one rank's own, and starts afresh there."""
        return {}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's training state: what it holds of the model, plus `extra_state` under
        `_shardwise.` keys. `load_state_dict` of it into a fresh prepare of the same strategy
        on the same ranks continues bit-identically; plain single-process weights load too."""
        state = dict(self.module.state_dict(*args, **kwargs))
        state.update(prefixed(EXTRA, self.extra_state()))
        return state

    def load_state_dict(
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        module_state = {k: v for k, v in state_dict.items() if not k.startswith(EXTRA)}
        if extra := unprefixed(EXTRA, state_dict):  # (plain weights carry none: load those)
            self.load_extra_state(extra)
        return self.module.load_state_dict(module_state, strict=strict, assign=assign)

    def checkpoint_shard(
        self, optimizer: torch.optim.Optimizer, every_rank: bool = False
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """Layout and this rank's tensors for a sharded checkpoint (see `checkpoint.py`).

        This default is for replicated state: one unit per parameter, written by rank 0 alone
        (by every rank with `every_rank`: what an elastic job's in-memory snapshot keeps, where
        any rank may be the one to survive).
        """
        named = list(self.module.named_parameters())
        layout = {
            "num_shards": 1,
            "strategy": self.checkpoint_name(),
            "units": [{"params": [[n, list(p.shape)]]} for n, p in named],
        }
        if self.runtime.rank != 0 and not every_rank:
            return layout, None
        tensors = buffer_tensors(self.module)
        for i, (_, p) in enumerate(named):
            tensors[f"unit{i}/param"] = p.detach().reshape(-1)
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    tensors[f"unit{i}/{key}"] = value.reshape(-1) if value.dim() else value
        return layout, tensors

    def checkpoint_name(self) -> str:
        return type(self).__name__.removesuffix("Model").lower()

    def scales_loss(self) -> bool:
        """Whether an overflowing gradient is this model's own business: an fp16 loss scaler
        skips that step itself and lowers the scale (the trainer must let it)."""
        return False

    def loss_scale(self) -> float | None:
        """The fp16 loss scaler's present scale, where `scales_loss`."""
        return None

    def full_shapes(self) -> dict[str, torch.Size]:
        """What `load_full_state` takes on this rank: each parameter and saved buffer it holds
        (of the unsplit model, by single-process names), with its unsplit shape."""
        saved = set(self.module.state_dict(keep_vars=True))
        tensors = [*self.module.named_parameters(), *self.module.named_buffers()]
        return {name: t.shape for name, t in tensors if name in saved}

    @torch.no_grad()
    def load_full_state(
        self,
        optimizer: torch.optim.Optimizer,
        params: dict[str, torch.Tensor],
        states: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """Take this strategy's part of full per-parameter tensors (any saved world size)."""
        load_buffers(self.module, params)
        for name, p in self.module.named_parameters():
            load_parameter(optimizer, p, params[name], states.get(name, {}))

    def close(self) -> None:
        """Release threads, hooks, groups and files the strategy made (`release`), once. The
        model then refuses to run or step: DDP's replicas went on training without their
        hooks, each apart from the others; ZeRO's shards were gone (a `KeyError`)."""
        if self.closed:
            return
        self.closed = True
        self.release()
        self.register_forward_pre_hook(_refuse_closed)

    def release(self) -> None:
        """What `close` releases: threads, hooks or groups the strategy created."""


def _refuse_closed(model: DistributedModel, _args: Any) -> None:
    raise RuntimeError(_closed_message(model))


def _closed_message(model: DistributedModel) -> str:
    return (
        f"this {type(model).__name__} was closed (model.close() released what its strategy "
        "holds): prepare the model again to go on training it"
    )


class UnsplitCheckpointsOnly:
    """For models split over ranks: resumable sharded checkpoints are not written yet (saying
    so beats writing a wrong one); `full_state_dict` and `state_dict` work."""

    def checkpoint_shard(self, optimizer: torch.optim.Optimizer):
        strategy = type(self).__name__.removesuffix("Model")
        raise NotImplementedError(
            f"sharded checkpoints of {strategy} models are not supported yet: "
            "save sw.full_state_dict(model) instead"
        )

    # Loading one is not supported either (this rank's names and shapes are its slices', not
    # the unsplit model's: they failed with a KeyError or a size mismatch).
    def full_shapes(self) -> dict[str, torch.Size]:
        raise self._no_loading()

    def load_full_state(self, optimizer, params, states) -> None:
        raise self._no_loading()

    def _no_loading(self) -> NotImplementedError:
        strategy = type(self).__name__.removesuffix("Model")
        return NotImplementedError(
            f"loading a checkpoint into a {strategy} model is not supported yet: load the "
            "weights into the model before sw.prepare, or train it on a device mesh "
            "(strategy mesh), which loads any checkpoint"
        )


class DistributedOptimizer(torch.optim.Optimizer):
    """The optimizer `sw.prepare` returns, for every strategy.

    It holds a real torch optimizer (`inner`) over what this rank updates and shares its
    `param_groups` and `state`, so LR schedulers and `optimizer.state` work as usual. `step`
    runs the model's hooks around the inner step; `zero_grad` is the model's (DDP keeps
    gradients as views into its buckets, ZeRO clears its shards).
    """

    def __init__(self, model: DistributedModel, inner: torch.optim.Optimizer | None) -> None:
        params = [p for g in inner.param_groups for p in g["params"]] if inner else []
        super().__init__(params or list(model.parameters()), inner.defaults if inner else {})
        self.model, self.inner = model, inner
        self._share_inner()

    def _share_inner(self) -> None:
        if self.inner is not None:
            self.param_groups, self.state = self.inner.param_groups, self.inner.state

    def step(self, closure: Callable | None = None) -> Any:
        if self.model.closed:
            raise RuntimeError(_closed_message(self.model))
        self.model.settle_gradients()
        if not self.model.before_step():
            return None
        loss = self.model.step_optimizer(self.inner, closure) if self.inner else None
        self.model.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state_dict)
            self._share_inner()  # torch's load replaces the state and group containers


@torch.no_grad()
def load_parameter(
    optimizer: torch.optim.Optimizer,
    p: nn.Parameter,
    value: torch.Tensor,
    state: dict[str, torch.Tensor],
) -> None:
    """Set `p` to its full saved `value`, and its optimizer state to the full saved `state`
    (flat tensors take `p`'s shape; scalars, such as Adam's step, stay scalars)."""
    p.copy_(value)
    optimizer.state[p] = {
        k: (v.view_as(p) if v.dim() else v).clone().to(p.device) for k, v in state.items()
    }


def clear_grads(params: list[nn.Parameter], set_to_none: bool) -> None:
    """`zero_grad` over parameters whose gradients autograd made: dropped, or zeroed."""
    for p in params:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()


def square_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else device)
    for t in tensors:
        total += t.detach().float().pow(2).sum()
    return total


def buffer_tensors(module: nn.Module, frozen: bool = False) -> dict[str, torch.Tensor]:
    """Module buffers (replicated on every rank) for rank 0's checkpoint file; with `frozen`,
    the frozen parameters too (a strategy that shards only what trains holds them so)."""
    return {f"buffer/{n}": b.detach() for n, b in replicated(module, frozen)}


@torch.no_grad()
def load_buffers(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Buffers and frozen parameters from `tensors`, where it has them (by name)."""
    for name, b in replicated(module, frozen=True):
        if name in tensors:
            b.copy_(tensors[name])


def replicated(module: nn.Module, frozen: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every buffer, and with `frozen` every parameter that does not train (transfer learning:
    no optimizer steps it, so a data-parallel strategy keeps it whole on every rank)."""
    yield from module.named_buffers()
    if frozen:
        yield from ((n, p) for n, p in module.named_parameters() if not p.requires_grad)


def prefixed(prefix: str, state: dict[str, Any]) -> dict[str, Any]:
    return {prefix + k: v for k, v in state.items()}


def unprefixed(prefix: str, state: dict[str, Any]) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
