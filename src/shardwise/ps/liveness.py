"""Heartbeats through the c10d store: a thread that proves this process lives, and a watch that
notices who has gone silent.

A counter per rank in the store, bumped every `period_s`, costs one tiny store request and needs
no connection of its own; a rank whose counter has not moved for `timeout_s` is dead (a hung
process looks the same as a killed one, which is what a training job cares about).
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

GIVE_UP_AFTER = 20  # consecutive failed beats: the store went away with the job


def _key(rank: int) -> str:
    return f"shardwise/ps/heartbeat/{rank}"


class HeartbeatSender:
    """Bump this rank's counter every `period_s` until `stop()`."""

    def __init__(self, rank: int, period_s: float) -> None:
        self._store = dist.distributed_c10d._get_default_store()
        self._key, self._period = _key(rank), period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ps-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self._period):
            try:
                self._store.add(self._key, 1)
                failures = 0
            except Exception:  # a transient error is retried; a store gone for good is not
                failures += 1
                if failures >= GIVE_UP_AFTER:
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class HeartbeatWatch:
    """The last time each watched rank's counter moved."""

    def __init__(self, ranks: list[int], timeout_s: float, check_every_s: float) -> None:
        self._store = dist.distributed_c10d._get_default_store()
        self.timeout_s, self.check_every_s = timeout_s, check_every_s
        self._seen = {r: (-1, time.monotonic()) for r in ranks}
        self._next_check = 0.0

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
            beats = self._store.add(_key(rank), 0)
            last, since = self._seen[rank]
            if beats != last:
                self._seen[rank] = (beats, now)
            elif now - since > self.timeout_s:
                out.append((rank, now - since))
        return out
