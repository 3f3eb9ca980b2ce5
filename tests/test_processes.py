"""No process of a job outlives it: SIGKILL or SIGTERM to `shardwise train` (torchrun's agent
runs in it) or to the parameter-server supervisor leaves nothing running after 5 s, counted
from /proc, at any moment: training, or start-up (a worker still importing torch when its
launcher dies); a single-machine job listens on 127.0.0.1 only (its sockets, read from
/proc/net); and a script that forgets `sw.shutdown()` still exits cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LONG = ["--set", "train.steps=100000"]
PS = ["--set", "strategy.name=ps", "--set", "strategy.servers=1", "--set", "strategy.workers=2"]


def processes_of(run_dir: Path) -> list[int]:
    """Pids whose command line names the run directory (every process of the job does)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(run_dir) in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses (IPv4 or IPv6, hex as in /proc/net) that these processes listen on."""
    return {address for address, _ in _listening(pids)}


def listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports that these processes listen on."""
    return {port for _, port in _listening(pids)}


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):  # (gone meanwhile)
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                found.add((address, int(port, 16)))
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _start(run_dir: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shardwise", "train", "digits", *LONG, *args]
    return subprocess.Popen(
        [*argv, "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_until_training(run_dir: Path, job: subprocess.Popen, ranks: int) -> None:
    deadline = time.monotonic() + 120
    while len(processes_of(run_dir)) < ranks + 1 or not (run_dir / "config.yaml").exists():
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(3)  # the process group is up and the ranks are stepping


@pytest.mark.parametrize(
    "kind, sig",
    [
        ("train", signal.SIGKILL),
        ("train", signal.SIGTERM),
        ("ps", signal.SIGKILL),
        ("ps", signal.SIGTERM),
    ],
    ids=["train-sigkill", "train-sigterm", "ps-sigkill", "ps-sigterm"],
)
def test_no_process_of_the_job_outlives_a_signal_to_its_launcher(tmp_path, kind, sig):
    run_dir = tmp_path / "run"
    job = _start(run_dir, *(PS if kind == "ps" else []))
    try:
        _wait_until_training(run_dir, job, ranks=3 if kind == "ps" else 2)
        listening = listening_addresses([job.pid, *processes_of(run_dir)])
        assert listening and listening <= LOOPBACK, listening  # the store and gloo's sockets
        job.send_signal(sig)
        job.wait(timeout=30)
        deadline = time.monotonic() + 5
        while processes_of(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_of(run_dir) == [], "processes of the job still running after 5 s"
        if sig == signal.SIGTERM:
            assert job.returncode == 128 + signal.SIGTERM
            assert "Traceback" not in job.stderr.read()
    finally:
        job.kill()
        for pid in processes_of(run_dir):  # (never leave them to the next test)
            os.kill(pid, signal.SIGKILL)


def _none_left_after(run_dir: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = processes_of(run_dir)
    for pid in left:  # (never leave them to the next test)
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes of the job still running {seconds:.0f} s after the kill"


@pytest.mark.parametrize(
    "kind, started",
    [("train", 1), ("train", 2), ("ps", 1), ("ps", 3)],
    ids=["train-first-worker", "train-all-workers", "ps-first-worker", "ps-all-workers"],
)
def test_no_process_outlives_a_launcher_killed_while_its_workers_start(tmp_path, kind, started):
    """SIGKILL to the launcher as soon as `started` workers exist: they are then starting
    Python and importing torch, before any of the job's own code has run."""
    run_dir = tmp_path / "run"
    job = _start(run_dir, *(PS if kind == "ps" else []))
    try:
        deadline = time.monotonic() + 60
        while len(set(processes_of(run_dir)) - {job.pid}) < started:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        job.kill()
        job.wait(timeout=30)
        assert not (run_dir / "timing").exists()  # (it was start-up: no rank had trained yet)
        _none_left_after(run_dir, 5)
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
    for _ in range(3):  # the abort at exit it replaces came at random
        result = subprocess.run(
            [sys.executable, "-m", "shardwise", "run", "--nproc", "2", str(script)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
