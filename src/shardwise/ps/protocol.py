"""Messages between workers and servers: a header, then (maybe) one tensor.

Everything travels as tensors over c10d point-to-point messages (`comm.messages`). The header
is 8 int64 values: kind, then up to 6 integers whose meaning depends on the kind, then the
payload's element count (0: no payload). Objects that are not tensors (a model's signature, an
error message) travel as UTF-8 JSON in a uint8 payload: nothing received is ever executed. A
header's length is checked against the kind's bound before it sizes anything. Every message
written or read is counted in `traffic` (by peer, direction and kind).
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

    HELLO = 1  # worker -> server: the model's signature; reply OK [version] or ERROR
    PULL = 2  # worker -> server: [clock]; reply OK [version] + parameters
    PUSH = 3  # worker -> server: [clock, version used, workers summed (0: one)] + gradient
    DONE = 4  # worker -> server: no more steps from this worker
    NEXT = 5  # worker -> server 0: [for which worker (0: me)]; reply BATCH [epoch, worker] +
    #           indices, WAIT [worker] (none now, one may come back from a dead worker) or END
    IDLE = 6  # worker -> other servers: server 0 has no batch for it yet (do not wait for it)
    LOST = 7  # relay -> server 0: [worker] died; its unfinished batch goes back to the queue
    FINISHED = 8  # relay -> server 0: [worker] is done; its last batch counts as consumed
    ROUND = 9  # server 0 -> other servers (sync): [version after] + the round's member ranks
    OK = 10
    ERROR = 11
    END = 12
    WAIT = 13
    BATCH = 14


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


def send(dst: int, kind: Kind, *ints: int, payload: torch.Tensor | None = None, group=None) -> None:
    """Send a header (and its payload) to rank `dst` of `group`, waiting until both are out."""
    head = messages.header(int(kind), *ints)
    head[-1] = 0 if payload is None else payload.numel()
    handles = [messages.send_header(head, dst, group)]
    if payload is not None:
        handles.append(comm.send(payload.contiguous(), dst, group))
    for h in handles:
        h.wait()
    traffic.add("sent", dst, kind, _nbytes(head) + (0 if payload is None else _nbytes(payload)))


class ProtocolError(ValueError):
    """A malformed message: unknown kind, a length out of bounds, a payload that is not JSON."""


MAX_TEXT = 1 << 20  # bytes of a JSON payload (a model's signature, an error message)
MAX_INDICES = 1 << 24  # a batch's sample indices, a round's member ranks

PAYLOAD_DTYPE = {
    Kind.HELLO: torch.uint8,
    Kind.PUSH: torch.float32,
    Kind.ERROR: torch.uint8,
    Kind.BATCH: torch.int64,
    Kind.ROUND: torch.int64,
}


PAYLOAD_LIMIT = {
    Kind.HELLO: MAX_TEXT,
    Kind.ERROR: MAX_TEXT,
    Kind.BATCH: MAX_INDICES,
    Kind.ROUND: MAX_INDICES,
}


def recv(
    src: int, dtype: torch.dtype | None = None, group=None, max_numel: int = 1 << 31
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A header and its payload from rank `src` of `group` (blocking); the payload's dtype is
    `dtype`, or the one its kind implies. `ProtocolError` for an unknown kind or a length out
    of bounds (`max_numel` for tensors of parameters or gradients): the stream from that rank
    can no longer be trusted to be in step."""
    h = messages.recv_header(src, group)
    traffic.add("received", src, int(h[0]), _nbytes(h))  # (counted even if refused below)
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
    out = torch.empty(numel, dtype=PAYLOAD_DTYPE.get(kind, dtype or torch.float32))
    comm.recv(out, src, group)
    traffic.add("received", src, int(kind), _nbytes(out), messages=0)  # (the header's message)
    return h, out


def pack(obj: object) -> torch.Tensor:
    """JSON of plain data (lists, dicts, strings, numbers) as a uint8 payload."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def unpack(payload: torch.Tensor | None) -> object:
    """The plain data of a `pack`ed payload; `ProtocolError` if it is not JSON."""
    if payload is None or payload.dtype != torch.uint8 or payload.numel() > MAX_TEXT:
        raise ProtocolError("expected a JSON payload")
    try:
        return json.loads(payload.numpy().tobytes().decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"payload is not JSON: {e}") from None


def make_group() -> dist.ProcessGroup:
    """The parameter server's own gloo group (collective: every rank creates it, once).

    A server waits for each worker's next message in a thread of its own, for as long as that
    worker computes: no collective timeout should end the wait, so the group's is a day.
    Liveness is the heartbeats' job."""
    return dist.new_group(backend="gloo", timeout=timedelta(days=1))
