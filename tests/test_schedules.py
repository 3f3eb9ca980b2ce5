"""Learning-rate schedules: each equals its formula, and torch's own scheduler, at sampled steps."""

from __future__ import annotations

import math

import pytest
import torch

import shardwise as sw
from shardwise.config import load_config
from shardwise.jobs import base_lr

LR, TOTAL = 0.5, 300
SAMPLED = [0, 1, 7, 49, 50, 51, 99, 100, 150, 211, 299]


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    """The rate each of `steps` optimizer steps runs at."""
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)


FORMULAS = {
    "constant": lambda s: LR,
    "step": lambda s: LR * 0.3 ** (s // 50),
    "exponential": lambda s: LR * 0.99**s,
    "cosine": lambda s: 0.05 + (LR - 0.05) * (1 + math.cos(math.pi * s / TOTAL)) / 2,
}
TORCH = {
    "constant": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.3),
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, TOTAL, eta_min=0.05),
}
OPTIONS = {"step": {"gamma": 0.3, "step_size": 50}, "exponential": {"gamma": 0.99}}


@pytest.mark.parametrize("name", ["constant", "step", "exponential", "cosine"])
def test_schedule_equals_its_formula_and_torchs_scheduler(name):
    ours = sw.lr_scheduler(
        _optimizer(), name, total_steps=TOTAL, min_ratio=0.1, **OPTIONS.get(name, {})
    )
    assert isinstance(ours, torch.optim.lr_scheduler.LRScheduler)
    got, torchs = _lrs(ours, TOTAL), _lrs(TORCH[name](_optimizer()), TOTAL)
    for s in SAMPLED:
        assert got[s] == pytest.approx(FORMULAS[name](s), rel=1e-12, abs=1e-15)
        assert got[s] == pytest.approx(torchs[s], rel=1e-9)


@pytest.mark.parametrize("name", ["step", "exponential", "cosine"])
def test_linear_warm_up_then_the_schedule_from_its_start(name):
    warm = 20
    ours = sw.lr_scheduler(
        _optimizer(),
        name,
        total_steps=TOTAL + warm,
        warmup_steps=warm,
        min_ratio=0.1,
        **OPTIONS.get(name, {}),
    )
    got = _lrs(ours, TOTAL + warm)
    for s in (0, 4, 19):
        assert got[s] == pytest.approx(LR * (s + 1) / warm, rel=1e-12)
    for s in SAMPLED:  # after the warm-up the schedule starts at its own step 0
        assert got[warm + s] == pytest.approx(FORMULAS[name](s), rel=1e-12, abs=1e-15)


def test_a_resumed_scheduler_goes_on_at_the_same_rates():
    first = sw.lr_scheduler(_optimizer(), "cosine", total_steps=TOTAL, warmup_steps=10)
    _lrs(first, 120)
    resumed = sw.lr_scheduler(_optimizer(), "cosine", total_steps=TOTAL, warmup_steps=10)
    resumed.load_state_dict(first.state_dict())
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())  # its lr, as torch resumes
    assert _lrs(resumed, 50) == _lrs(first, 50)


def test_linear_scaling_rule_from_config():
    plain = load_config("digits", ["data.batch_size=32"])
    assert base_lr(plain.optim, 32, 4) == plain.optim.lr
    scaled = load_config("digits", ["data.batch_size=32", "optim.scale_lr=linear"])
    assert base_lr(scaled.optim, 32, 4) == pytest.approx(4 * scaled.optim.lr)  # from one rank's
    tuned = load_config("digits", ["optim.scale_lr=linear", "optim.base_batch=256"])
    assert base_lr(tuned.optim, 32, 4) == pytest.approx(tuned.optim.lr / 2)  # 128 of 256


@pytest.mark.parametrize(
    "options",
    [{"gamma": 0.0}, {"gamma": 1.5}, {"min_ratio": -0.1}, {"step_size": 0}, {"total_steps": 0}],
)
def test_bad_schedule_options_are_refused(options):
    with pytest.raises(ValueError, match="schedule"):
        sw.Schedule("step", **{"total_steps": 10, **options})
    with pytest.raises(ValueError, match="schedule must be one of"):
        sw.Schedule("linear-ish")
