"""The parameter server's cost model (`cost_models.ps_costs`) against real jobs: the messages every
rank wrote and read, counted where the protocol does its I/O (`protocol.traffic`) and, for a
worker's sends, by the comm layer too; and the bytes its tensors hold
(`memory.model_state_bytes`). The prediction is made from a model on the meta device."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import comm
from shardwise.nn.models import MLP
from shardwise.observe.memory import model_state_bytes
from shardwise.plan.cost_models.ps_costs import Message, predict_ps
from shardwise.ps import protocol
from shardwise.ps.server import Server
from spawn import run

SIZES = [13, 16, 9, 5]  # 427 parameters: two servers hold 214 and 213 of them
WORKERS, BATCH, STEPS, SAMPLES = 2, 4, 4, 64
# Who asks for a batch while another still holds the queue's last one is a matter of timing:
# that worker is told WAIT (and says IDLE to the other servers). The model leaves them out.
TIMING = ("WAIT", "IDLE")
CATEGORIES = ("params", "master_weights", "grads", "optimizer")


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(SIZES)


def _options(servers: int, relays: int, mode: str, rule: str) -> sw.ParameterServer:
    return sw.ParameterServer(servers=servers, relays=relays, mode=mode, rule=rule)


def _minus(after: dict, before: dict) -> dict:
    out = {
        k: (n - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1])
        for k, (n, b) in after.items()
    }
    return {k: v for k, v in out.items() if v != (0, 0)}


def _comm_sends() -> tuple[int, int]:
    """(calls, bytes) of the comm layer's `send`: its own count of what this process sent."""
    t = comm.stats.total().by_op.get("send")
    return (t.calls, t.bytes) if t else (0, 0)


def _job(servers: int, relays: int, mode: str, rule: str) -> dict:
    strategy = _options(servers, relays, mode, rule)
    rank, world = dist.get_rank(), dist.get_world_size()
    if strategy.is_relay():
        sw.ps.relay(_mlp(), strategy)
        return {"traffic": protocol.traffic.snapshot()}
    if strategy.is_server():
        work = (
            sw.ps.WorkQueue.for_batches(STEPS * WORKERS, SAMPLES, BATCH, 0) if rank == 0 else None
        )
        clients = list(strategy.relay_groups(world)) if relays else strategy.workers(world)
        # Built here rather than through sw.ps.serve, to read its shard and optimizer after.
        server = Server(
            _mlp(), strategy, torch.optim.AdamW, {"lr": 1e-2}, rank, clients, work, WORKERS
        )
        server.serve()
        memory = model_state_bytes(nn.ParameterList(server.params), server.optimizer)
        return {"traffic": protocol.traffic.snapshot(), "memory": memory}
    model, opt = sw.prepare(_mlp(), strategy, optimizer=torch.optim.AdamW, lr=1e-2)
    start = protocol.traffic.snapshot()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(SAMPLES, 13, generator=g), torch.randint(0, 5, (SAMPLES,), generator=g)
    steps, memory = [], None
    while True:
        before, (calls, nbytes) = protocol.traffic.snapshot(), _comm_sends()
        if (indices := model.client.next_batch()) is None:
            break
        F.cross_entropy(model(x[indices]), y[indices]).backward()
        opt.step()
        # After the step, before zero_grad: the gradients are still there, and an optimizer
        # stepped here (averaging rule) has made its state, which torch makes at the first step.
        memory = model_state_bytes(model, opt)
        opt.zero_grad()
        after, (calls_after, nbytes_after) = protocol.traffic.snapshot(), _comm_sends()
        steps.append((_minus(after, before), (calls_after - calls, nbytes_after - nbytes)))
    strategy.close(model)
    return {
        "start": start,
        "steps": steps,
        "traffic": protocol.traffic.snapshot(),
        "memory": memory,
    }


def _expected(
    messages: list[Message], rank: int, times: int = 1, steps_of: dict[int, int] | None = None
) -> Counter:
    """(direction, peer, kind) -> [messages, bytes] that `rank` sends and receives, `times` over;
    a message to or from a worker in `steps_of` as many times as that worker stepped."""
    out: Counter = Counter()
    for m in messages:
        worker = next((r for r in (m.src, m.dst) if r in (steps_of or {})), None)
        n = times if worker is None else steps_of[worker]
        for direction, me, peer in (("sent", m.src, m.dst), ("received", m.dst, m.src)):
            if me == rank:
                out[direction, peer, m.kind.name, "messages"] += n * m.count
                out[direction, peer, m.kind.name, "bytes"] += n * m.nbytes
    return out


