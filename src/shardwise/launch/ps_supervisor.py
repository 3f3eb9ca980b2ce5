"""The supervisor of a parameter-server job: S + W processes on this machine, started directly.

torchrun's agent ends every process when one fails: right for lock-step strategies, wrong here,
where surviving a dead worker is the point. So this supervisor starts the processes itself (the
environment torchrun would set), hosts the job's store (`comm/jobstore.py`, on 127.0.0.1 only)
as torchrun's agent hosts its own (so a frozen server cannot take everyone's heartbeats with it),
reports a worker that dies and lets the others go on (the servers notice through the
heartbeats), and when a server dies, goes silent (SIGSTOPped, say: its heartbeats stop) or stays
stuck once every worker has given up on it, it stops the rest and starts the job again once: the
servers resume from their snapshots and the workers from the servers' version. A relay
(two-level job) counts as a server here: its workers cannot go on without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from shardwise.comm import jobstore
from shardwise.config import Config
from shardwise.distributed import loopback, zygote
from shardwise.distributed.launcher import boot_argv, worker_environment
from shardwise.distributed.signals import handling_stop_signals
from shardwise.faults.nonfinite import EXIT_NONFINITE
from shardwise.ps.liveness import EXIT_SERVER_LOST, FIRST_BEAT_S, HeartbeatWatch, gave_up_key
from shardwise.ps.snapshots import EXIT_NO_SNAPSHOT

GRACE_S = 3.0  # seconds the job's processes get to leave after SIGTERM, before SIGKILL
WORKERS_NOTICE_S = 1.5  # seconds the workers get to notice a failed server themselves


@dataclass(frozen=True)
class Layout:
    """Who is who in the job (ranks: servers, then relays, then workers) and how the serving
    ranks prove they live (the job's `strategy.heartbeat_s` and `timeout_s`)."""

    servers: int  # shards (each on `replicas` server processes)
    relays: int = 0
    heartbeat_s: float = 0.5
    timeout_s: float = 10.0
    replicas: int = 1

    @property
    def serving(self) -> int:
        return self.servers * self.replicas + self.relays

    def role(self, rank: int) -> str:
        servers = self.servers * self.replicas
        kind = "server" if rank < servers else "relay" if rank < self.serving else "worker"
        return f"{kind} rank {rank}"

    def partner(self, rank: int) -> int | None:
        """The other server of a replicated shard (None: no replicas, or not a server)."""
        if self.replicas == 1 or rank >= self.servers * self.replicas:
            return None
        return (rank + self.servers) % (self.servers * self.replicas)

    def fatal(self, rank: int, procs: list[subprocess.Popen]) -> bool:
        """Whether the job cannot go on without `rank`: a server or relay whose shard has no
        other server still running."""
        if rank >= self.serving:
            return False
        partner = self.partner(rank)
        return partner is None or procs[partner].poll() is not None

    def served(self, procs: list[subprocess.Popen]) -> bool:
        """Whether every serving rank has ended and each shard's was served to the end (by one
        of its servers) and every relay finished."""
        if any(p.poll() is None for p in procs[: self.serving]):
            return False
        relays = procs[self.servers * self.replicas : self.serving]
        shards = [
            [procs[shard + k * self.servers] for k in range(self.replicas)]
            for shard in range(self.servers)
        ]
        return all(p.returncode == 0 for p in relays) and all(
            any(p.returncode == 0 for p in pair) for pair in shards
        )


@dataclass
class Attempt:
    """One start of the job's processes, with the store they meet in (hosted here)."""

    procs: list[subprocess.Popen]
    store: jobstore.JobStoreServer
    client: jobstore.JobStoreClient  # (held: `keys` does not keep its Python object alive)
    keys: dist.Store  # the store below the attempt's prefix: what the ranks write
    watch: HeartbeatWatch  # the serving ranks' heartbeats
    failures: dict[int, int] = field(default_factory=dict)  # rank -> exit code
    servers_done_at: float | None = None  # when every serving rank had finished well

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)


