"""The flight recorder: every collective this rank issued, and the one it is blocked in.

Per process group, each collective gets the next sequence number, and a running hash of the
group's calls (op, shape, dtype) summarises the whole sequence in one number: ranks that
issued the same collectives in the same order have equal hashes. The recorder keeps the last
calls with their call sites (the first frame outside `shardwise.comm`), and marks which call
this rank is waiting in and since when: what the watchdog (`faults/watchdog.py`) reads to name
a hang or a desync. Recording costs a dictionary update and a CRC per call.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

COMM_DIR = str(Path(__file__).resolve().parent)
KEEP = 64  # calls remembered per rank
P2P = "p2p"  # point-to-point traffic is recorded under one name, never compared across ranks
# Messages of groups whose waits have no bound (a parameter server waits for a worker's next
# message as long as the worker computes; its heartbeats watch it): never a hang.
UNWATCHED = "p2p-unwatched"


def collective_groups(counts: dict[str, int]) -> dict[str, int]:
    """`counts` without the point-to-point entries: what ranks of a group must agree on."""
    return {g: n for g, n in counts.items() if g not in (P2P, UNWATCHED)}


@dataclass(frozen=True)
class Call:
    op: str
    group: str  # "world", or the group's global ranks ("0,2")
    seq: int  # this call's number in its group (1 = the group's first)
    shape: tuple[int, ...]
    dtype: str
    site: str  # file:line (function) of the caller

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.op} #{self.seq} (group {self.group}, {shape} {self.dtype}) at {self.site}"

    def signature(self) -> str:
        """What must be equal on every rank of the group."""
        return f"{self.op}|{self.shape}|{self.dtype}"

    def to_json(self) -> dict:
        return {**self.__dict__, "shape": list(self.shape)}


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(COMM_DIR):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"


class FlightRecorder:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seq: dict[str, int] = {}
        self.hash: dict[str, int] = {}
        self.history: deque[Call] = deque(maxlen=KEEP)
        # thread -> (the call it waits for, monotonic time it began): a communication thread
        # (ring all-reduce) waits in its own calls while the training thread computes
        self.waiting: dict[int, tuple[Call, float]] = {}
        self.check_call = None  # debug mode: compares each call across ranks before it runs
        self._names: dict[int, str] = {}
        self._unwatched: set[int] = set()  # ids of groups whose waits are never hangs

    def unwatch(self, group: dist.ProcessGroup) -> None:
        """Waits in `group` have no bound (see UNWATCHED)."""
        self._unwatched.add(id(group))

    def group_name(self, group: dist.ProcessGroup | None) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        key = id(group)
        if key not in self._names:
            self._names[key] = ",".join(map(str, dist.get_process_group_ranks(group)))
        return self._names[key]

    def issue(
        self, op: str, group: dist.ProcessGroup | None, tensor: torch.Tensor | None = None
    ) -> Call:
        if group is not None and id(group) in self._unwatched:
            name = UNWATCHED
        else:
            name = P2P if op in ("send", "recv", "p2p") else self.group_name(group)
        seq = self.seq.get(name, 0) + 1
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "-"
        call = Call(op, name, seq, shape, dtype, _site())
        self.seq[name] = seq
        self.hash[name] = zlib.crc32(call.signature().encode(), self.hash.get(name, 0))
        self.history.append(call)
        if self.check_call is not None and name not in (P2P, UNWATCHED):
            self.check_call(call, group)
        return call

    @contextlib.contextmanager
    def blocked_in(self, call: Call):
        """Marks the time this thread waits for `call` to finish."""
        thread = threading.get_ident()
        self.waiting[thread] = (call, time.monotonic())
        try:
            yield
        finally:
            self.waiting.pop(thread, None)

    def longest_wait(self) -> tuple[Call, float] | None:
        """The call waited for longest, and for how many seconds (unbounded waits left out)."""
        waits = [w for w in self.waiting.values() if w[0].group != UNWATCHED]
        if not waits:
            return None
        call, since = min(waits, key=lambda w: w[1])
        return call, time.monotonic() - since

    def last(self) -> Call | None:
        return self.history[-1] if self.history else None


recorder = FlightRecorder()
