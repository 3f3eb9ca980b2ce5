"""Non-finite losses and gradients: how they are found, and the exit code of a run they stop."""

from __future__ import annotations

import torch

EXIT_NONFINITE = 4  # every rank's exit code when the non-finite policy stops the run


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether every element of `tensors` is finite, as a tensor. A tensor's least and greatest
    elements are finite exactly when all are (aminmax propagates NaN; unlike a norm, it cannot
    overflow), and one reduction reading each tensor once is 12x faster on a CPU than
    `isfinite(t).all()`, which writes a mask as large as the tensor and reads it again (1.6M
    fp32 gradients: 0.28 against 3.5 ms). The step-time model prices it on fake gradients."""
    extremes = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    return torch.cat(extremes).isfinite().all() if extremes else torch.tensor(True)
