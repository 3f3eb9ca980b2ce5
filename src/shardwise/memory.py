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
