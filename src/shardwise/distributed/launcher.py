"""Start N local worker processes with torchrun's own machinery (the elastic agent).

`launch` is what `torchrun --standalone --nproc-per-node N` does: one agent supervising the
workers, and if any worker fails the agent stops the rest (or restarts them all, resuming, while
`max_restarts` allows) and reports it. Around it, this launcher hosts the job's own store
(`comm/jobstore.py`: authenticated, on 127.0.0.1, where every key the ranks share lives) and
gives the agent its rendezvous (`loopback.py`: torchrun's own store, on 127.0.0.1 only) and a log
directory that goes with the job. Workers start through `boot.py`, which ties them to this process
before anything else (a launcher killed at any moment takes them with it), and inherit the
environment set here: threads per rank (more threads than cores is several times slower) and
glibc malloc thresholds (returning memory to the OS after each step makes step times swing by
~30%).

When the job fails, the last line says why in the terms of the job: the rank that hung (from the
watchdog's verdict in the store), the rank that failed and what it said when it left, or the
signal the job was stopped by.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry

from shardwise.comm import jobstore
from shardwise.comm.broken import broken_connection
from shardwise.comm.shared_memory import process_ended
from shardwise.distributed import boot, leaving, loopback, membership, zygote
from shardwise.distributed.runtime import WATCHDOG_ENV

BOOT = str(Path(boot.__file__).resolve())  # run by path: nothing imported before its work
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NONFINITE_EXIT = 4  # the trainer's EXIT_NONFINITE (not imported: the launcher stays light)
# How every rank of a job leaves together, on purpose: stopped by a signal after the step all
# agreed on (128 + SIGTERM or SIGINT: `train/exits.py`), or on non-finite values. In an elastic
# job such a rank is not lost: nobody is told it went, nor replaced (a replacement would wait
# to join a job that has ended, for good).
AGREED_ENDS = frozenset({NONFINITE_EXIT, 128 + signal.SIGTERM, 128 + signal.SIGINT})


class LaunchError(RuntimeError):
    """A worker failed; the message names the rank and what happened to it."""

    exit_code = 1


class Stopped(LaunchError):
    """The job was stopped by a signal (its ranks saved a checkpoint first, where they could)."""

    def __init__(self, signum: int, message: str | None = None) -> None:
        super().__init__(message or f"stopped by signal {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def worker_environment(
    nproc: int, threads_per_rank: int | None, bind_cores: bool = False
) -> dict[str, str]:
    usable = boot.usable_cores()
    threads = threads_per_rank or max(1, usable // nproc)
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    # Each rank its own `threads` cores (`boot.bind_cores`); empty: unbound, whatever binding
    # this process was given.
    env[boot.CORES_ENV] = _cores_per_rank(nproc, threads, usable) if bind_cores else ""
    env[boot.PARENT_ENV] = str(os.getpid())  # the workers' parent: this process
    for key, value in boot.MALLOC_ENV.items():
        env[key] = os.environ.get(key, value)
    return env


def _cores_per_rank(nproc: int, threads: int, usable: int) -> str:
    """`threads`, where each rank can have cores of its own; else "" (unbound), said in a line
    where binding was asked for and cannot be done."""
    if nproc * threads > usable:
        why = f"{nproc} ranks x {threads} threads need {nproc * threads} cores, this "
        why += f"launcher may use {usable}"
    elif not hasattr(os, "sched_setaffinity"):
        why = "this platform cannot"
    else:  # (a lone rank on every core is bound to nothing: not said)
        return str(threads) if threads < usable else ""
    print(f"shardwise: ranks not bound to cores: {why}", file=sys.stderr)
    return ""


def boot_argv(python_args: list[str]) -> list[str]:
    """The arguments after `python` that start a worker through `boot.py`."""
    return [BOOT, *python_args]


def launch(
    module_args: list[str],
    nproc: int,
    threads_per_rank: int | None = None,
    max_restarts: int = 0,
    on_failure: str = "stop",
    bind_cores: bool = False,
) -> None:
    """Run `python -m <module_args...>` on `nproc` local ranks; raise `LaunchError` on failure
    (after `max_restarts` restarts of all of them, when a rank fails). With `on_failure`
    'shrink', a rank that fails is only reported to the others (they go on without it);
    'replace': and a replacement is started, which joins them (`distributed/membership.py`).
    `bind_cores`: each rank runs on cores of its own (`boot.bind_cores`)."""
    _launch(["-m", *module_args], nproc, threads_per_rank, max_restarts, on_failure, bind_cores)


def launch_script(
    script: str,
    args: list[str],
    nproc: int,
    threads_per_rank: int | None = None,
    hang_timeout_s: float = 60.0,
    bind_cores: bool = False,
) -> None:
    """Run `python <script> <args...>` on `nproc` local ranks, each with a watchdog that ends
    the job naming the rank that hangs (or left early) after `hang_timeout_s`."""
    if not os.path.isfile(script):
        raise ValueError(f"no such script: {script}")
    if not 0 < hang_timeout_s < float("inf"):
        raise ValueError(f"--hang-timeout must be a positive number of seconds: {hang_timeout_s}")
    if threads_per_rank is not None and threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be at least 1, got {threads_per_rank}")
    with _environment({WATCHDOG_ENV: str(hang_timeout_s)}):
        _launch([script, *args], nproc, threads_per_rank, bind_cores=bind_cores)


class _Agent(LocalElasticAgent):
    """torchrun's agent, saying which rank failed before it restarts them all; or, in an
    elastic job, telling the others a rank is gone (and starting its replacement)."""

    def __init__(
        self, spec: WorkerSpec, logs: str, store: jobstore.JobStoreServer, on_failure: str
    ) -> None:
        super().__init__(spec, DefaultLogsSpecs(log_dir=logs), start_method="spawn")
        self.job_store = store
        self.on_failure = on_failure
        self.members: dict[int, str] = {}  # local rank -> the member id running there
        self.starts: dict[int, int] = {}  # local rank -> processes started there so far
        self.lost: dict[int, ProcessFailure] = {}  # members gone, the last of each rank
        self.vacant: set[int] = set()  # local ranks whose member is gone, and not replaced
        self.noted: set[tuple[int, int, int]] = set()  # (attempt, rank, pid) noted as ended

    def _monitor_workers(self, worker_group):
        self._note_ended(worker_group)
        if self.on_failure != "stop":
            self._watch_members(worker_group)
        result = super()._monitor_workers(worker_group)
        everyone_lost = len(self.vacant) == worker_group.spec.local_world_size
        if result.state == WorkerState.SUCCEEDED and everyone_lost:  # nobody did the work
            # (those left ended the job together: how they did is how it ended)
            ended = {r: f for r, f in self.lost.items() if f.exitcode in AGREED_ENDS}
            return RunResult(state=WorkerState.FAILED, failures=ended or dict(self.lost))
        return self._say_restart(worker_group, result)

    def _note_ended(self, worker_group) -> None:
        """Each rank process that ended (any code), noted once in the job's store: a rank
        still joining the job stops waiting for it (`leaving.arrive`)."""
        attempt = worker_group.spec.max_restarts - self._remaining_restarts
        for local_rank, handler in self._pcontext.subprocess_handlers.items():
            code = handler.proc.poll()
            rank = worker_group.workers[local_rank].global_rank
            if code is not None and (attempt, rank, handler.proc.pid) not in self.noted:
                self.noted.add((attempt, rank, handler.proc.pid))
                leaving.note_ended(
                    lambda key, value: self.job_store.write(f"attempt-{attempt}/{key}", value),
                    rank,
                    code,
                )

    def _watch_members(self, worker_group) -> None:
        """A member that exits with an error is gone: the others are told through the job's
        store at once (they stop waiting for it), and under 'replace' another process takes
        its place, as a newcomer that asks to join."""
        context = self._pcontext
        attempt = worker_group.spec.max_restarts - self._remaining_restarts
        for local_rank in sorted(context._running_local_ranks):
            handler = context.subprocess_handlers[local_rank]
            code = handler.proc.poll()
            if code is None or code == 0:
                continue
            member = self.members.get(local_rank, str(worker_group.workers[local_rank].global_rank))
            self._note_ended(worker_group)  # (before a replacement takes its place)
            failure = ProcessFailure(local_rank, handler.proc.pid, code, "")
            self.lost[worker_group.workers[local_rank].global_rank] = failure
            context._running_local_ranks.discard(local_rank)
            # Gone, whatever the code: a replacement stopped (SIGTERM) before it was taken in
            # would otherwise be taken in, and the members' rendezvous wait for it.
            self.job_store.write(f"attempt-{attempt}/{membership.gone_key(member)}", _exit(failure))
            if code in AGREED_ENDS:
                self.vacant.add(local_rank)  # (the job's end: its exit code is the job's)
                continue
            line = f"shardwise: {membership.member_name(member)} {_exit(failure)}"
            if self.on_failure == "replace":
                self._replace(worker_group, local_rank, member)
                line += "; a replacement starts"
            else:
                self.vacant.add(local_rank)
            print(f"{line}; the others go on without it", file=sys.stderr, flush=True)

    def _replace(self, worker_group, local_rank: int, member: str) -> None:
        context = self._pcontext
        self.starts[local_rank] = self.starts.get(local_rank, 0) + 1
        slot = member.partition("#")[0]
        newcomer = f"{slot}#{self.starts[local_rank]}"
        env = {**context.envs[local_rank], membership.ID_ENV: newcomer}
        handler = get_subprocess_handler(
            entrypoint=context.entrypoint,
            args=context.args[local_rank],
            env=env,
            stdout=context.stdouts[local_rank],
            stderr=context.stderrs[local_rank],
            local_rank_id=local_rank,
        )
        context.subprocess_handlers[local_rank] = handler
        context._running_local_ranks.add(local_rank)
        worker_group.workers[local_rank].id = handler.proc.pid
        self.members[local_rank] = newcomer

    def _say_restart(self, worker_group, result):
        if not result.is_failed() or self._remaining_restarts <= 0:
            return result
        if any(f.exitcode == NONFINITE_EXIT for f in result.failures.values()):
            self._remaining_restarts = 0  # the same batches would stop it again: no restart
            return result
        done = worker_group.spec.max_restarts - self._remaining_restarts + 1
        print(
            f"shardwise: {_what_failed(result.failures, self.job_store, done - 1)}; restarting "
            f"every rank (restart {done} of {worker_group.spec.max_restarts}), resuming from "
            "the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        return result


def _what_failed(failures: dict[int, ProcessFailure], store, attempt: int) -> str:
    """What ended a start of the job, in a few words: the watchdog's verdict, or the rank that
    failed first and why."""
    verdict = store.read(f"attempt-{attempt}/{leaving.PREFIX}/verdict")
    if verdict is not None:
        return verdict.decode(errors="replace")
    rank, failure, reason = _culprit(failures, store, attempt)
    return f"rank {rank} {f'failed: {reason}' if reason else _exit(failure)}"


def _exit(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        with_signal = signal.Signals(-failure.exitcode).name
        return f"was killed by {with_signal}"
    return f"failed with exit code {failure.exitcode}"


def _launch(
    python_args: list[str],
    nproc: int,
    threads_per_rank: int | None,
    max_restarts: int = 0,
    on_failure: str = "stop",
    bind_cores: bool = False,
) -> None:
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    workers = worker_environment(nproc, threads_per_rank, bind_cores)
    with (
        jobstore.JobStoreServer(jobstore.new_secret()) as store,
        _environment({**workers, **store.environment()}),
        zygote.running(python_args, dict(os.environ)) as forked,
        _environment(forked),
        agent_logs() as logs,
    ):
        try:
            failures, attempt = _run_agent(
                python_args, nproc, max_restarts, logs, store, on_failure
            )
        except SignalException as e:  # SIGTERM / SIGINT: the agent stopped the ranks
            raise Stopped(int(e.sigval)) from None
        if failures:
            raise _failure(failures, store, attempt)


AGENT_LOGS = "shardwise-agent-"  # then the launcher's pid, "-", and tempfile's letters


def agent_logs() -> tempfile.TemporaryDirectory:
    """A folder for torchrun's agent's logs and error files, removed with the job. A launcher
    killed by SIGKILL cannot remove its own: each launch removes those of this user's launchers
    that no longer run (named by pid), so they do not pile up in the temporary directory."""
    for stale in Path(tempfile.gettempdir()).glob(f"{AGENT_LOGS}*-*"):
        pid = stale.name.removeprefix(AGENT_LOGS).split("-", 1)[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and stale.stat().st_uid == os.getuid() and process_ended(int(pid)):
                shutil.rmtree(stale)
    return tempfile.TemporaryDirectory(prefix=f"{AGENT_LOGS}{os.getpid()}-")


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """`values` in this process's environment (the agent's workers inherit it) for the job,
    and as it was after: a later job (or a torchrun rank started from here) must not take this
    one's store, secret or parent for its own."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_agent(
    python_args: list[str], nproc: int, max_restarts: int, logs: str, store, on_failure: str
) -> tuple[dict[int, ProcessFailure], int]:
    """What `torch.distributed.launcher.api.launch_agent` does for one node, with our agent:
    the failures of the last start ({} when every rank succeeded), and which start it was."""
    run_id = f"shardwise-{uuid.uuid4().hex[:8]}"
    parameters = RendezvousParameters(
        backend=loopback.BACKEND,  # the agent hosts torchrun's store, on 127.0.0.1 only
        endpoint="",
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
    )
    rendezvous = rendezvous_registry.get_rendezvous_handler(parameters)
    spec = WorkerSpec(
        role="default",
        local_world_size=nproc,
        entrypoint=sys.executable,
        args=tuple(boot_argv(python_args)),
        rdzv_handler=rendezvous,
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    agent = _Agent(spec, logs, store, on_failure)
    try:
        result = agent.run()
    finally:
        rendezvous.shutdown()
    attempt = max_restarts - agent._remaining_restarts
    return (result.failures if result.is_failed() else {}), attempt


def _failure(
    failures: dict[int, ProcessFailure], store: jobstore.JobStoreServer, attempt: int
) -> LaunchError:
    """The error that names what ended the job's start `attempt`: a hang's verdict (the rank
    that hung), a stop signal, or the first rank to fail and the reason it gave as it left."""
    if store.read(f"attempt-{attempt}/{leaving.PREFIX}/verdict") is not None:
        error = LaunchError(_what_failed(failures, store, attempt))
        error.exit_code = 3
        return error
    rank, failure, reason = _culprit(failures, store, attempt)
    codes = {128 + s for s in STOP_SIGNALS}
    if failure.exitcode in codes:  # the ranks stopped on a signal, after saving a checkpoint
        name = signal.Signals(failure.exitcode - 128).name
        return Stopped(
            failure.exitcode - 128,
            f"the job stopped on {name} to a rank, after saving a checkpoint (see above)",
        )
    if failure.exitcode == NONFINITE_EXIT:  # every rank stopped under train.nonfinite
        error = LaunchError("the run stopped on non-finite values (train.nonfinite; see above)")
        error.exit_code = NONFINITE_EXIT
        return error
    if reason:  # what it said as it left (the agent may have stopped it after that)
        return LaunchError(f"worker rank {rank} failed: {reason}")
    return LaunchError(f"worker rank {rank} {_exit(failure)} (its output is above)")


def _culprit(
    failures: dict[int, ProcessFailure], store: jobstore.JobStoreServer, attempt: int
) -> tuple[int, ProcessFailure, str]:
    """The rank that failed first, its failure and what it said as it left. First, a rank that
    died or exited saying nothing (killed where it stood, or `os._exit`), unless the agent
    stopped it; then one that said why it failed; then one whose connection broke (the victim
    of another's death). Among equals, the first to say it leaves, then the first the agent saw."""
    key = f"attempt-{attempt}/{leaving.PREFIX}/left"
    left = {r: _record(store.read(f"{key}/{r}")) for r in failures}

    def first(item: tuple[int, ProcessFailure]) -> tuple:
        rank, failure = item
        reason = str(left[rank].get("reason", ""))
        stopped = failure.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)
        rank_class = 0 if not left[rank] and not stopped else 2 if broken_connection(reason) else 1
        return (rank_class, left[rank].get("order", math.inf), failure.timestamp)

    rank, failure = min(failures.items(), key=first)
    return rank, failure, str(left[rank].get("reason", ""))[:300]


def _record(value: bytes | None) -> dict:
    """A JSON record a rank left in the store ({} if none, or not one)."""
    try:
        record = json.loads(value) if value is not None else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
