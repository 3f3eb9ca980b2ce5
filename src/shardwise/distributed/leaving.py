"""A rank that leaves the job says so in the job's store: who left, why, and after how many calls.

A rank waiting in a collective that a departed peer never issued is then a hang at once, not
after the timeout (the watchdog reads these records), and a launcher names the rank that failed
first, not the ones that timed out waiting for it.
"""

from __future__ import annotations

import json
import time

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


# Joining: every rank of a start arrives in the job's store before its process group forms,
# and a launcher notes each rank process that ends. A rank waiting for one that ended before it
# arrived (its script returned, or failed, before `sw.init()`) hears so at once, not when the
# group's rendezvous times out minutes later.
JOINING = "shardwise/joining"
POLL_S = (0.005, 0.05)  # the first and the longest pause between two looks


class EndedBeforeJoining(RuntimeError):
    """Ranks of the job ended, or never came, before they joined it (`arrive`)."""


def note_ended(write, rank: int, code: int) -> None:
    """(The launcher) rank `rank`'s process ended with `code`; `write(key, value)` sets a key
    of this start."""
    write(f"{JOINING}/ended/{rank}", str(code))
    write(f"{JOINING}/ended-any", "1")


def arrive(store, rank: int, world_size: int, timeout_s: float) -> None:
    """Say this rank arrived, and wait for the others: `EndedBeforeJoining` (one line) naming
    the ranks that ended before they arrived, at once, or those still missing after
    `timeout_s`."""
    store.set(f"{JOINING}/arrived/{rank}", "1")
    store.add(f"{JOINING}/arrivals", 1)
    deadline, pause = time.monotonic() + timeout_s, POLL_S[0]
    while store.add(f"{JOINING}/arrivals", 0) < world_size:
        late = time.monotonic() > deadline
        if late or store.check([f"{JOINING}/ended-any"]):
            missing = [r for r in range(world_size) if not store.check([f"{JOINING}/arrived/{r}"])]
            ended = {r: store.get(f"{JOINING}/ended/{r}").decode() for r in missing
                     if store.check([f"{JOINING}/ended/{r}"])}  # fmt: skip
            if ended or late:
                said = [f"rank {r} ended (exit code {c})" for r, c in sorted(ended.items())]
                said += [f"rank {r} never came" for r in missing if r not in ended]
                raise EndedBeforeJoining(
                    f"{'; '.join(said)} before joining the job (its sw.init()): rank {rank} "
                    "cannot form the process group"
                )
        time.sleep(pause)
        pause = min(2 * pause, POLL_S[1])
