"""A parameter server: owns a shard of the parameters and its optimizer state, applies updates.

One loop, one thread: wait for a message from any worker, handle it, repeat until every worker
has said DONE or died. What a PULL waits for is the consistency mode:

- sync: the parameters after every live worker's push of the previous clock (lock-step, the
  same arithmetic as single-process training on the global batch);
- async: nothing, the current parameters are sent at once;
- ssp (stale synchronous parallel, Ho et al. 2013): the worker may be at most `staleness`
  clocks ahead of the slowest live worker, and waits otherwise.

A push is applied on arrival (async, ssp) or once all live workers' pushes for the clock are in
(sync: their average). The update is either a gradient for the server-side optimizer or, under
the averaging rule, the worker's parameters blended in (`new = beta * server + (1 - beta) *
worker`). Every applied update's staleness (server version minus the version the worker
computed on) is recorded. Workers prove they are alive by bumping a counter in the c10d store;
one silent for `timeout_s` is declared dead and nobody waits for it any more. Server 0 also deals
out batches (`WorkQueue`), taking back those a dead worker never finished.

The server's clients are the workers, or, in a two-level job, the relays (`relay.py`): each
speaks for a group of workers, pushes their sum with its count, and asks for batches on their
behalf (the worker's rank travels in the message, and the answer goes back through the relay).
"""

from __future__ import annotations

import collections
import json
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.ps import protocol
from shardwise.ps.liveness import HeartbeatWatch
from shardwise.ps.protocol import COORDINATOR, Kind
from shardwise.ps.sharding import (
    describe_mismatch,
    flat_values,
    plan_shards,
    signature,
    trainable,
)


class WorkQueue:
    """Batches of sample indices, `epochs` shuffled passes, dealt to whoever asks next."""

    def __init__(
        self, size: int, batch: int, epochs: int, seed: int, limit: int | None = None
    ) -> None:
        self.queue: collections.deque[tuple[int, list[int]]] = collections.deque()
        for epoch in range(epochs):
            order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
            for start in range(0, size - batch + 1, batch):  # drop_last, as the loaders do
                self.queue.append((epoch, order[start : start + batch].tolist()))
        while limit is not None and len(self.queue) > limit:  # `limit` batches in all
            self.queue.pop()
        self.outstanding: dict[int, tuple[int, list[int]]] = {}
        self.consumed: list[int] = []

    def next(self, worker: int) -> tuple[int, list[int]] | None:
        """The worker finished its previous batch (if any) and wants another."""
        if worker in self.outstanding:
            self.consumed.extend(self.outstanding.pop(worker)[1])
        if not self.queue:
            return None
        self.outstanding[worker] = self.queue.popleft()
        return self.outstanding[worker]

    def finish(self, worker: int) -> None:
        if worker in self.outstanding:
            self.consumed.extend(self.outstanding.pop(worker)[1])

    def skip(self, batches: int) -> None:
        """A resumed job: the snapshot already holds the first `batches` batches' updates."""
        for _ in range(min(batches, len(self.queue))):
            self.consumed.extend(self.queue.popleft()[1])

    def give_back(self, worker: int) -> None:
        """A dead worker's unfinished batch goes to the front of the queue."""
        if worker in self.outstanding:
            self.queue.appendleft(self.outstanding.pop(worker))


@dataclass
class ServerReport:
    """What a server returns when the job is over (and writes to the run directory)."""

    rank: int
    updates: int
    staleness: list[int] = field(default_factory=list)
    # client rank (worker, or relay) -> seconds of silence before it was declared dead
    dead_workers: dict[int, float] = field(default_factory=dict)
    clocks: dict[int, int] = field(default_factory=dict)
    consumed: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    pushes_received: int = 0  # push messages (one per worker, or one per relay and clock)
    rounds: list[list[int]] = field(default_factory=list)  # sync: the clients of each update
    resumed_from: int | None = None
    final: torch.Tensor | None = field(default=None, repr=False)  # this shard, at the end
    # (client, its clock, slowest live client's clock) for every pull answered: SSP's bound
    pull_gaps: list[tuple[int, int, int]] = field(default_factory=list)


