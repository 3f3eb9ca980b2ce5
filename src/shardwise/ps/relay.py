"""The second level of a two-level parameter server: a relay between a group of workers and the
servers.

With W workers and S servers, every server hears from every worker: W pushes per clock, W
connections, W heartbeats to watch. A relay serves its group of workers as if it were the one
server (the whole parameter vector, the same messages) and speaks to the servers as one client:

- sync: it sums its workers' pushes of a clock and forwards one push carrying the sum and how
  many workers it holds, so the servers still apply the mean over all W workers (the same
  arithmetic as a flat job, and as single-process training) from R pushes instead of W;
- async: it forwards each push as it comes and answers that worker's pull with the parameters
  the servers send back after applying it (the relay adds no staleness of its own).

Before each push it names to server 0 the workers whose pushes that one holds (HOLDS): their
batches are then in the parameters, and one of them dying before it asks for its next batch
must not have that batch dealt again (a round may leave out a worker of the group that waited
for a batch, so the group alone does not say whose are in it).

It also asks server 0 for its workers' batches (server 0 keeps the one work queue), watches their
heartbeats, and tells server 0 when one dies so that its batch is dealt again. Everything comes
in through one inbox (a thread per peer), so the relay never blocks on one side while the other
needs an answer. Its workers' messages pass the server's own checks (`validation.py`) before
anything is done with them: a refused one gets its sender an ERROR and a log line, and is
dropped.
"""

from __future__ import annotations

import collections
import queue
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.distributed.runtime import Runtime
from shardwise.ps import protocol
from shardwise.ps.consistency import round_complete, sync_pull_ready
from shardwise.ps.outbox import Outbox
from shardwise.ps.peers import Peers, RefusalLog, check_hello, start_receivers
from shardwise.ps.protocol import COORDINATOR, Kind
from shardwise.ps.sharding import flat_values, signature
from shardwise.ps.validation import Rules, Turn, check
from shardwise.ps.worker import ParameterServer, PSClient


@dataclass
class RelayReport:
    rank: int
    workers: list[int]
    pushes_received: int = 0  # from its workers
    pushes_forwarded: int = 0  # to each server
    dead_workers: dict[int, float] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    refused: int = 0  # messages refused (malformed, out of turn, from a worker not served)


