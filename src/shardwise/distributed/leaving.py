"""A rank that leaves the job says so in the job's store: who left, why, and after how many calls.

A rank waiting in a collective that a departed peer never issued is then a hang at once, not
after the timeout (the watchdog reads these records), and a launcher names the rank that failed
first, not the ones that timed out waiting for it.
"""

from __future__ import annotations

import json

from shardwise.comm.flight import collective_groups, recorder

PREFIX = "shardwise/watchdog"  # (beside the watchdog's heartbeats: one place to look)


def announce(store, rank: int, reason: str) -> None:
    """Record that `rank` leaves (`reason`: '' for a normal end), with how many calls it issued
    per group."""
    order = store.add(f"{PREFIX}/left-count", 1)  # (the first to leave is the likely culprit)
    record = {"reason": reason, "seq": collective_groups(dict(recorder.seq)), "order": order}
    store.set(f"{PREFIX}/left/{rank}", json.dumps(record))


def count(store) -> int:
    """How many ranks have left so far."""
    return store.add(f"{PREFIX}/left-count", 0)


def record(store, rank: int) -> dict | None:
    """What `rank` said when it left, or None while it has not."""
    key = f"{PREFIX}/left/{rank}"
    return json.loads(store.get(key)) if store.check([key]) else None


def failed_ranks(store, world_size: int, but: int) -> list[int]:
    """The ranks (other than `but`) that announced they left the job on a failure."""
    return [
        rank
        for rank in range(world_size)
        if rank != but and (record(store, rank) or {}).get("reason")
    ]