def _start(
    argv: list[str],
    nproc: int,
    workers: dict[str, str],  # `worker_environment`'s
    attempt: int,
    layout: Layout,
    forked: dict[str, str],
) -> Attempt:
    # The job's store lives in the supervisor, as torchrun's agent hosts its own: a rank that
    # freezes freezes nobody's store requests (heartbeats).
    server = jobstore.JobStoreServer(jobstore.new_secret())
    env = {**os.environ, **workers, **server.environment(), **forked}
    env.update(
        MASTER_ADDR=loopback.HOST,  # gloo's sockets follow it: 127.0.0.1 only
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        SHARDWISE_PS_ATTEMPT=str(attempt),
    )
    client = jobstore.JobStoreClient(server.address, server.secret)
    keys = dist.PrefixStore(f"attempt-{attempt}", client)
    watch = HeartbeatWatch(
        list(range(layout.serving)),
        layout.timeout_s,
        layout.heartbeat_s / 2,
        store=keys,
        startup_s=FIRST_BEAT_S,
    )
    # One process group for the job's processes (its leader the first): a signal to the
    # supervisor is passed on to all of them at once.
    procs: list[subprocess.Popen] = []
    for r in range(nproc):
        group = procs[0].pid if procs else 0
        env_r = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        command = [sys.executable, *boot_argv(argv)]
        procs.append(subprocess.Popen(command, env=env_r, process_group=group))
    return Attempt(procs, server, client, keys, watch)


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


def supervise(
    argv: list[str],
    layout: Layout,
    nproc: int,
    threads: int | None,
    restarts: int,
    bind_cores: bool = False,
) -> tuple[bool, dict[int, int]]:
    """Run the processes; returns (whether the servers and relays finished, {rank: exit code}
    of processes that failed)."""
    running: list[subprocess.Popen] = []
    workers = worker_environment(nproc, threads, bind_cores)
    base = {**os.environ, **workers}
    with _ending_children_on_signals(running), zygote.running(argv, base) as forked:
        for attempt in range(restarts + 1):  # (a restart's processes are forks too: no imports)
            job = _start(argv, nproc, workers, attempt, layout, forked)
            running[:] = job.procs
            if _watch(job, layout):
                return layout.served(job.procs), job.failures
            if EXIT_NO_SNAPSHOT in [job.failures.get(r) for r in range(layout.servers)]:
                print(
                    "shardwise: not restarting the job: the servers have no usable snapshot "
                    "to resume from (their own lines say why), and a restart cannot help",
                    flush=True,
                )
                return False, job.failures
            if EXIT_NONFINITE in job.failures.values():  # (the same data would do it again)
                return False, job.failures
            if attempt < restarts:
                print(
                    "shardwise: restarting the job; servers resume from their snapshots",
                    flush=True,
                )
        return False, job.failures


def _watch(job: Attempt, layout: Layout) -> bool:
    """Until every process has ended; False if a server or relay failed (died, went silent, or
    was given up on by a rank waiting on it), after stopping the others."""
    try:
        return _watch_until_done(job, layout)
    finally:
        job.store.close()


def _watch_until_done(job: Attempt, layout: Layout) -> bool:
    while True:
        running = job.running()  # (before the exits are noted: the last one is noted too)
        failed = _note_exits(job, layout)
        for rank, silent_s in job.watch.dead(_running_serving(job, layout)):
            silent = f"ps {layout.role(rank)} silent for {silent_s:.1f} s (no heartbeat: "
            silent += "frozen or unreachable)"
            if not layout.fatal(rank, job.procs):  # its backup serves on: its connections
                job.procs[rank].kill()  # must break, for its workers to go over
                print(f"shardwise: {silent}; killed, its backup serves on", flush=True)
                continue
            print(f"shardwise: {silent}; stopping the job", flush=True)
            job.failures[rank], failed = -signal.SIGKILL, True
        if failed:
            # Its workers notice it too (the same timeout): give them a moment to say so and
            # leave on their own, before the rest is stopped.
            deadline = time.monotonic() + WORKERS_NOTICE_S
            while job.running() and time.monotonic() < deadline:
                time.sleep(0.05)
            _note_exits(job, layout)  # (those who left on their own, before the rest is stopped)
            for p in job.procs:
                p.kill()
            for p in job.procs:
                p.wait()
            return False
        if not running:
            return True
        _stop_workers_left_behind(job, layout)
        time.sleep(0.1)


def _running_serving(job: Attempt, layout: Layout) -> set[int]:
    return {r for r in range(layout.serving) if job.procs[r].poll() is None}


