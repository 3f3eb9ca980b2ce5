"""ZeRO on one rank: plain training, saved in ZeRO's layout.

A slice of one is the whole: there is nothing to shard, reduce or gather. What remains of ZeRO
at one rank is a cost, not a saving: the flat gradient buffer every backward copies its
gradients into so that the optimizer can step one flat slice (a pass over 23 MB a step for the
digits MLP, 14 % of its step). So, in fp32 with no offload and no codec, the optimizer steps
the parameters themselves (views of their units' buffers, as at any world size) with the
gradients autograd made, as plain torch does: no hook, no copy, the same bits.

Only the checkpoint sees the units: the optimizer's per-parameter state is laid end to end per
unit as it is saved (`checkpoint_shard`), the layout every world size and strategy reads back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.optim.layerwise import ParameterNorms
from shardwise.strategies.base import clear_grads, load_buffers, load_parameter, square_sum
from shardwise.strategies.zero.stage1 import ZeroStage1
from shardwise.strategies.zero.stage3 import ZeroStage3


class SoleRankStage1(ZeroStage1):
    """ZeRO stage 1 alone in the world, in fp32: its units, by size, only lay out its
    checkpoints."""

    def backward_buckets(self, order: list[int]) -> list[list[nn.Parameter]]:
        return []  # nothing to reduce: no hook on any parameter

    def prepare_units(self) -> None:
        pass  # gradients stay where autograd puts them: no unit gradient buffer

    def params(self) -> list[nn.Parameter]:
        return [p for unit in self.units for p in unit.params]

    def optimizer_params(self) -> list[nn.Parameter]:
        return self.params()

    def parameter_norms(self) -> ParameterNorms:
        return ParameterNorms.whole(self.optimizer_params())

    def grad_shards(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params() if p.grad is not None]

    def grad_square_sum(self) -> torch.Tensor:
        return square_sum(self.local_grads(), self.units[0].full.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.params(), set_to_none)

    def checkpoint_shard(
        self, optimizer: torch.optim.Optimizer, every_rank: bool = False
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """ZeRO's layout: each unit's parameters and optimizer state flat (a parameter the
        optimizer never stepped, having had no gradient, has zeros there)."""
        layout, tensors = super().checkpoint_shard(optimizer, every_rank)
        for i, unit in enumerate(self.units):
            states = [optimizer.state.get(p, {}) for p in unit.params]
            keys = dict.fromkeys(k for s in states for k, v in s.items() if torch.is_tensor(v))
            for key in keys:
                values = [s[key] for s in states if key in s]
                if values[0].dim() == 0:  # a scalar (Adam's step): the same for every parameter
                    tensors[f"unit{i}/{key}"] = values[0]
                    continue
                pieces = [
                    s.get(key, torch.zeros_like(p))
                    for s, p in zip(states, unit.params, strict=True)
                ]
                tensors[f"unit{i}/{key}"] = unit.flatten(pieces, values[0].dtype)
        return layout, tensors

    @torch.no_grad()
    def load_full_state(self, optimizer, params, states) -> None:
        # (the units' parameters only: a frozen one has no state in the optimizer)
        load_buffers(self.module, params)
        for p in self.params():
            name = self.names[p]
            load_parameter(optimizer, p, params[name], states.get(name, {}))


class SoleRankStage2(SoleRankStage1):
    """Stage 2 alone: stage 1's units; only its checkpoints' name differs."""

    stage = 2


class SoleRankStage3(SoleRankStage1):
    """Stage 3 alone: its units, one per block, only lay out its checkpoints."""

    stage = 3
    unit_params = ZeroStage3.unit_params


SOLE_RANK: dict[int, type[SoleRankStage1]] = {
    1: SoleRankStage1,
    2: SoleRankStage2,
    3: SoleRankStage3,
}
