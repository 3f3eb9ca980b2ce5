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

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from shardwise.config import Config
from shardwise.launcher import worker_environment


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
    return [
        subprocess.Popen([sys.executable, *argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(nproc)
    ]


def supervise(argv: list[str], servers: int, nproc: int, threads: int | None, restarts: int):
    """Run the processes (ranks below `servers` serve); returns (succeeded, {rank: exit code}
    of processes that failed)."""
    failures: dict[int, int] = {}
    for attempt in range(restarts + 1):
        procs = _start(argv, nproc, threads, attempt)
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
    summarise(cfg, run_dir, time.perf_counter() - started, failures)
    return 0
