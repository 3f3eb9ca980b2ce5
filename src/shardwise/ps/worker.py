"""The worker side of a parameter server, as a strategy: `sw.prepare(model, sw.ParameterServer())`.

The usual loop works unchanged: `loss.backward()` leaves gradients on the worker's copy, and the
optimizer `prepare` returns pushes them on `step()`, each slice to the server that owns it, then
pulls the parameters back (waiting as long as the consistency mode says). The real optimizer,
and its state, lives on the servers. Under the averaging rule the worker keeps a real optimizer,
steps it, and pushes its parameters instead of its gradients.

Ranks 0..S-1 are servers, the next R relays (a two-level job, `relays: R`), the rest workers.
Server ranks call `sw.ps.serve(...)` with the same model and optimizer, relays `sw.ps.relay(...)`;
both return once every worker is done. A worker in a two-level job talks to its relay only, as
if it were the one server.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from shardwise.comm.broken import broken_connection, describe
from shardwise.comm.compressed_collectives import codec_fingerprint
from shardwise.comm.flat import split_bounds, unflatten
from shardwise.distributed import runtime
from shardwise.distributed.runtime import Runtime
from shardwise.ps import protocol
from shardwise.ps.compressed import PS_CODECS, PullReplicas, PushEncoder, ps_codec
from shardwise.ps.liveness import HeartbeatSender, UpstreamGuard
from shardwise.ps.protocol import Kind
from shardwise.ps.sharding import flat_values, plan_shards, signature, trainable
from shardwise.strategies.base import DistributedModel, DistributedOptimizer, Strategy
from shardwise.strategies.section import StrategySection, check_options

PS_CODEC_PATTERN = r"^(fp16|bf16|int8|sign|(topk|randomk)(:(0?\.\d+|1(\.0*)?))?)$"


class PSError(RuntimeError):
    """A server refused this worker (e.g. a different model)."""


class WentOver(Exception):
    """The worker went over to a server's backup (`replicas: 2`), which holds this worker at
    `clock` and with batch number `batch` (-1: none): the caller sends again what it lacks."""

    def __init__(self, server: int, clock: int, batch: int) -> None:
        super().__init__(f"went over to server rank {server}")
        self.server, self.clock, self.batch = server, clock, batch


@dataclass(frozen=True)
class ParameterServer(Strategy):
    """Options of a parameter-server job (the same object on servers and workers).

    servers: the first `servers` ranks serve; the others are workers.
    mode: 'sync' (lock-step, exact), 'async' (apply on arrival) or 'ssp' (bounded staleness).
    staleness: ssp: how many clocks a worker may run ahead of the slowest live one.
    rule: 'gradient' (server-side optimizer steps on pushed gradients) or 'average' (workers
        step locally and push parameters; the server keeps beta * server + (1 - beta) * worker).
    staleness_lr: scale each update's learning rate by 1 / (1 + its staleness).
    heartbeat_s / timeout_s: how often every role proves it lives; the silence that declares one
        dead (a worker, by its servers; a server, by its workers, relays and the supervisor,
        which then end the job or restart it from snapshots).
    progress_timeout_s: a worker alive but whose clock has not moved for this long while another
        is ahead of it is stuck (its training thread hangs): declared dead like a silent one. A
        server that leaves a request unanswered for progress_timeout_s + timeout_s is stuck.
    snapshot_every: servers save their shard every K updates (0: never) to `snapshot_dir`
        (required then; `shardwise train` uses the run directory), and resume from it when
        they start again.
    relays: a second level (0: none): R relay processes, each serving an equal group of the
        workers as if it were the server, summing their pushes into one per clock (sync) and
        asking for their batches; the servers then hear from R relays instead of W workers.
    compression: a codec for pushes (gradients, error feedback on the worker) and, unless
        `pull_compression` says otherwise, pulls (the difference from the worker's copy, which
        the server mirrors): 'fp16', 'bf16', 'int8', 'topk:RATIO', 'randomk:RATIO' or 'sign'
        (`ps/compressed.py`); rule 'gradient', no relays.
    pull_compression: the codec for pulls when not `compression`'s ('none': plain fp32). A
        sparse codec on pulls leaves the workers' copies lagging (each pull refreshes only a
        few coordinates of parameters that all move): 'int8' suits pulls better.
    replicas: 2 keeps each shard on a primary (ranks 0..S-1) and a backup server (ranks
        S..2S-1): the primary forwards every message it handles to its backup before handling
        it, so the backup holds the same state; when the primary dies its workers go over to
        the backup, which serves on from there (no snapshot read, no update lost).
    backup_workers: sync: a round applies the mean of the first N - b pushes of the N active
        workers (Chen et al. 2016); a push that comes after its round closed is not applied,
        its batch goes back to the work queue for another worker, and the servers count how
        often each worker was late (`ServerReport.late`). No relays.
    """

    every_rank_prepares = False  # (servers serve; workers meet them over sockets)

    servers: int = 1
    mode: str = "sync"
    staleness: int = 2
    rule: str = "gradient"
    beta: float = 0.5
    staleness_lr: bool = False
    heartbeat_s: float = 0.5
    timeout_s: float = 10.0
    progress_timeout_s: float = 60.0
    snapshot_every: int = 0
    snapshot_dir: str | None = None
    relays: int = 0
    compression: str | None = None
    pull_compression: str | None = None
    backup_workers: int = 0
    replicas: int = 1

    def __post_init__(self) -> None:
        check_options(self, PSConfig)
        if self.timeout_s <= self.heartbeat_s:
            raise ValueError("ps timeout_s must exceed heartbeat_s")
        if self.snapshot_every and self.snapshot_dir is None:
            raise ValueError("ps snapshot_every needs a snapshot_dir to write to")
        if self.relays and self.mode == "ssp":
            raise ValueError(
                "ps relays work with mode sync or async: SSP bounds each worker by the slowest "
                "of all, which a relay does not see (use relays: 0 for ssp)"
            )
        if self.backup_workers and (self.mode != "sync" or self.relays):
            raise ValueError(
                f"ps backup_workers needs mode sync and no relays (got mode {self.mode!r}, "
                f"relays {self.relays}): async and ssp never wait for a worker"
            )
        if self.replicas == 2 and (
            self.relays or self.compression or self.pull_codec or self.snapshot_every
        ):
            raise ValueError(
                "ps replicas: 2 needs relays 0, no compression and snapshot_every 0 (the backup "
                "servers replace snapshots)"
            )
        for spec in (self.compression, self.pull_codec):
            ps_codec(spec)  # validates the spec
        if (self.compression or self.pull_codec) and (self.relays or self.rule != "gradient"):
            raise ValueError(
                f"ps compression={self.compression!r}, pull_compression="
                f"{self.pull_compression!r} need rule 'gradient' and no relays "
                f"(got rule {self.rule!r}, relays {self.relays})"
            )

    @property
    def pull_codec(self) -> str | None:
        """The codec spec for pulls (None: plain fp32)."""
        if self.pull_compression is None:
            return self.compression
        return None if self.pull_compression == "none" else self.pull_compression

    def codec_fingerprint(self) -> int:
        """What a worker's HELLO and its server must agree on: both codecs (0: none)."""
        if self.compression is None and self.pull_codec is None:
            return 0
        return codec_fingerprint(f"{self.compression}/{self.pull_codec}")

    def is_server(self, rank: int | None = None) -> bool:
        return (runtime.current().rank if rank is None else rank) < self.serving_servers

    def is_relay(self, rank: int | None = None) -> bool:
        rank = runtime.current().rank if rank is None else rank
        return self.serving_servers <= rank < self.serving_servers + self.relays

    def workers(self, world_size: int) -> list[int]:
        return list(range(self.serving_servers + self.relays, world_size))

    def relay_groups(self, world_size: int) -> dict[int, list[int]]:
        """Relay rank -> its workers: equal contiguous groups (sizes differ by at most one)."""
        workers = self.workers(world_size)
        if len(workers) < self.relays:
            raise ValueError(
                f"{self.relays} relays need at least as many workers, got {len(workers)}"
            )
        bounds = split_bounds(len(workers), self.relays)
        return {self.servers + i: workers[a:b] for i, (a, b) in enumerate(bounds)}

    def upstream(self, rank: int, world_size: int) -> list[int]:
        """The ranks a worker pushes to and pulls from: every server, or its relay."""
        if not self.relays:
            return list(range(self.servers))
        for relay, group in self.relay_groups(world_size).items():
            if rank in group:
                return [relay]
        raise ValueError(f"rank {rank} is not a worker")

    @property
    def serving_servers(self) -> int:
        """Server processes: each shard's primary, and its backup with `replicas: 2`."""
        return self.servers * self.replicas

    def shard_of(self, rank: int) -> int:
        """The shard a server rank holds (a backup holds its primary's)."""
        return rank % self.servers

    def backup_of(self, rank: int) -> int | None:
        """The backup server of primary `rank` (None without replicas)."""
        return rank + self.servers if self.replicas == 2 and rank < self.servers else None

    def check_backups(self, world_size: int) -> None:
        workers = len(self.workers(world_size))
        if self.backup_workers >= workers:
            raise ValueError(
                f"ps backup_workers {self.backup_workers} leaves no worker of {workers} "
                "to wait for: it must be fewer than the workers"
            )

    # ---- worker side
    def wrap(self, model: nn.Module, rt: Runtime) -> PSWorkerModel:
        if self.is_server(rt.rank) or self.is_relay(rt.rank):
            raise ValueError(
                f"rank {rt.rank} is a server or relay: call sw.ps.serve(...) or "
                "sw.ps.relay(...) there"
            )
        if rt.world_size <= self.serving_servers + self.relays:
            raise ValueError(
                f"{self.servers} server(s) and {self.relays} relay(s) leave no "
                f"worker in a world of {rt.world_size}"
            )
        self.check_backups(rt.world_size)
        first = self.serving_servers + self.relays
        data_shard = (rt.world_size - first, rt.rank - first)
        return PSWorkerModel(model, rt, PSClient(model, self, rt), self.rule, data_shard)


