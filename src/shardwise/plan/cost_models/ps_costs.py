"""Predicted per-rank costs of a parameter-server job (`shardwise.ps`) before it runs: model-state
bytes by role, and the bytes and messages every rank sends and receives per step, as the
protocol frames them (issue #16).

The model may live on the meta device: only parameter names, shapes and dtypes are read. Ranks
0..S-1 are servers, then R relays (a two-level job), then W workers. P is the number of
trainable parameter elements, n_s the length of server s's range of the flat vector (`sharding`:
P cut into S near-equal ranges, whatever the tensors), C a server's clients (the W workers, or
the R relays), g a relay's group of workers, B the samples of a batch of server 0's work queue.

Memory, in `memory.model_state_bytes`'s categories at `memory_report`'s moment (after backward,
before the step):

    worker     its model (every parameter, in its own dtype) and the trainable ones' gradients;
               no optimizer state under the gradient rule (the optimizer lives on the servers),
               the optimizer's own under the averaging rule (the worker steps locally)
    server s   one fp32 parameter of n_s elements and the optimizer's state over it (Adam:
               8 n_s + 4); its gradient lives only during an update. Under the averaging rule
               the server's optimizer never steps: no state.
    relay      its model (filled by its first pull) and the flat fp32 vector it answers its
               workers' pulls with: the model's bytes + 4P

Every message is a header of 8 int64 (H = 64 bytes) and at most one payload (`protocol`),
which ends with one more element of its dtype (its mark): parameters and gradients as fp32 (4
bytes an element, whatever the model's dtype), sample indices and member ranks as int64, a
HELLO's model signature as UTF-8 JSON, whose length is found by building it as the worker does
(`protocol.pack(signature(model))`). The formulas below leave the mark out. A client (a worker,
or a relay towards the servers) talks to its upstream ranks U (every server; a two-level
worker's relay, which holds the whole vector):

    start      HELLO + signature and its OK; the first PULL and its OK + the range (4 n)
    each step  PUSH + 4 n and PULL to each of U, OK + 4 n back from each: U(3H) + 3 * 4P in all;
               with a work queue, NEXT to the dealer (server 0, or its relay) and BATCH + 8B back
    end        DONE to each of U; with a work queue, the NEXT answered END

A relay passes its workers' NEXT, BATCH and END on to and from server 0 and tells it FINISHED
for each worker that is done. Upwards, a sync relay sends one PUSH and PULL per server and step
(the sum of its group's pushes), an async one a PUSH and PULL per worker push; before each
push, HOLDS + 8g (sync) or + 8 (async) to server 0, naming the workers whose pushes it holds.
A server's step is one step of every worker: it hears its clients' pushes and pulls (C of each,
W under an async relay) and, in sync mode with S > 1, server 0 announces each update's members
to the others: ROUND + 8C, S - 1 messages. Nothing else is per step: consistency mode,
staleness and the update rule change when a message is answered, not its bytes; the protocol
has no compression, and the shards are always the equal flat ranges above.

Bytes are those handed to the backend (what `protocol.traffic` counts, and `comm.accounting`
for the sending side); gloo's TCP transport frames each of its sends again, below us, and the
heartbeats go through the c10d store: neither is counted. `calls` are protocol messages; the
comm layer counts a message with a payload as two sends (header, then payload).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from shardwise.comm.messages import HEADER
from shardwise.plan.cost_models import CostModel
from shardwise.plan.costs import FP32, CostJob, Costs, optimizer_bytes
from shardwise.ps.protocol import COORDINATOR, PAYLOAD_DTYPE, Kind, pack
from shardwise.ps.sharding import plan_shards, signature, trainable
from shardwise.ps.worker import ParameterServer, PSConfig

HEADER_BYTES = 8 * HEADER  # every message's header: HEADER int64 values
INT64 = 8  # a sample index (BATCH), a member rank (ROUND), a worker's rank (HOLDS)


@dataclass(frozen=True)
class Message:
    """`count` messages of `kind` from rank `src` to rank `dst`, each a header and `payload`
    bytes."""

    src: int
    dst: int
    kind: Kind
    payload: int = 0
    count: int = 1

    @property
    def nbytes(self) -> int:
        return self.count * (
            HEADER_BYTES + self.payload + (_mark(self.kind) if self.payload else 0)
        )


def _mark(kind: Kind) -> int:
    """The bytes of the element that ends a payload of `kind` (`protocol`: one element of its
    dtype)."""
    return PAYLOAD_DTYPE.get(kind, torch.float32).itemsize


@dataclass
class RankTraffic:
    """What one rank sends and receives, by message kind (lower-case): bytes and messages."""

    sent: dict[str, int] = field(default_factory=dict)
    sent_messages: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    received_messages: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, rank: int, messages: list[Message]) -> RankTraffic:
        out = cls()
        for m in messages:
            kind = m.kind.name.lower()
            if m.src == rank:
                out.sent[kind] = out.sent.get(kind, 0) + m.nbytes
                out.sent_messages[kind] = out.sent_messages.get(kind, 0) + m.count
            if m.dst == rank:
                out.received[kind] = out.received.get(kind, 0) + m.nbytes
                out.received_messages[kind] = out.received_messages.get(kind, 0) + m.count
        return out


@dataclass
class RankCosts(Costs):
    """One rank of a PS job. As for every strategy, `comm` and `calls` are what it sends per
    step (bytes and messages, by message kind); a PS rank's traffic is not symmetric, so what it
    receives per step is beside them, and the job's first and last exchanges (`start`, `end`:
    once per job, not per step) too."""

    role: str = "worker"
    received: dict[str, int] = field(default_factory=dict)
    received_calls: dict[str, int] = field(default_factory=dict)
    start: RankTraffic = field(default_factory=RankTraffic)
    end: RankTraffic = field(default_factory=RankTraffic)

    def as_dict(self) -> dict:
        return {
            **super().as_dict(),
            "role": self.role,
            "received": dict(sorted(self.received.items())),
            "received_calls": dict(sorted(self.received_calls.items())),
            "start": asdict(self.start),
            "end": asdict(self.end),
        }


@dataclass
class PSCosts:
    """Every rank's costs (servers, relays, then workers) and the messages they follow from."""

    ranks: list[RankCosts]
    start: list[Message]
    step: list[Message]  # one step of every worker
    end: list[Message]

    def of_role(self, role: str) -> list[RankCosts]:
        return [r for r in self.ranks if r.role == role]


