"""Start N local worker processes with torchrun's own machinery (the elastic agent).

`launch` is what `torchrun --standalone --nproc-per-node N` does: one agent supervising the
workers, and if any worker fails the agent stops the rest and reports it. Its rendezvous is
`loopback.py`'s: the job's c10d store listens on 127.0.0.1 only (torchrun's listens on every
interface). Workers inherit the environment set here: threads per rank (more threads than
cores is several times slower) and glibc malloc thresholds (returning memory to the OS after
each step makes step times swing by ~30%).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardwise import loopback
from shardwise.runtime import TOKEN_ENV

# Keep freed memory in the process: large gradient buffers are reallocated every step.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


class LaunchError(RuntimeError):
    """A worker failed; the message names the rank and its exit code."""

    exit_code = 1


class Stopped(LaunchError):
    """The job was stopped by a signal (its ranks saved a checkpoint first, where they could)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def worker_environment(nproc: int, threads_per_rank: int | None) -> dict[str, str]:
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env[TOKEN_ENV] = secrets.token_hex(16)  # the job's keys in the c10d store sit below it
    for key, value in MALLOC_ENV.items():
        env[key] = os.environ.get(key, value)
    return env


def launch(
    module_args: list[str], nproc: int, threads_per_rank: int | None = None, max_restarts: int = 0
) -> None:
    """Run `python -m <module_args...>` on `nproc` local ranks; raise `LaunchError` on failure
    (after `max_restarts` restarts of all of them, when a rank fails)."""
    _launch(["-m", *module_args], nproc, threads_per_rank, max_restarts)


def launch_script(
    script: str, args: list[str], nproc: int, threads_per_rank: int | None = None
) -> None:
    """Run `python <script> <args...>` on `nproc` local ranks (each dies with the launcher)."""
    if not os.path.isfile(script):
        raise ValueError(f"no such script: {script}")
    _launch(["-m", "shardwise.worker", script, *args], nproc, threads_per_rank)


def _launch(
    python_args: list[str], nproc: int, threads_per_rank: int | None, max_restarts: int = 0
) -> None:
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    os.environ.update(worker_environment(nproc, threads_per_rank))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend=loopback.BACKEND,  # the agent hosts the store, on 127.0.0.1 only
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)(*python_args)
    except SignalException as e:  # SIGTERM / SIGINT: the agent stopped the ranks
        raise Stopped(int(e.sigval)) from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise LaunchError(
            f"worker rank {rank} failed with exit code {failure.exitcode} (its output is above)"
        ) from None
