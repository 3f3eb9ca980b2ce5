"""The trainer's parts serve a user's own loop without the trainer (tests/own_loop.py): killed
mid-run and resumed, it ends bit-identical to a run never interrupted; a hung rank is named
by the watchdog within its timeout."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness import finish, run_cli, start_cli

pytestmark = (
    pytest.mark.alone
)  # (its ranks run a 3 s watchdog: a slow but healthy rank would be named)

SCRIPT = Path(__file__).with_name("own_loop.py")


def _args(run_dir: Path, *extra: str) -> list[str]:
    return ["run", "--nproc", "2", str(SCRIPT), "--run-dir", str(run_dir), *extra]


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(*_args(run_dir, *extra), cwd=run_dir.parent, env={"OMP_NUM_THREADS": "1"})


def test_a_killed_own_loop_resumes_bit_identically(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    env = {"OMP_NUM_THREADS": "1"}
    (code, out), (first, _) = finish(  # (the whole run and the killed one at once)
        start_cli(*_args(whole), cwd=tmp_path, env=env),
        start_cli(*_args(killed, "--kill-at", "7"), cwd=tmp_path, env=env),  # saved: step 4
    )
    assert code == 0, out[-3000:]
    assert first != 0 and not (killed / "final.safetensors").exists()
    second = _run(killed)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "(step 4)" in second.stdout
    expected, resumed = (
        load_file(whole / "final.safetensors"),
        load_file(killed / "final.safetensors"),
    )
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        assert resumed[name].equal(tensor), name


def test_a_hung_rank_of_an_own_loop_is_named_within_the_timeout(tmp_path):
    run_dir = tmp_path / "hung"
    started = time.monotonic()
    result = _run(run_dir, "--hang-at", "3")
    took = time.monotonic() - started
    assert result.returncode != 0
    report = (run_dir / "hang_report.txt").read_text()
    assert "rank 1" in report and "never arrived" in report, report
    assert result.stderr.strip().splitlines()[-1].startswith("shardwise: hang: rank 1 ")
    assert took < 60  # start-up, then the watchdog's 3 s: never the backend's 300 s
