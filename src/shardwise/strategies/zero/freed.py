"""What a ZeRO-3 parameter is while its unit is not gathered: a `FreedParameter`.

Between a unit's forward (or backward) and its next gather, its parameters are views of a
buffer whose storage has been released. Any computation on them would read nothing (torch
reports it as "setStorage: ... out of bounds for storage of size 0", naming no parameter).
So while freed, each parameter's class is `FreedParameter`: its metadata (shape, dtype, device,
`requires_grad`, `.grad`, hashing) stays readable, which is what code such as Hugging Face's
`model.dtype` reads, and any computation is a one-line error naming the parameter and its unit.
Gathering gives the parameter its own class back, so a gathered parameter costs nothing extra.

FSDP2 gets the same safety from DTensor (a sharded parameter outside forward is a DTensor);
DeepSpeed from a `ds_status` flag it checks in its own hooks only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Tensor methods that read metadata only (what a freed parameter may still answer).
_METADATA = {
    "__hash__", "dim", "element_size", "is_complex", "is_contiguous", "is_floating_point",
    "ndimension", "nelement", "numel", "size", "storage_offset", "stride", "data_ptr",
    "untyped_storage", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
    "get_device", "type",
}  # fmt: skip


class FreedParameter(nn.Parameter):
    """A ZeRO-3 parameter whose unit is not gathered (see the module's docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        with torch._C.DisableTorchFunctionSubclass():
            if name in ("__get__", "__set__", "__delete__") or name in _METADATA:
                return func(*args, **(kwargs or {}))
            freed = next(
                a for a in _tensors(args, kwargs) if isinstance(a, FreedParameter) and a is not None
            )
            if name == "__repr__":
                return f"FreedParameter(shape={tuple(freed.shape)}, not gathered)"
            param, unit, _ = freed.zero3_owner
        raise RuntimeError(
            f"ZeRO-3: parameter {param!r} ({tuple(freed.shape)}) used by {name or func} while "
            f"its unit {unit!r} is not gathered: it is read outside the forward of the module "
            "that holds it (read full weights with model.full_state_dict())"
        )


def _tensors(args: Any, kwargs: dict | None) -> list:
    flat = list(args) + list((kwargs or {}).values())
    out = []
    for a in flat:
        if isinstance(a, (list, tuple)):
            out += list(a)
        else:
            out.append(a)
    return out


def own(params: list[nn.Parameter], names: list[str], unit: str) -> None:
    """Record on each parameter its name, its unit and its own class (for the error that names
    them, and to give the class back)."""
    for p, name in zip(params, names, strict=True):
        p.zero3_owner = (name, unit, type(p))


def disown(params: list[nn.Parameter]) -> None:
    """The strategy is closed: every parameter keeps its own class, and nothing of ours."""
    for p in params:
        mark_gathered(p)
        del p.zero3_owner


def mark_freed(p: nn.Parameter) -> None:
    p.__class__ = FreedParameter


def mark_gathered(p: nn.Parameter) -> None:
    p.__class__ = p.zero3_owner[2]
