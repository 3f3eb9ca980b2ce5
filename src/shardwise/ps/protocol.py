"""Messages between workers and servers: a header, then (maybe) one tensor.

Everything travels as tensors over c10d point-to-point messages (`comm.messages`). The header
is 8 int64 values: kind, up to 5 integers whose meaning depends on the kind, a mark, then the
payload's element count (0: no payload). Objects that are not tensors (a model's signature, an
error message) travel as UTF-8 JSON in a uint8 payload: nothing received is ever executed. A
header's length is checked against the kind's bound before it sizes anything. Every message
written or read is counted in `traffic` (by peer, direction and kind).

gloo delivers a message shorter than the buffer posted for it as if it were whole (the rest of
the buffer keeps what it held), so each message ends with a mark where a short one cannot put
it: the header's seventh value, and one element of all-0xA5 bytes after the payload's values.
A receive prefills those places with zeros and refuses a message that did not overwrite them
(`ProtocolError`): a truncated header or a payload shorter than its header announced. (A message
longer than the buffer posted for it makes gloo abort the receiving process, below anything
Python can catch: the bounds below keep honest peers from ever sending one.)
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm import messages

COORDINATOR = 0  # server 0: deals out batches and, in sync mode, decides each round's members


class Kind(IntEnum):
    """What a message is. "Worker" is the asking side: a worker, or a relay for its group."""

    HELLO = 1  # worker -> server: [codec fingerprint, going over (1: to a backup server whose
    #            primary it lost)] + the model's signature; reply OK [its first clock] or
    #            ERROR (going over: OK [the client's clock there, the batch it holds there (-1:
    #            none)])
    PULL = 2  # worker -> server: [clock]; reply OK [version, codec fingerprint] + parameters
    #           (compressed: the codec's bytes of the difference from the worker's copy)
    PUSH = 3  # worker -> server: [clock, version used, workers summed (0: one), codec
    #           fingerprint] + gradient (compressed: the codec's bytes)
    DONE = 4  # worker -> server: no more steps from this worker
    NEXT = 5  # worker -> server 0: [for which worker (0: me), again (1: the batch it holds, not
    #           received)]; reply BATCH [epoch, worker, batch number] + indices, WAIT [worker]
    #           (none now, one may come back from a dead worker) or END
    IDLE = 6  # worker -> other servers: server 0 has no batch for it yet (do not wait for it)
    LOST = 7  # relay -> server 0: [worker] died; its unfinished batch goes back to the queue
    FINISHED = 8  # relay -> server 0: [worker] is done; its last batch counts as consumed
    ROUND = 9  # server 0 -> other servers (sync): [version after] + the round's member ranks
    OK = 10
    ERROR = 11
    END = 12
    WAIT = 13
    BATCH = 14
    SKIP = 15  # worker -> server: [clock, version used] no update from it this clock (its
    #            gradient was not finite: `train.nonfinite: skip`); answered like a PUSH
    FROM = 16  # primary server -> its backup: [sender]; the next message is the sender's, as the
    #            primary is about to handle it (replicas: 2)
    DEAD = 17  # primary server -> its backup: [client] declared dead + JSON [silent s, why]
    HOLDS = 18  # relay -> server 0, just before its PUSH (or SKIP) of [clock]: the workers whose
    #             pushes (or skips) that one holds, each once: their batches are in its update


class Traffic:
    """Messages and bytes this process wrote and read, per (direction, peer, kind): what went
    on the wire, header and payload (`comm.accounting` counts only bytes sent, not per peer).
    Receiving threads and the outbox's sending threads count at once: hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int, str], list[int]] = {}

    def add(self, direction: str, peer: int, kind: int, nbytes: int, messages: int = 1) -> None:
        try:
            name = Kind(kind).name
        except ValueError:  # (a header of an unknown kind, refused by `recv`)
            name = str(kind)
        with self._lock:
            entry = self._counts.setdefault((direction, peer, name), [0, 0])
            entry[0] += messages
            entry[1] += nbytes

    def snapshot(self) -> dict[tuple[str, int, str], tuple[int, int]]:
        """(direction "sent" or "received", peer rank, kind name) -> (messages, bytes)."""
        with self._lock:
            return {key: (n, b) for key, (n, b) in self._counts.items()}


traffic = Traffic()  # this process's


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


HEADER_MARK = 0x5348_4152_4457_4953  # a header's seventh value ("SIWDRAHS")
MARK_BYTE = 0xA5  # every byte of the element that ends a payload
MAX_INTS = messages.HEADER - 3  # a header's integers: after the kind, before mark and length


