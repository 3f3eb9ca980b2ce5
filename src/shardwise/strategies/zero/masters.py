"""What ZeRO's optimizer steps: this rank's slice of the compute buffer itself, or fp32 master
weights beside it (mixed precision, offload). One object, chosen once, composed into the stage.

`ShardViews`: no second copy. Stages 1/2 step a view of the unit's buffer, so stepping updates
the model; stage 3 steps a clone, the only persistent copy of the slice.

`FP32Masters`: fp32 master slices (Micikevicius et al., ICLR 2018), in host memory when
offloaded, beside a compute copy in bf16/fp16 (or fp32 with offload alone). Gradients arrive in
the compute dtype, are divided by the loss scale (fp16) and accumulate in fp32; a step whose
gradients overflowed on any rank is skipped while the scale backs off.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.nn.mixed_precision import LossScaler, compute_dtype, install_casts
from shardwise.strategies.zero.units import FlatUnit, Place


class ShardViews:
    """The optimizer steps the compute buffer's slices directly."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.compute_dtype = dtype

    def make_shard(self, unit: FlatUnit, view: bool, place: Place | None = None) -> nn.Parameter:
        """`place`: what makes the zeroed buffer a shard that is no view is copied into (its
        numel, dtype, device), where not any tensor (stage 3's, in shared memory)."""
        own = unit.own_values()
        # (values read from a source are this rank's alone already, and placed: no copy)
        if view or unit.initial is not None:
            return nn.Parameter(own)
        if place is None:
            return nn.Parameter(own.clone())
        return nn.Parameter(place(own.numel(), own.dtype, own.device).copy_(own))

    def take_grad(self, unit: FlatUnit, shard: nn.Parameter, keep_full: bool) -> None:
        """The reduced slice becomes the shard's gradient."""
        if keep_full:  # gradients stay views of the persistent buffer (4P + 4P + 8P/N)
            if shard.grad is not None:
                raise RuntimeError(
                    "ZeRO stage 1 reduces once per step: accumulate gradients over several "
                    "backwards inside model.no_sync() (all but the last; sw.train_step(..., "
                    "accumulate=K) does), or use stage 2; and call optimizer.zero_grad() after "
                    "each step"
                )
            own = unit.own(unit.grad_full)
            if own.data_ptr() != unit.reduced.data_ptr():  # (a slice of one: reduced in place)
                own.copy_(unit.reduced)
            shard.grad = own
        else:
            add_grad(shard, unit.reduced)

    def step_allowed(self, grads: list[torch.Tensor]) -> bool:
        return True

    def install(self, model: nn.Module) -> list:
        return []  # no hooks: the model computes in its own dtype

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class FP32Masters:
    """fp32 master slices on `device`, a compute copy in `mixed_precision` (None: fp32)."""

    def __init__(
        self, mixed_precision: str | None, device: torch.device | None, scaler_device
    ) -> None:
        self.compute_dtype = compute_dtype(mixed_precision)
        self.mixed = mixed_precision is not None
        self.device = device
        self.scaler = LossScaler(scaler_device) if mixed_precision == "fp16" else None

    def make_shard(self, unit: FlatUnit, view: bool, place: Place | None = None) -> nn.Parameter:
        # (never placed: a master is not what the ranks gather)
        if self.mixed:
            master = unit.master_init
        else:  # (values read from a source are this rank's alone already: no copy)
            master = unit.own_values() if unit.initial is not None else unit.own_values().clone()
        return nn.Parameter(master.to(self.device or master.device))

    def take_grad(self, unit: FlatUnit, shard: nn.Parameter, keep_full: bool) -> None:
        # (a slice of the full buffer itself, which stage 1 zeroes below: a copy then)
        aliased = keep_full and shares_storage(unit.reduced, unit.grad_full)
        reduced = unit.reduced.to(shard.device, shard.dtype, copy=aliased)
        if self.scaler is not None:
            reduced.div_(self.scaler.scale)
        add_grad(shard, reduced)
        if keep_full:  # reduced into the master: the next backward starts at zero
            unit.grad_full.zero_()

    def step_allowed(self, grads: list[torch.Tensor]) -> bool:
        """False on an fp16 overflow on any rank (the step is skipped, the scale halves)."""
        if self.scaler is None:
            return True
        overflow = self.scaler.found_overflow(grads)
        self.scaler.after_step(overflow)
        return not overflow

    def install(self, model: nn.Module) -> list:
        """The hooks that cast inputs and outputs (and scale the loss's gradient)."""
        return install_casts(model, self.compute_dtype, self.scaler) if self.mixed else []

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state)


def add_grad(shard: nn.Parameter, grad: torch.Tensor) -> None:
    shard.grad = grad if shard.grad is None else shard.grad.add_(grad)


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
