"""Heartbeats through the c10d store: a thread that proves this process lives, a watch that
notices who has gone silent, and a guard that ends a process waiting on a server that went
silent (or stopped answering).

A counter per rank in the store, bumped every `period_s`, costs one tiny store request and needs
no connection of its own; a rank whose counter has not moved for `timeout_s` is dead (a frozen
process looks the same as a killed one, which is what a training job cares about). Every role
beats: workers and relays for their servers, servers for their clients and the supervisor (which
hosts the store, so a frozen server cannot take the heartbeats of the others with it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from shardwise.distributed import runtime

GIVE_UP_AFTER = 20  # consecutive failed beats: the store went away with the job
EXIT_SERVER_LOST = 3  # exit code of a process that gave up on a silent or stuck server
FIRST_BEAT_S = 120.0  # silence allowed before a rank's first beat (imports, data, snapshots)


def heartbeat_key(rank: int) -> str:
    return f"shardwise/ps/heartbeat/{rank}"


def finished_key(rank: int) -> str:
    """Set when a rank stops beating because it is done (not silent: nobody waits for it)."""
    return f"shardwise/ps/finished/{rank}"


def gave_up_key(rank: int) -> str:
    """Set by a rank that gave up on an upstream one: the culprit's rank, for the supervisor."""
    return f"shardwise/ps/gave-up/{rank}"


class HeartbeatSender:
    """Bump this rank's counter every `period_s` until `stop()` (which marks it finished)."""

    def __init__(self, rank: int, period_s: float) -> None:
        self._store, self.rank = runtime.store(), rank
        self._key, self._period = heartbeat_key(rank), period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ps-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        # The first beat at once: until it, watchers allow a start-up's silence (FIRST_BEAT_S),
        # and a server forked ready to serve can answer 10 updates before a period has passed.
        while True:
            try:
                self._store.add(self._key, 1)
                failures = 0
            except Exception:  # a transient error is retried; a store gone for good is not
                failures += 1
                if failures >= GIVE_UP_AFTER:
                    return
            if self._stop.wait(self._period):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(Exception):  # (a store already gone: nobody is watching)
            self._store.set(finished_key(self.rank), "1")


class HeartbeatWatch:
    """The last time each watched rank's counter moved."""

    def __init__(
        self,
        ranks: list[int],
        timeout_s: float,
        check_every_s: float,
        store=None,
        startup_s: float | None = None,
    ) -> None:
        """`startup_s` (default: `timeout_s`): the silence allowed before a rank's first beat
        (a process still starting: imports, data, snapshots). A rank that stopped beating
        because it finished is never silent."""
        self.store = store if store is not None else runtime.store()
        self.timeout_s, self.check_every_s = timeout_s, check_every_s
        self.startup_s = timeout_s if startup_s is None else startup_s
        self._seen = {r: (0, time.monotonic()) for r in ranks}
        self._started: set[int] = set()  # heard from before their first beat
        self._next_check = 0.0

    def watch(self, rank: int) -> None:
        """Watch `rank` too, from now (a backup server that beats already)."""
        self._seen[rank] = (0, time.monotonic())
        self._started.add(rank)

    def heard(self, rank: int) -> None:
        """A message came from `rank`: until its first beat, that is its sign of life (it has
        started), and the timeout, not the start-up allowance, runs from here."""
        beats, _ = self._seen[rank]
        if not beats:
            self._seen[rank] = (0, time.monotonic())
            self._started.add(rank)

    def silent_for(self, rank: int) -> float:
        return time.monotonic() - self._seen[rank][1]

    def dead(self, ranks: set[int]) -> list[tuple[int, float]]:
        """Those of `ranks` silent for longer than the timeout, with their silence (looked at
        most every `check_every_s`: each look is one store request per rank)."""
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + self.check_every_s
        out = []
        for rank in sorted(ranks):
            beats = self.store.add(heartbeat_key(rank), 0)
            last, since = self._seen[rank]
            if beats != last:
                self._seen[rank] = (beats, now)
                continue
            starting = not beats and rank not in self._started
            quiet = now - since > (self.startup_s if starting else self.timeout_s)
            if quiet and not self.store.check([finished_key(rank)]):  # (finished: not silent)
                out.append((rank, now - since))
        return out


class UpstreamGuard:
    """Ends this process, naming the culprit, when it waits on an upstream rank (a server, or a
    worker's relay) that went silent for `timeout_s`, or that has not answered one request for
    `stuck_after_s` although it beats (alive, but its loop is stuck: a healthy server answers
    within the progress timeout that unblocks it from a stuck peer, plus a heartbeat check).

    Only while the owner waits (inside `waiting()`): the blocked thread cannot be woken, so the
    guard's thread exits the process; between waits nothing is done to it (a script that is
    computing, or already leaving, is not killed under it)."""

    def __init__(
        self,
        rank: int,
        role: str,
        upstream: dict[int, str],  # rank -> its role ("server", "relay")
        timeout_s: float,
        stuck_after_s: float,
        heartbeat_s: float,
    ) -> None:
        self.rank, self.me = rank, f"{role} rank {rank}"
        self.upstream, self.stuck_after_s = upstream, stuck_after_s
        self._watch = HeartbeatWatch(
            list(upstream), timeout_s, heartbeat_s / 2, startup_s=FIRST_BEAT_S
        )
        self._since: float | None = None  # when the current wait began
        self._on: int | None = None  # whose answer the current wait is for
        self._stop = threading.Event()
        self._period = heartbeat_s / 2
        self._store_failed_since: float | None = None
        self.patient: set[int] = set()  # upstream ranks with a backup to go over to
        self._thread = threading.Thread(target=self._run, daemon=True, name="ps-guard")
        self._thread.start()

    @contextlib.contextmanager
    def waiting(self, on: int | None = None):
        """Around a blocking wait for upstream rank `on`'s answer; `on=None` for a wait with no
        bound on its length (a relay's whole serving loop: only silence ends it)."""
        self._on, self._since = on, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def replace(self, old: int, new: int) -> None:
        """Watch `new` instead of `old` (a worker went over to a server's backup)."""
        self.upstream[new] = self.upstream.pop(old)
        self.patient.discard(old)
        self._watch.watch(new)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                silent = self._watch.dead(set(self.upstream))
                self._store_failed_since = None
            except Exception:  # the store (hosted by the launcher) is unreachable
                silent = []
                self._store_failed_since = self._store_failed_since or time.monotonic()
            since = self._since
            if since is None:
                continue
            now = time.monotonic()
            # (a server with a backup gets another timeout: our supervisor kills a silent one
            # that has a backup, and its broken connection sends this worker over)
            silent = [
                (r, t) for r, t in silent if r not in self.patient or t > 2 * self._watch.timeout_s
            ]
            if silent:
                rank, silent_s = silent[0]
                self._give_up(rank, f"silent for {silent_s:.1f} s")
            elif (on := self._on) is not None and now - since > self.stuck_after_s:
                self._give_up(on, f"has not answered for {now - since:.1f} s (alive: stuck)")
            elif (failed := self._store_failed_since) and now - failed > self._watch.timeout_s:
                self._give_up(None, "the job's store (hosted by its launcher) unreachable")

    def _give_up(self, culprit: int | None, what: str) -> None:
        if culprit is not None:
            what = f"{self.upstream[culprit]} rank {culprit} {what}"
            with contextlib.suppress(Exception):  # (the supervisor names it from this key)
                self._watch.store.set(gave_up_key(self.rank), str(culprit))
        print(f"shardwise: ps {self.me}: {what}; ending this process", file=sys.stderr, flush=True)
        os._exit(EXIT_SERVER_LOST)
