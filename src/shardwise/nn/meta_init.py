"""Models whose parameters do not exist yet: built on the meta device, filled from a source.

A model too large for one process's memory is built with its parameters on the meta device
(shapes only) inside `empty_parameters()`; buffers stay real (they are small, and some, such
as rotary frequencies, are computed by the constructor and saved nowhere). A
`ParameterSource` then gives each rank only the values it keeps: ZeRO-3 reads its flat slice of
each unit (`read_flat`), tensor parallel its slice of each split weight (`read_slice`), a
pipeline stage its own layers' tensors, a replicated strategy the whole tensors (`materialize`).

    with sw.empty_parameters():
        model = AutoModelForCausalLM.from_config(config)
    model, opt = sw.prepare(model, sw.ZeRO(stage=3), source=sw.HFWeights("llama-dir"))

This is accelerate's `init_empty_weights(include_buffers=False)` and torchtitan's meta-device
init, with the weights read straight into the shards rather than materialised whole first.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class ParameterSource(Protocol):
    """Where a meta-device model's values come from (a checkpoint directory, an initialiser).
    Names are the model's `state_dict` names; values come in the source's dtype.

    A source may also have `read_slice(name, dim, start, stop)`, indices start..stop of `name`
    along `dim` (what a tensor-parallel rank keeps of a weight split by columns); `read_slice`
    below falls back on `read_flat` or `read` where it has none."""

    def __contains__(self, name: str) -> bool: ...

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        ...

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements start..stop of `name` flattened (row-major), as a 1-D tensor."""
        ...


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device (no memory); buffers are
    made as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Every buffer onto `device` (`module.to` would try to copy the meta parameters too)."""
    for m in module.modules():
        for key, b in m._buffers.items():
            if b is not None:
                m._buffers[key] = b.to(device)


def swap_parameters(module: nn.Module, make) -> None:
    """Replace each parameter `p` by `make(name, p)` wherever the model holds it (a tied
    parameter stays one parameter: every holder gets the same new one)."""
    new: dict[nn.Parameter, nn.Parameter] = {}
    names = {p: n for n, p in module.named_parameters()}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is not None:
                if p not in new:
                    new[p] = make(names[p], p)
                m._parameters[key] = new[p]


def placeholders(module: nn.Module, device: torch.device) -> None:
    """Meta parameters become parameters on `device` that hold no memory yet (a strategy
    that shards them points them into its own buffers)."""

    def placeholder(_name: str, p: nn.Parameter) -> nn.Parameter:
        if not p.is_meta:
            return p
        value = torch.empty(p.shape, dtype=p.dtype, device=device)
        value.untyped_storage().resize_(0)  # never touched: the allocation costs nothing
        return nn.Parameter(value, requires_grad=p.requires_grad)

    swap_parameters(module, placeholder)


def _checked(name: str, value: torch.Tensor, like: torch.Tensor | torch.Size) -> torch.Tensor:
    shape = tuple(like.shape if isinstance(like, torch.Tensor) else like)
    if tuple(value.shape) != shape:
        raise ValueError(
            f"source tensor {name!r} has shape {tuple(value.shape)}, the model's {shape}"
        )
    return value


@torch.no_grad()
def materialize(module: nn.Module, source: ParameterSource, device: torch.device) -> None:
    """Every meta parameter read whole from `source` (and every persistent buffer it holds)."""

    swap_parameters(module, lambda name, p: read_whole(p, name, source, device))
    load_buffers_from(module, source)


def read_whole(
    p: nn.Parameter, name: str, source: ParameterSource, device: torch.device | None = None
) -> nn.Parameter:
    """`p` itself where it holds values; else a parameter of its shape read from `source`."""
    if not p.is_meta:
        return p
    if name not in source:
        raise ValueError(f"the source has no tensor {name!r} for the model's parameter")
    value = _checked(name, source.read(name), p).to(device or "cpu", p.dtype)
    return nn.Parameter(value, requires_grad=p.requires_grad)


def read_slice(
    source: ParameterSource, name: str, shape: torch.Size, dim: int, start: int, stop: int
) -> torch.Tensor:
    """Indices start..stop along `dim` of the tensor `name` (whole: `shape`): by the source's
    own `read_slice` where it has one; by `read_flat` where they are one run of the flattened
    tensor (only size-1 dimensions before `dim`: a split by rows); else the whole tensor of
    this one parameter, read and cut."""
    if name not in source:
        raise ValueError(f"the source has no tensor {name!r} for the model's parameter")
    part = torch.Size((*shape[:dim], stop - start, *shape[dim + 1 :]))
    if hasattr(source, "read_slice"):
        return _checked(name, source.read_slice(name, dim, start, stop), part)
    if math.prod(shape[:dim]) == 1:
        inner = math.prod(shape[dim + 1 :])
        values = source.read_flat(name, start * inner, stop * inner)
        if values.numel() != part.numel():
            raise ValueError(f"source tensor {name!r} is smaller than the model's parameter")
        return values.reshape(part)
    return _checked(name, source.read(name), shape).narrow(dim, start, stop - start).clone()


@torch.no_grad()
def load_buffers_from(
    module: nn.Module, source: ParameterSource, within: nn.Module | None = None
) -> None:
    """Persistent buffers the source holds (BatchNorm statistics); others stay as built. With
    `within` (a part of `module`), only the buffers that part holds."""
    persistent = module.state_dict(keep_vars=True)
    kept = None if within is None else {id(b) for b in within.buffers()}
    for name, b in module.named_buffers():
        if kept is not None and id(b) not in kept:
            continue
        if name in persistent and name in source:
            b.copy_(_checked(name, source.read(name), b))


def read_range(
    source: ParameterSource, names: list[str], numels: list[int], start: int, stop: int
) -> list[tuple[int, torch.Tensor]]:
    """The parts of elements start..stop of the parameters `names` laid end to end (a flat
    unit): (offset in the range, values) for each parameter the range overlaps."""
    parts, offset = [], 0
    for name, n in zip(names, numels, strict=True):
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            if name not in source:
                raise ValueError(f"the source has no tensor {name!r} for the model's parameter")
            values = source.read_flat(name, lo - offset, hi - offset)
            if values.numel() != hi - lo:
                raise ValueError(f"source tensor {name!r} is smaller than the model's parameter")
            parts.append((lo - start, values.reshape(-1)))
        offset += n
    return parts
