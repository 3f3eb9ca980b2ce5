"""Predicted activation memory: the bytes autograd would save in a forward pass, found by running
that forward on fake tensors (torch's FakeTensorMode: shapes, dtypes and devices, no data, no
compute), so the kernels chosen, and what they save, are those of the real run.

The model runs with data-less CPU stand-ins for its parameters, on a fake batch of the given
shape, and every tensor autograd saves is counted once per storage,
parameters excepted: the figure the `ActivationMeter` measures in a real step. Regions under
activation checkpointing count their inputs only, as in the real run; the recompute's working
set, alive during one region's backward, is not part of that figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from shardwise.memory import is_weight


def saved_bytes(
    layers: Sequence[nn.Module] | nn.Module,
    make_input: Callable[[], torch.Tensor],
    dtype: torch.dtype | None = None,
    loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[int, list[int]]:
    """Bytes saved for backward by one forward of `layers` (a module, or modules applied in
    turn) on `make_input()` (built inside the fake mode), computing in `dtype` (default: the
    parameters' own, with float inputs cast to it and the output cast back to fp32, as mixed
    precision's hooks do); `loss` maps the output to a loss whose own saved tensors count too.
    Returns the total and the bytes each layer adds."""
    modules = [layers] if isinstance(layers, nn.Module) else list(layers)
    counted: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_weight(t) and t.numel():
            storage = t.untyped_storage()
            counted.setdefault(storage._cdata, storage.nbytes())
        return t

    per_layer = []
    with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = make_input()
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        for module in modules:
            before = sum(counted.values())
            x = functional_call(module, fake_state(module, dtype), (x,))
            per_layer.append(sum(counted.values()) - before)
        if dtype is not None:
            x = x.float()
        if loss is not None:
            before = sum(counted.values())
            loss(x)
            per_layer[-1] += sum(counted.values()) - before
    return sum(counted.values()), per_layer


def fake_state(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Data-less CPU stand-ins for `module`'s parameters (in `dtype`) and buffers, called in the
    fake mode. The module itself runs (functional_call swaps them in for the call), so patched
    forwards, such as activation checkpointing's, run as they will in training."""
    state: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        fake = torch.empty(p.shape, dtype=dtype or p.dtype, device="cpu")
        state[name] = nn.Parameter(fake, requires_grad=p.requires_grad)
    for name, b in module.named_buffers():
        state[name] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    return state
