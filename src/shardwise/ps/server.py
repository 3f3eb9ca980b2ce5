"""A parameter server: owns a shard of the parameters and its optimizer state, applies updates.

One loop, one thread: wait for a message from any client, handle it (one handler per kind of
message), answer the pulls the consistency mode now allows (`consistency.py`), repeat until
every client has said DONE or died. The update is either a gradient for the server-side
optimizer or, under the averaging rule, the worker's parameters blended in
(`new = beta * server + (1 - beta) * worker`). Every applied update's staleness (server version
minus the version the worker computed on) is recorded. Clients prove they are alive by bumping a
counter in the c10d store; one silent for `timeout_s` is declared dead and nobody waits for it
any more. Server 0 also deals out batches (its `Dealer`, `dealer.py`), taking back those a dead
worker never finished; the other servers deal none.

With `replicas: 2` each shard also has a backup server. The primary forwards every message it
is about to handle, and every client it declares dead, to its backup (FROM, DEAD) before acting
on it; the backup handles them alike and so holds the same state, but sends nothing (`standby`).
When the primary dies, its connection to the backup breaks and the backup takes over (a
worker's word that it lost the primary, a HELLO that says so, is held until then: no client
makes a takeover). Each worker that comes over is told its clock and batch there and sends
again what the backup lacks; only then does the backup answer it. (Under our supervisor a
primary that freezes is killed, which breaks its connections.)

The server's clients are the workers, or, in a two-level job, the relays (`relay.py`): each
speaks for a group of workers, pushes their sum with its count, and asks for batches on their
behalf (the worker's rank travels in the message, and the answer goes back through the relay).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import runtime
from shardwise.faults.injection import FaultInjector
from shardwise.ps import compressed, protocol
from shardwise.ps.consistency import mode_for
from shardwise.ps.dealer import dealing
from shardwise.ps.liveness import HeartbeatSender
from shardwise.ps.outbox import Outbox
from shardwise.ps.peers import (
    Peers,
    RefusalLog,
    check_hello,
    start_forwarded_receiver,
    start_receivers,
)
from shardwise.ps.protocol import COORDINATOR, Kind
from shardwise.ps.shard import Shard
from shardwise.ps.sharding import signature
from shardwise.ps.snapshots import EXIT_NO_SNAPSHOT, ShardSnapshots, SnapshotError
from shardwise.ps.validation import Rules, Turn, check
from shardwise.ps.work_queue import WorkQueue

# The kinds of message a server hears (the others are its answers), each handled by `_on_<kind>`.
HANDLED = (Kind.HELLO, Kind.PULL, Kind.PUSH, Kind.SKIP, Kind.IDLE, Kind.NEXT, Kind.LOST)
HANDLED += (Kind.FINISHED, Kind.DONE, Kind.ROUND, Kind.HOLDS)
GOING_OVER = 1  # a HELLO's second integer: from a worker whose server (this one's primary) died


@dataclass
class ServerReport:
    """What a server returns when the job is over (and writes to the run directory)."""

    rank: int
    updates: int
    staleness: list[int] = field(default_factory=list)
    # client rank (worker, or relay) -> seconds of silence before it was declared dead
    dead_workers: dict[int, float] = field(default_factory=dict)
    clocks: dict[int, int] = field(default_factory=dict)
    consumed_batches: int = 0  # server 0: batches of its work queue consumed (trained)
    consumed_samples: int = 0
    rejected: dict[int, str] = field(default_factory=dict)
    pushes_received: int = 0  # push messages (one per worker, or one per relay and clock)
    refused: int = 0  # messages refused (malformed, out of turn, from a client no longer served)
    rounds: list[list[int]] = field(default_factory=list)  # sync: the clients of each update
    # sync with backup workers: client -> pushes that came after their round closed
    late: dict[int, int] = field(default_factory=dict)
    resumed_from: int | None = None
    took_over_at: int | None = None  # a backup server: the version at which it took over
    # Bytes this server wrote and read on the wire (headers and payloads, `protocol.traffic`):
    # pulls answered and pushes received, compressed or not.
    bytes_sent: int = 0
    bytes_received: int = 0
    final: torch.Tensor | None = field(default=None, repr=False)  # this shard, at the end


class Server:
    """One shard's server: its loop (`serve`), a handler per kind of message, and the updates
    (as `ServerView` to the consistency mode)."""

    def __init__(
        self,
        model: nn.Module,
        options: Any,  # the ParameterServer strategy's options
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        rank: int,
        clients: list[int],
        work: WorkQueue | None = None,
        workers: int | None = None,
        faults: FaultInjector | None = None,  # kill, hang or slow this server (step: update)
        lr_schedule: Callable[[int], float] | None = None,
    ) -> None:
        """`clients`: the ranks that push and pull (workers, or relays); `work`: the batches to
        deal (server 0's, or none); `workers`: how many workers there are in all (the batches
        one sync update consumes); `lr_schedule`: the rate's multiplier at a training step
        (`nn.schedules.Schedule`; a step is as many batches as there are workers)."""
        self.o, self.rank, self.faults = options, rank, faults
        self.lr_schedule = lr_schedule
        self.workers = workers or len(clients)
        self.shard_index = options.shard_of(rank)
        self.backup = options.backup_of(rank)  # (a primary's backup server, forwarded to)
        self.primary = rank - options.servers if rank >= options.servers else None
        self.standby = self.primary is not None  # a backup, until its primary is lost
        self.came_over: set[int] = set()  # clients of a backup that took over, re-greeted
        self.lost_in_standby: dict[int, str] = {}  # connections that broke meanwhile
        # HELLOs held until a takeover: a client's last (a client repeating it holds no more)
        self.coming_over: dict[int, torch.Tensor] = {}
        # Beating from the start: the clients and the supervisor tell a frozen server by this.
        self._beats = HeartbeatSender(rank, options.heartbeat_s)
        self.shard = Shard(
            model, self.shard_index, options.servers, optimizer_cls, optimizer_kwargs
        )
        self.params, self.optimizer = self.shard.params, self.shard.optimizer  # (never replaced)
        self.signature = signature(model)
        self.push_codec = compressed.ps_codec(options.compression)  # (None: fp32)
        pull_codec = compressed.ps_codec(options.pull_codec)
        self.pulls = compressed.PullMirrors(pull_codec) if pull_codec else None
        self.version = 0
        self._make_bookkeeping(clients)
        self._connect()
        self.dealer = dealing(work, self.peers, self.outbox)
        self.identity = self._identity(optimizer_cls, optimizer_kwargs)
        self.handlers = self._handlers()
        self.snapshots = None
        if options.snapshot_every:
            self._resume()
        self.start_version = self.version  # (0, or a resumed server's: `first_clock`)

    def _make_bookkeeping(self, clients: list[int]) -> None:
        """Who is served, their clocks, the consistency mode, and what is held for them."""
        o = self.o
        self.peers = Peers(clients, o.timeout_s, o.heartbeat_s)
        # A relay stalls while it waits for a stuck worker of its own, until it declares that
        # one (after progress_timeout_s): it is stuck itself only if it stalls longer.
        relay_s = o.timeout_s if o.relays else 0.0
        self.stuck_after_s = o.progress_timeout_s + relay_s
        self.clock = dict.fromkeys(clients, 0)
        # (with replicas, every other shard's primary and backup hear server 0's rounds)
        followers = [r for r in range(o.serving_servers) if o.shard_of(r) != 0]
        self.mode = mode_for(o.mode, o.staleness, self.shard_index, followers, o.backup_workers)
        self.coordinators = frozenset(r for r in range(o.serving_servers) if o.shard_of(r) == 0)
        self.waiting_pulls: list[tuple[int, int]] = []  # (client, clock)
        self.report = ServerReport(rank=self.rank, updates=0)
        self.greeted: set[int] = set()
        self.clock_unsaid: set[int] = set()  # greeted clients that have not pulled yet
        # relay -> the workers its push on the way holds (HOLDS; server 0 of a two-level job),
        # and those of them it lost before that push was applied (sync: its round waits)
        self.holds: dict[int, list[int]] = {}
        self.lost_in_push: dict[int, list[int]] = {}
        self.refusals = RefusalLog(f"ps server {self.rank}")

    def _connect(self) -> None:
        """The server's own process group (collective), its inbox and its outbox."""
        self.group = protocol.make_group()
        self.inbox: queue.Queue = queue.Queue()
        self.outbox = Outbox(self.group, self.inbox)
        if self.primary is not None:  # nothing goes out until this backup takes over
            self.outbox.delivers = self._delivers

    def _identity(self, optimizer_cls: type, optimizer_kwargs: dict[str, Any]) -> str:
        """What a snapshot must have been written by to be resumed from: the same model, shard,
        optimizer and training options (not only a directory that happens to be the same)."""
        return json.dumps(
            {
                "model": [[n, list(s)] for n, s in self.signature],
                "bounds": list(self.shard.bounds),
                "optimizer": [optimizer_cls.__name__, repr(sorted(optimizer_kwargs.items()))],
                "mode": [self.o.mode, self.o.staleness, self.o.servers],
                # (how an update is applied: a snapshot of another rule is another training)
                "update": [self.o.rule, self.o.beta, self.o.backup_workers, self.o.staleness_lr],
                "work": self.dealer.plan(),
            },
            sort_keys=True,
        )

    def _handlers(self) -> dict[Kind, Any]:
        """One handler per kind of message a client (or server 0) sends: `_on_<kind>`."""
        return {kind: getattr(self, f"_on_{kind.name.lower()}") for kind in HANDLED}

    def _resume(self) -> None:
        """Start from the servers' newest common usable snapshot; its batches are consumed.
        With none left of a version they all kept, this process ends (one line, exit code
        EXIT_NO_SNAPSHOT): a restart would find the same files."""
        store = runtime.store()
        self.snapshots = ShardSnapshots(
            self.o.snapshot_dir, self.rank, self.o.servers, store, self.identity, self.shard.numels
        )
        try:
            self._restore()
        except SnapshotError as e:
            print(f"shardwise: ps server {self.rank}: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_NO_SNAPSHOT)

    # ---- the loop
    def serve(self) -> ServerReport:
        """Serve until every client is done or dead; the report of what this server saw."""
        self._start()
        while self.peers.serving():
            if not self.standby:  # (a backup hears its primary's declarations)
                self._declare_silent_and_stuck()
            try:
                client, h, payload = self.inbox.get(timeout=self.o.heartbeat_s / 2)
            except queue.Empty:
                continue
            if h is None:
                self._not_a_message(client, payload)
            elif client == self.primary and Kind(int(h[0])) == Kind.DEAD:
                silent_s, why = protocol.unpack(payload)
                self._declare_dead(int(h[1]), float(silent_s), str(why))
            else:
                self._handle(client, h, payload)
            if self.standby:
                continue
            for lost, why in self.peers.lost_undeclared():  # its connection broke
                self._declare_dead(lost, self.peers.heartbeats.silent_for(lost), why)
        self.outbox.close()
        self._beats.stop()
        self.report.clocks = dict(self.clock)
        for (direction, _, _), (_, nbytes) in protocol.traffic.snapshot().items():
            if direction == "sent":
                self.report.bytes_sent += nbytes
            else:
                self.report.bytes_received += nbytes
        self.report.final = self.shard.final()
        self.report.consumed_batches, self.report.consumed_samples = self.dealer.consumed()
        return self.report

    def _start(self) -> None:
        """The rules messages are checked by, and a receiving thread per sender."""
        world_size = dist.get_world_size()
        # relay -> its workers (their batches are dealt through it)
        self.groups = self.o.relay_groups(world_size) if self.o.relays else {}
        self.rules = Rules(
            server=self.rank,
            world_size=world_size,
            clients=frozenset(self.peers.live),
            relays=bool(self.o.relays),
            coordinates=self.shard_index == COORDINATOR,
            hears_rounds=self.mode.hears_rounds,
            shard_numel=self.shard.numel,
            workers=self.workers,
            coordinators=self.coordinators,
            groups={relay: frozenset(workers) for relay, workers in self.groups.items()},
        )
        senders = [*self.peers.live, *(self.coordinators if self.mode.hears_rounds else [])]
        # (every receive thread reads on after a DONE: what a client sends after it is refused)
        numel, push_dtype = self.shard.numel, None
        if self.push_codec is not None:  # pushes are the codec's bytes
            numel = max(numel, compressed.wire_size(self.push_codec, numel))
            push_dtype = torch.uint8
        start_receivers(senders, self.group, self.inbox, set(), numel, push_dtype)
        if self.primary is not None:
            start_forwarded_receiver(self.primary, self.group, self.inbox, numel)

    def _declare_silent_and_stuck(self) -> None:
        """Declare dead the clients silent past the timeout, and those alive but stuck."""
        for client, silent_s in self.peers.silent():
            self._declare_dead(client, silent_s)
        held = {client for client, _ in self.waiting_pulls}
        for client, clock, still_s in self.peers.stuck(self.stuck_after_s, held):
            why = f"stuck at clock {clock} for {still_s:.1f} s (alive, no progress)"
            self._declare_dead(client, still_s, why)

    def _handle(self, src: int, h: torch.Tensor, payload) -> None:
        """Refuse the message (one line saying why), or hand it to its kind's handler."""
        if self.backup is not None:  # first the backup, so it never lags what was done here
            self._forward(Kind.FROM, src, h=h, payload=payload)
        going_over = Kind(int(h[0])) == Kind.HELLO and int(h[2]) == GOING_OVER
        if going_over and self.primary is not None:
            if self.standby:  # (held until this server knows its primary lost: a client's
                self.coming_over[src] = payload  # word alone makes no takeover)
            else:
                self._came_over(src, payload)
            return
        payload, problem = self._decoded(h, payload)
        if problem := problem or self._problem(src, h, payload):
            self._refuse(src, problem)
            return
        self.handlers[Kind(int(h[0]))](src, h, payload)
        self._answer_pulls()

    # ---- what is not handled: broken connections and refused messages
    def _decoded(self, h: torch.Tensor, payload) -> tuple[torch.Tensor | None, str | None]:
        """A compressed PUSH's values, decoded after its codec and bytes are checked, or what
        is wrong with it; any other message as it came."""
        if self.push_codec is None or Kind(int(h[0])) != Kind.PUSH or payload is None:
            return payload, None
        values, problem = compressed.read(self.push_codec, int(h[4]), payload, self.shard.numel)
        return values, problem and f"PUSH {problem}"

    def _problem(self, src: int, h: torch.Tensor, payload) -> str | None:
        """What is wrong with the message (its form and turn first, then whether its sender is
        served)."""
        turn = Turn(
            greeted=src in self.greeted,
            clock=None if src in self.clock_unsaid else self.clock.get(src, 0),
            pulling=any(client == src for client, _ in self.waiting_pulls),
            pushed=self.mode.holds(src),
        )
        if problem := check(self.rules, src, h, payload, turn):
            return problem
        if src not in self.peers.live and src not in self.coordinators:
            why = self.report.rejected.get(src, "it was declared dead")
            return f"rank {src} is no longer served ({why})"
        if src in self.peers.done:
            return f"{Kind(int(h[0])).name} after its DONE"
        if Kind(int(h[0])) == Kind.HELLO:
            self.greeted.add(src)
        return None

    def _not_a_message(self, src: int, reason) -> None:
        if isinstance(reason, protocol.ProtocolError):  # read whole: the peer may go on
            self._refuse(src, str(reason))
            return
        if src == self.primary:
            if self.standby and self.peers.serving():
                self._take_over(f"lost ({reason})")
            return
        if src == self.backup:
            print(f"shardwise: ps server {self.rank}: backup server rank {src} lost ({reason})")
            self.backup = None
            return
        if self.standby:  # (its primary says what becomes of it; kept for a takeover)
            self.lost_in_standby[src] = f"its connection broke ({reason})"
            return
        if src in self.peers.live and src not in self.peers.done:
            self.peers.lose(src, f"its connection broke ({reason})")

    def _refuse(self, src: int, problem: str) -> None:
        """ERROR to the sender and one line in the log; the message is dropped, its sender
        stays connected (its next message is judged on its own)."""
        self.report.refused += 1
        self.refusals.say(src, problem)
        self.outbox.send(src, Kind.ERROR, payload=protocol.pack(problem))

    # ---- the handlers, one per kind of message
    def _on_hello(self, src: int, h: torch.Tensor, payload: torch.Tensor) -> None:
        problem = check_hello(self.signature, payload)
        if problem is None and int(h[1]) != self.o.codec_fingerprint():
            codecs = f"compression {self.o.compression}, pull_compression {self.o.pull_codec}"
            problem = f"its codecs are not this server's ({codecs})"
        if problem is None:
            self.clock[src] = clock = self.mode.first_clock(self)
            self.clock_unsaid.add(src)  # (its first PULL says which clock it goes on from)
            self.outbox.send(src, Kind.OK, clock)
        else:  # refuse this worker, keep serving the others
            self.report.rejected[src] = problem
            self.peers.live.discard(src)
            self.outbox.send(src, Kind.ERROR, payload=protocol.pack(problem))
            self.mode.settle(self)  # (a sync round no longer waits for its push)

    def _on_pull(self, src: int, h: torch.Tensor, payload) -> None:
        self.peers.idle.discard(src)
        if src in self.clock_unsaid:
            self.clock_unsaid.discard(src)
            self.clock[src] = int(h[1])
        self.waiting_pulls.append((src, int(h[1])))

    def _on_push(self, src: int, h: torch.Tensor, payload: torch.Tensor) -> None:
        self.peers.idle.discard(src)
        self.report.pushes_received += 1
        self.clock[src] = int(h[1]) + 1
        self.peers.note_clock(src, self.clock[src])
        self.mode.push(self, src, version_used=int(h[2]), value=payload, count=max(1, int(h[3])))

    def _on_skip(self, src: int, h: torch.Tensor, payload) -> None:
        """A client with no update this clock (a non-finite gradient): its clock moves on, its
        round (sync) counts it as pushed, and nothing of it is applied."""
        self.peers.idle.discard(src)
        self.clock[src] = int(h[1]) + 1
        self.peers.note_clock(src, self.clock[src])
        self.mode.push(self, src, version_used=int(h[2]), value=None, count=0)

    def _on_idle(self, src: int, h: torch.Tensor, payload) -> None:
        self.peers.idle.add(src)  # it waits for a batch from server 0: do not wait for it here
        self.mode.settle(self)

    def _on_next(self, src: int, h: torch.Tensor, payload) -> None:
        """A worker (or a relay, for one of its workers) wants its next batch (or, again, the
        one it holds: its server died before sending it)."""
        worker = int(h[1]) or src
        held = self.dealer.again(src, worker) if int(h[2]) else self.dealer.request(src, worker)
        if held:
            self.mode.settle(self)  # (a worker held is idle: a sync round waits for it no more)

    def _on_lost(self, src: int, h: torch.Tensor, payload) -> None:
        """A relay's worker died: its unfinished batch is dealt again; but where the relay's
        push waiting in a sync round holds it, once that round is applied (then it is in the
        parameters: consumed, not dealt again)."""
        worker = int(h[1])
        if self.mode.holds(src) and worker in self.holds.get(src, ()):
            self.lost_in_push.setdefault(src, []).append(worker)
        else:
            self.dealer.lost([worker])

    def _on_holds(self, src: int, h: torch.Tensor, payload: torch.Tensor) -> None:
        """A relay names the workers its next push holds (their batches count once it is
        applied)."""
        self.holds[src] = payload.tolist()

    def _on_finished(self, src: int, h: torch.Tensor, payload) -> None:
        """A relay's worker closed: its last batch counts as consumed."""
        self.dealer.finished(int(h[1]))

    def _on_done(self, src: int, h: torch.Tensor, payload) -> None:
        self.peers.finish(src)
        self.dealer.finished(src)
        self.mode.settle(self)

    def _on_round(self, src: int, h: torch.Tensor, payload: torch.Tensor) -> None:
        """From server 0: the members of the next sync round."""
        self.mode.announce(self, payload.tolist(), version_after=int(h[1]))
        self.mode.settle(self)

    # ---- updates
    def active(self) -> set[int]:
        """The clients that still take part (alive, not done, not waiting for a batch)."""
        return self.peers.active()

    def is_live(self, client: int) -> bool:
        """Whether `client` is alive (served, not declared dead)."""
        return client in self.peers.live

    def announce_round(self, follower: int, members: list[int], version_after: int) -> None:
        """Tell server `follower` the members of the sync round to `version_after` (ROUND)."""
        self.outbox.send(follower, Kind.ROUND, version_after, payload=torch.tensor(members))

    def late(self, client: int) -> None:
        """Its push came after its round closed: counted, not applied, its batch dealt again."""
        self.report.late[client] = self.report.late.get(client, 0) + 1
        self.dealer.late(client)

    def skipped(self, client: int) -> None:
        """An async SKIP: no update, and the batch behind it (the worker's, or the one its relay
        named) is consumed: a worker that dies next has it dealt again no more (trained twice,
        before; and a resumed job trained it, where the run straight through skipped it)."""
        self._note_applied([client])

    def apply_round(self, members: list[int], pushes: list[tuple[torch.Tensor, int]]) -> None:
        """A sync round: the mean over the workers behind `pushes` ((sum, count) per client)."""
        self.report.rounds.append(members)
        pushes = [(value, n) for value, n in pushes if value is not None]  # (SKIPs: nothing)
        if not pushes:  # every member died before its push reached this server, or skipped
            self._note_applied(members)
            self.version += 1
            return
        total = torch.stack([value for value, _ in pushes]).sum(dim=0)
        self.apply(total / sum(n for _, n in pushes), staleness=0, behind=members)

    @torch.no_grad()
    def apply(self, flat: torch.Tensor, staleness: int, behind: list[int]) -> None:
        """Apply one update made `staleness` versions ago from the pushes of the clients
        `behind` it (then any fault planned for it)."""
        started = time.perf_counter()
        self._note_applied(behind)  # (before a snapshot holds it)
        self._apply(flat, staleness)
        if self.faults is not None:
            self.faults.slow_down(started, step=self.version)
            self.faults.before_step(self.version)  # (kill, or hang with the heartbeats going on)

    def _apply(self, flat: torch.Tensor, staleness: int) -> None:
        self.report.staleness.append(staleness)
        if self.o.rule == "average":
            self.shard.average(flat, self.o.beta)
        else:
            scale = 1.0 / (1 + staleness) if self.o.staleness_lr else 1.0
            if self.lr_schedule is not None:  # (the step whose batches this update ends)
                batches = self.version * self.mode.batches_per_update(self.workers)
                scale *= self.lr_schedule(batches // self.workers)
            self.shard.step(flat, scale)
        self.version += 1
        self.report.updates += 1
        if self.snapshots and self.version % self.o.snapshot_every == 0:
            self._snapshot()

    # ---- pulls: answered when the consistency mode allows
    def _answer_pulls(self) -> None:
        still = []
        for client, clock in self.waiting_pulls:
            if client not in self.peers.live:
                continue
            if self.mode.may_answer(self, client, clock):
                ints, values = (self.version,), self.shard.values()
                if self.pulls is not None:  # [version, codec fingerprint (0: plain fp32)]
                    fingerprint, values = self.pulls.answer(client, values)
                    ints = (self.version, fingerprint)
                self.outbox.send(client, Kind.OK, *ints, payload=values)
                self.peers.note_served(client)
            else:
                still.append((client, clock))
        self.waiting_pulls = still

    # ---- liveness
    def _declare_dead(self, client: int, silent_s: float, why: str = "") -> None:
        """Nobody waits for it any more; a dead worker's unfinished batch goes back to the
        queue, and so do those of a dead relay's workers (they stop with it: the supervisor
        restarts the job)."""
        if self.backup is not None:
            self._forward(Kind.DEAD, client, payload=protocol.pack([silent_s, why]))
        self.peers.mark_dead(client, silent_s)
        if self.pulls is not None:
            self.pulls.forget(client)
        self.report.dead_workers[client] = silent_s
        self.mode.forget(client)
        self.holds.pop(client, None)
        self.lost_in_push.pop(client, None)  # (among its group's, given back now)
        self.dealer.lost(self.groups.get(client, [client]))
        role = "relay" if self.o.relays else "worker"
        why = why or f"silent for {silent_s:.1f} s"
        if not self.standby:  # (a backup's primary has said it)
            print(f"shardwise: ps server {self.rank}: {role} rank {client}: {why}; declared dead")
        self.mode.settle(self)
        self._answer_pulls()

    # ---- replicas: a primary's forwarding, a backup's takeover
    def _forward(self, kind: Kind, sender: int, h=None, payload=None) -> None:
        """To the backup, before this server acts: FROM [sender] and the sender's message
        (header `h`), or DEAD [client] + why. Sent from this loop, not the outbox: it is out
        before anything that follows from it."""
        try:
            if kind == Kind.FROM:
                protocol.send(self.backup, Kind.FROM, sender, group=self.group)
                ints = h[1 : 1 + protocol.MAX_INTS].tolist()
                protocol.send(
                    self.backup, Kind(int(h[0])), *ints, payload=payload, group=self.group
                )
            else:
                protocol.send(self.backup, kind, sender, payload=payload, group=self.group)
        except Exception as e:
            lost = f"backup server rank {self.backup} lost ({e})"
            print(f"shardwise: ps server {self.rank}: {lost}; serving on alone", flush=True)
            self.backup = None

    def _delivers(self, dst: int) -> bool:
        """A backup sends nothing while its primary serves; then, to a client, only once it
        came over (before that the client does not listen to this server)."""
        return not self.standby and (dst in self.came_over or dst not in self.clock)

    def _take_over(self, why: str) -> None:
        self.standby = False
        self.report.took_over_at = self.version
        print(
            f"shardwise: ps server {self.rank}: primary server rank {self.primary} {why}; "
            f"serving shard {self.shard_index} from here, at version {self.version}",
            flush=True,
        )
        for client in self.peers.live:  # (their time to show progress starts now: no
            self.peers.note_served(client)  # clock moved here while the primary was lost)
        for client, reason in self.lost_in_standby.items():
            if client in self.peers.live and client not in self.peers.done:
                self.peers.lose(client, reason)
        for client, payload in self.coming_over.items():
            self._came_over(client, payload)
        self.mode.take_over(self)

    def _came_over(self, src: int, payload) -> None:
        """A worker lost this backup's primary: forget what it waits for here (it asks again),
        and tell it its clock and the batch it holds here."""
        problem = check_hello(self.signature, payload)
        if problem is None and src not in self.peers.live:
            problem = (
                f"rank {src} is no longer served ({self.report.rejected.get(src, 'declared dead')})"
            )
        if problem is None and src not in self.greeted:
            problem = "it never said HELLO to this shard's primary"
        self.came_over.add(src)
        if problem is not None:
            self._refuse(src, problem)
            return
        self.waiting_pulls = [(c, k) for c, k in self.waiting_pulls if c != src]
        self.dealer.release(src)
        self.outbox.send(src, Kind.OK, self.clock.get(src, 0), self.dealer.holding(src))

    # ---- snapshots
    def _note_applied(self, clients: list[int]) -> None:
        """The batches the pushes of `clients` hold are in the update being made: a worker's
        own, and those of the workers a relay named (HOLDS) before its push. (A relay's round
        may leave out a worker of its group that waited for a batch, and an async push holds
        one worker's: the group does not say whose are in it.)"""
        for client in clients:
            self.dealer.applied(self.holds.pop(client, []) if client in self.groups else [client])
            if lost := self.lost_in_push.pop(client, None):  # (their batches now consumed)
                self.dealer.lost(lost)

    def _snapshot(self) -> None:
        # (server 0's holds the batches applied: a resumed job deals the others, those only)
        dealt = self.dealer.snapshot()
        self.snapshots.save({"version": self.version, **self.shard.state(), **dealt})

    def _restore(self) -> None:
        """Resume from the newest version that every server has a usable snapshot of (checked
        by `ShardSnapshots`: this job's, undamaged), or start afresh if they kept none."""
        found = self.snapshots.newest_common()
        if found is None:
            return
        path, state = found
        self.shard.load(state, path)
        self.version = state["version"]
        self.report.resumed_from = self.version
        try:
            self.dealer.restore(state, self.version * self.mode.batches_per_update(self.workers))
        except ValueError as e:
            raise SnapshotError(f"{path}: {e}") from None
