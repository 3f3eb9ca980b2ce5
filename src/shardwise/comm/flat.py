"""Flat buffers: many tensors laid end to end as one, and a length cut into near-equal parts.

Collectives move one contiguous buffer per call, so every strategy flattens: buckets of
gradients (DDP), units of parameters (ZeRO), replicas to average (local SGD, gossip), shards of
a parameter server. These are the two helpers they share.
"""

from __future__ import annotations

import torch


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors' values end to end in one new 1-D tensor (in `dtype`, if given)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return flat if dtype is None else flat.to(dtype)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like each of `like`, in order (the inverse of `flatten`)."""
    pieces = flat[: sum(t.numel() for t in like)].split([t.numel() for t in like])
    return [piece.view(t.shape) for piece, t in zip(pieces, like, strict=True)]


def split_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each part of `size` items; the first `size % parts` parts get one more."""
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
