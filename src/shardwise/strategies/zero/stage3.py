"""ZeRO stage 3: stage 2, with the parameters sharded too (the ZeRO paper's P_os+g+p).

Each block of the model (each element of an `nn.ModuleList` / `nn.Sequential`, and each other
child with parameters: `stage3_units`) is one unit. Its full parameters exist only while it
runs: all-gathered just before its forward and freed right after, gathered again when the
gradient of its output arrives in backward and freed once its gradient is reduce-scattered. The
next unit's gather is started before waiting on this one's (prefetch), so communication overlaps
compute. Memory with fp32 Adam: 16P/N plus one or two gathered units. Communication: two
all-gathers and one reduce-scatter per step, 1.5x what DDP sends.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.strategies.zero.stage2 import ZeroStage2
from shardwise.strategies.zero.units import FlatUnit


def stage3_units(model: nn.Module) -> list[nn.Module]:
    """Modules that become stage-3 units, in registration (≈ forward) order."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                visit(child)
            elif any(p.requires_grad for p in child.parameters()):
                units.append(child)

    visit(model)
    return units


def _check_recompute_regions(model: nn.Module, units: list[nn.Module]) -> None:
    """A recomputed region (activation checkpointing) must not hold a unit inside it: the
    unit's gather-and-free hooks would run again in the recompute, after its weights are freed."""
    for name, module in model.named_modules():
        if getattr(module.forward, "recomputes", False):
            inner = next((u for u in units if u is not module and _contains(module, u)), None)
            if inner is not None:
                raise ValueError(
                    f"activation_checkpointing: region {name!r} holds a ZeRO-3 unit; "
                    "checkpoint that unit, or modules inside it, instead"
                )


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


class ZeroStage3(ZeroStage2):
    stage = 3
    shard_is_view = False  # the full buffer is transient: the shard is the only lasting copy

    def unit_params(self, params: list[nn.Parameter], bucket_bytes: int) -> list[list]:
        """One unit per block; parameters outside every block form unit 0, gathered for the
        whole forward and backward."""
        self.unit_modules = stage3_units(self.module)
        _check_recompute_regions(self.module, self.unit_modules)
        covered = {p for m in self.unit_modules for p in m.parameters()}
        self.rest = [p for p in params if p not in covered]
        groups = [[p for p in m.parameters() if p.requires_grad] for m in self.unit_modules]
        return [self.rest, *groups] if self.rest else groups

    def prepare_units(self) -> None:
        offset = 1 if self.rest else 0
        if self.rest:
            gather_rest = self.module.register_forward_pre_hook(
                lambda *_: self._gather(0, prefetch=False)
            )
            self.hooks.append(gather_rest)
        for i, module in enumerate(self.unit_modules, start=offset):
            self.hooks += [
                module.register_forward_pre_hook(
                    lambda _m, _a, i=i: self._gather(i, prefetch=True)
                ),
                module.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out)),
            ]
        for u in self.units:
            u.free()

    def _gather(self, i: int, prefetch: bool, direction: int = 1) -> None:
        unit = self.units[i]
        unit.start_gather(self._compute_copy(self.shards[i]))
        nxt = i + direction
        if prefetch and 0 <= nxt < len(self.units):
            self.units[nxt].start_gather(self._compute_copy(self.shards[nxt]))
        unit.wait_gather()

    def _after_forward(self, i: int, output: Any) -> Any:
        if torch.is_grad_enabled():
            tensors = output if isinstance(output, (tuple, list)) else (output,)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, i=i: self._gather(i, prefetch=True, direction=-1))
        self.units[i].free()
        return output

    def _launch(self, index: int) -> None:
        super()._launch(index)
        self.units[index].free()  # its backward is done: the gathered weights can go

    def gather_parameters(self) -> None:
        pass  # gathered on demand, unit by unit, in the next forward

    def take_full_params(self, unit: FlatUnit, full: torch.Tensor) -> None:
        pass  # the shard is the only copy: nothing else to update
