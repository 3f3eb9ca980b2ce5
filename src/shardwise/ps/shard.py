"""A server's shard: its range of the model's flat parameters, the optimizer over it, and the
arithmetic of one update (an optimizer step on a gradient, or the averaging rule's blend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.comm.flat import flatten
from shardwise.optim.layerwise import LayerwiseOptimizer
from shardwise.ps.sharding import flat_values, plan_shards, trainable
from shardwise.ps.snapshots import SnapshotError, first_line


class Shard:
    """Server `rank`'s part of `model`'s trainable parameters (of `servers` parts in all), with
    an optimizer over it (none when the part is empty)."""

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        servers: int,
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
    ) -> None:
        if issubclass(optimizer_cls, LayerwiseOptimizer):
            raise ValueError(
                f"{optimizer_cls.__name__} needs each parameter's norm, and a parameter server "
                "steps a flat range of them: use a data-parallel strategy, or another optimizer"
            )
        plan = plan_shards(model, servers)
        self.bounds = plan.bounds[rank]
        mine = plan.split(flat_values(trainable(model)))[rank]
        self.params = [nn.Parameter(mine.clone())] if mine.numel() else []
        self.numels = [p.numel() for p in self.params]
        self.optimizer = optimizer_cls(self.params, **optimizer_kwargs) if self.params else None
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    @property
    def numel(self) -> int:
        """How many values the shard holds."""
        return sum(self.numels)

    def values(self) -> torch.Tensor:
        """The shard as one flat tensor (what a pull is answered with)."""
        return flatten(self.params)

    def final(self) -> torch.Tensor:
        """The shard's values, flat and detached (empty for an empty shard)."""
        return torch.cat([p.detach().reshape(-1) for p in self.params] or [torch.zeros(0)])

    @torch.no_grad()
    def average(self, flat: torch.Tensor, beta: float) -> None:
        """The averaging rule: `new = beta * shard + (1 - beta) * flat`."""
        for p, worker_value in zip(self.params, flat.split(self.numels), strict=True):
            p.mul_(beta).add_(worker_value.view_as(p), alpha=1 - beta)

    @torch.no_grad()
    def step(self, flat: torch.Tensor, lr_scale: float) -> None:
        """One optimizer step on the gradient `flat`, at `lr_scale` times the base rates."""
        if self.optimizer is None:
            return
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = lr * lr_scale
        for p, g in zip(self.params, flat.split(self.numels), strict=True):
            p.grad = g.view_as(p).clone()
        with torch.enable_grad():
            self.optimizer.step()
        self.optimizer.zero_grad()

    def state(self) -> dict[str, Any]:
        """What a snapshot holds of the shard: its bounds, values and optimizer state."""
        return {
            "bounds": list(self.bounds),
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
        }

    @torch.no_grad()
    def load(self, state: dict[str, Any], path: Path) -> None:
        """Take the values and optimizer state of a checked snapshot (read from `path`);
        `SnapshotError` if its optimizer state does not load."""
        for p, value in zip(self.params, state["params"], strict=True):
            p.copy_(value)
        if self.optimizer and state["optimizer"]:
            try:
                self.optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                why = first_line(e)
                raise SnapshotError(f"{path}: its optimizer state does not load ({why})") from None
