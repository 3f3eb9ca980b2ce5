"""Exact resume: a job that loses a rank restarts and resumes from its newest checkpoint, a job
stopped by SIGTERM saves one and continues with --resume, and either way it ends bit-identical
to the same job run straight through: parameters, optimizer moments, strategy state (PowerSGD's
error feedback and Q matrices, ZeRO's shards) and random generators, compared file by file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise import run_checkpoint

STEPS = 60


def _train(run_dir: Path, *sets: str, env: dict | None = None, extra=()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shardwise", "train", "digits", "--nproc", "2"]
    argv += ["--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=10", *extra]
    for kv in sets:
        argv += ["--set", kv]
    return subprocess.Popen(
        [*argv, "--run-dir", str(run_dir)] if "--resume" not in extra else argv,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(job: subprocess.Popen) -> str:
    try:
        out, _ = job.communicate(timeout=240)
    finally:
        job.kill()  # (a job that hangs must not outlive its test)
    assert job.returncode == 0, out[-3000:]
    return out


def _same_end(a: Path, b: Path) -> None:
    """The last checkpoints (each rank's whole state) and the final weights are identical."""
    last = f"checkpoints/{run_checkpoint.PREFIX}{STEPS:09d}"
    for name in ["checkpoint/model.safetensors", *(f"{last}/rank{r}.safetensors" for r in (0, 1))]:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys()
        differ = [k for k in x if not torch.equal(x[k], y[k])]
        assert not differ, (name, differ[:5])


@pytest.mark.parametrize(
    "strategy",
    [["strategy.compression=powersgd:2"], ["strategy.name=zero", "strategy.stage=2"]],
    ids=["ddp-powersgd", "zero2"],
)
def test_a_killed_rank_restarts_and_resumes_bit_identically(tmp_path, strategy):
    straight = _train(tmp_path / "straight", *strategy)
    _finish(straight)
    fault = {"SHARDWISE_FAULT": "kill:rank=1:step=37"}
    faulty = _train(tmp_path / "faulty", *strategy, env=fault, extra=["--max-restarts", "1"])
    out = _finish(faulty)
    assert "fault injected: kill-rank1-step37" in out
    assert "resumed from" in out and "(step 30)" in out
    assert (tmp_path / "faulty" / "faults" / "kill-rank1-step37").exists()  # fired once
    _same_end(tmp_path / "straight", tmp_path / "faulty")


def test_sigterm_saves_a_checkpoint_and_resume_continues_bit_identically(tmp_path):
    straight = _train(tmp_path / "straight")
    _finish(straight)
    slow = ["train.delay_s=[0.05, 0.05]"]  # (sleeps only: the arithmetic is the same)
    stopped = _train(tmp_path / "stopped", *slow)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 15):
        assert time.monotonic() < deadline and stopped.poll() is None
        time.sleep(0.1)
    stopped.send_signal(signal.SIGTERM)
    try:
        out, _ = stopped.communicate(timeout=120)
    finally:
        stopped.kill()
    assert stopped.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert out.strip().splitlines()[-1] == "shardwise: stopped by signal SIGTERM"  # no traceback
    saved = run_checkpoint.complete(tmp_path / "stopped" / "checkpoints")
    step = int(saved[-1].name.removeprefix(run_checkpoint.PREFIX))
    assert 15 <= step < STEPS and f"stopped after step {step}" in out
    resumed = _train(tmp_path / "stopped", extra=["--resume", str(tmp_path / "stopped")])
    assert f"(step {step})" in _finish(resumed)
    _same_end(tmp_path / "straight", tmp_path / "stopped")


def test_a_corrupt_checkpoint_is_skipped_for_the_one_before(tmp_path, capsys):
    _finish(_train(tmp_path / "run"))
    root = tmp_path / "run" / "checkpoints"
    newest, previous = run_checkpoint.complete(root)[-1], run_checkpoint.complete(root)[-2]
    shard = newest / "rank1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5] + b"xxxxx")
    found = run_checkpoint.newest(tmp_path / "run", 2, "ddp")
    assert found == (previous, int(previous.name.removeprefix(run_checkpoint.PREFIX)))
    assert f"checkpoint file missing or corrupt (checksum): {shard}" in capsys.readouterr().out
    assert run_checkpoint.newest(tmp_path / "run", 4, "ddp") is None  # saved on 2 ranks