class Relay:
    def __init__(self, model: nn.Module, options: ParameterServer, rt: Runtime, faults=None):
        self.o, self.rank, self.faults = options, rt.rank, faults
        self.workers = options.relay_groups(rt.world_size)[rt.rank]
        self.servers = list(range(options.servers))
        self.signature = signature(model)
        # Upward, the relay is a client like a worker: hello, first pull, heartbeats.
        self.up = PSClient(model, options, rt, servers=self.servers, role="relay")
        self.group = self.up.group
        self.flat = flat_values(self.up.params)
        self.version, self.clock = self.up.version, self.up.clock
        self.peers = Peers(self.workers, options.timeout_s, options.heartbeat_s)
        # sync: worker -> its push of this clock (None: it skipped it)
        self.pending: dict[int, torch.Tensor | None] = {}
        self.waiting_pulls: list[tuple[int, int]] = []  # (worker, clock)
        # worker -> the servers' replies to wait for before its pull is answered: the one to
        # the push that holds its own (its batch is then in the parameters, and its next NEXT
        # reaches server 0 after that update: HOLDS named the batch that update holds)
        self.reply_needed: dict[int, int] = {}
        self.pulls_sent = self.replies = 0
        self.pieces: dict[int, collections.deque] = {s: collections.deque() for s in self.servers}
        self.told_idle = False
        self.inbox: queue.Queue = queue.Queue()
        self.outbox = Outbox(self.group, self.inbox)
        self.report = RelayReport(rank=rt.rank, workers=list(self.workers))
        self.greeted: set[int] = set()
        self.clocks = dict.fromkeys(self.workers, 0)  # worker -> the clock of its next push
        self.refusals = RefusalLog(f"ps relay {rt.rank}")
        # Towards its workers the relay is their server: the same rules, over the whole vector.
        self.rules = Rules(
            server=rt.rank,
            world_size=rt.world_size,
            clients=frozenset(self.workers),
            relays=False,
            coordinates=True,  # it asks server 0 for their batches
            hears_rounds=False,
            shard_numel=self.flat.numel(),
            workers=1,
        )

    def serve(self) -> RelayReport:
        # All along, the relay waits on its servers: one that goes silent ends it (its workers
        # then see it silent, and the supervisor restarts the job or ends it).
        with self.up.guard.waiting():
            return self._serve()

    def _serve(self) -> RelayReport:
        everyone = [*self.workers, *self.servers]
        numel = self.flat.numel()  # (the most a PUSH or a pull's answer holds)
        start_receivers(everyone, self.group, self.inbox, set(self.workers), max_numel=numel)
        while self.peers.serving():
            for worker, silent_s in self.peers.silent():
                self._declare_dead(worker, silent_s)
            held = {worker for worker, _ in self.waiting_pulls}
            for worker, clock, still_s in self.peers.stuck(self.o.progress_timeout_s, held):
                self._declare_dead(worker, still_s, f"stuck at clock {clock} (alive, no progress)")
            try:
                src, h, payload = self.inbox.get(timeout=self.o.heartbeat_s / 2)
            except queue.Empty:
                continue
            if h is None:
                if isinstance(payload, protocol.ProtocolError):  # read whole: it may go on
                    self._refuse(src, str(payload))
                continue  # (a connection closed: a worker's death shows in its heartbeats)
            if src in self.servers:
                self._from_server(src, Kind(int(h[0])), h, payload)
            elif problem := self._problem(src, h, payload):
                self._refuse(src, problem)
            else:
                self._from_worker(src, Kind(int(h[0])), h, payload)
            self._answer_pulls()
        while self.replies < self.pulls_sent:  # the servers' last answers, before leaving
            src, h, payload = self.inbox.get()  # (a sync round may wait long for a straggler)
            if src in self.servers:
                if h is None:  # the servers are gone: nothing more will come
                    break
                self._from_server(src, Kind(int(h[0])), h, payload)
        for server in self.servers:
            protocol.send(server, Kind.DONE, group=self.group)
        self.outbox.close()
        self.up.close(say_done=False)
        return self.report

    # ---- the workers' side: the relay is their server
    def _problem(self, w: int, h: torch.Tensor, payload) -> str | None:
        """What is wrong with a worker's message: the server's checks, then whether it is
        still served."""
        turn = Turn(
            greeted=w in self.greeted,
            clock=self.clocks.get(w, 0),
            pulling=any(x == w for x, _ in self.waiting_pulls),
            pushed=self.o.mode == "sync" and w in self.pending,
        )
        if problem := check(self.rules, w, h, payload, turn):
            return problem
        if w not in self.peers.live:
            why = self.report.rejected.get(w, "it was declared dead")
            return f"rank {w} is no longer served ({why})"
        if w in self.peers.done:
            return f"{Kind(int(h[0])).name} after its DONE"
        if Kind(int(h[0])) == Kind.HELLO:
            self.greeted.add(w)
        return None

    def _refuse(self, w: int, problem: str) -> None:
        """ERROR to the worker and one line in the log (a flood is summed up); the message is
        dropped, the worker stays connected."""
        self.report.refused += 1
        self.refusals.say(w, problem)
        self._send(w, Kind.ERROR, payload=protocol.pack(problem))

    def _from_worker(self, w: int, kind: Kind, h: torch.Tensor, payload) -> None:
        if kind == Kind.HELLO:
            problem = check_hello(self.signature, payload)
            if problem is None:
                self.clocks[w] = self.version
                self._send(w, Kind.OK, self.version)
            else:
                self.report.rejected[w] = problem
                self.peers.live.discard(w)
                self._send(w, Kind.ERROR, payload=protocol.pack(problem))
                self._forward_sync()
        elif kind == Kind.PULL:
            self.waiting_pulls.append((w, int(h[1])))
        elif kind in (Kind.PUSH, Kind.SKIP):
            self._on_push(w, h, payload if kind == Kind.PUSH else None)
        elif kind == Kind.IDLE:  # it waits for a batch: do not wait for its push
            self.peers.idle.add(w)
            self._forward_sync()
        elif kind == Kind.NEXT:
            protocol.send(COORDINATOR, Kind.NEXT, w, group=self.group)
        elif kind == Kind.DONE:
            self.peers.finish(w)
            protocol.send(COORDINATOR, Kind.FINISHED, w, group=self.group)
            self._forward_sync()

    def _on_push(self, w: int, h: torch.Tensor, payload: torch.Tensor | None) -> None:
        """A worker's push (payload None: it skipped this clock)."""
        self.peers.idle.discard(w)
        self.clocks[w] = int(h[1]) + 1
        self.peers.note_clock(w, self.clocks[w])
        self.report.pushes_received += 1
        if self.o.mode == "sync":
            self.pending[w] = payload
            self._forward_sync()
        else:  # forward at once; answer its pull with what comes back
            self._push_up(payload, version_used=int(h[2]), count=1, holds=[w])

    def _send(self, w: int, kind: Kind, *ints: int, payload: torch.Tensor | None = None) -> None:
        """Queued for the worker's sending thread: one that stopped reading blocks nobody (it
        may have died between asking and our answer: its heartbeats will tell)."""
        self.outbox.send(w, kind, *ints, payload=payload)

    def _forward_sync(self) -> None:
        """Sync: once every active worker of the group pushed this clock, push their sum."""
        if self.o.mode != "sync":
            return
        active = self.peers.active()
        if round_complete(self.pending, active):
            pushed = [value for value in self.pending.values() if value is not None]
            holds = list(self.pending)  # (one that skipped too: its batch is done with the round)
            self.pending.clear()
            total = torch.stack(pushed).sum(dim=0) if pushed else None  # (None: all skipped)
            self._push_up(total, version_used=self.version, count=len(pushed), holds=holds)
        elif not active and self.peers.serving() and not self.told_idle:
            for server in self.servers:  # all of the group waits for batches: skip us
                protocol.send(server, Kind.IDLE, group=self.group)
            self.told_idle = True

    def _push_up(
        self, flat: torch.Tensor | None, version_used: int, count: int, holds: list[int]
    ) -> None:
        """Name the workers `holds` to server 0, push to every server its slice (or SKIP, with
        nothing to push), then ask for the parameters after it (the pulls of the workers
        `holds` wait for that answer)."""
        started = time.perf_counter()
        if self.faults is not None:  # (kill, or hang with the heartbeats going on)
            self.faults.before_step(self.clock + 1)
        holding = torch.tensor(holds, dtype=torch.int64)
        protocol.send(COORDINATOR, Kind.HOLDS, self.clock, payload=holding, group=self.group)
        for server, piece in zip(self.servers, self._slices(flat), strict=True):
            kind = Kind.SKIP if flat is None else Kind.PUSH
            payload = piece if piece is not None and piece.numel() else None
            protocol.send(
                server, kind, self.clock, version_used, count, payload=payload, group=self.group
            )
        self.clock += 1
        for server in self.servers:
            protocol.send(server, Kind.PULL, self.clock, group=self.group)
        self.pulls_sent += 1
        self.reply_needed.update(dict.fromkeys(holds, self.pulls_sent))
        self.report.pushes_forwarded += 1
        self.told_idle = False
        if self.faults is not None:  # (forwarding, slowed)
            self.faults.slow_down(started, step=self.report.pushes_forwarded)

    def _slices(self, flat: torch.Tensor | None) -> list[torch.Tensor | None]:
        return [None] * len(self.servers) if flat is None else self.up.plan.split(flat)

    def _answer_pulls(self) -> None:
        still = []
        for w, clock in self.waiting_pulls:
            if w not in self.peers.live:
                continue
            # Not before the servers answered the push holding its own (in sync mode, a worker
            # that waited for a batch meanwhile has a clock behind the version: the version
            # alone would answer its pull before that round), nor before its push left.
            ready = self.replies >= self.reply_needed.get(w, 0)
            if self.o.mode == "sync":
                active = self.peers.active()
                ready = ready and sync_pull_ready(w, self.pending, self.version, clock, active)
            if ready:
                self._send(w, Kind.OK, self.version, payload=self.flat)
                self.peers.note_served(w)
            else:
                still.append((w, clock))
        self.waiting_pulls = still

    # ---- the servers' side: the relay is their client
    def _from_server(self, s: int, kind: Kind, h: torch.Tensor, payload) -> None:
        if kind == Kind.OK:  # a pull's reply: this server's slice
            self.pieces[s].append((int(h[1]), payload if payload is not None else torch.zeros(0)))
            if all(self.pieces.values()):  # every server's slice of the next reply is in
                parts = [self.pieces[server].popleft() for server in self.servers]
                self.version = min(version for version, _ in parts)
                self.flat = torch.cat([piece for _, piece in parts])
                self.replies += 1
        elif kind in (Kind.BATCH, Kind.WAIT, Kind.END):  # server 0 answers for a worker
            worker = int(h[2]) if kind == Kind.BATCH else int(h[1])
            if worker not in self.peers.live:
                return
            if kind == Kind.BATCH:
                self.peers.idle.discard(worker)
                self.told_idle = False  # server 0 counts on us again: say so if all idle again
                self._send(worker, Kind.BATCH, int(h[1]), worker, int(h[3]), payload=payload)
                self.peers.note_served(worker)
            else:
                self._send(worker, kind, worker)
                if kind == Kind.WAIT:  # do not wait for it: it has nothing to push
                    self.peers.idle.add(worker)
                    self._forward_sync()
        elif kind == Kind.ERROR:
            raise RuntimeError(f"parameter server {s}: {protocol.unpack(payload)}")

    def _declare_dead(self, worker: int, silent_s: float, why: str = "silent") -> None:
        self.peers.mark_dead(worker, silent_s)
        self.pending.pop(worker, None)
        self.report.dead_workers[worker] = silent_s
        protocol.send(COORDINATOR, Kind.LOST, worker, group=self.group)
        print(
            f"shardwise: ps relay {self.rank}: worker rank {worker}: {why} for "
            f"{silent_s:.1f} s; declared dead",
            flush=True,
        )
        self._forward_sync()
