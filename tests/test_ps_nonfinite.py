"""`train.nonfinite` in a parameter-server job: a worker whose loss or gradient is not finite
pushes nothing for that step (the job goes on, its weights stay finite); a run that keeps going
non-finite stops, non-zero, each worker naming its step. (A non-finite push that reaches a server
anyway is refused: tests/test_ps_fuzz.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from harness import run_ps_job

PS = ["strategy.servers=1", "strategy.workers=2", "train.steps=20"]


def _ps_job(run_dir, *sets: str):
    return run_ps_job(run_dir, *PS, *sets, timeout=300)


def test_a_nan_on_one_worker_skips_its_step_and_the_job_goes_on(run_dir):
    result = _ps_job(run_dir, "faults=[nan:rank=2:step=5]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shardwise: ps worker rank 2: step 5: non-finite loss" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "ps/worker2.jsonl").open()]
    assert [r["step"] for r in rows if r.get("skipped")] == [5]
    weights = load_file(str(run_dir / "checkpoint/model.safetensors"))
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_run_that_goes_non_finite_stops_non_zero_naming_the_workers(run_dir, policy):
    # Plain SGD at a learning rate of a million: the weights overflow within a few steps.
    result = _ps_job(run_dir, "optim.name=sgd", "optim.lr=1e6", f"train.nonfinite={policy}")
    assert result.returncode == 1
    out = result.stdout + result.stderr
    bad = 3 if policy == "skip" else 1  # train.max_bad_steps in a row, or the first
    assert "non-finite loss (samples" in out and f"{bad} bad step(s) in a row: stopping" in out
    assert "stopped on non-finite values (train.nonfinite" in out
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("shardwise: the parameter-server job failed: worker rank")
    )
    assert "Traceback" not in out
