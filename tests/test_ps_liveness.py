"""A parameter-server job whose server freezes or hangs never hangs itself: its workers and the
supervisor name the server within its timeouts (timed here, from the job's output as it comes,
against the moment the server was stopped), and the job restarts from snapshots or fails.
Nothing of the job is left running."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from harness import none_left, start_ps_job, wait_until

pytestmark = [
    pytest.mark.alone,  # (heartbeats of 0.2 s and silences of 2 s, bounds in seconds)
    pytest.mark.usefixtures("fresh_launchers"),  # (what /proc shows of a launcher)
]

HEARTBEAT_S, TIMEOUT_S, PROGRESS_S = 0.2, 2.0, 2.0
BASE = [
    "strategy.servers=1",
    "strategy.workers=2",
    "strategy.mode=sync",
    f"strategy.heartbeat_s={HEARTBEAT_S}",
    f"strategy.timeout_s={TIMEOUT_S}",
    f"strategy.progress_timeout_s={PROGRESS_S}",
]


class Job:
    """`shardwise train digits` as a parameter-server job, its output lines timestamped (wall
    clock) as they arrive."""

    def __init__(self, run_dir: Path, *sets: str, env: dict[str, str] | None = None) -> None:
        self.proc = start_ps_job(run_dir, *BASE, *sets, env=env)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def wait(self, timeout_s: float = 180) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code

    def first(self, text: str) -> float:
        """When the first line containing `text` arrived."""
        found = [t for t, line in self.lines if text in line]
        assert found, f"no line with {text!r} in:\n" + "\n".join(x for _, x in self.lines[-40:])
        return found[0]

    def line(self, text: str) -> str:
        """The first line containing `text`."""
        self.first(text)
        return next(line for _, line in self.lines if text in line)

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


def test_a_sigstopped_server_is_named_in_time_and_the_job_resumes_from_its_snapshot(run_dir):
    job = Job(run_dir, "train.steps=150", "strategy.snapshot_every=10")
    try:
        snapshots = run_dir / "ps-snapshots"
        wait_until(
            lambda: list(snapshots.glob("server0-v*.safetensors")), job=job.proc, detail=job.output
        )
        os.kill(int((run_dir / "ps" / "pid0").read_text()), signal.SIGSTOP)
        stopped = time.time()
        assert job.wait() == 0, job.output()[-3000:]
        bound = stopped + TIMEOUT_S + 2
        for worker in (1, 2):  # each worker, blocked on the frozen server, names it
            assert job.first(f"ps worker rank {worker}: server rank 0 silent for") <= bound
        # The supervisor names it too (silent in its own watch, or given up on by a worker)
        assert job.first("stopping the job") <= bound
        assert "server rank 0" in job.line("stopping the job")
        assert job.first("restarting the job; servers resume from their snapshots") <= bound + 1
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["resumed_from"] >= 10 and summary["resumed_from"] % 10 == 0
        assert summary["updates"] == 150 - summary["resumed_from"]  # the rest, no more
        none_left(run_dir)
    finally:
        job.proc.kill()


def test_a_hung_server_is_named_stuck_by_its_workers_and_the_job_fails(run_dir):
    """The server's loop hangs at its 20th update while its heartbeats go on: alive, so not
    silent, but its workers' requests go unanswered past progress_timeout_s + timeout_s."""
    job = Job(run_dir, "train.steps=150", env={"SHARDWISE_FAULT": "hang:rank=0:step=20"})
    try:
        assert job.wait() == 1, job.output()[-3000:]
        fired = float((run_dir / "faults" / "hang-rank0-step20").read_text())
        stuck_after = PROGRESS_S + TIMEOUT_S  # (their pulls went out just before it hung)
        bound = fired + stuck_after + 2
        for worker in (1, 2):
            said = job.first(f"ps worker rank {worker}: server rank 0 has not answered for")
            assert fired + stuck_after - 0.5 <= said <= bound
        assert job.first("stopping the job: server rank 0 failed") <= bound + 2
        assert "the parameter-server job failed: server rank 0" in job.output()
        none_left(run_dir)
    finally:
        job.proc.kill()


def test_a_worker_whose_training_hangs_is_named_stuck_and_the_job_fails_naming_it(run_dir):
    """Worker 2's training thread blocks at its 10th step while its process (and heartbeats)
    live on: server 0 declares it stuck within progress_timeout_s + 2 s, worker 1 trains its
    batch and every other, and the job ends, naming it (all workers must finish by default)."""
    job = Job(run_dir, "train.steps=60", env={"SHARDWISE_FAULT": "hang:rank=2:step=10"})
    try:
        assert job.wait() == 1, job.output()[-3000:]
        fired = float((run_dir / "faults" / "hang-rank2-step10").read_text())
        said = job.first("ps server 0: worker rank 2: stuck at clock")
        assert said <= fired + PROGRESS_S + 2
        assert job.first("ps worker rank 2 still running") > said  # stopped by the supervisor
        assert "failed: worker rank 2 (exit code -9)" in job.output()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["consumed_samples"] == 60 * 2 * 32  # its batch was trained by worker 1
        rows = (run_dir / "ps" / "worker1.jsonl").read_text().splitlines()
        assert sum(json.loads(r)["samples"] for r in rows) == 60 * 2 * 32 - 9 * 32
        none_left(run_dir)
    finally:
        job.proc.kill()


def test_a_client_still_starting_is_not_silent_until_it_is_heard_from():
    """A server gives a client that has not beaten yet the start-up allowance (imports, its
    data), not the timeout of a silent one; once the client has talked (a push), the timeout
    runs from its last message."""
    import torch.distributed as dist

    from shardwise.ps.liveness import HeartbeatWatch

    watch = HeartbeatWatch(
        [3], timeout_s=0.2, check_every_s=0.0, store=dist.HashStore(), startup_s=60
    )
    time.sleep(0.3)
    assert watch.dead({3}) == []  # starting: 0.3 s of silence is well within 60 s
    watch.heard(3)
    assert watch.dead({3}) == []
    time.sleep(0.3)
    ((rank, silent_s),) = watch.dead({3})
    assert rank == 3 and 0.2 < silent_s < 30


def test_a_frozen_primary_server_is_replaced_by_its_backup_and_the_job_goes_on(run_dir):
    """replicas: 2; the primary is SIGSTOPped mid-run: the supervisor names it silent within
    the timeout and kills it, its workers go over to the backup (which holds every update),
    and the job ends well without a restart or a snapshot, every batch consumed once."""
    job = Job(run_dir, "train.steps=80", "strategy.replicas=2")
    try:
        wait_until(
            lambda: any(
                len(p.read_text().splitlines()) >= 20 for p in run_dir.glob("ps/worker*.jsonl")
            ),
            job=job.proc,
            detail=job.output,
        )
        os.kill(int((run_dir / "ps" / "pid0").read_text()), signal.SIGSTOP)
        stopped = time.time()
        assert job.wait() == 0, job.output()[-3000:]
        bound = stopped + TIMEOUT_S + 2
        assert job.first("ps server rank 0 silent for") <= bound
        assert "killed, its backup serves on" in job.line("ps server rank 0 silent for")
        assert job.first("ps server 1: primary server rank 0 lost") <= bound + 1
        for worker in (2, 3):
            assert job.first(f"ps worker rank {worker}: server rank 0 lost") <= bound + 1
        assert "restarting" not in job.output()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["updates"] == 80 and summary["consumed_samples"] == 80 * 2 * 32
        assert summary["eval_accuracy"] >= 0.85
        none_left(run_dir)
    finally:
        job.proc.kill()