def _measured(traffic: dict, leave_out: tuple[str, ...] = ()) -> Counter:
    out: Counter = Counter()
    for (direction, peer, kind), (n, b) in traffic.items():
        if kind not in leave_out:
            out[direction, peer, kind, "messages"] += n
            out[direction, peer, kind, "bytes"] += b
    return out


def _by_kind(counts: Counter) -> Counter:
    """Summed over peers: (direction, lower-case kind, what) as `RankCosts` holds them."""
    out: Counter = Counter()
    for (direction, _, kind, what), v in counts.items():
        out[direction, kind.lower(), what] += v
    return out


def _keyed(tables: list[tuple[dict, str, str]], times: int = 1) -> Counter:
    """(table by kind, direction, what) -> the tables, `times` over, keyed as `_by_kind` keys."""
    out: Counter = Counter()
    for table, direction, what in tables:
        for kind, v in table.items():
            out[direction, kind, what] += times * v
    return out


def _per_step(costs, times: int = 1) -> Counter:
    """A `RankCosts`'s per-step figures, `times` over."""
    return _keyed(
        [
            (costs.comm, "sent", "bytes"),
            (costs.calls, "sent", "messages"),
            (costs.received, "received", "bytes"),
            (costs.received_calls, "received", "messages"),
        ],
        times,
    )


def _once(traffic) -> Counter:
    """A `cost_models.ps_costs.RankTraffic`: a rank's start or end."""
    return _keyed(
        [
            (traffic.sent, "sent", "bytes"),
            (traffic.sent_messages, "sent", "messages"),
            (traffic.received, "received", "bytes"),
            (traffic.received_messages, "received", "messages"),
        ]
    )


CASES = {
    "sync-2-servers": (2, 0, "sync", "gradient"),
    "two-level-async-average": (1, 1, "async", "average"),
}


@pytest.mark.parametrize("servers, relays, mode, rule", CASES.values(), ids=list(CASES))
def test_predicted_bytes_and_memory_are_what_the_job_moved_and_held(servers, relays, mode, rule):
    results = run(_job, servers + relays + WORKERS, servers, relays, mode, rule, timeout_s=60)
    with torch.device("meta"):  # the prediction reads shapes and dtypes only
        model = MLP(SIZES)
    predicted = predict_ps(model, _options(servers, relays, mode, rule), WORKERS, "adamw", BATCH)
    steps_of = {rank: len(r["steps"]) for rank, r in enumerate(results) if "steps" in r}
    # Every batch of the queue was trained once. Async: not necessarily STEPS by each worker, as
    # the faster one takes more of the queue; sync: STEPS each.
    assert sum(steps_of.values()) == STEPS * WORKERS
    if mode == "sync":
        assert set(steps_of.values()) == {STEPS}
    for rank, (costs, got) in enumerate(zip(predicted.ranks, results, strict=True)):
        # The whole job, peer by peer: start, a step of every worker as often as it stepped, end.
        # What a relay forwards for all its workers at once is made STEPS times: the mean.
        want = _expected(predicted.start, rank) + _expected(predicted.end, rank)
        want += _expected(predicted.step, rank, STEPS, steps_of)
        total = _measured(got["traffic"], TIMING)
        assert total == want, (rank, costs.role)
        stepped = steps_of.get(rank, STEPS)
        assert _by_kind(total) == _once(costs.start) + _per_step(costs, stepped) + _once(costs.end)
        if costs.role == "worker":
            assert _by_kind(_measured(got["start"])) == _once(costs.start)
            for step, (traffic, (calls, nbytes)) in enumerate(got["steps"]):
                assert _measured(traffic) == _expected(predicted.step, rank), (rank, step)
                assert _by_kind(_measured(traffic)) == _per_step(costs)
                # The comm layer counted the same bytes sent (a header, then any payload).
                assert nbytes == sum(costs.comm.values())
                sent = [m for m in predicted.step if m.src == rank]
                assert calls == sum(m.count * (2 if m.payload else 1) for m in sent)
        if "memory" in got:
            for category in CATEGORIES:
                bytes_predicted, held = costs.memory[category], got["memory"][category]
                assert abs(bytes_predicted - held) <= 0.02 * max(held, 1), (rank, category)
