"""Model-state memory accounting: bytes held in parameters, gradients and optimizer state.

Tensors are counted by their underlying storage, once: a gradient that is a view into a DDP
bucket costs nothing beyond the bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2) holds its shard locally
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # Scalar state (Adam's step counter) is included: it is real memory, if tiny.
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, extra: Iterable[torch.Tensor] = ()
) -> dict[str, int]:
    """Bytes per category, each storage counted once (in the first category that holds it)."""
    seen: set[int] = set()
    report: dict[str, int] = {}
    # The optimizer's parameters may be shards the model does not hold (ZeRO): where they are
    # not views of the model's parameters, they are master weights (the only persistent copy in
    # ZeRO-3; fp32 beside a bf16 compute copy under mixed precision).
    params = list(model.parameters())
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    categories = {
        "params": params,
        "master_weights": masters,
        "grads": [p.grad for p in (*params, *masters) if p.grad is not None],
        "optimizer": optimizer_tensors(optimizer),
        "buffers": list(extra),
    }
    for name, tensors in categories.items():
        storages = {k: v for k, v in _storages(tensors).items() if k not in seen}
        seen.update(storages)
        report[name] = sum(storages.values())
    report["total"] = sum(report.values())
    return report


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated on the GPU, or resident (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank bytes in parameters, gradients and optimizer state (master weights included
    where a strategy keeps them), and the process's peak. Call it after backward, before the
    step, to see the model state at its fullest."""
    report = model_state_bytes(model, optimizer)
    device = next(model.parameters()).device
    report["peak"] = peak_bytes(device)
    return report


def is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight transposed): weights, not
    activations."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class ActivationMeter:
    """Bytes autograd keeps alive for backward (the activations), now and at the peak.

    Inside `with meter:`, every tensor autograd saves for backward is wrapped; the wrapper counts
    its storage while alive (once per storage, however often it is saved) and uncounts it when
    the graph that holds it is freed, after that micro-batch's backward. Parameters and views of
    them are weights, not activations, and are not counted. It measures any schedule the same
    way, ours or torch's, on any device.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if is_weight(tensor) or tensor.numel() == 0:
            return tensor
        return _Saved(self, tensor)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _add(self, key: int, nbytes: int) -> None:
        entry = self._refs.setdefault(key, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def _remove(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._refs[key]

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.meter, self.tensor, self.key = meter, tensor, storage.data_ptr()
        meter._add(self.key, storage.nbytes())

    def __del__(self) -> None:
        self.meter._remove(self.key)