def predict_ps(
    model: nn.Module,
    options: ParameterServer | PSConfig,
    workers: int | None = None,
    optimizer: str = "adamw",
    batch: int | None = None,
) -> PSCosts:
    """The costs of a PS job over `model` with `options` (a `ParameterServer`, or the config's
    `PSConfig`, which also gives `workers`) and the server-side `optimizer` (the workers' own
    under the averaging rule); `batch`: samples per batch when workers take their batches from
    server 0's work queue, as `train/ps_training.py` runs them (None: they feed themselves, no
    NEXT/BATCH)."""
    o = _strategy(options)
    if workers is None:
        if isinstance(options, ParameterServer):  # (its `workers` is the layout's rank list)
            raise ValueError("predict_ps needs `workers` with a ParameterServer")
        workers = options.workers
    world = o.servers + o.relays + workers
    shards = [b - a for a, b in plan_shards(model, o.servers).bounds]
    start, step, end = _messages(o, world, model, shards, batch)
    ranks = []
    for rank in range(world):
        costs = _state(o, rank, model, shards, optimizer)
        per_step, costs.start, costs.end = (RankTraffic.of(rank, m) for m in (step, start, end))
        for kind, nbytes in per_step.sent.items():
            costs.add_comm(kind, nbytes, per_step.sent_messages[kind])
        costs.received, costs.received_calls = per_step.received, per_step.received_messages
        costs.notes = _notes(o, costs.role, rank, shards, workers)
        ranks.append(costs)
    return PSCosts(ranks, start, step, end)


def ps_costs(job: CostJob, s: PSConfig) -> Costs:
    """`predictors.predict`'s view: rank `job.rank`'s costs in a job of `job.world_size` ranks (its
    servers and relays included) under the config's `PSConfig` `s`, each worker taking batches
    of `job.global_batch // workers` samples from server 0's queue (none: no batch messages)."""
    workers = job.world_size - s.servers * s.replicas - s.relays
    batch = job.global_batch // workers if job.global_batch else None
    costs = predict_ps(job.model, s, workers, job.optimizer, batch).ranks[job.rank]
    if costs.role == "worker" and batch:
        traced = job.activations(batch)
        costs.activations = None if traced is None else traced[0]
    return costs


def _strategy(options: ParameterServer | PSConfig) -> ParameterServer:
    """The layout rules (who is a server, relay or worker; relay groups) of `options`."""
    if isinstance(options, ParameterServer):
        return options
    fields = ("servers", "mode", "staleness", "rule", "relays")
    return ParameterServer(**{name: getattr(options, name) for name in fields})


# ---- messages ----------------------------------------------------------------------------------
def _messages(
    o: ParameterServer, world: int, model: nn.Module, shards: list[int], batch: int | None
) -> tuple[list[Message], list[Message], list[Message]]:
    """The job's messages: at the start, in one step of every worker, and at the end."""
    start: list[Message] = []
    step: list[Message] = []
    end: list[Message] = []
    hello = pack(signature(model)).numel()  # built as the clients build it: exact JSON length
    total = sum(shards)
    groups = o.relay_groups(world) if o.relays else {}
    for relay, group in groups.items():
        # A sync relay pushes its group's sum once a step; an async one each push as it comes.
        pushes = 1 if o.mode == "sync" else len(group)
        _client(relay, list(enumerate(shards)), hello, pushes, start, step, end)
        # Before each push, server 0 hears whose pushes it holds: all its group's, or one.
        named = INT64 * (len(group) if o.mode == "sync" else 1)
        step += [Message(relay, COORDINATOR, Kind.HOLDS, named, pushes)]
        end += [Message(relay, COORDINATOR, Kind.FINISHED, count=len(group))]
    for worker in o.workers(world):
        up = o.upstream(worker, world)
        ranges = [(up[0], total)] if o.relays else [(s, shards[s]) for s in up]
        _client(worker, ranges, hello, 1, start, step, end)
        if batch is not None:
            _batches(worker, up[0], batch, step, end)
    clients = len(groups) or len(o.workers(world))
    if o.mode == "sync":  # server 0 tells the others each update's members
        step += [Message(COORDINATOR, f, Kind.ROUND, INT64 * clients) for f in range(1, o.servers)]
    return start, step, end


