"""The planner's model-state accounting against the ZeRO paper's Figure 1."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from shardwise.planner import model_states

FIGURE_1 = {"DP": 120e9, "ZeRO-1": 31.4e9, "ZeRO-2": 16.6e9, "ZeRO-3": 1.875e9}


def test_plan_reproduces_zero_figure_1_from_the_command_line():
    argv = [sys.executable, "-m", "shardwise", "plan"]
    argv += ["--params", "7.5e9", "--devices", "64", "--precision", "mixed", "--json"]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - started < 10  # (a Python start; the plan itself is instant)
    plans = {p["strategy"]: p for p in json.loads(done.stdout)}
    assert set(plans) == set(FIGURE_1)
    for name, total in FIGURE_1.items():  # the figure rounds to 0.1 GB
        assert plans[name]["total_bytes"] == pytest.approx(total, abs=0.05e9), name


def test_each_stage_shards_one_more_category():
    p, n = 1e6, 8
    dp, z1, z2, z3 = (model_states(p, n, stage, "fp32") for stage in (0, 1, 2, 3))
    assert (dp.params_bytes, dp.grads_bytes, dp.optimizer_bytes) == (4 * p, 4 * p, 8 * p)
    assert z1.optimizer_bytes == 8 * p / n and z1.grads_bytes == 4 * p
    assert z2.grads_bytes == 4 * p / n and z2.params_bytes == 4 * p
    assert z3.params_bytes == 4 * p / n
    assert z3.comm_bytes_per_step == 1.5 * z2.comm_bytes_per_step == 1.5 * dp.comm_bytes_per_step


def test_bad_plan_input_is_one_line():
    argv = [sys.executable, "-m", "shardwise", "plan", "--params", "1e9", "--devices", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "shardwise: plan: need params > 0 and devices >= 1, got 1000000000.0 and 0"
    ]
