"""No process of a job outlives it: SIGKILL or SIGTERM to `shardwise train` (torchrun's agent
runs in it) or to the parameter-server supervisor leaves nothing running, counted from /proc, at
any moment: training, or start-up (a worker still importing torch when its launcher dies); a
single-machine job listens on 127.0.0.1 only (its sockets, read from /proc/net); and a script
that forgets `sw.shutdown()` still exits cleanly.

"Nothing running" is polled for up to 30 s (`harness.none_left`): an orphan would train on for
good, and a pass returns as soon as the last process is gone (within a second on an idle
machine; a busy one takes longer to schedule what the kernel killed, or to bring a worker that
was still starting Python to the first line of `boot.py`, where it sees its launcher gone)."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest

from harness import (
    DEVNULL,
    LOOPBACK,
    PIPE,
    finish,
    listening_addresses,
    none_left,
    processes_of,
    start_cli,
    start_ps_job,
    train_args,
    wait_until,
)
from shardwise.distributed.launcher import AGENT_LOGS, agent_logs

pytestmark = pytest.mark.usefixtures("fresh_launchers")  # (what /proc shows of a launcher)

LONG = "train.steps=100000"
PS = ["strategy.servers=1", "strategy.workers=2"]


def _start(run_dir: Path, kind: str):
    """A long job (`kind` "train" or "ps") started: stdout discarded, stderr kept."""
    quiet = {"stdout": DEVNULL, "stderr": PIPE}
    if kind == "ps":
        return start_ps_job(run_dir, LONG, *PS, **quiet)
    return start_cli(*train_args(run_dir, LONG), **quiet)


def _wait_until_training(run_dir: Path, job, kind: str) -> None:
    """Until each training rank has logged a step: the process group is up and the ranks are
    stepping (the PS job's workers, ranks 1 and 2, step only with their server's answers)."""
    if kind == "ps":
        logs = [run_dir / "ps" / f"worker{rank}.jsonl" for rank in (1, 2)]
    else:
        logs = [run_dir / "timing" / f"rank{rank}.jsonl" for rank in (0, 1)]
    wait_until(lambda: all(log.exists() and log.read_text().strip() for log in logs), job=job)


@pytest.mark.parametrize(
    "kind, sig",
    [
        # (alone: another job's launcher removes a dead launcher's folder, which it looks for)
        pytest.param("train", signal.SIGKILL, marks=pytest.mark.alone),
        ("train", signal.SIGTERM),
        ("ps", signal.SIGKILL),
        ("ps", signal.SIGTERM),
    ],
    ids=["train-sigkill", "train-sigterm", "ps-sigkill", "ps-sigterm"],
)
def test_no_process_of_the_job_outlives_a_signal_to_its_launcher(run_dir, kind, sig):
    job = _start(run_dir, kind)
    try:
        _wait_until_training(run_dir, job, kind)
        listening = listening_addresses([job.pid, *processes_of(run_dir)])
        assert listening and listening <= LOOPBACK, listening  # the store and gloo's sockets
        job.send_signal(sig)
        job.wait(timeout=30)
        none_left(run_dir, after=f"{sig.name} to the launcher")
        if sig == signal.SIGTERM:
            assert job.returncode == 128 + signal.SIGTERM
            said = job.stderr.read()  # (not torch's agent's "Received 15 death signal" too)
            assert "Traceback" not in said and "death signal" not in said, said
        if kind == "train":  # torchrun's agent's log folder: gone with the job, or at the next
            left = list(Path(tempfile.gettempdir()).glob(f"{AGENT_LOGS}{job.pid}-*"))
            assert len(left) == (1 if sig == signal.SIGKILL else 0), left
            with agent_logs() as logs:  # (what the next launch does first)
                assert not any(path.exists() for path in left)
                assert Path(logs).name.startswith(f"{AGENT_LOGS}{os.getpid()}-")
    finally:
        job.kill()


@pytest.mark.alone  # (the kill must land before any rank has started its work)
@pytest.mark.parametrize(
    "kind, started",
    [("train", 1), ("train", 2), ("ps", 1), ("ps", 3)],
    ids=["train-first-worker", "train-all-workers", "ps-first-worker", "ps-all-workers"],
)
def test_no_process_outlives_a_launcher_killed_while_its_workers_start(run_dir, kind, started):
    """SIGKILL to the launcher as soon as `started` workers exist: they are then starting
    Python and importing torch, before any of the job's own code has run."""
    job = _start(run_dir, kind)
    try:
        wait_until(
            lambda: len(set(processes_of(run_dir)) - {job.pid}) >= started, job=job, every_s=0.01
        )
        job.kill()
        job.wait(timeout=30)
        # It was start-up: no rank had got past joining the job (where a trainer makes its
        # timing/ and a PS role its ps/ folder).
        assert not (run_dir / ("ps" if kind == "ps" else "timing")).exists()
        none_left(run_dir, after="the kill")
    finally:
        job.kill()


def test_a_script_without_shutdown_exits_cleanly(tmp_path):
    script = tmp_path / "forgets_shutdown.py"
    script.write_text(
        "import torch\n"
        "import shardwise as sw\n"
        "rt = sw.init()\n"
        "t = torch.ones(4)\n"
        "sw.comm.all_reduce(t)\n"
        "assert t[0].item() == rt.world_size\n"
    )
    # The abort at exit it replaces came at random: three jobs, at once.
    jobs = [start_cli("run", "--nproc", "2", str(script)) for _ in range(3)]
    for code, out in finish(*jobs, timeout=120):
        assert code == 0, out[-2000:]
