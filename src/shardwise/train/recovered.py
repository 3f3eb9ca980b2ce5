"""The state an elastic job's rebuilt run goes on from (`elastic.py` gathers it, `build.py`
takes it instead of a checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    policy: dict[str, Any]  # the non-finite policy's state (its streak, the steps skipped)