class PSClient:
    """A worker's connection to the servers (or its relay): hello, pull, push, next batch,
    done, heartbeat. A relay uses one too, for its own connection to the servers."""

    def __init__(
        self,
        model: nn.Module,
        options: ParameterServer,
        rt: Runtime,
        servers: list[int] | None = None,
        role: str = "worker",
    ) -> None:
        """`servers`: whom to talk to (default: this worker's servers, or its relay); `role`:
        what this process is ("worker", or "relay" for a relay's connection upward)."""
        self.o, self.model = options, model
        self.servers = servers if servers is not None else options.upstream(rt.rank, rt.world_size)
        # server -> its backup, gone over to when the server's connection breaks (replicas: 2)
        self.backups = {s: b for s in self.servers if (b := options.backup_of(s)) is not None}
        # server -> the last PUSH or SKIP to it: (kind, ints, payload), sent again to its backup
        self.last_sent: dict[int, tuple[Kind, tuple[int, ...], torch.Tensor | None]] = {}
        self.last_batch = -1  # the number of the last batch received
        self.plan = plan_shards(model, len(self.servers))
        self.params = trainable(model)
        self.rank = rt.rank
        self.version = 0
        self.group = protocol.make_group()
        self._beats = HeartbeatSender(rt.rank, options.heartbeat_s)
        # A worker of a two-level job talks to its relay; everyone else to the servers.
        upstream_role = "relay" if role == "worker" and options.relays else "server"
        # A healthy server answers within the progress timeout after which it gives up on a
        # stuck peer (one more level of it behind a relay), plus a check: past that, it is stuck.
        levels = 2 if upstream_role == "relay" else 1
        stuck_after_s = options.progress_timeout_s + levels * options.timeout_s
        self.guard = UpstreamGuard(
            rt.rank,
            role,
            dict.fromkeys(self.servers, upstream_role),
            options.timeout_s,
            stuck_after_s,
            options.heartbeat_s,
        )
        self.guard.patient = set(self.backups)
        worker = role == "worker"  # (a relay's connection upward is never compressed)
        push_codec, pull_codec = ps_codec(options.compression), ps_codec(options.pull_codec)
        self.pushes = PushEncoder(push_codec) if push_codec and worker else None
        self.pulls = PullReplicas(pull_codec) if pull_codec and worker else None
        sig = self.signature = protocol.pack(signature(model))
        clocks = []
        for server in self.servers:
            # (the codecs' fingerprint: a server with other ones refuses this worker now)
            self._send(server, Kind.HELLO, options.codec_fingerprint(), payload=sig)
            try:
                h, _ = self._recv(server)
            except PSError:
                self.close(say_done=False)
                raise
            clocks.append(int(h[1]))
        self.clock = clocks[0]  # (server 0's `first_clock`: sync, its round in hand)
        self.pull()

    def _send(self, server: int, kind: Kind, *ints: int, payload=None) -> None:
        """(a send blocks too, once a frozen server's socket buffer is full: guarded alike)"""
        with self.guard.waiting(on=server), self._going_over_if_broken(server):
            protocol.send(server, kind, *ints, payload=payload, group=self.group)

    def _recv(self, server: int, dtype: torch.dtype | None = None, most: int = 1 << 31):
        """The next message from `server`, given up on (the process ends, naming it) if the
        server goes silent or leaves it unanswered past the bound. `most`: the values its
        payload may hold (what is posted to receive it)."""
        with self.guard.waiting(on=server), self._going_over_if_broken(server):
            h, payload = protocol.recv(server, dtype, group=self.group, max_numel=most)
        if Kind(int(h[0])) == Kind.ERROR:  # (e.g. declared stuck, its late messages refused)
            raise PSError(
                f"parameter server {server} refused this worker: {protocol.unpack(payload)}"
            )
        return h, payload

    @contextlib.contextmanager
    def _going_over_if_broken(self, server: int):
        """A broken connection to a server that has a backup: go over to it (`WentOver`)."""
        try:
            yield
        except RuntimeError as e:
            if server not in self.backups or not broken_connection(str(e)):
                raise
            raise self._go_over(server, describe(e)) from None

    def _go_over(self, server: int, why: str) -> WentOver:
        """Talk to `server`'s backup from now on: HELLO (going over), and what it holds of us."""
        backup = self.backups.pop(server)
        print(
            f"shardwise: ps worker rank {self.rank}: server rank {server} lost ({why}); going "
            f"over to its backup, server rank {backup}",
            flush=True,
        )
        self.servers[self.servers.index(server)] = backup
        if server in self.last_sent:  # (sent again if the backup lacks it)
            self.last_sent[backup] = self.last_sent.pop(server)
        self.guard.replace(server, backup)
        self._send(backup, Kind.HELLO, self.o.codec_fingerprint(), 1, payload=self.signature)
        h, _ = self._recv(backup)
        return WentOver(backup, clock=int(h[1]), batch=int(h[2]))

    @torch.no_grad()
    def pull(self) -> None:
        """The parameters, each range from its server (waiting as the mode says). A server that
        dies meanwhile is replaced by its backup (`replicas: 2`), which is sent again the push
        it lacks and this pull."""
        for i in range(len(self.servers)):
            self._to_server(i, Kind.PULL, self.clock)
        pieces, versions = [], []
        for i, (start, end) in enumerate(self.plan.bounds):
            while True:
                server = self.servers[i]
                dtype = self.pulls.dtype(server) if self.pulls else torch.float32
                # (a plain answer holds exactly the shard's values: no more is ever read)
                most = (1 << 31) if self.pulls else end - start
                try:
                    h, piece = self._recv(server, dtype, most)
                    break
                except WentOver as went:
                    self._send_again(went)
                    self._send(went.server, Kind.PULL, self.clock)
            versions.append(int(h[1]))
            piece = piece if piece is not None else torch.zeros(0, dtype=dtype)
            if Kind(int(h[0])) != Kind.OK:
                raise PSError(
                    f"parameter server {server} answered a pull with a {Kind(int(h[0])).name}"
                )
            if self.pulls is not None:
                piece, problem = self.pulls.take(server, int(h[2]), piece, end - start)
                if problem:
                    raise PSError(f"parameter server {server} answered a pull with {problem}")
            elif piece.numel() != end - start:
                raise PSError(
                    f"parameter server {server} answered a pull with {piece.numel()} values, "
                    f"its shard holds {end - start}"
                )
            pieces.append(piece)
        # The oldest shard's: with backup workers a round may close between two answers, and a
        # push computed partly on parameters it replaced is late.
        self.version = min(versions)
        flat = torch.cat(pieces)
        for p, value in zip(self.params, unflatten(flat, self.params), strict=True):
            p.copy_(value)

    def _to_server(self, i: int, kind: Kind, *ints: int, payload=None) -> None:
        """A message to the server of shard `i`, or to its backup if that server is lost on
        the way (after what the backup lacks)."""
        server = self.servers[i]
        if kind in (Kind.PUSH, Kind.SKIP) and server in self.backups:
            self.last_sent[server] = (kind, ints, payload)  # (sent again to its backup)
        try:
            self._send(server, kind, *ints, payload=payload)
        except WentOver as went:
            if kind in (Kind.PUSH, Kind.SKIP):
                self.last_sent[went.server] = (kind, ints, payload)
            self._send_again(went)
            if kind not in (Kind.PUSH, Kind.SKIP):
                self._send(went.server, kind, *ints, payload=payload)

    def _send_again(self, went: WentOver) -> None:
        """The last push (or skip) to the backup gone over to, if its clock says it lacks it."""
        if went.server not in self.last_sent:
            return
        kind, ints, payload = self.last_sent[went.server]
        if went.clock <= ints[0]:  # (the backup's clock for us has not passed that push)
            self._send(went.server, kind, *ints, payload=payload)

    def push(self, tensors: list[torch.Tensor]) -> None:
        """One value per parameter (gradients, or parameters under the averaging rule)."""
        flat = flat_values(tensors)
        fingerprint = self.pushes.fingerprint if self.pushes else 0
        for i, piece in enumerate(self.plan.split(flat)):
            payload = piece if piece.numel() else None
            if payload is not None and self.pushes is not None:
                payload = self.pushes.encode(piece, server_index=i)
            # [clock, version used, workers summed (0: one), codec fingerprint]
            self._to_server(i, Kind.PUSH, self.clock, self.version, 0, fingerprint, payload=payload)
        self.clock += 1

    def skip(self) -> None:
        """No update from this worker for its clock (its gradient was not finite): every server
        moves its clock on, and a sync round counts it without its values."""
        for i in range(len(self.servers)):
            self._to_server(i, Kind.SKIP, self.clock, self.version)
        self.clock += 1

    def next_batch(self) -> list[int] | None:
        """Indices of the next batch from the work queue on server 0 (None: no more); through
        the relay in a two-level job."""
        again = 0
        while True:
            try:
                return self._next_batch(again)
            except WentOver as went:  # the batch it holds there, never received: again
                again = int(went.batch >= 0 and went.batch != self.last_batch)

    def _next_batch(self, again: int) -> list[int] | None:
        dealer = self.servers[0]
        self._send(dealer, Kind.NEXT, 0, again)
        h, indices = self._recv(dealer, torch.int64)
        if Kind(int(h[0])) == Kind.WAIT:  # none now: the other servers must not wait for us
            for i in range(1, len(self.servers)):
                self._to_server(i, Kind.IDLE)
            h, indices = self._recv(dealer, torch.int64)
        if Kind(int(h[0])) == Kind.END:
            return None
        self.last_batch = int(h[3])
        return indices.tolist()

    def close(self, say_done: bool = True) -> None:
        if say_done:
            for i in range(len(self.servers)):
                self._to_server(i, Kind.DONE)
        self.guard.stop()
        self._beats.stop()


