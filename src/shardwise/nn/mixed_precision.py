"""Mixed precision: low-precision compute over fp32 master weights, and dynamic loss scaling.

Compute (forward, backward, gradient communication) runs in bf16 or fp16; the optimizer keeps
fp32 master weights and steps them (Micikevicius et al., "Mixed Precision Training", ICLR 2018).
fp16's narrow range needs loss scaling: gradients are computed for `loss * scale` so small values
do not flush to zero, divided by `scale` before the step, and a step whose gradients overflowed
(inf/NaN on any rank) is skipped while the scale halves; after `growth_interval` good steps it
doubles again.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from shardwise import comm

DTYPES = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str | None) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"mixed_precision must be None, 'bf16' or 'fp16', got {name!r}")
    return DTYPES[name]


class LossScaler:
    """Dynamic loss scale shared by all ranks (they agree on overflow through one all-reduce).

    The flag is reduced over the whole job, on `device` (NCCL reduces only GPU tensors, and
    offloaded gradients sit on the CPU): on a device mesh, the model's other slices must skip
    the same step."""

    def __init__(
        self, device: torch.device, init_scale: float = 2.0**16, growth_interval: int = 2000
    ) -> None:
        self.device = device
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps: list[int] = []
        self.steps = 0

    def found_overflow(self, grads: list[torch.Tensor]) -> bool:
        local = any(not torch.isfinite(g).all() for g in grads)
        flag = torch.tensor([1.0 if local else 0.0], device=self.device)
        comm.all_reduce(flag, group=None, op=torch.distributed.ReduceOp.MAX)  # the whole job
        return bool(flag.item())

    def after_step(self, overflow: bool) -> None:
        """Back off on overflow (the step was skipped), grow after a run of good steps."""
        if overflow:
            self.skipped_steps.append(self.steps)
            self.scale /= 2
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2
        self.steps += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        # (skipped_steps is a record of the past: no later step depends on it)
        return {
            "scale": torch.tensor(self.scale, dtype=torch.float64),
            "good_steps": torch.tensor(self.good_steps),
            "steps": torch.tensor(self.steps),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.steps = int(state["good_steps"]), int(state["steps"])


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors anywhere in `value` in `dtype`; containers keep their type (a
    Hugging Face ModelOutput stays one, its `.loss` still there)."""
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return tree_map_only(torch.Tensor, cast, value)


class _ScaledGradient(torch.autograd.Function):
    """The tensors in fp32, new ones (a copy of one in fp32 already: a view made here could
    not be changed in place); on the way back, each gradient times the loss scale, in the
    tensor's own dtype."""

    @staticmethod
    def forward(ctx, scaler: LossScaler, *tensors: torch.Tensor):
        ctx.scaler, ctx.dtypes = scaler, [t.dtype for t in tensors]
        return tuple(t.clone() if t.dtype == torch.float32 else t.float() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        scale = ctx.scaler.scale
        pairs = zip(grads, ctx.dtypes, strict=True)
        return None, *(None if g is None else (g * scale).to(d) for g, d in pairs)


def install_casts(model: nn.Module, dtype: torch.dtype, scaler: LossScaler | None) -> list:
    """Inputs enter in `dtype`; outputs leave in fp32, and with a scaler their gradient is
    multiplied by the loss scale on its way back (so `loss.backward()` needs no change)."""

    def cast_inputs(_module, args, kwargs):
        return _cast_floats(args, dtype), _cast_floats(kwargs, dtype)

    def cast_outputs(_module, _args, output):
        if scaler is None:
            return _cast_floats(output, torch.float32)
        # Every output that carries a gradient back, not only a tensor's: a Hugging Face model
        # returns an object (its own loss, its logits) and backward starts from either. Each
        # leaves as a new fp32 tensor whose gradient is scaled: one output made from another
        # inside the model (an auxiliary loss added into the loss) is scaled once on that
        # path, not twice as a hook on each would (scale squared).
        leaves = {id(t): t for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
        tracked = [t for t in leaves.values() if t.requires_grad and t.is_floating_point()]
        scaled = dict(zip(map(id, tracked), _ScaledGradient.apply(scaler, *tracked), strict=True))
        output = tree_map_only(torch.Tensor, lambda t: scaled.get(id(t), t), output)
        return _cast_floats(output, torch.float32)  # (the rest: no gradient to scale)

    return [
        model.register_forward_pre_hook(cast_inputs, with_kwargs=True),
        model.register_forward_hook(cast_outputs),
        *FrozenInComputeDtype(model, dtype).hooks,
    ]


class FrozenInComputeDtype:
    """Frozen floating-point parameters take part in the forward in the compute dtype, as the
    trainable ones' compute copies do (FSDP2's policy casts every parameter it manages); the
    module keeps its own, in their dtype, for its state, checkpoints and exports. A copy is
    swapped in as a forward begins and the parameter back as it ends (raised or not): the
    model's (every use inside it, a parent's of its child's weight too), and each owning
    module's (a region recomputed in backward runs its modules outside the model's forward).
    The outermost of nested calls swaps. A copy is made again once its parameter changed (a
    load, a new tensor), and a parameter that trains again is no longer swapped."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.owned: dict[nn.Module, list[str]] = {}
        for module in model.modules():
            names = [
                name
                for name, p in module._parameters.items()
                if p is not None
                and not p.requires_grad
                and p.is_floating_point()
                and p.dtype != dtype
            ]
            if names:
                self.owned[module] = names
        # the parameter a copy was made of, its storage and version when made, and the copy
        self.copies: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}
        self.depth: dict[nn.Module, int] = {}  # forwards of a module under way (nested)
        self.swapped: dict[nn.Module, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        self.hooks: list = []
        for module in dict.fromkeys([model, *self.owned]) if self.owned else ():
            self.hooks.append(module.register_forward_pre_hook(self._swap_in))
            self.hooks.append(module.register_forward_hook(self._swap_back, always_call=True))

    def _swap_in(self, module: nn.Module, _args) -> None:
        self.depth[module] = self.depth.get(module, 0) + 1
        if self.depth[module] > 1:  # (called inside itself: its outermost call swapped)
            return
        owners = self.owned if module is self.model else {module: self.owned[module]}
        done = []
        for owner, names in owners.items():
            for name in names:
                param = owner._parameters[name]
                # (a copy in place already: an enclosing call's; or a parameter that trains)
                if isinstance(param, nn.Parameter) and not param.requires_grad:
                    owner._parameters[name] = self._copy(param)
                    done.append((owner, name, param))
        self.swapped[module] = done

    def _swap_back(self, module: nn.Module, _args, _output) -> None:
        self.depth[module] -= 1
        if self.depth[module] == 0:
            for owner, name, param in self.swapped.pop(module):
                owner._parameters[name] = param

    @torch.no_grad()
    def _copy(self, param: nn.Parameter) -> torch.Tensor:
        made = self.copies.get(id(param))
        now = (param.data_ptr(), param._version)
        if made is None or made[0]() is not param or made[1:3] != now:
            copy = param.detach().to(self.dtype)
            self.copies[id(param)] = (weakref.ref(param), *now, copy)
            return copy
        return made[3]
