"""The strategy interface every parallelism in shardwise implements.

A strategy is a transform: `wrap` turns a plain model into its distributed form, and
`make_optimizer` builds the optimizer over whatever that strategy lets this rank update (all
parameters for data parallel, one shard for ZeRO, ...). `full_state_dict` reassembles the
single-process state dict, so checkpoints and exports never depend on how training was split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise import runtime
from shardwise.runtime import Runtime

LossFn = Callable[[Any, Any], torch.Tensor]


class Strategy(ABC):
    """Base class; subclasses are small dataclasses holding the user's options."""

    @abstractmethod
    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """Return the distributed model. May issue collectives (e.g. the initial broadcast)."""

    @abstractmethod
    def make_optimizer(
        self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """Build the optimizer for the model `wrap` returned."""

    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The complete, unsharded state dict with single-process keys, on every rank."""

    def local_grads(self, model: nn.Module) -> list[torch.Tensor]:
        """The gradients this rank holds (all of them, or its shard)."""
        return [p.grad for p in model.parameters() if p.grad is not None]

    def grad_square_sum(self, model: nn.Module) -> torch.Tensor:
        """Σ g² over the whole (global) gradient, the same on every rank: what clipping needs.

        This default is for replicated gradients; strategies that shard them sum over ranks.
        """
        return square_sum(self.local_grads(model))

    # ---- the training loop's hooks: what changes when the model itself is split -------------
    def train_step(
        self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn
    ) -> torch.Tensor:
        """Forward, loss and backward for one batch; returns the (detached) loss. A pipeline
        runs its whole schedule here."""
        loss = self.adapt_loss(model, loss_fn)(model(inputs), targets)
        loss.backward()
        return loss.detach()

    def adapt_loss(self, model: nn.Module, loss_fn: LossFn) -> LossFn:
        """The loss to use on this model's outputs (tensor parallel: from vocabulary slices)."""
        return loss_fn

    def predict(self, model: nn.Module, output: torch.Tensor) -> torch.Tensor:
        """Predicted class per row of `output` (argmax over the last dimension)."""
        return output.argmax(-1)

    def data_shard(self, model: nn.Module) -> tuple[int, int]:
        """(replicas, index): how many different batches a step consumes, and which is ours.
        Ranks that split one model between them must see the same batch."""
        rt = runtime.current()
        return rt.world_size, rt.rank

    def checkpoint_shard(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
        """Layout and this rank's tensors for a sharded checkpoint (see `checkpoint.py`).

        This default is for replicated state: one unit per parameter, written by rank 0 alone.
        """
        named = list(model.module.named_parameters())
        layout = {
            "num_shards": 1,
            "strategy": type(self).__name__.lower(),
            "units": [{"params": [[n, list(p.shape)]]} for n, p in named],
        }
        if runtime.current().rank != 0:
            return layout, None
        tensors = buffer_tensors(model)
        for i, (_, p) in enumerate(named):
            tensors[f"unit{i}/param"] = p.detach().reshape(-1)
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    tensors[f"unit{i}/{key}"] = value.reshape(-1) if value.dim() else value
        return layout, tensors

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        params: dict[str, torch.Tensor],
        states: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """Take this strategy's part of full per-parameter tensors (any saved world size)."""
        load_buffers(model, params)
        with torch.no_grad():
            for name, p in model.module.named_parameters():
                p.copy_(params[name])
                optimizer.state[p] = {
                    k: (v.view_as(p) if v.dim() else v).clone().to(p.device)
                    for k, v in states.get(name, {}).items()
                }

    def close(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Release threads or groups the strategy created."""


def buffer_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Module buffers (replicated on every rank) for rank 0's checkpoint file."""
    return {f"buffer/{n}": b.detach() for n, b in model.module.named_buffers()}


@torch.no_grad()
def load_buffers(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, b in model.module.named_buffers():
        if name in tensors:
            b.copy_(tensors[name])


class UnsplitCheckpointsOnly:
    """For strategies that split the model itself: resumable sharded checkpoints are not
    written yet (saying so beats writing a wrong one); `full_state_dict` works."""

    def checkpoint_shard(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        raise NotImplementedError(
            f"sharded checkpoints of {type(self).__name__} models are not supported yet: "
            "save sw.full_state_dict(model) instead"
        )


def square_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    device = tensors[0].device if tensors else runtime.current().device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for t in tensors:
        total += t.detach().float().pow(2).sum()
    return total


class WrappedModel(nn.Module):
    """A strategy's model: forwards to `module`; its state dict has the unwrapped keys."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
