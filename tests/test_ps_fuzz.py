"""A hostile client among honest ones: 10,000 random, malformed, oversized and out-of-turn
messages to a live parameter server while two honest workers train in sync mode. The server
never dies, answers every hostile message with an ERROR (counted by the hostile client), and
the honest workers end where single-process training on their batches ends."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.comm import messages
from shardwise.ps import protocol
from shardwise.ps.protocol import Kind
from spawn import run
from test_ps import BATCH, STEPS, _global_batch, _mlp, _reference

HOSTILE = 3
MESSAGES = 10_000
DONE_KEY = "test/hostile-done"


def _hostile_message(rng: random.Random, shard_numel: int):
    """(header ints, payload or None): always consistent on the wire (a payload only where the
    server reads one, in the dtype it reads), wrong in every other way it can be."""
    kind = rng.choice([*range(0, 20), *[int(k) for k in Kind]])
    ints = [rng.choice([-5, 0, 1, 7, 2**40]) for _ in range(6)]
    if kind not in set(Kind):  # an unknown kind: a header only (its length may say anything)
        return [kind, *ints, rng.choice([0, 3, 2**40])], None
    limit = protocol.PAYLOAD_LIMIT.get(Kind(kind), shard_numel)
    choice = rng.random()
    if choice < 0.2:  # an oversized announcement, refused before any payload is read
        return [kind, *ints, limit + rng.choice([1, 2**33])], None
    if choice < 0.5:
        return [kind, *ints, 0], None
    dtype = protocol.PAYLOAD_DTYPE.get(Kind(kind), torch.float32)
    numel = rng.choice([1, max(1, shard_numel - 1), shard_numel, min(limit, shard_numel + 7)])
    payload = torch.randint(0, 255, (numel,)).to(dtype) if dtype != torch.float32 else None
    if payload is None:
        payload = torch.randn(numel).mul_(rng.choice([1.0, float("nan"), 1e30]))
    return [kind, *ints, numel], payload


def _fuzz_run():
    strategy = sw.ParameterServer(servers=1, mode="sync", timeout_s=30.0)
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    if strategy.is_server():
        report = sw.ps.serve(_mlp(), strategy, torch.optim.AdamW, lr=1e-2)
        return {"refused": report.refused, "updates": report.updates}
    model, opt = sw.prepare(_mlp(), strategy, optimizer=torch.optim.AdamW, lr=1e-2)
    client = model.client
    if rank == HOSTILE:  # a client that turns hostile after its HELLO
        rng = random.Random(0)
        shard = sum(p.numel() for p in model.parameters())
        errors = 0
        # its first message breaks the protocol (a second HELLO): it is never served after
        protocol.send(0, Kind.HELLO, payload=protocol.pack([]), group=client.group)
        for i in range(MESSAGES):
            if i:
                ints, payload = _hostile_message(rng, shard)
                head = messages.header(*ints)
                handles = [messages.send_header(head, 0, client.group)]
                if payload is not None:
                    handles.append(sw.comm.send(payload.contiguous(), 0, client.group))
                for handle in handles:
                    handle.wait()
            h, reply = protocol.recv(0, group=client.group)
            errors += Kind(int(h[0])) == Kind.ERROR and isinstance(protocol.unpack(reply), str)
        store.set(DONE_KEY, "1")
        return {"errors": errors}
    index = rank - 1
    while client.clock < STEPS:
        x, y = _global_batch(client.clock, 2)
        part = slice(index * BATCH, (index + 1) * BATCH)
        F.cross_entropy(model(x[part]), y[part]).backward()
        opt.step()
        opt.zero_grad()
    # (polling: a blocking wait would hold the store client that the heartbeats need)
    sw.comm.store.wait_for(store, [DONE_KEY], 600)  # the honest ones end after the flood
    state = sw.full_state_dict(model)
    strategy.close(model)
    return state


def test_a_hostile_client_never_stops_the_server_nor_changes_the_honest_result():
    server, *honest, hostile = run(_fuzz_run, 4, timeout_s=600)
    assert hostile["errors"] == MESSAGES  # an ERROR for every hostile message
    assert server["refused"] == MESSAGES and server["updates"] == STEPS
    expected = _reference(workers=2)
    for state in honest:
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5
