"""The collectives and point-to-point messages shardwise issues, each one counted.

Strategies never call `torch.distributed` directly: they call these, so that bytes and waiting
time are recorded in one place (`accounting.stats`), and the flight recorder (`flight.recorder`)
knows each call and which one this rank waits in. Asynchronous calls return a `Handle` whose
`wait()` measures how long the caller was blocked.

Every wait goes through `_wait`. Under `train.on_failure: shrink` (`interrupt.py`), a wait is
made in slices, asking between them whether the job's membership changed, and an error of the
backend itself (a broken connection) is a `PeerLost`, which the trainer answers by shrinking
the job instead of failing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function, has_torch_function_unary

from shardwise.comm import interrupt
from shardwise.comm.accounting import native_volume, stats
from shardwise.comm.direct import (
    ALL_REDUCE_OPTIONS,
    GATHER,
    GATHER_OPTIONS,
    RED_OP,
    SCATTER,
    SCATTER_SUM_OPTIONS,
    torch_all_gather_flat,
    torch_reduce_scatter_flat,
)
from shardwise.comm.flight import recorder
from shardwise.comm.interrupt import PeerLost

ProcessGroup = dist.ProcessGroup

# The tag of a pairwise gather's messages: its own, apart from other point-to-point traffic on
# the group (messages with one tag from one peer are received in the order they were sent);
# `send` and `irecv` refuse it.
PAIRWISE_TAG = 0x5A17


def _wait(pending: dist.Work | Future) -> None:
    """Wait for a backend operation (or a communication thread's future) to finish."""
    if not interrupt.active():
        pending.result() if isinstance(pending, Future) else pending.wait()
        return
    # Told by the operation itself when it ends (no polling latency); asked in between whether
    # to give up. (A gloo operation's own `wait(timeout)` is not honoured by every collective.)
    since = interrupt.membership()
    done = threading.Event()
    failed: list[BaseException] = []
    try:
        future = pending if isinstance(pending, Future) else pending.get_future()
        future.add_done_callback(lambda _: done.set())
        waited = False
    except RuntimeError:  # gloo's messages have no future: a thread of its own waits
        threading.Thread(target=_wait_in_thread, args=(pending, done, failed), daemon=True).start()
        waited = True  # (a message's wait may be made once: not again below)
    while not done.wait(interrupt.POLL_S):
        interrupt.raise_if_interrupted(since)
    try:
        if failed:
            raise failed[0]
        if not waited:
            pending.result() if isinstance(pending, Future) else pending.wait()
    except PeerLost:
        raise
    except RuntimeError as e:  # the backend failed: a peer's connection broke
        raise PeerLost(str(e).splitlines()[0]) from e


def _wait_in_thread(work: dist.Work, done: threading.Event, failed: list) -> None:
    """A message's blocking wait, for `_wait` (left blocked for good where the peer died)."""
    try:
        work.wait()
    except BaseException as e:  # (handed to the waiting thread)
        failed.append(e)
    done.set()


class Handle:
    """An operation in flight: a backend `Work` or a `Future` from a communication thread.

    A call issued here (`_issue`) is counted once, as it is waited for: its bytes, the time it
    blocked issuing and waiting, and its time in flight between (the accounting's one update
    on the path of a call; every asynchronous call is waited for before its result is used).
    A communication thread's future counts only its waiting: its thread counts its calls."""

    __slots__ = ("_call", "_counted", "_issued", "_pending", "op")

    def __init__(
        self,
        op: str,
        pending: dist.Work | Future | None,
        call: tuple | None,  # (a Call's fields, as the flight recorder recorded them)
        issued: float | None = None,  # `time.perf_counter()` when issued (default: now)
        counted: tuple[int, float] | None = None,  # (bytes, seconds issuing) to count at wait
    ) -> None:
        self.op = op
        self._pending = pending
        self._call = call
        self._issued = time.perf_counter() if issued is None else issued
        self._counted = counted

    def wait(self) -> None:
        pending = self._pending
        if pending is None:
            return
        # From the issue to this wait the operation could progress while the caller computed:
        # that long, at most, it overlapped compute.
        start = time.perf_counter()
        call = self._call
        if call is None:
            _wait(pending)
        else:  # (`_wait_recorded` inline: a frame less on every asynchronous call's path)
            thread, waiting = threading.get_ident(), recorder.waiting
            waiting[thread] = (call, start)
            try:
                if interrupt.waits_interrupted or isinstance(pending, Future):
                    _wait(pending)
                else:
                    pending.wait()
            finally:
                waiting.pop(thread, None)
        self._pending = None
        blocked, in_flight = time.perf_counter() - start, start - self._issued
        if self._counted is None:
            stats.add_waited(self.op, in_flight, blocked)
        else:
            nbytes, issuing = self._counted
            stats.record_waited(self.op, nbytes, issuing + blocked, in_flight)


_DONE = Handle("done", None, None, 0.0)  # what a call that has finished returns
_NEW_HANDLE = object.__new__  # (a Handle without running `__init__`: `_issue`)


def _wait_recorded(
    pending: dist.Work | Future, call: tuple | None, since: float | None = None
) -> None:
    """`_wait`, with the flight recorder told which call this thread waits in (from `since`).
    On every collective's path: flat (`recorder.begin_wait`, `end_wait` and `_wait`'s own test,
    inline), since on 2 cores a Python call there costs 2-4 us end to end, its code run cold
    after the wait."""
    if call is None:
        _wait(pending)
        return
    thread, waiting = threading.get_ident(), recorder.waiting
    waiting[thread] = (call, time.perf_counter() if since is None else since)
    try:
        if interrupt.waits_interrupted or isinstance(pending, Future):
            _wait(pending)
        else:
            pending.wait()
    finally:
        waiting.pop(thread, None)


@dataclass(frozen=True)
class TraceGroup:
    """A stand-in for a process group when one rank's share of a model is traced on fake tensors
    (the cost model): its collectives move nothing, count nothing and return at once, since
    only shapes matter there."""

    size: int
    rank: int


def group_size(group: ProcessGroup | TraceGroup | None = None) -> int:
    if isinstance(group, TraceGroup):
        return group.size
    # (the group's own size, not `dist.get_world_size`'s lookups: on every collective's path)
    try:
        return (dist.GroupMember.WORLD if group is None else group).size()
    except AttributeError:  # (torch's stand-in for a group this rank is not in is a number)
        if group is None:
            raise ValueError(
                "a collective with no process group: call sw.init() first (under torchrun or "
                "shardwise run, or alone as a world of one)"
            ) from None
        raise ValueError(
            "a collective over a group this rank is not a member of (torch would skip it; "
            "every rank that calls one of ours must be in its group)"
        ) from None


def group_rank(group: ProcessGroup | TraceGroup | None = None) -> int:
    if isinstance(group, TraceGroup):
        return group.rank
    return (dist.GroupMember.WORLD if group is None else group).rank()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.nbytes


# The bytes a native collective sends (`native_volume`), by (op, payload bytes, group): on the
# path of every collective, a dictionary's lookup rather than two Python calls (each 2-4 us end
# to end on 2 cores, its code cold after the previous call's wait).
_VOLUMES: dict[tuple[str, int, ProcessGroup | TraceGroup | None], int] = {}


def forget_volumes() -> None:
    """The groups changed (a new world, after a re-form; none, after shutdown): `None` may name
    another world now, and a group left behind must not be held here."""
    _VOLUMES.clear()


def _learn_volume(op: str, nbytes: int, group: ProcessGroup | TraceGroup | None) -> int:
    if len(_VOLUMES) > 4096:  # (payloads that vary call to call: keep it bounded)
        _VOLUMES.clear()
    volume = _VOLUMES[op, nbytes, group] = native_volume(op, nbytes, group_size(group))
    return volume


def _issue(
    op: str,
    nbytes: int | None,
    call,
    async_op: bool,
    group: ProcessGroup | None = None,
    tensor: torch.Tensor | None = None,
    recorded_as: str | None = None,
    blocking: bool = False,
    args: tuple = (),
) -> Handle:
    """Run a backend call (`call(*args)`: a process group's own method and its arguments need
    no closure, `direct.py`), count it (as `op`), and either wait (timing the wait) or hand
    back a Handle. `recorded_as`: the flight recorder's name for how it was sent, where not `op`.
    `blocking`: the call itself is the wait (a collective of ours that returns when done),
    marked as waited in from its issue, so the watchdog names a rank that never arrives.
    `nbytes` None: the native volume of `op` over `tensor` (a group this rank is not in is
    refused there, before the call)."""
    if isinstance(group, TraceGroup):
        return Handle(op, None, None)
    if nbytes is None:  # (the native volume of `op` over `tensor`: `_VOLUMES`)
        nbytes = _VOLUMES.get((op, tensor.nbytes, group))
        if nbytes is None:
            nbytes = _learn_volume(op, tensor.nbytes, group)
    start = time.perf_counter()
    if blocking or recorder.check_call is not None:
        # Recorded before it runs: the watchdog must know what a blocking call waits in, and
        # debug mode (`check_call`) compares each call across ranks before it can hang.
        recorded = recorder.issue(recorded_as or op, group, tensor, depth=3)
        work = _run_blocking(call, args, recorded, start) if blocking else call(*args)
    else:
        # The backend's call first, recorded while its messages are in flight: off the path
        # from one call's end to the next one's start, which the peers wait on. (The 2-core
        # VM, world 2, a float's all-reduce: the record cost 10-14 us a call there, end to
        # end, 4-9 in flight.)
        work = call(*args)
        recorded = recorder.issue(recorded_as or op, group, tensor, depth=3)
    if work is None:  # (a blocking call: done)
        stats.record(op, nbytes, time.perf_counter() - start)
        return _DONE
    if async_op:  # counted as it is waited for
        issued = time.perf_counter()
        # (made in this frame, not `Handle.__init__`'s: a frame less on the path)
        handle = _NEW_HANDLE(Handle)
        handle.op, handle._pending, handle._call = op, work, recorded
        handle._issued, handle._counted = issued, (nbytes, issued - start)
        return handle
    _wait_recorded(work, recorded, start)
    stats.record(op, nbytes, time.perf_counter() - start)
    return _DONE


def _run_blocking(call, args: tuple, recorded: tuple, start: float):
    """A call that is its own wait, marked as waited in from `start`."""
    thread = recorder.begin_wait(recorded, start)
    try:
        return call(*args)
    except PeerLost:
        raise
    except RuntimeError as e:  # (failed as a backend's wait fails: `_wait`)
        if not interrupt.active():
            raise
        raise PeerLost(str(e).splitlines()[0]) from e
    finally:
        recorder.end_wait(thread)


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Handle:
    """In-place all-reduce with the backend's native algorithm."""
    options = ALL_REDUCE_OPTIONS.get(op) if type(op) is RED_OP else None
    if options is None or has_torch_function_unary(tensor) or tensor.is_complex():
        # (what only torch's wrapper handles: `direct.py`)
        call = partial(dist.all_reduce, tensor, op=op, group=group, async_op=True)
        return _issue("all_reduce", None, call, async_op, group, tensor)
    pg = dist.GroupMember.WORLD if group is None else group
    args = (pg, [tensor], options)  # (the method looked up as called: a stub replaces it)
    return _issue("all_reduce", None, ProcessGroup.allreduce, async_op, group, tensor, args=args)


def broadcast(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False
) -> Handle:
    """In-place broadcast from group rank `src`."""
    is_root = group_rank(group) == src
    volume = native_volume("broadcast", _nbytes(tensor), group_size(group), is_root)
    return _issue(
        "broadcast",
        volume,
        lambda: dist.broadcast(tensor, group_src=src, group=group, async_op=True),
        async_op,
        group,
        tensor,
    )


def reduce(
    tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, async_op: bool = False
) -> Handle:
    """In-place sum-reduce onto group rank `dst`."""
    is_root = group_rank(group) == dst
    volume = native_volume("reduce", _nbytes(tensor), group_size(group), is_root)
    return _issue(
        "reduce",
        volume,
        lambda: dist.reduce(tensor, group_dst=dst, group=group, async_op=True),
        async_op,
        group,
        tensor,
    )


def all_gather_into_tensor(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Gather every rank's equal-sized `shard` into `output` (group-rank order)."""
    if has_torch_function((output, shard)) or output.is_complex() or shard.is_complex():
        call = partial(torch_all_gather_flat, output, shard, group=group, async_op=True)
        return _issue("all_gather", None, call, async_op, group, output)
    pg = dist.GroupMember.WORLD if group is None else group
    args = (pg, output, shard, GATHER_OPTIONS)
    return _issue("all_gather", None, GATHER, async_op, group, output, args=args)


class _PendingMessages:
    """Several point-to-point messages in flight, waited for as one operation. (They have no
    future: under `on_failure: shrink`, `_wait` waits for them in a thread of its own.)"""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def get_future(self) -> Future:
        raise RuntimeError("messages have no future")  # (`_wait` then waits in a thread)


def post_pairwise_gather(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None = None
) -> _PendingMessages:
    """Send `shard` to every other rank of `group` and receive each rank's into its place in
    `output`, straight on `torch.distributed` (also the floor's bare replay, `bench/floor.py`)."""
    n, me = group_size(group), group_rank(group)
    places = output.view(n, -1)
    mine = shard.reshape(-1)
    works = []
    for peer in range(n):
        if peer != me:
            works.append(dist.isend(mine, group=group, group_dst=peer, tag=PAIRWISE_TAG))
            works.append(dist.irecv(places[peer], group=group, group_src=peer, tag=PAIRWISE_TAG))
    places[me].copy_(mine)
    return _PendingMessages(works)


def all_gather_pairwise(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """`all_gather_into_tensor` as direct messages: this rank's shard goes to every other rank,
    theirs arrive in place. The same (N-1)/N of the output a ring sends; where gloo's ranks
    share one host it is faster than gloo's own all-gather (back to back on the 2-core VM,
    world 2: 3 MB 1.21 against 1.59 ms, 24 MB 10.1 against 14.5; world 4: 3 MB 2.0 against
    3.7, 24 MB 18.4 against 27.3). Counted as an all-gather; recorded as
    "all_gather_pairwise", so that a replay sends it the same way."""
    if (
        output.dtype != shard.dtype
        or output.device != shard.device
        or not output.is_contiguous()
        or output.numel() != shard.numel() * group_size(group)
    ):  # (raw bytes cross the wire: a mismatch would be received silently wrong)
        raise ValueError(
            f"all_gather_pairwise: output {output.dtype} {tuple(output.shape)} on "
            f"{output.device} does not hold {group_size(group)} shards {shard.dtype} "
            f"{tuple(shard.shape)} on {shard.device} (contiguous, same dtype and device)"
        )
    return _issue(
        "all_gather",
        None,
        lambda: post_pairwise_gather(output, shard, group),
        async_op,
        group,
        output,
        recorded_as="all_gather_pairwise",
    )


def reduce_scatter_tensor(
    shard: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Sum `full` over ranks and keep this rank's equal-sized slice in `shard`."""
    if has_torch_function((shard, full)) or shard.is_complex() or full.is_complex():
        call = partial(torch_reduce_scatter_flat, shard, full, group=group, async_op=True)
        return _issue("reduce_scatter", None, call, async_op, group, full)
    pg = dist.GroupMember.WORLD if group is None else group
    args = (pg, shard, full, SCATTER_SUM_OPTIONS)
    return _issue("reduce_scatter", None, SCATTER, async_op, group, full, args=args)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Split `tensor` into group-size equal chunks, chunk r to rank r; `output` receives rank
    r's chunk for this rank at place r. This rank sends every chunk but its own."""
    volume = native_volume("all_to_all", _nbytes(tensor), group_size(group))
    return _issue(
        "all_to_all",
        volume,
        lambda: dist.all_to_all_single(output, tensor, group=group, async_op=True),
        async_op,
        group,
        tensor,
    )


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: ProcessGroup | None = None,
    op: str = "p2p",
) -> None:
    """Post all sends and receives (peers are group ranks) at once and wait for all of them.

    Posting both directions together is what keeps a ring from deadlocking: every rank sends to
    its right neighbour while it receives from its left one.
    """
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs]
    recorded = recorder.issue("p2p", group, sends[0][0] if sends else None)
    start = time.perf_counter()
    for work in dist.batch_isend_irecv(ops):
        _wait_recorded(work, recorded)
    stats.record(op, sum(_nbytes(t) for t, _ in sends), time.perf_counter() - start)


def _check_tag(tag: int) -> None:
    if tag == PAIRWISE_TAG:
        raise ValueError(f"tag {PAIRWISE_TAG} is reserved for all_gather_pairwise's messages")


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Handle:
    """Start sending `tensor` to group rank `dst`; keep `tensor` alive until the handle's wait.
    A receive matches the sends from its source with its `tag`, in the order they were sent."""
    assert tensor.is_contiguous(), "send a contiguous tensor"
    _check_tag(tag)
    return _issue(
        "send",
        _nbytes(tensor),
        lambda: dist.isend(tensor, group=group, group_dst=dst, tag=tag),
        async_op=True,
        group=group,
        tensor=tensor,
    )


def irecv(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0
) -> Handle:
    """Post a receive into `tensor` from group rank `src`; `wait()` on the handle (timed).

    Posting early lets the transfer happen while this rank computes: gloo moves a message
    only once its receive is posted."""
    _check_tag(tag)
    return _issue(
        "recv",
        0,
        lambda: dist.irecv(tensor, group=group, group_src=src, tag=tag),
        True,
        group,
        tensor,
    )


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> None:
    """Receive into `tensor` from group rank `src`, blocking (the wait is counted)."""
    recorded = recorder.issue("recv", group, tensor)
    start = time.perf_counter()
    _wait_recorded(dist.irecv(tensor, group=group, group_src=src), recorded)
    stats.record("recv", 0, time.perf_counter() - start)


def barrier(group: ProcessGroup | None = None) -> None:
    recorded = recorder.issue("barrier", group)
    start = time.perf_counter()
    _wait_recorded(dist.barrier(group=group, async_op=True), recorded)
    stats.record("barrier", 0, time.perf_counter() - start)
