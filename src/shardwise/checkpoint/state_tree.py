"""A training state (nested dicts, lists and tuples of tensors and plain values) as tensors plus
JSON: what run checkpoints and parameter-server snapshots write, so that reading one back
unpickles nothing. `split` moves every tensor into a flat dict (for safetensors) and leaves a
JSON tree that names them; `join` puts them back."""

from __future__ import annotations

from typing import Any

import torch


def split(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` with every tensor moved into `tensors` (replaced by {"tensor": key})."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": prefix}
    if isinstance(value, dict):
        return {"dict": [[k, split(v, f"{prefix}/{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"cannot save a {type(value).__name__} at {prefix}")


def join(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `split` (`ValueError` for a tree it did not write)."""
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"malformed node: a {type(node).__name__}, not one kind and its value")
    ((kind, value),) = node.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {k: join(v, tensors) for k, v in value}
    if kind in ("list", "tuple"):
        items = [join(v, tensors) for v in value]
        return tuple(items) if kind == "tuple" else items
    if kind != "value":
        raise ValueError(f"unknown node {kind!r}")
    return value
