"""The peers a server (or a relay) serves, and what both do with them alike.

`Peers` is one record of who is live, done, idle (waiting for a batch: nobody waits for it),
lost (its connection broke while we answered it) or dead (silent past the timeout), with the
heartbeat watch that notices silence. `start_receivers` runs one thread per peer that puts each
of its messages, in order, into one inbox, so the owner handles everything in one loop and never
blocks on one peer while another needs an answer. `check_hello` compares a newcomer's model with
ours.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from shardwise.comm.broken import describe
from shardwise.ps import protocol
from shardwise.ps.liveness import FIRST_BEAT_S, HeartbeatWatch
from shardwise.ps.protocol import Kind
from shardwise.ps.sharding import describe_mismatch

LOG_PER_CLIENT = 5  # lines logged about one client's refused messages before only every 1000th


class RefusalLog:
    """One line per refused message of a peer, until a flood: then every 1000th, with a count."""

    def __init__(self, who: str) -> None:
        self.who, self.counts = who, {}

    def say(self, src: int, text: str) -> None:
        count = self.counts[src] = self.counts.get(src, 0) + 1
        if count <= LOG_PER_CLIENT or count % 1000 == 0:
            more = f" ({count} so far)" if count > LOG_PER_CLIENT else ""
            print(f"shardwise: {self.who}: rank {src}: refused: {text}{more}", flush=True)


class Peers:
    def __init__(self, ranks: list[int], timeout_s: float, heartbeat_s: float) -> None:
        self.live, self.done, self.idle = set(ranks), set(), set()
        self.lost: dict[int, str] = {}  # rank -> why: its connection broke while we answered it
        self.dead: dict[int, float] = {}  # rank -> seconds of silence when declared dead
        # A client still starting (imports, its data) has not beaten yet: as long as everyone
        # else gives it (the supervisor, its own guard), not the timeout of a silent one.
        self.heartbeats = HeartbeatWatch(ranks, timeout_s, heartbeat_s / 2, startup_s=FIRST_BEAT_S)
        now = time.monotonic()
        self.progress = {r: (0, now) for r in ranks}  # rank -> (clock, when it last moved)

    def active(self) -> set[int]:
        """Those others may wait for: alive, not finished, not waiting for work."""
        return self.live - self.done - self.idle

    def serving(self) -> bool:
        return bool(self.live - self.done)

    def silent(self) -> list[tuple[int, float]]:
        """Peers whose heartbeats stopped for longer than the timeout, with their silence."""
        return self.heartbeats.dead(self.live - self.done - set(self.lost))

    def note_clock(self, rank: int, clock: int) -> None:
        self.heartbeats.heard(rank)
        if clock != self.progress[rank][0]:
            self.progress[rank] = (clock, time.monotonic())

    def note_served(self, rank: int) -> None:
        """It was given something to do (parameters it waited for, a batch): its time to show
        progress starts now, not at its last push (it may have waited long, through no fault
        of its own)."""
        self.progress[rank] = (self.progress[rank][0], time.monotonic())

    def stuck(self, timeout_s: float, waiting_on_us: set[int]) -> list[tuple[int, int, float]]:
        """(rank, clock, seconds without progress) of active peers whose clock has not moved
        for `timeout_s` while another waits on them: one ahead of them, or one idle (at the
        end of the queue, waiting for a batch that a stuck peer holds). Alive, but their
        training stalled; peers all waiting together, or waiting for our answer
        (`waiting_on_us`: a pull held for a sync round, say), are not stuck."""
        active = self.active() - set(self.lost) - waiting_on_us
        others = self.live - self.done - set(self.lost)
        idle = bool(others & self.idle)
        now = time.monotonic()
        lead = max((self.progress[r][0] for r in others), default=0)
        return [
            (r, clock, now - since)
            for r in sorted(active)
            for clock, since in [self.progress[r]]
            if now - since > timeout_s and (clock < lead or idle)
        ]

    def lose(self, rank: int, why: str) -> None:
        self.lost.setdefault(rank, why)

    def lost_undeclared(self) -> list[tuple[int, str]]:
        """Peers whose connection broke, not declared dead yet, and why."""
        return [(r, why) for r, why in sorted(self.lost.items()) if r not in self.dead]

    def mark_dead(self, rank: int, silent_s: float) -> None:
        self.live.discard(rank)
        self.idle.discard(rank)
        self.dead[rank] = silent_s

    def finish(self, rank: int) -> None:
        self.done.add(rank)
        self.idle.discard(rank)


def start_receivers(
    ranks: list[int],
    group,
    inbox: queue.Queue,
    until_done: set[int] | None = None,
    max_numel: int = 1 << 31,
    push_dtype: torch.dtype | None = None,
) -> None:
    """A thread per peer: (rank, header, payload) into `inbox` for each message; (rank, None,
    ProtocolError) for a header refused before its payload was read (the peer may go on);
    and (rank, None, reason) once its connection closes or breaks, when the thread ends.
    Threads of the ranks in `until_done` (all when None) end after that peer's DONE.
    `push_dtype`: what a PUSH's payload holds (default fp32; uint8 when compressed)."""

    def receive(rank: int) -> None:
        while True:
            try:
                h, payload = protocol.recv(rank, push_dtype, group, max_numel)
            except protocol.ProtocolError as e:
                inbox.put((rank, None, e))
                continue
            except Exception as e:  # its connection closed or broke
                inbox.put((rank, None, describe(e)))
                return
            inbox.put((rank, h, payload))
            ends = until_done is None or rank in until_done
            if ends and Kind(int(h[0])) == Kind.DONE:
                return

    for rank in ranks:
        name = f"ps-recv-{rank}"
        threading.Thread(target=receive, args=(rank,), daemon=True, name=name).start()


def start_forwarded_receiver(primary: int, group, inbox: queue.Queue, max_numel: int) -> None:
    """A backup server's thread for its primary's forwarding: each FROM [sender] and the
    message after it go into `inbox` as the sender's; a DEAD as the primary's; (primary, None,
    reason) once the connection closes or breaks."""

    def receive() -> None:
        while True:
            try:
                h, payload = protocol.recv(primary, None, group, max_numel)
                if Kind(int(h[0])) == Kind.FROM:
                    sender = int(h[1])
                    h, payload = protocol.recv(primary, None, group, max_numel)
                else:
                    sender = primary
            except Exception as e:  # its primary is gone (or, at the end, done)
                inbox.put((primary, None, describe(e)))
                return
            inbox.put((sender, h, payload))

    threading.Thread(target=receive, daemon=True, name=f"ps-primary-{primary}").start()


def check_hello(signature: list, payload: torch.Tensor | None) -> str | None:
    """None if the newcomer's model (its HELLO's payload) is ours, else what differs (or what
    is malformed about it)."""
    try:
        got = protocol.unpack(payload)
        theirs = [(str(name), tuple(int(d) for d in shape)) for name, shape in got]
    except Exception as e:  # (whatever a client's JSON makes of these conversions)
        return f"malformed HELLO: {type(e).__name__}: {str(e)[:200]}"
    return describe_mismatch(signature, theirs)