def _note_exits(job: Attempt, layout: Layout) -> bool:
    """Report each process that ended badly, once; True if the job cannot go on: a server or
    relay failed, or a rank gave up on one (it names it in the store) that still runs."""
    failed = False
    for rank, p in enumerate(job.procs):
        code = p.poll()
        if code in (None, 0) or rank in job.failures:
            continue
        job.failures[rank] = code
        culprit = _given_up_on(job, rank) if code == EXIT_SERVER_LOST else None
        if code == EXIT_NONFINITE:
            print(
                f"shardwise: ps {layout.role(rank)} stopped on non-finite values "
                "(train.nonfinite; its own line says which): stopping the job",
                flush=True,
            )
            failed = True
        elif culprit is not None:
            print(
                f"shardwise: ps {layout.role(rank)} gave up on {layout.role(culprit)} (silent "
                "or stuck; its own line says which)",
                flush=True,
            )
            if culprit in _running_serving(job, layout):
                print(f"shardwise: stopping the job: {layout.role(culprit)} failed", flush=True)
                job.failures.setdefault(culprit, -signal.SIGKILL)
                failed = True
        elif rank < layout.serving and not layout.fatal(rank, job.procs):
            partner = layout.partner(rank)
            print(
                f"shardwise: ps {layout.role(rank)} exited with code {code}; server rank "
                f"{partner} serves its shard on",
                flush=True,
            )
            continue
        elif rank < layout.serving:
            print(f"shardwise: ps {layout.role(rank)} exited with code {code}", flush=True)
        else:
            print(
                f"shardwise: ps {layout.role(rank)} exited with code {code}; the others go on",
                flush=True,
            )
        failed = failed or rank < layout.serving
    return failed


def _given_up_on(job: Attempt, rank: int) -> int | None:
    """The upstream rank that `rank` gave up on, from the key its guard left (None if none)."""
    key = gave_up_key(rank)
    if not job.keys.check([key]):
        return None
    try:
        return int(job.keys.get(key))
    except ValueError:
        return None


def _stop_workers_left_behind(job: Attempt, layout: Layout) -> None:
    """Once every server (and relay) has finished, a worker still running was declared dead or
    stuck by them (its training hung, its process lives on): after a grace period, stop it and
    name it, so that the job ends."""
    if not layout.served(job.procs):
        return
    now = time.monotonic()
    if job.servers_done_at is None:
        job.servers_done_at = now
    if now - job.servers_done_at <= GRACE_S:
        return
    for rank, p in enumerate(job.procs[layout.serving :], start=layout.serving):
        if p.poll() is None:
            p.kill()
            job.failures[rank] = p.wait()
            print(
                f"shardwise: ps {layout.role(rank)} still running {GRACE_S:.0f} s after the "
                "servers finished (declared dead or stuck by them): stopped",
                flush=True,
            )


def run_ps_job(cfg: Config, argv: list[str], run_dir: Path) -> int:
    """Run the roles (`argv`: `shardwise train CONFIG --run-dir RUN_DIR`), then summarise; 1 if
    a server failed for good, or fewer workers finished than `strategy.min_workers` (all by
    default: the summary is still written, and each failed role named)."""
    from shardwise.train.ps_training import summarise

    s = cfg.strategy
    layout = Layout(s.servers, s.relays, s.heartbeat_s, s.timeout_s, s.replicas)
    restarts = 1 if s.snapshot_every else 0
    started = time.perf_counter()
    argv = ["-m", *argv]
    launch = cfg.launch
    ok, failures = supervise(
        argv, layout, launch.nproc, launch.threads_per_rank, restarts, launch.bind_cores
    )
    failed = ", ".join(
        f"{layout.role(r)} (exit code {code})" for r, code in sorted(failures.items())
    )
    if not ok:
        print(f"shardwise: the parameter-server job failed: {failed}", file=sys.stderr)
        return 1
    finished = s.workers - sum(r >= layout.serving for r in failures)
    if finished:  # a job whose every worker died did not train: nothing to sum up
        summarise(cfg, run_dir, time.perf_counter() - started, failures)
    needed = s.min_workers if s.min_workers is not None else s.workers
    if finished < needed:
        print(
            f"shardwise: {finished} of {s.workers} parameter-server workers finished "
            f"(strategy.min_workers: {needed}); failed: {failed}",
            file=sys.stderr,
        )
        return 1
    return 0
