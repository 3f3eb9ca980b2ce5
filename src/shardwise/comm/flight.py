"""The flight recorder: every collective this rank issued, and the one it is blocked in.

Per process group, each collective gets the next sequence number, and a running hash of the
group's calls (op, shape, dtype) summarises the whole sequence in one number: ranks that
issued the same collectives in the same order have equal hashes. The recorder keeps the last
calls with their call sites (the first frame outside `shardwise.comm`), and marks which call
this rank is waiting in and since when: what the watchdog (`faults/watchdog.py`) reads to name
a hang or a desync. Recording a call appends its raw fields (the dtype, the caller's code and
the offset of the call in it) to a list; the hashes are brought up to date about every KEEP
calls or when read, and the fields formatted only when read (a hang, a desync, a trace): on 2 cores,
world 2, the record's cost end to end fell from 3.5-4.7 to 1.4-2.5 us a call that way.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import zlib
from operator import itemgetter
from pathlib import Path
from types import CodeType

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


class Call(tuple):
    """One collective as this rank issued it: (op, group, seq, shape, dtype, site). Issuing is on
    every collective's path, so it records raw values (the dtype, the caller's code and the
    offset of the call in it) in a plain tuple (`FlightRecorder.issue`), made a Call
    (`_make_call`) and formatted only when read."""

    __slots__ = ()

    def __new__(
        cls,
        op: str,
        group: str,  # "world", or the group's global ranks ("0,2")
        seq: int,  # this call's number in its group (1 = the group's first)
        shape: tuple[int, ...],
        dtype: str | torch.dtype,
        # file:line (function) of the caller, or its code and the offset of the call in it
        site: str | tuple[CodeType, int] | None,
    ) -> Call:
        return tuple.__new__(cls, (op, group, seq, shape, dtype, site))

    def __getnewargs__(self) -> tuple:  # (a copy or pickle makes it as `__new__` takes it)
        return tuple(self)

    op = property(itemgetter(0))
    group = property(itemgetter(1))
    seq = property(itemgetter(2))
    shape = property(itemgetter(3))

    @property
    def dtype(self) -> str:
        return _dtype_name(self[4])

    @property
    def site(self) -> str:
        site = self[5]
        if isinstance(site, str):
            return site
        if site is None:
            return "?"
        code, offset = site
        return f"{Path(code.co_filename).name}:{_line(code, offset)} ({code.co_name})"

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.op} #{self.seq} (group {self.group}, {shape} {self.dtype}) at {self.site}"

    def signature(self) -> str:
        """What must be equal on every rank of the group."""
        return _signature(self.op, self.shape, self.dtype)

    def to_json(self) -> dict:
        keys = ("op", "group", "seq", "shape", "dtype", "site")
        return {k: list(self.shape) if k == "shape" else getattr(self, k) for k in keys}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Call) and self.to_json() == other.to_json()

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # (compared by what it describes, as a dict, never a key)

    def __repr__(self) -> str:
        return f"Call({self.describe()})"


_make_call = tuple.__new__  # Call's fields, in order, with no Python frame: `_make_call(Call, t)`


def _dtype_name(dtype: str | torch.dtype | None) -> str:
    if dtype is None:
        return "-"
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _signature(op: str, shape: tuple[int, ...], dtype: str) -> str:
    return f"{op}|{tuple(shape)}|{dtype}"


def _line(code: CodeType, offset: int) -> int | None:
    """The source line of the instruction at `offset` (a frame's `f_lasti`) in `code`: what
    `f_lineno` would have said, worked out only when read (decoding the line table on every
    call cost 0.1-0.5 us, several times that end to end on 2 cores)."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line
    return None


_INSIDE: dict[CodeType, bool] = {}  # code object -> whether it is shardwise.comm's own


_P2P_OPS = frozenset(("send", "recv", "p2p"))  # recorded under P2P, whatever their group
_SIGNATURES: dict[tuple, bytes] = {}  # (op, shape, dtype) -> the CRC of the call's signature


def _signature_crc(op: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> bytes:
    key = (op, shape, dtype)
    crc = _SIGNATURES.get(key)
    if crc is None:
        if len(_SIGNATURES) > 4096:  # (shapes that vary step to step: keep it bounded)
            _SIGNATURES.clear()
        signature = _signature(op, shape, _dtype_name(dtype))
        crc = _SIGNATURES[key] = zlib.crc32(signature.encode()).to_bytes(4, "little")
    return crc


class FlightRecorder:
    def __init__(self) -> None:
        self._folding = threading.Lock()  # (the watchdog's thread reads while ranks issue)
        self.reset()

    def reset(self) -> None:
        # Under the fold's lock, one lock for the recorder's life: a fold running in another
        # thread (a watchdog's read) would otherwise finish on the new calls with the old
        # count of those hashed, and leave the new run's first calls out of its hashes.
        with self._folding:
            self._reset()

    def _reset(self) -> None:
        self.seq: dict[str, int] = {}
        # The calls, newest last: the last KEEP at least, and those issued since the last
        # `_fold`, which adds them to their groups' hashes (past 2 KEEP calls, or when read:
        # hashing on each call's path cost 0.2 us warm, several times that end to end).
        self._calls: list[tuple] = []  # (each a Call's fields: `issue`)
        self._hashed = 0  # how many of `_calls`, from the first, the hashes hold
        self._hash: dict[str, int] = {}
        # thread -> (the call it waits for, monotonic time it began): a communication thread
        # (ring all-reduce) waits in its own calls while the training thread computes
        self.waiting: dict[int, tuple[tuple, float]] = {}  # (a Call, or its fields)
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
        self,
        op: str,
        group: dist.ProcessGroup | None,
        tensor: torch.Tensor | None = None,
        depth: int = 2,  # frames from here to the first that may be the call site
    ) -> tuple:
        """Records a call; what it returns stands for it in `waiting` (a Call's fields, read
        as a Call through `longest_wait`, `last` and `history`)."""
        if op in _P2P_OPS:
            name = UNWATCHED if group is not None and id(group) in self._unwatched else P2P
        elif group is None:
            name = "world"
        else:
            name = UNWATCHED if id(group) in self._unwatched else self.group_name(group)
        seq = self.seq.get(name, 0) + 1
        self.seq[name] = seq
        if tensor is None:
            shape, dtype = (), None
        else:
            shape, dtype = tensor.shape, tensor.dtype  # (a torch.Size is a tuple)
        # The call site: the first frame outside `shardwise.comm` (inline: a Python call on
        # this path costs 2-4 us end to end on 2 cores, its code cold after a wait). From
        # `_issue` (depth 3), the frame above it is a collective of ours.
        try:
            frame, site = sys._getframe(depth), None
        except ValueError:  # (a collective called by no Python code: a C thread's callback)
            frame, site = None, None
        while frame is not None:
            code = frame.f_code
            inside = _INSIDE.get(code)
            if inside is None:
                inside = _INSIDE[code] = code.co_filename.startswith(COMM_DIR)
            if not inside:
                site = (code, frame.f_lasti)  # (its line when read: `_line`)
                break
            frame = frame.f_back
        call = (op, name, seq, shape, "-" if dtype is None else dtype, site)  # (a Call's fields)
        calls = self._calls
        calls.append(call)
        if len(calls) > 2 * KEEP:
            self._fold()
        if self.check_call is not None and name not in (P2P, UNWATCHED):
            self.check_call(_make_call(Call, call), group)
        return call

    def _fold(self) -> None:
        """Adds the calls not yet hashed to their groups' hashes, and forgets all but the last
        KEEP calls. (Appending is atomic: an issuing thread takes the lock only to fold.)"""
        with self._folding:
            calls, hashes = self._calls, self._hash
            issued = len(calls)
            signatures: dict[str, list[bytes]] = {}  # per group, its calls' CRCs in order
            for op, name, _, shape, dtype, _ in calls[self._hashed : issued]:
                crc = _SIGNATURES.get((op, shape, dtype)) or _signature_crc(op, shape, dtype)
                signatures.setdefault(name, []).append(crc)
            for name, crcs in signatures.items():  # (the CRC of a concatenation is chained)
                hashes[name] = zlib.crc32(b"".join(crcs), hashes.get(name, 0))
            forget = max(0, issued - KEEP)
            del calls[:forget]
            self._hashed = issued - forget

    @property
    def hash(self) -> dict[str, int]:
        """Per group, the running hash of its calls' signatures (op, shape, dtype)."""
        self._fold()
        return dict(self._hash)

    @property
    def history(self) -> list[Call]:
        """The last KEEP calls, oldest first."""
        return [_make_call(Call, call) for call in self._calls[-KEEP:]]

    def begin_wait(self, call: tuple, since: float | None = None) -> int:  # (a Call's fields)
        """This thread waits for `call` from `since` (`time.perf_counter()`, default now)
        until `end_wait` (what the watchdog reads); the thread's id, for `end_wait`."""
        thread = threading.get_ident()
        self.waiting[thread] = (call, time.perf_counter() if since is None else since)
        return thread

    def end_wait(self, thread: int) -> None:
        self.waiting.pop(thread, None)

    @contextlib.contextmanager
    def blocked_in(self, call: tuple):
        """Marks the time this thread waits for `call` to finish."""
        thread = self.begin_wait(call)
        try:
            yield
        finally:
            self.end_wait(thread)

    def longest_wait(self) -> tuple[Call, float] | None:
        """The call waited for longest, and for how many seconds (unbounded waits left out)."""
        waits = [w for w in self.waiting.values() if w[0][1] != UNWATCHED]  # ([1]: the group)
        if not waits:
            return None
        call, since = min(waits, key=lambda w: w[1])
        return _make_call(Call, call), time.perf_counter() - since

    def last(self) -> Call | None:
        calls = self._calls
        return _make_call(Call, calls[-1]) if calls else None


recorder = FlightRecorder()