class PSWorkerModel(DistributedModel):
    """A worker's copy of the model. After each optimizer step it pushes its gradients (or,
    under the averaging rule, its locally stepped parameters) to the servers and pulls the
    parameters the consistency mode allows."""

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        client: PSClient,
        rule: str,
        data_shard: tuple[int, int],
    ) -> None:
        super().__init__(module, runtime)
        self.client, self.rule, self._data_shard = client, rule, data_shard
        self.last_wait_s = 0.0  # seconds the last step waited for push and pull

    def make_optimizer(
        self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> DistributedOptimizer:
        # The gradient rule's optimizer lives on the servers: nothing to step here.
        local = optimizer_cls(self.optimizer_params(), **kwargs) if self.rule == "average" else None
        return DistributedOptimizer(self, local)

    @torch.no_grad()
    def after_step(self) -> None:
        client = self.client
        if self.rule == "average":  # stepped here: push the parameters
            values = list(client.params)
        else:
            values = [p.grad if p.grad is not None else torch.zeros_like(p) for p in client.params]
        start = time.perf_counter()
        client.push(values)
        client.pull()
        self.last_wait_s = time.perf_counter() - start

    @torch.no_grad()
    def skip_step(self) -> None:
        """Instead of the optimizer's step, where this worker's loss or gradient is not finite
        (`train.nonfinite`): nothing is pushed, the servers' parameters are pulled."""
        start = time.perf_counter()
        self.client.skip()
        self.client.pull()
        self.last_wait_s = time.perf_counter() - start

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.client.pull()  # the servers' current parameters
        return super().full_state_dict()

    def extra_state(self) -> dict[str, torch.Tensor]:
        client = self.client
        return {"clock": torch.tensor(client.clock), "version": torch.tensor(client.version)}

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore: the servers hold the job's clock and parameters, and a worker
        goes on from theirs (its HELLO and first PULL), whatever it saved."""

    def data_shard(self) -> tuple[int, int]:
        return self._data_shard

    def release(self) -> None:
        self.client.close()


class PSConfig(StrategySection):
    name: Literal["ps"] = Field("ps", description="the parallelism strategy")
    servers: int = Field(1, ge=1, description="server processes (ranks 0..servers-1)")
    workers: int = Field(2, ge=1, description="worker processes")
    mode: Literal["sync", "async", "ssp"] = Field("sync", description="consistency mode")
    staleness: int = Field(2, ge=0, description="ssp: clocks a worker may run ahead")
    rule: Literal["gradient", "average"] = Field(
        "gradient", description="push gradients, or push parameters to be averaged"
    )
    beta: float = Field(0.5, ge=0, le=1, description="average: new = beta*server+(1-beta)*worker")
    staleness_lr: bool = Field(False, description="scale each update's lr by 1/(1+staleness)")
    heartbeat_s: float = Field(0.5, gt=0, description="seconds between worker heartbeats")
    timeout_s: float = Field(10.0, gt=0, description="silence that declares a worker dead")
    progress_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a live worker whose clock has not moved for this long while another is "
        "ahead is stuck: declared dead, its batch dealt again",
    )
    snapshot_every: int = Field(0, ge=0, description="servers save their shard every K updates")
    min_workers: int | None = Field(
        None,
        ge=1,
        description="the job fails (exit 1, naming the failed roles) if fewer workers finish "
        "(default: all)",
    )
    relays: int = Field(
        0, ge=0, description="two-level: relays between workers and servers (sync/async)"
    )
    compression: str | None = Field(
        None,
        description=f"codec for pushes and pulls: {PS_CODECS} (rule gradient, no relays)",
        pattern=PS_CODEC_PATTERN,
    )
    pull_compression: str | None = Field(
        None,
        description="codec for pulls if not compression's: the same names, or none (fp32)",
        pattern=r"^(none|fp16|bf16|int8|sign|(topk|randomk)(:(0?\.\d+|1(\.0*)?))?)$",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=2,
        description="2: each shard also on a backup server (ranks servers..2*servers-1), kept "
        "in lockstep; a dead primary's workers go over to it (relays 0, no compression)",
    )
    backup_workers: int = Field(
        0,
        ge=0,
        description="sync: each round averages the first workers - b pushes; a late push is "
        "not applied and its batch goes to another worker",
    )

    @model_validator(mode="after")
    def _relays_fit(self) -> PSConfig:
        if self.timeout_s <= self.heartbeat_s:  # (every live worker would be declared dead)
            raise ValueError(
                f"ps timeout_s {self.timeout_s} must exceed heartbeat_s {self.heartbeat_s}"
            )
        if self.relays and self.mode == "ssp":
            raise ValueError("ps relays work with mode sync or async, not ssp")
        if self.relays > self.workers:
            raise ValueError(f"{self.relays} relays need at least as many workers")
        if self.backup_workers and (self.mode != "sync" or self.relays):
            raise ValueError("ps backup_workers needs mode sync and relays 0")
        if self.backup_workers >= self.workers:
            raise ValueError(
                f"ps backup_workers {self.backup_workers} must be fewer than the {self.workers} "
                "workers"
            )
        if self.min_workers is not None and self.min_workers > self.workers:
            raise ValueError(f"min_workers {self.min_workers} exceeds workers {self.workers}")
        compressed = self.compression or self.pull_compression not in (None, "none")
        if compressed and (self.relays or self.rule != "gradient"):
            raise ValueError("ps compression and pull_compression need rule gradient, relays 0")
        if self.replicas == 2 and (self.relays or compressed or self.snapshot_every):
            raise ValueError("ps replicas 2 needs relays 0, no compression and snapshot_every 0")
        return self

    def build(self, world_size: int, run_dir: Path) -> ParameterServer:
        snapshots = str(run_dir / "ps-snapshots")
        options = self.options(exclude={"workers", "min_workers"})
        return ParameterServer(**options, snapshot_dir=snapshots)

    def ranks_needed(self) -> int | None:
        return self.servers * self.replicas + self.relays + self.workers

    def data_parallel_ranks(self, world_size: int) -> int:
        return self.workers

    def describe(self) -> str:
        relays = f"{self.relays} relays, " if self.relays else ""
        pulls = f", pulls {self.pull_compression}" if self.pull_compression else ""
        codec = f", {self.compression}{pulls}" if self.compression or pulls else ""
        backups = f", {self.backup_workers} backup" if self.backup_workers else ""
        backups += ", each shard replicated" if self.replicas == 2 else ""
        return (
            f"parameter server ({self.mode}, {self.servers} server(s), {relays}"
            f"{self.workers} workers{backups}{codec})"
        )
