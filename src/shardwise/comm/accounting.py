"""Communication accounting: calls, bytes sent by this rank and time spent waiting, per step.

Every collective shardwise issues goes through `shardwise.comm`, which records here. The
training loop reads `stats.end_step()` once per step; benchmarks and tests read the same numbers.

Bytes are the bytes *this rank sends*. For our own algorithms built on point-to-point messages
(ring all-reduce, pipelines, parameter servers) that is the sum of the messages' sizes. For the
backend's native collectives, whose internal algorithm we cannot observe, it is the volume the
bandwidth-optimal textbook algorithm sends per rank (see `native_volume`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


def native_volume(op: str, nbytes: int, group_size: int, is_root: bool = False) -> int:
    """Bytes one rank sends for a native collective over `nbytes` of payload.

    all_reduce: ring reduce-scatter + all-gather, 2(n-1)/n of the payload.
    all_gather / reduce_scatter: (n-1)/n of the full (gathered / unscattered) payload.
    all_to_all: (n-1)/n of the payload (every chunk but this rank's own, sent once, directly).
    broadcast: the root sends the payload once to each other rank (flat tree).
    reduce: every non-root rank sends its payload once to the root (flat tree).
    """
    n = group_size
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes // n
    if op == "broadcast":
        return (n - 1) * nbytes if is_root else 0
    if op == "reduce":
        return 0 if is_root else nbytes
    raise ValueError(f"unknown collective {op!r}")


@dataclass
class OpTotals:
    calls: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    overlap_s: float = 0.0  # asynchronous calls: issue to wait, the most they overlapped compute


@dataclass
class CommSnapshot:
    """Totals over a window (one step, or the whole run), overall and per operation."""

    calls: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    overlap_s: float = 0.0
    by_op: dict[str, OpTotals] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "bytes": self.bytes,
            "wait_s": round(self.wait_s, 6),
            "by_op": {k: vars(v) for k, v in sorted(self.by_op.items())},
        }


class CommStats:
    """Counters per operation, for one step and the run; communication may be issued from a
    background thread.

    A call is noted as one tuple appended to a queue (`deque.append` is atomic: no lock, no
    table to look up), and the notes are added into the open step's table when it is read
    (`end_step`, `step_wait_s`, `total`). On every collective's path, what a call costs is
    what it touches: on 2 cores, code run right after a collective's wait runs from cold
    caches, and a locked update of a table per call cost 5-7 us end to end there (0.4 warm).
    """

    # (a read folds the notes at least this often: a loop that never ends a step stays bounded)
    FOLD_EVERY = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: dict[str, OpTotals] = {}
        self._ended: dict[str, OpTotals] = {}  # the run's totals, up to the last step's end
        # (op, calls, bytes, seconds waited, seconds overlapped): the calls not yet in `_step`
        self._notes: deque[tuple[str, int, int, float, float]] = deque()
        # Threads that communicate for the training thread (a codec's, the hierarchical
        # all-reduce's): their blocking is not waiting time. A set of idents: asked on every
        # call, a membership test costs a seventh of a missing `threading.local` attribute.
        self._background: set[int] = set()
        # Told of every call that blocked the training thread (op, bytes, seconds blocked):
        # the timeline, while it records.
        self.listener: Callable[[str, int, float], None] | None = None

    def _note(self, note: tuple[str, int, int, float, float]) -> None:
        """(op, calls, bytes, seconds waited, seconds overlapped), noted (inline where a call's
        path cannot afford a Python call: `record`, `record_waited`)."""
        notes = self._notes
        notes.append(note)
        if len(notes) > self.FOLD_EVERY:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Add the notes into the open step's table (the lock held). A note appended meanwhile
        by another thread is added now or by the next fold."""
        notes, step = self._notes, self._step
        while notes:
            op, calls, nbytes, wait_s, overlap_s = notes.popleft()
            totals = step.get(op)
            if totals is None:
                totals = step[op] = OpTotals()
            totals.calls += calls
            totals.bytes += nbytes
            totals.wait_s += wait_s
            totals.overlap_s += overlap_s

    def record(self, op: str, nbytes: int, wait_s: float = 0.0, calls: int = 1) -> None:
        """Count one call of `op` sending `nbytes`, which blocked the caller `wait_s` seconds."""
        if threading.get_ident() in self._background:
            wait_s = 0.0  # a background thread's blocking does not stall training
        notes = self._notes  # (`_note`)
        notes.append((op, calls, nbytes, wait_s, 0.0))
        if len(notes) > self.FOLD_EVERY:
            with self._lock:
                self._fold()
        if self.listener is not None and wait_s > 0:
            self.listener(op, nbytes, wait_s)

    def add_waited(self, op: str, in_flight_s: float, blocked_s: float) -> None:
        """An asynchronous `op` waited for: in flight `in_flight_s` before the wait (the most it
        overlapped compute), then blocking its caller `blocked_s`."""
        if threading.get_ident() in self._background:
            return  # a background thread's blocking does not stall training
        self._note((op, 0, 0, blocked_s, in_flight_s))
        if self.listener is not None and blocked_s > 0:
            self.listener(op, 0, blocked_s)

    def record_waited(self, op: str, nbytes: int, wait_s: float, in_flight_s: float) -> None:
        """One asynchronous call of `op` that sent `nbytes`, counted as it is waited for (one
        note instead of two): `wait_s` it blocked its caller, issuing and waiting, and
        `in_flight_s` it ran in between (the most it overlapped compute)."""
        if threading.get_ident() in self._background:
            wait_s = in_flight_s = 0.0  # a background thread's blocking does not stall training
        notes = self._notes  # (`_note`)
        notes.append((op, 1, nbytes, wait_s, in_flight_s))
        if len(notes) > self.FOLD_EVERY:
            with self._lock:
                self._fold()
        if self.listener is not None and wait_s > 0:
            self.listener(op, nbytes, wait_s)

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """Mark this thread as a communication thread: its blocking is not waiting time."""
        thread = threading.get_ident()
        self._background.add(thread)
        try:
            yield
        finally:
            self._background.discard(thread)

    def step_wait_s(self) -> float:
        """Seconds the training thread has waited on communication in this step so far."""
        with self._lock:
            self._fold()
            return sum(t.wait_s for t in self._step.values())

    def end_step(self) -> CommSnapshot:
        """Return the counters since the previous call and start a new step window."""
        with self._lock:
            self._fold()
            table, self._step = self._step, {}
            _add_into(self._ended, table)
        return _snapshot(table)

    def total(self) -> CommSnapshot:
        """The run's totals so far, the open step's included."""
        with self._lock:
            self._fold()
            both: dict[str, OpTotals] = {}
            _add_into(both, self._ended)
            _add_into(both, self._step)
        return _snapshot(both)

    def reset(self) -> None:
        with self._lock:
            self._notes.clear()
            self._step, self._ended = {}, {}


def _add_into(into: dict[str, OpTotals], table: dict[str, OpTotals]) -> None:
    for op, t in table.items():
        mine = into.setdefault(op, OpTotals())
        mine.calls += t.calls
        mine.bytes += t.bytes
        mine.wait_s += t.wait_s
        mine.overlap_s += t.overlap_s


def _snapshot(table: dict[str, OpTotals]) -> CommSnapshot:
    snap = CommSnapshot(
        by_op={k: OpTotals(v.calls, v.bytes, v.wait_s, v.overlap_s) for k, v in table.items()}
    )
    for v in table.values():
        snap.calls += v.calls
        snap.bytes += v.bytes
        snap.wait_s += v.wait_s
        snap.overlap_s += v.overlap_s
    return snap


#: The process-wide recorder. Like torch.distributed's default group, one process has one.
stats = CommStats()
