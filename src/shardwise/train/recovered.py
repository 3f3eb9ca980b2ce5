"""The state an elastic job's rebuilt run goes on from (`elastic.py` gathers it, `build.py`
takes it instead of a checkpoint)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Recovered:
    """The state a rebuilt run goes on from (`build(..., recovered=)`)."""

    step: int  # steps done
    params: dict[str, torch.Tensor]
    states: dict[str, dict[str, torch.Tensor]]
    scheduler: dict[str, Any]
    data: dict[str, Any]
    rng: dict[str, Any] | None  # None: a new member (generators of its own)
    global_replicas: int  # the ranks the job started with: its global batch and learning rate


def fresh_generators(step: int, rank: int) -> None:
    """A new member's generators: its own, not a copy of another rank's."""
    seed = 1_000_003 * step + rank
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