class Server:
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
    ) -> None:
        """`clients`: the ranks that push and pull (workers, or relays); `workers`: how many
        workers there are in all (the batches one sync update consumes)."""
        self.o, self.rank, self.work = options, rank, work
        plan = plan_shards(model, options.servers)
        self.bounds = plan.bounds[rank]
        mine = plan.split(flat_values(trainable(model)))[rank]
        self.params = [nn.Parameter(mine.clone())] if mine.numel() else []
        self.numels = [p.numel() for p in self.params]
        self.signature = signature(model)
        self.optimizer = optimizer_cls(self.params, **optimizer_kwargs) if self.params else None
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []
        self.version = 0
        self.live = set(clients)
        self.accepted: set[int] = set()
        self.done: set[int] = set()
        self.clock = dict.fromkeys(clients, 0)
        self.heartbeats = HeartbeatWatch(clients, options.timeout_s, options.heartbeat_s / 2)
        # client -> (sum of pushed gradients, how many workers' pushes it holds), this clock
        self.pending_sync: dict[int, tuple[torch.Tensor, int]] = {}
        self.waiting_pulls: list[tuple[int, int]] = []  # (client, clock)
        self.waiting_batch: dict[int, int] = {}  # worker held for a batch -> client asking
        # Sync with several servers: server 0 decides each round's members (who is idle, dead
        # or late is known there first) and the others follow, so that every shard averages
        # the same pushes. Rounds announced but not applied yet, in order:
        self.follows = options.mode == "sync" and options.servers > 1 and rank > 0
        self.rounds: collections.deque[list[int]] = collections.deque()
        self.report = ServerReport(rank=rank, updates=0)
        self.store = dist.distributed_c10d._get_default_store()
        self.group = protocol.make_group()
        self.inbox: queue.Queue = queue.Queue()
        self.lost: set[int] = set()  # clients whose connection broke while we answered them
        self.idle: set[int] = set()  # clients waiting for a batch: nobody waits for them
        self.snapshot_dir = Path(options.snapshot_dir) if options.snapshot_dir else None
        if options.snapshot_every:
            self._restore()
            if self.work is not None:  # sync applies one update per W batches, else one each
                per_update = (workers or len(clients)) if options.mode == "sync" else 1
                self.work.skip(self.version * per_update)

    # ---- the loop
    def serve(self) -> ServerReport:
        for client in [*self.live, *([COORDINATOR] if self.follows else [])]:
            threading.Thread(
                target=self._receive, args=(client,), daemon=True, name=f"ps-recv-{client}"
            ).start()
        while self.live - self.done:
            self._check_heartbeats()
            try:
                client, h, payload = self.inbox.get(timeout=self.o.heartbeat_s / 2)
            except queue.Empty:
                continue
            if h is not None and (client in self.live or client == COORDINATOR):
                self._handle(client, h, payload)
                self._answer_pulls()
            for lost in sorted(self.lost - set(self.report.dead_workers)):
                self._declare_dead(lost, self.heartbeats.silent_for(lost))
        self.report.clocks = dict(self.clock)
        self.report.final = torch.cat(
            [p.detach().reshape(-1) for p in self.params] or [torch.zeros(0)]
        )
        if self.work is not None:
            self.report.consumed = list(self.work.consumed)
        return self.report

    def _receive(self, client: int) -> None:
        """One thread per client: its messages, in order, into the inbox, until DONE."""
        while True:
            try:
                h, payload = protocol.recv(client, group=self.group)
            except Exception:  # its connection closed: the heartbeat timeout will tell
                self.inbox.put((client, None, None))
                return
            self.inbox.put((client, h, payload))
            if Kind(int(h[0])) == Kind.DONE:
                return

    def _handle(self, src: int, h: torch.Tensor, payload: torch.Tensor | None) -> None:
        kind = Kind(int(h[0]))
        if kind == Kind.ROUND:  # from server 0: the members of the next sync round
            self.rounds.append(payload.tolist())
            self._maybe_apply_sync()
        elif kind == Kind.HELLO:
            problem = describe_mismatch(self.signature, protocol.unpack(payload))
            if problem is None:
                self.accepted.add(src)
                self.clock[src] = self.version  # a resumed server: workers continue from here
                self._send(src, Kind.OK, self.version)
            else:  # refuse this worker, keep serving the others
                self.report.rejected[src] = problem
                self.live.discard(src)
                self._send(src, Kind.ERROR, payload=protocol.pack(problem))
        elif kind == Kind.PULL:
            self.idle.discard(src)
            self.waiting_pulls.append((src, int(h[1])))
        elif kind == Kind.PUSH:
            self.idle.discard(src)
            self.report.pushes_received += 1
            self._push(src, int(h[1]), int(h[2]), payload, count=max(1, int(h[3])))
        elif kind == Kind.IDLE:  # it waits for a batch from server 0: do not wait for it here
            self.idle.add(src)
            self._maybe_apply_sync()
        elif kind == Kind.NEXT:  # from a worker, or from a relay for one of its workers
            worker = int(h[1]) or src
            batch = self.work.next(worker) if self.work is not None else None
            if batch is not None:
                self._send(src, Kind.BATCH, batch[0], worker, payload=torch.tensor(batch[1]))
            elif self.work is not None and self.work.outstanding:
                self.waiting_batch[worker] = src  # held: another worker's batch may come back
                if worker == src:  # a relay says IDLE itself once its whole group waits
                    self.idle.add(src)
                self._send(src, Kind.WAIT, worker)
                self._maybe_apply_sync()
            else:
                self._send(src, Kind.END, worker)
            self._deal()  # its finished batch may have been the last one others waited on
        elif kind in (Kind.LOST, Kind.FINISHED) and self.work is not None:
            worker = int(h[1])  # a relay's worker died (its batch is dealt again) or closed
            self.waiting_batch.pop(worker, None)
            if kind == Kind.LOST:
                self.work.give_back(worker)
            else:
                self.work.finish(worker)
            self._deal()
        elif kind == Kind.DONE:
            self.done.add(src)
            self.idle.discard(src)
            if self.work is not None:
                self.work.finish(src)
                self._deal()
            self._maybe_apply_sync()

    def _active(self) -> set[int]:
        """Workers that others may wait for: alive, not finished, not waiting for work."""
        return self.live - self.done - self.idle

    def _deal(self) -> None:
        """Hand batches to held workers. With the queue empty, a worker waits while another
        still holds a batch (it may die and give it back), and gets END once none does."""
        for worker, client in sorted(self.waiting_batch.items()):
            if client not in self.live or client in self.done:
                del self.waiting_batch[worker]
                continue
            batch = self.work.next(worker) if self.work is not None else None
            if batch is not None:
                self._send(client, Kind.BATCH, batch[0], worker, payload=torch.tensor(batch[1]))
            elif self.work is None or not self.work.outstanding:
                self._send(client, Kind.END, worker)
            else:
                continue
            del self.waiting_batch[worker]
            self.idle.discard(client)

    def _send(self, dst: int, kind: Kind, *ints: int, payload: torch.Tensor | None = None):
        try:
            protocol.send(dst, kind, *ints, payload=payload, group=self.group)
        except RuntimeError:  # the worker's connection is gone: it died between ask and answer
            self.lost.add(dst)
            self.live.discard(dst)

    # ---- updates
    def _push(
        self, client: int, clock: int, version_used: int, payload: torch.Tensor, count: int
    ) -> None:
        self.clock[client] = clock + 1
        if self.o.mode == "sync":
            self.pending_sync[client] = (payload, count)
            self._maybe_apply_sync()
        else:  # a relay forwards each of its workers' pushes on its own, in these modes
            self._apply(payload / count, staleness=self.version - version_used)

    def _maybe_apply_sync(self) -> None:
        """Server 0: once every active client pushed this clock, apply the mean over all the
        workers' pushes and announce the round's members. The others: apply each announced
        round once its members' pushes are in (a member that died here is left out)."""
        if self.follows:
            while self.rounds:
                members = self.rounds[0]
                if any(m not in self.pending_sync and m in self.live for m in members):
                    return  # a push is still on its way
                self.rounds.popleft()
                self.report.rounds.append(members)
                self._apply_mean(
                    [self.pending_sync.pop(m) for m in members if m in self.pending_sync]
                )
            return
        if self.pending_sync and set(self.pending_sync) >= self._active():
            members = sorted(self.pending_sync)
            if self.o.mode == "sync" and self.o.servers > 1:
                for server in range(1, self.o.servers):
                    protocol.send(
                        server,
                        Kind.ROUND,
                        self.version + 1,
                        payload=torch.tensor(members),
                        group=self.group,
                    )
            self.report.rounds.append(members)
            self._apply_mean([self.pending_sync.pop(m) for m in members])

    def _apply_mean(self, pushes: list[tuple[torch.Tensor, int]]) -> None:
        """Apply the mean over the workers behind `pushes` ((sum, count) per client)."""
        if not pushes:  # every member died before its push reached this server
            self.version += 1
            return
        total = torch.stack([value for value, _ in pushes]).sum(dim=0)
        self._apply(total / sum(n for _, n in pushes), staleness=0)

    @torch.no_grad()
    def _apply(self, flat: torch.Tensor, staleness: int) -> None:
        self.report.staleness.append(staleness)
        pieces = flat.split(self.numels)
        if self.o.rule == "average":
            for p, worker_value in zip(self.params, pieces, strict=True):
                p.mul_(self.o.beta).add_(worker_value.view_as(p), alpha=1 - self.o.beta)
        elif self.optimizer is not None:
            scale = 1.0 / (1 + staleness) if self.o.staleness_lr else 1.0
            for group, lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = lr * scale
            for p, g in zip(self.params, pieces, strict=True):
                p.grad = g.view_as(p).clone()
            with torch.enable_grad():
                self.optimizer.step()
            self.optimizer.zero_grad()
        self.version += 1
        self.report.updates += 1
        if self.o.snapshot_every and self.version % self.o.snapshot_every == 0:
            self._snapshot()

    # ---- pulls: answered when the consistency mode allows
    def _may_answer(self, client: int, clock: int) -> bool:
        if self.o.mode == "async":
            return True
        if self.o.mode == "sync":  # never before the round that holds the client's own push
            pending = client in self.pending_sync
            return not pending and (self.version >= clock or not self._active())
        slowest = min((self.clock[w] for w in self._active()), default=clock)
        return clock - slowest <= self.o.staleness

    def _answer_pulls(self) -> None:
        still = []
        for client, clock in self.waiting_pulls:
            if client not in self.live:
                continue
            if self._may_answer(client, clock):
                slowest = min((self.clock[w] for w in self._active()), default=clock)
                self.report.pull_gaps.append((client, clock, slowest))
                flat = torch.cat([p.detach().reshape(-1) for p in self.params])
                self._send(client, Kind.OK, self.version, payload=flat)
            else:
                still.append((client, clock))
        self.waiting_pulls = still

    # ---- liveness
    def _check_heartbeats(self) -> None:
        for client, silent_s in self.heartbeats.dead(self.live - self.done - self.lost):
            self._declare_dead(client, silent_s)

    def _declare_dead(self, client: int, silent_s: float) -> None:
        """Nobody waits for it any more; a dead worker's unfinished batch goes back to the
        queue (a dead relay's workers stop with it: the supervisor restarts the job)."""
        self.live.discard(client)
        self.report.dead_workers[client] = silent_s
        if not self.follows:  # (a follower keeps its push: server 0 may have counted it)
            self.pending_sync.pop(client, None)
        self.idle.discard(client)
        self.waiting_batch.pop(client, None)
        if self.work is not None:
            self.work.give_back(client)
            self._deal()
        role = "relay" if self.o.relays else "worker"
        print(
            f"shardwise: ps server {self.rank}: {role} rank {client} silent for "
            f"{silent_s:.1f} s, declared dead",
            flush=True,
        )
        self._maybe_apply_sync()
        self._answer_pulls()

    # ---- snapshots
    def _snapshot_path(self, version: int) -> Path:
        return self.snapshot_dir / f"server{self.rank}-v{version:09d}.pt"

    def _snapshot_versions(self) -> list[int]:
        paths = self.snapshot_dir.glob(f"server{self.rank}-v*.pt")
        return sorted(int(p.stem.rsplit("-v", 1)[1]) for p in paths)

    def _snapshot(self) -> None:
        """Save this shard atomically; keep the last two (a restart needs a version that every
        server has, and they do not all write at the same instant)."""
        state = {
            "version": self.version,
            "bounds": self.bounds,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
        }
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        path = self._snapshot_path(self.version)
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a crash leaves the previous snapshots intact
        for old in self._snapshot_versions()[:-2]:
            self._snapshot_path(old).unlink(missing_ok=True)

    @torch.no_grad()
    def _restore(self) -> None:
        """Resume from the newest version that every server has a snapshot of (servers agree
        through the c10d store), or start afresh if there is none."""
        mine = self._snapshot_versions()
        self.store.set(f"shardwise/ps/snapshots/server{self.rank}", json.dumps(mine))
        keys = [f"shardwise/ps/snapshots/server{r}" for r in range(self.o.servers)]
        self.store.wait(keys)
        common = set(mine)
        for key in keys:
            common &= set(json.loads(self.store.get(key)))
        if not common:
            return
        path = self._snapshot_path(max(common))
        state = torch.load(path, weights_only=False)
        if tuple(state["bounds"]) != tuple(self.bounds):
            raise ValueError(f"{path}: a snapshot of another shard of the parameters")
        for p, value in zip(self.params, state["params"], strict=True):
            p.copy_(value)
        if self.optimizer and state["optimizer"]:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.report.resumed_from = self.version