def _client(
    client: int,
    ranges: list[tuple[int, int]],
    hello: int,
    pushes: int,
    start: list[Message],
    step: list[Message],
    end: list[Message],
) -> None:
    """A client's messages with each upstream rank holding a range of `n` elements: hello and
    first pull; `pushes` pushes a step, each followed by a pull; done."""
    for up, n in ranges:
        values = FP32 * n  # (a range of no elements travels without a payload)
        start += [
            Message(client, up, Kind.HELLO, hello),
            Message(up, client, Kind.OK),
            Message(client, up, Kind.PULL),
            Message(up, client, Kind.OK, values),
        ]
        step += [
            Message(client, up, Kind.PUSH, values, pushes),
            Message(client, up, Kind.PULL, count=pushes),
            Message(up, client, Kind.OK, values, pushes),
        ]
        end += [Message(client, up, Kind.DONE)]


def _batches(worker: int, dealer: int, batch: int, step: list[Message], end: list[Message]) -> None:
    """A worker's batches from server 0's queue, through its relay if `dealer` is one: NEXT and
    BATCH each step; the last NEXT is answered END."""
    hops = [(worker, dealer)] + ([(dealer, COORDINATOR)] if dealer != COORDINATOR else [])
    for asker, answerer in hops:
        step += [
            Message(asker, answerer, Kind.NEXT),
            Message(answerer, asker, Kind.BATCH, INT64 * batch),
        ]
        end += [Message(asker, answerer, Kind.NEXT), Message(answerer, asker, Kind.END)]


# ---- memory ------------------------------------------------------------------------------------
def _state(
    o: ParameterServer, rank: int, model: nn.Module, shards: list[int], optimizer: str
) -> RankCosts:
    """Rank `rank`'s role, its model state and the tensors an optimizer of its steps."""
    if o.is_server(rank):
        n = shards[rank]
        memory = _server_memory(n, o.rule, optimizer)
        return RankCosts(memory=memory, optimizer_numels=[n] if n else [], role="server")
    if o.is_relay(rank):
        return RankCosts(memory=_relay_memory(model), role="relay")
    local = [p.numel() for p in trainable(model)] if o.rule == "average" else []
    memory = _worker_memory(model, o.rule, optimizer)
    return RankCosts(memory=memory, optimizer_numels=local, role="worker")


def _storage(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _worker_memory(model: nn.Module, rule: str, optimizer: str) -> dict[str, int]:
    params = trainable(model)
    held = 0
    if rule == "average":  # its own optimizer, state in each parameter's dtype
        held = sum(optimizer_bytes([p.numel()], optimizer, p.element_size()) for p in params)
    return {
        "params": _storage(model.parameters()),
        "master_weights": 0,
        "grads": _storage(params),
        "optimizer": held,
    }


def _server_memory(n: int, rule: str, optimizer: str) -> dict[str, int]:
    # One flat fp32 parameter; torch's optimizers make their state at the first step, which
    # the averaging rule never takes.
    state = optimizer_bytes([n], optimizer) if n and rule == "gradient" else 0
    return {"params": FP32 * n, "master_weights": 0, "grads": 0, "optimizer": state}


def _relay_memory(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in trainable(model))
    return {
        "params": _storage(model.parameters()) + FP32 * total,
        "master_weights": 0,
        "grads": 0,
        "optimizer": 0,
    }


def _notes(o: ParameterServer, role: str, rank: int, shards: list[int], workers: int) -> list[str]:
    """What comes and goes outside the categories, and what the messages leave out."""
    total = sum(shards)
    if role == "server":
        n = shards[rank]
        clients = o.relays or workers
        notes = [f"an update holds a gradient copy of the shard for its step: {FP32 * n} bytes"]
        if o.mode == "sync":
            notes.append(f"sync: the pushes of a round wait here: up to {clients * FP32 * n} bytes")
    elif role == "relay":
        notes = []
        if o.mode == "sync":
            group = len(o.relay_groups(o.servers + o.relays + workers)[rank])
            notes.append(
                f"sync: its group's pushes wait for a round: up to {group * FP32 * total} bytes"
            )
    else:
        notes = [f"a push and a pull each build a flat fp32 copy: {FP32 * total} bytes"]
    notes.append(
        "with a work queue, at its end: a worker that asks while another holds the last batch "
        "gets WAIT (and tells the other servers IDLE; so does a sync relay whose whole group "
        "waits): not counted"
    )
    if o.snapshot_every:
        notes.append("snapshots: each server writes its shard and optimizer state to disk")
    return notes


# (A parameter server's step time has no model yet.)
MODEL = CostModel(ps_costs)
