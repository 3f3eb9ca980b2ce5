"""The strategy interface every parallelism in shardwise implements.

A strategy is a transform: `wrap` turns a plain model into its distributed form, and
`make_optimizer` builds the optimizer over whatever that strategy lets this rank update (all
parameters for data parallel, one shard for ZeRO, ...). `full_state_dict` reassembles the
single-process state dict, so checkpoints and exports never depend on how training was split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from shardwise.runtime import Runtime


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

    def close(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Release threads or groups the strategy created."""
