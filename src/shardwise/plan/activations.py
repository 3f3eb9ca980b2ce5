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

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._pytree import tree_leaves, tree_map_only

from shardwise.observe.memory import PeakMeter, is_weight, optimizer_tensors
from shardwise.optim import LAMB, LARS


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

    storages = []  # kept until the end, so that no address is reused for another storage

    def pack(t: torch.Tensor) -> None:
        if not is_weight(t) and t.numel():
            storage = t.untyped_storage()
            if storage._cdata not in counted:
                counted[storage._cdata] = storage.nbytes()
                storages.append(storage)
        # The tensor itself is not kept: no backward runs, and an op's output kept by its own
        # node is a reference cycle through autograd that the garbage collector cannot see.

    per_layer = []
    with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(pack, _unused):
        x = make_input()
        if dtype is not None:
            x = cast_floats(x, dtype)
        for module in modules:
            before = sum(counted.values())
            x = functional_call(module, fake_state(module, dtype), (x,))
            per_layer.append(sum(counted.values()) - before)
        if dtype is not None:
            x = cast_floats(x, torch.float32)
        if loss is not None:
            before = sum(counted.values())
            loss(x)
            per_layer[-1] += sum(counted.values()) - before
    return sum(counted.values()), per_layer


def cast_floats(value, dtype: torch.dtype):
    """Every floating-point tensor in `value` (a tensor, a dict batch, a model's output object)
    in `dtype`, as mixed precision's hooks cast inputs and outputs."""
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return tree_map_only(torch.Tensor, cast, value)


def _unused(_):
    raise AssertionError("saved_bytes runs no backward")


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


class TrainingPass(nn.Module):
    """Forward through some layers, the loss (or a sum) and backward, as one module call: so
    that `functional_call` keeps the fake parameters in place through backward, where
    checkpointed regions run their forward again. With `dtype`, float inputs are cast to it
    and the output back to fp32, as mixed precision's hooks do. With `with_backward` False, the
    forward and the loss only."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        loss_fn,
        dtype: torch.dtype | None = None,
        with_backward: bool = True,
    ):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.loss_fn, self.dtype, self.with_backward = loss_fn, dtype, with_backward

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.dtype is not None:
            x = cast_floats(x, self.dtype)
        for layer in self.layers:
            x = layer(x)
        if self.dtype is not None:
            x = cast_floats(x, torch.float32)
        loss = self.loss_fn(x, y) if self.loss_fn is not None else x.float().sum()
        if self.with_backward:
            loss.backward()


def backward_peak(
    model: nn.Module,
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dtype: torch.dtype | None = None,
    keep_grads: bool = True,
    emulation: Callable[[dict[str, nn.Parameter]], list] | None = None,
) -> int:
    """The most bytes one forward, loss and backward of `model` on `batch()` (inputs and
    targets, made in the fake mode) holds at once beyond the parameters and the batch
    (activations, the operators' temporaries, gradients): `PeakMeter` on fake tensors. With
    `keep_grads` False, each parameter's gradient is let go once accumulated (a strategy that
    moves it into a bucket or reduces it at once). `emulation(params)` installs a strategy's
    hooks on the fake parameters (by name) and returns handles to remove afterwards."""
    handles = []
    with FakeTensorMode():
        params = fake_state(model, dtype)
        x, y = batch()
        if emulation is not None:
            handles = emulation(params)
        elif not keep_grads:
            for p in params.values():
                if isinstance(p, nn.Parameter) and p.requires_grad:
                    p.register_post_accumulate_grad_hook(let_go)
        state = {f"layers.0.{k}": v for k, v in params.items()}
        meter = PeakMeter(alive=[*tree_leaves((x, y)), *state.values()])
        try:
            with meter:
                functional_call(TrainingPass([model], loss_fn, dtype), state, (x, y))
        finally:
            for handle in handles:
                handle.remove()
    return meter.peak - meter.start


def let_go(p: torch.Tensor) -> None:
    """A gradient hook: the gradient is moved elsewhere (a strategy's bucket) and let go."""
    p.grad = None


def optimizer_peak(numels: Sequence[int], optimizer: str, dtype=torch.float32) -> int:
    """The most bytes one optimizer step (not the first, which makes its state) over tensors of
    `numels` elements allocates at once beyond what exists before it."""
    return _optimizer_peak(tuple(numels), optimizer, dtype)


# (a function of its arguments alone, priced for each strategy and rank the planner weighs,
# which mostly step the same tensors: a step on fake tensors costs ~70 ms)
@functools.lru_cache(maxsize=256)
def _optimizer_peak(numels: tuple[int, ...], optimizer: str, dtype: torch.dtype) -> int:
    if not any(numels):
        return 0
    with FakeTensorMode():
        opt = stepped_optimizer(numels, optimizer, dtype)
        params = opt.param_groups[0]["params"]
        meter = PeakMeter(alive=[*params, *(p.grad for p in params), *optimizer_tensors(opt)])
        with meter:
            opt.step()
    return meter.peak - meter.start


def stepped_optimizer(
    numels: Sequence[int], optimizer: str, dtype: torch.dtype = torch.float32
) -> torch.optim.Optimizer:
    """An optimizer over parameters of `numels` elements, with gradients, stepped once so that
    its state exists (a later step is what every step costs). Call it in a fake mode."""
    cls = {
        "adamw": torch.optim.AdamW,
        "adam": torch.optim.Adam,
        "sgd": torch.optim.SGD,
        "lars": LARS,
        "lamb": LAMB,
    }
    kwargs = {"momentum": 0.9} if optimizer in ("sgd", "lars") else {}
    params = [nn.Parameter(torch.empty(n, dtype=dtype)) for n in numels if n]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = cls[optimizer](params, lr=1e-3, **kwargs)
    opt.step()
    return opt