def _mark(dtype: torch.dtype) -> torch.Tensor:
    """One element of `dtype` whose bytes are all MARK_BYTE."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((size,), MARK_BYTE, dtype=torch.uint8).view(dtype)


def send(dst: int, kind: Kind, *ints: int, payload: torch.Tensor | None = None, group=None) -> None:
    """Send a header (and its payload, then its mark) to rank `dst` of `group`, waiting until
    both are out. An empty payload travels as none."""
    if payload is not None and not payload.numel():
        payload = None
    if len(ints) > MAX_INTS:
        raise ValueError(f"a {kind.name} holds at most {MAX_INTS} integers, got {len(ints)}")
    head = messages.header(int(kind), *ints)
    head[-2], head[-1] = HEADER_MARK, 0 if payload is None else payload.numel()
    handles = [messages.send_header(head, dst, group)]
    if payload is not None:
        payload = torch.cat([payload.reshape(-1), _mark(payload.dtype)])
        handles.append(comm.send(payload, dst, group))
    for h in handles:
        h.wait()
    traffic.add("sent", dst, kind, _nbytes(head) + (0 if payload is None else _nbytes(payload)))


class ProtocolError(ValueError):
    """A malformed message: truncated, of an unknown kind, a length out of bounds, a payload
    shorter than announced or not JSON. The message was read whole: the stream goes on."""


MAX_TEXT = 1 << 20  # bytes of a JSON payload (a model's signature, an error message)
MAX_INDICES = 1 << 24  # a batch's sample indices, a round's member ranks, a relay's workers

# (a PUSH's is fp32, or uint8 when compressed: the receiver says which)
PAYLOAD_DTYPE = {
    Kind.HELLO: torch.uint8,
    Kind.DEAD: torch.uint8,
    Kind.ERROR: torch.uint8,
    Kind.BATCH: torch.int64,
    Kind.ROUND: torch.int64,
    Kind.HOLDS: torch.int64,
}


# The most values a payload of each kind may hold (`recv`'s `max_numel` for the others: a range
# of parameters or gradients). Kinds that never carry one announce none: a header that does is
# refused before anything is waited for.
NO_PAYLOAD = (Kind.PULL, Kind.DONE, Kind.NEXT, Kind.IDLE, Kind.LOST, Kind.FINISHED, Kind.SKIP)
NO_PAYLOAD += (Kind.FROM,)
PAYLOAD_LIMIT = {
    Kind.HELLO: MAX_TEXT,
    Kind.DEAD: MAX_TEXT,
    Kind.ERROR: MAX_TEXT,
    Kind.BATCH: MAX_INDICES,
    Kind.ROUND: MAX_INDICES,
    Kind.HOLDS: MAX_INDICES,
    **dict.fromkeys((*NO_PAYLOAD, Kind.END, Kind.WAIT), 0),
}


def recv(
    src: int, dtype: torch.dtype | None = None, group=None, max_numel: int = 1 << 31
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A header and its payload from rank `src` of `group` (blocking); the payload's dtype is
    `dtype`, or the one its kind implies. `ProtocolError` for a truncated header, an unknown
    kind, a length out of bounds (`max_numel` for tensors of parameters or gradients) or a
    payload shorter than announced: each message was read whole, so the next one is read as
    the sender sent it."""
    h = torch.zeros(messages.HEADER, dtype=torch.int64)  # (zeros: where a short one stops)
    comm.recv(h, src, group)
    traffic.add("received", src, int(h[0]), _nbytes(h))  # (counted even if refused below)
    if int(h[-2]) != HEADER_MARK:
        raise ProtocolError(f"a truncated or malformed header from rank {src}")
    try:
        kind = Kind(int(h[0]))
    except ValueError:
        raise ProtocolError(f"unknown message kind {int(h[0])} from rank {src}") from None
    numel = int(h[-1])
    limit = PAYLOAD_LIMIT.get(kind, max_numel)
    if not 0 <= numel <= limit:
        raise ProtocolError(
            f"{kind.name} from rank {src} announces {numel} values (at most {limit})"
        )
    if numel == 0:
        return h, None
    out = torch.empty(numel + 1, dtype=PAYLOAD_DTYPE.get(kind, dtype or torch.float32))
    end = out[-1:].view(torch.uint8)
    end.zero_()
    comm.recv(out, src, group)
    traffic.add("received", src, int(kind), _nbytes(out), messages=0)  # (the header's message)
    if not bool((end == MARK_BYTE).all()):
        raise ProtocolError(
            f"{kind.name} from rank {src} carried fewer values than the {numel} it announced"
        )
    return h, out[:-1]


def pack(obj: object) -> torch.Tensor:
    """JSON of plain data (lists, dicts, strings, numbers) as a uint8 payload."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def unpack(payload: torch.Tensor | None) -> object:
    """The plain data of a `pack`ed payload; `ProtocolError` if it is not JSON."""
    if payload is None or payload.dtype != torch.uint8 or payload.numel() > MAX_TEXT:
        raise ProtocolError("expected a JSON payload")
    try:
        return json.loads(payload.numpy().tobytes().decode(), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"payload is not JSON: {str(e)[:200]}") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def make_group() -> dist.ProcessGroup:
    """The parameter server's own gloo group (collective: every rank creates it, once).

    A server waits for each worker's next message in a thread of its own, for as long as that
    worker computes: no collective timeout should end the wait, so the group's is a day.
    Liveness is the heartbeats' job."""
    group = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    comm.flight.recorder.unwatch(group)  # (nor is any wait in it a hang for the watchdog)
    return group
