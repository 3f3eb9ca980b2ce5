"""Learning-rate schedules: a multiplier of the base learning rate for each optimizer step.

    constant     1
    step         gamma ** (s // step_size)            (torch's StepLR)
    exponential  gamma ** s                           (torch's ExponentialLR)
    cosine       m + (1 - m) (1 + cos(pi s / T)) / 2  (torch's CosineAnnealingLR, eta_min = m lr)

where s counts the steps after a linear warm-up of `warmup_steps` (whose step i, from 0, runs
at (i + 1) / warmup_steps of the rate) and T is the number of steps after it. Each is one closed
formula, so a resumed run's schedule is the same function of the step, with nothing to carry
but the step (torch's chainable schedulers multiply step by step, and drift from it).

`lr_scheduler` returns a plain `torch.optim.lr_scheduler.LambdaLR`: usable with any optimizer,
saved and loaded with its `state_dict`, as in any torch loop. `scaled_lr` is the linear scaling
rule (Goyal et al., 2017): the rate grows with the global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardwise.arguments import finite_number, whole_number

SCHEDULES = ("constant", "step", "exponential", "cosine")
DEFAULT_GAMMA = {"step": 0.1, "exponential": 0.98}  # per step_size steps; per step


@dataclass(frozen=True)
class Schedule:
    """A learning-rate multiplier as a function of the step (0 = the first)."""

    name: str = "constant"
    total_steps: int = 1
    warmup_steps: int = 0
    step_size: int = 100  # step: steps between decays
    gamma: float | None = None  # step, exponential: the decay factor (default: DEFAULT_GAMMA)
    min_ratio: float = 0.0  # cosine: the floor, a fraction of the base rate

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.name!r}")
        whole_number("schedule total_steps", self.total_steps, least=1)
        whole_number("schedule warmup_steps", self.warmup_steps)  # (2.5: multipliers past 1)
        whole_number("schedule step_size", self.step_size, least=1)
        if self.gamma is not None and not 0 < self.gamma <= 1:
            raise ValueError(f"schedule gamma must be in (0, 1], got {self.gamma}")
        if self.gamma is not None and self.name not in DEFAULT_GAMMA:  # (ignored: a typo?)
            raise ValueError(
                f"schedule gamma decays 'step' and 'exponential' schedules, not {self.name!r}"
            )
        if not 0 <= self.min_ratio <= 1:
            raise ValueError(f"schedule min_ratio must be in [0, 1], got {self.min_ratio}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        s = step - self.warmup_steps
        gamma = self.gamma if self.gamma is not None else DEFAULT_GAMMA.get(self.name, 1.0)
        if self.name == "step":
            return gamma ** (s // self.step_size)
        if self.name == "exponential":
            return gamma**s
        if self.name == "cosine":
            progress = min(1.0, s / max(1, self.total_steps - self.warmup_steps))
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0


def lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: Schedule | str = "constant", **options
) -> torch.optim.lr_scheduler.LambdaLR:
    """A torch scheduler following `schedule` (a `Schedule`, or its name and options), e.g.
    `lr_scheduler(opt, "cosine", total_steps=1000, warmup_steps=100, min_ratio=0.1)`."""
    if isinstance(schedule, str):
        schedule = Schedule(schedule, **options)
    elif options:
        raise TypeError("options go with a schedule's name, not with a Schedule")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def scaled_lr(lr: float, global_batch: int, base_batch: int) -> float:
    """The linear scaling rule: `lr` was right for `base_batch` samples per step; a global
    batch k times larger takes a k times larger rate (with a warm-up, as its authors advise)."""
    finite_number("lr", lr, above=0)
    whole_number("global_batch", global_batch, least=1)
    whole_number("base_batch", base_batch, least=1)
    return lr * global_batch / base_batch
