"""The supervisor of a parameter-server job: S + W processes on this machine, started directly.

torchrun's agent ends every process when one fails: right for lock-step strategies, wrong here,
where surviving a dead worker is the point. So this supervisor starts the processes itself (the
environment torchrun would set, a c10d store on 127.0.0.1), reports a worker that dies and lets
the others go on (the servers notice through the heartbeats), and when a server dies it stops
the rest and starts the job again once: the servers resume from their snapshots and the workers
from the servers' version. A relay (two-level job) counts as a server here: its workers cannot
go on without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shardwise.config import Config
from shardwise.launcher import worker_environment
from shardwise.signals import handling_stop_signals

GRACE_S = 3.0  # seconds the job's processes get to leave after SIGTERM, before SIGKILL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], nproc: int, threads: int | None, attempt: int) -> list:
    env = {**os.environ, **worker_environment(nproc, threads)}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        SHARDWISE_PS_ATTEMPT=str(attempt),
    )
    # One process group for the job's processes (its leader the first): a signal to the
    # supervisor is passed on to all of them at once.
    procs: list[subprocess.Popen] = []
    for r in range(nproc):
        group = procs[0].pid if procs else 0
        env_r = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen([sys.executable, *argv], env=env_r, process_group=group))
    return procs


@contextlib.contextmanager
def _ending_children_on_signals(running: list[subprocess.Popen]):
    """SIGTERM / SIGINT to the supervisor: its processes get SIGTERM, then SIGKILL after a
    grace period, and the supervisor exits 128 + signal (no orphan keeps training)."""

    def stop(signum, frame) -> None:
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        deadline = time.monotonic() + GRACE_S
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
        name = signal.Signals(signum).name
        print(f"shardwise: parameter-server job stopped by {name}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    with handling_stop_signals(stop):
        yield


def supervise(argv: list[str], servers: int, nproc: int, threads: int | None, restarts: int):
    """Run the processes (ranks below `servers` serve); returns (succeeded, {rank: exit code}
    of processes that failed)."""
    failures: dict[int, int] = {}
    running: list[subprocess.Popen] = []
    with _ending_children_on_signals(running):
        return _supervise(argv, servers, nproc, threads, restarts, failures, running)


def _supervise(argv, servers, nproc, threads, restarts, failures, running):
    for attempt in range(restarts + 1):
        procs = _start(argv, nproc, threads, attempt)
        running[:] = procs
        server_failed = False
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                code = p.poll()
                if code in (None, 0) or rank in failures:
                    continue
                failures[rank] = code
                if rank < servers:
                    server_failed = True
                    print(f"shardwise: ps server rank {rank} exited with code {code}", flush=True)
                else:
                    print(
                        f"shardwise: ps worker rank {rank} exited with code {code}; "
                        "the others go on",
                        flush=True,
                    )
            if server_failed:
                for p in procs:
                    p.kill()
                break
            _stop_workers_left_behind(procs, servers, failures)
            time.sleep(0.1)
        for p in procs:
            p.wait()
        if not server_failed:
            ok = all(p.returncode == 0 for p in procs[:servers])
            return ok, failures
        if attempt < restarts:
            print("shardwise: restarting the job; servers resume from their snapshots", flush=True)
            failures = {}
    return False, failures


def _stop_workers_left_behind(procs: list, servers: int, failures: dict[int, int]) -> None:
    """Once every server (and relay) has finished, a worker still running was declared dead or
    stuck by them (its training hung, its process lives on): after a grace period, stop it and
    name it, so that the job ends."""
    if any(p.poll() != 0 for p in procs[:servers]):
        return
    now = time.monotonic()
    for rank, p in enumerate(procs[servers:], start=servers):
        if p.poll() is not None:
            continue
        since = getattr(p, "servers_done_at", None)
        if since is None:
            p.servers_done_at = now
        elif now - since > GRACE_S:
            p.kill()
            failures[rank] = p.wait()
            print(
                f"shardwise: ps worker rank {rank} still running {GRACE_S:.0f} s after the servers "
                "finished (declared dead or stuck by them): stopped",
                flush=True,
            )


def run_ps_job(cfg: Config, argv: list[str], run_dir: Path) -> int:
    """Run the roles (`argv`: `shardwise train CONFIG --run-dir RUN_DIR`), then summarise."""
    from shardwise.ps_job import summarise

    argv = ["-m", *argv]
    restarts = 1 if cfg.strategy.snapshot_every else 0
    started = time.perf_counter()
    serving = cfg.strategy.servers + cfg.strategy.relays
    ok, failures = supervise(argv, serving, cfg.launch.nproc, cfg.launch.threads_per_rank, restarts)
    if not ok:
        print(f"shardwise: the parameter-server job failed ({failures})", file=sys.stderr)
        return 1
    workers = [r for r in failures if r >= serving]
    if len(workers) == cfg.launch.nproc - serving:  # a job whose every worker died did not train
        roles = ", ".join(f"worker rank {r} (exit code {failures[r]})" for r in sorted(workers))
        print(f"shardwise: every parameter-server worker failed: {roles}", file=sys.stderr)
        return 1
    summarise(cfg, run_dir, time.perf_counter() - started, failures)
    return 0
