"""The planner bench's own arithmetic: the rank correlation it reports, and the top choice
judged on fresh runs rather than on the sweep that picked the fastest."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from shardwise.bench import planner_bench as bench


def test_kendall_tau_counts_pairs():
    assert bench.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # one swapped pair of six: (5 concordant - 1 discordant) / 6
    assert abs(bench.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) - 4 / 6) < 1e-12


def test_a_configuration_is_predicted_by_its_runs_mean_and_measured_by_their_median():
    # Each run was priced at the calibration of its round: the prediction is their mean.
    tries = [
        {"peak": {"error": 0.01}, "step_time_s": {"predicted": p, "measured": m, "error": 0}}
        for p, m in ((0.050, 0.060), (0.060, 0.048), (0.040, 0.052))
    ]
    step = bench._combined(tries)["step_time_s"]
    assert step["predicted"] == pytest.approx(0.050) and step["measured"] == 0.052
    assert step["error"] == pytest.approx(0.050 / 0.052 - 1)
    assert step["runs_s"] == [0.060, 0.048, 0.052]
    assert step["predicted_runs_s"] == [0.050, 0.060, 0.040]


def test_choice_is_confirmed_on_fresh_runs(monkeypatch):
    # The sweep made zero2 look fastest by a lucky run; fresh runs show its usual time.
    usual = {"pp4-1f1b": 0.120, "zero2": 0.125, "ddp": 0.115, "zero1": 0.130, "tp4": 0.2}
    sweep = {**usual, "zero2": 0.100, "pp4-1f1b": 0.135}
    predicted = {**{k: 0.2 for k in usual}, "pp4-1f1b": 0.11}
    wobble = itertools.cycle([1.0, 1.02, 0.98])
    made = []

    def fresh_run(out, model, name, sets, nproc, steps):
        made.append(name)
        seconds = usual[name] * next(wobble)
        return {"step_time_s": {"predicted": predicted[name], "measured": seconds, "error": 0}}

    monkeypatch.setattr(bench, "run_one", fresh_run)
    results = {
        f"gpt n4 {k}": {
            "step_time_s": {
                "predicted": predicted[k],
                "measured": sweep[k],
                "error": 0,
                "runs_s": [sweep[k]],
            }
        }
        for k in usual
    }
    jobs = {key: ("gpt", key.split()[2], [], 4, 30) for key in results}
    assert bench._summarise(results)["choice"]["measured_best"] == "zero2"

    confirmed = bench._confirm(Path("unused"), results, jobs, rounds=3)

    # the top choice and the sweep's three fastest, in turns, three runs each
    assert made == ["pp4-1f1b", "zero2", "ddp", "zero1"] * 3
    assert confirmed["predicted_best"] == "pp4-1f1b"
    assert confirmed["measured_best"] == "ddp"
    assert set(confirmed["runs_s"]) == {"pp4-1f1b", "zero2", "ddp", "zero1"}
    assert abs(confirmed["its_measured_s"] - 0.120) < 0.120 * 0.021
    assert abs(confirmed["slower_by"] - (0.120 / 0.115 - 1)) < 0.05


def test_torch_memtracker_sees_a_plain_step_as_our_meter_does():
    # The rival's harness: torch's MemTracker on fake tensors through one step of the tiny
    # GPT, against our PeakMeter on the same step run for real (model state included).
    from shardwise.bench.torch_estimates import memtracker_peak, training_step
    from shardwise.config import load_config
    from shardwise.jobs import OPTIMIZERS, build_job, optimizer_kwargs
    from shardwise.observe.memory import PeakMeter, optimizer_tensors

    sets = [*bench.WORKLOADS["gpt"].sets, "strategy.name=ddp", "data.batch_size=8"]
    rival = memtracker_peak("tiny_gpt", sets, 8)
    cfg = load_config("tiny_gpt", sets)
    job = build_job(cfg)
    opt = OPTIMIZERS[cfg.optim.name](job.model.parameters(), **optimizer_kwargs(cfg.optim))
    x, y = job.batch_like()(8)

    training_step(job, opt, x, y)  # (the optimizer's state made)
    alive = [*job.model.parameters(), *job.model.buffers(), *optimizer_tensors(opt)]
    with PeakMeter(alive=alive) as meter:
        training_step(job, opt, x, y)
    assert meter.peak > sum(t.numel() * t.element_size() for t in alive)
    assert abs(rival / meter.peak - 1) < 0.02, (rival, meter.peak)


def test_a_choice_whose_fresh_runs_all_fail_is_reported_not_a_crash(monkeypatch):
    """Before, `_confirm` raised a KeyError (and planner.json, written after it, was lost)."""
    results = {
        f"gpt n4 {k}": {"step_time_s": {"predicted": p, "measured": 0.1, "error": 0}}
        for k, p in (("a", 0.01), ("b", 0.02))
    }
    jobs = {key: ("gpt", key.split()[2], [], 4, 30) for key in results}

    def run(out, model, name, sets, nproc, steps):
        if name == "a":
            return {"error": "exit 1", "output": ""}
        return {"step_time_s": {"predicted": 0.02, "measured": 0.04, "error": 0}}

    monkeypatch.setattr(bench, "run_one", run)
    assert bench._confirm(Path("unused"), results, jobs, rounds=2) == {
        "runs": 2,
        "error": "no fresh run of gpt n4 a completed",
    }


def test_the_step_error_median_is_the_median():
    results = {
        f"gpt n4 {i}": {
            "step_time_s": {"predicted": p, "measured": 1.0, "error": p - 1, "runs_s": [1.0]}
        }
        for i, p in enumerate([1.1, 1.3])
    }
    assert bench._summarise(results)["step_error_median"] == pytest.approx(0.2)  # (was 0.3)
