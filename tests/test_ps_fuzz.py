"""A hostile client among honest ones, against a live server and against a live relay: a flood
of truncated, oversized, short-payload, NaN, unknown-kind and out-of-turn messages while two
honest workers train in sync mode. The hostile client says HELLO, then IDLE (so that no round
waits for it), and stays connected: every message it sends reaches the server's (the relay's)
checks, each gets one ERROR naming what is wrong, nobody is declared dead for it, and the honest
workers end where single-process training on their batches ends.

Never sent: a message longer than the buffer its receiver posts (gloo aborts the receiving
process on one, below anything Python can catch; README)."""

from __future__ import annotations

import collections
import contextlib
import random

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from ps_batches import STEPS, mlp, single_process_weights, train_on_slices
from shardwise.comm import messages
from shardwise.ps import protocol
from shardwise.ps.protocol import Kind
from spawn import run

CATEGORIES = ("truncated", "oversized", "short", "nan", "unknown", "out-of-turn")
# What the ERROR says, for each category (the server's or relay's own words)
SAYS = {
    "truncated": "truncated or malformed header",
    "oversized": "announces",
    "short": "carried fewer values than",
    "nan": "non-finite values",
    "unknown": "unknown message kind",
    "out-of-turn": "",  # (several wordings: checked to be refusals, below)
}


def _header(kind: int, *ints: int, numel: int = 0) -> torch.Tensor:
    head = messages.header(kind, *ints)
    head[-2], head[-1] = protocol.HEADER_MARK, numel
    return head


def _send(dst: int, group, *tensors: torch.Tensor) -> None:
    for handle in [sw.comm.send(t.contiguous(), dst, group) for t in tensors]:
        handle.wait()


def _marked(values: torch.Tensor) -> torch.Tensor:
    return torch.cat([values, protocol._mark(values.dtype)])


def _hostile(rng: random.Random, category: str, clock: int, shard: int):
    """(tensors to send, in order): one message of `category`, wrong in that way only where it
    can be (the clock is right unless the category is out-of-turn)."""
    if category == "truncated":
        return [torch.tensor([Kind.PUSH, clock, 0][: rng.randint(1, 3)], dtype=torch.int64)]
    if category == "oversized":
        kind = rng.choice([Kind.PUSH, Kind.HELLO, Kind.PULL])
        limit = protocol.PAYLOAD_LIMIT.get(kind, shard)
        return [_header(kind, clock, numel=limit + rng.choice([1, 2**33]))]
    if category == "short":
        values = torch.randn(rng.randint(1, shard - 1))  # (no mark: it stops short)
        return [_header(Kind.PUSH, clock, 0, numel=shard), values]
    if category == "nan":
        values = torch.randn(shard)
        values[rng.randrange(shard)] = rng.choice([float("nan"), float("inf")])
        return [_header(Kind.PUSH, clock, 0, numel=shard), _marked(values)]
    if category == "unknown":
        return [_header(rng.choice([0, max(Kind) + 1, 99, -3]), clock)]
    wrong = rng.choice(["hello", "clock", "count", "pull", "round", "lost", "holds", "next"])
    if wrong == "hello":  # a second HELLO
        text = protocol.pack([])
        return [_header(Kind.HELLO, numel=text.numel()), _marked(text)]
    if wrong == "clock":  # a PUSH for another clock
        values = torch.randn(shard)
        return [_header(Kind.PUSH, clock + rng.choice([-1, 1, 7]), 0, numel=shard), _marked(values)]
    if wrong == "count":  # in turn, but a worker's push claiming to be two workers' sum
        values = torch.randn(shard)
        return [_header(Kind.PUSH, clock, 0, 2, numel=shard), _marked(values)]
    if wrong == "pull":
        return [_header(Kind.PULL, clock + rng.choice([1, 5]))]
    if wrong == "round":  # only server 0 announces rounds
        members = torch.tensor([1, 2])
        return [_header(Kind.ROUND, numel=2), _marked(members)]
    if wrong == "lost":  # only relays report their workers' deaths
        return [_header(Kind.LOST, 1)]
    if wrong == "holds":  # only relays name the workers their push holds
        named = torch.tensor([dist.get_rank()])
        return [_header(Kind.HOLDS, clock, numel=1), _marked(named)]
    return [_header(Kind.NEXT, rng.choice([1, 2]))]  # a batch for another worker


def _fuzz_run(relays: int, hostile: int, messages_count: int):
    strategy = sw.ParameterServer(servers=1, mode="sync", relays=relays, timeout_s=30.0)
    rank = dist.get_rank()
    if strategy.is_relay():
        report = sw.ps.relay(mlp(), strategy)
        return {"refused": report.refused, "dead": report.dead_workers}
    if strategy.is_server():
        report = sw.ps.serve(mlp(), strategy, torch.optim.AdamW, lr=1e-2)
        return {"refused": report.refused, "updates": report.updates, "dead": report.dead_workers}
    model, opt = sw.prepare(mlp(), strategy, optimizer=torch.optim.AdamW, lr=1e-2)
    client = model.client
    upstream = client.servers[0]  # the server, or the relay
    if rank == hostile:
        protocol.send(upstream, Kind.IDLE, group=client.group)  # no round waits for it
        rng = random.Random(0)
        shard = sum(p.numel() for p in model.parameters())
        errors: dict[str, list[str]] = collections.defaultdict(list)
        for i in range(messages_count):
            category = CATEGORIES[i % len(CATEGORIES)]
            _send(upstream, client.group, *_hostile(rng, category, client.clock, shard))
            h, reply = protocol.recv(upstream, group=client.group)
            if Kind(int(h[0])) == Kind.ERROR:
                errors[category].append(protocol.unpack(reply))
        client.close()
        return {"errors": dict(errors)}
    train_on_slices(model, opt, rank - strategy.servers - strategy.relays, 2)
    state = sw.full_state_dict(model)
    strategy.close(model)
    return state


@pytest.mark.parametrize("relays, messages_count", [(0, 1200), (1, 600)], ids=["server", "relay"])
def test_a_hostile_client_never_stops_the_server_nor_changes_the_honest_result(
    relays, messages_count
):
    world = 1 + relays + 3
    results = run(_fuzz_run, world, relays, world - 1, messages_count, timeout_s=600)
    *honest, hostile = results[1 + relays :]
    errors = hostile["errors"]
    per_category = messages_count // len(CATEGORIES)
    for category in CATEGORIES:  # each message answered by an ERROR saying what was wrong
        assert len(errors[category]) == per_category, category
        assert all(SAYS[category] in text for text in errors[category]), errors[category][:3]
    assert sum(results[r]["refused"] for r in range(1 + relays)) == messages_count
    assert all(results[r]["dead"] == {} for r in range(1 + relays))  # nobody declared dead
    assert results[0].get("updates", STEPS) == STEPS
    expected = single_process_weights(workers=2)
    for state in honest:
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5


def _a_server_answering_more_than_its_shard():
    """Rank 0 a server of this test's making: it greets the worker, then answers its pull with
    7 values more than the shard holds."""
    strategy = sw.ParameterServer(servers=1, mode="async")
    if dist.get_rank() == 0:
        group = protocol.make_group()
        protocol.recv(1, group=group)  # (the HELLO)
        protocol.send(1, Kind.OK, 0, group=group)
        protocol.recv(1, group=group)  # (the PULL)
        shard = sum(p.numel() for p in mlp().parameters())
        # (the worker refuses it from the header, and is gone before its payload)
        with contextlib.suppress(RuntimeError):
            protocol.send(1, Kind.OK, 0, 0, payload=torch.zeros(shard + 7), group=group)
        return None
    try:
        sw.prepare(mlp(), strategy, optimizer=torch.optim.SGD, lr=0.1)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_pull_answer_longer_than_the_shard_is_refused_before_it_is_read():
    """A worker posts for a plain pull's answer no more than its server's shard: a longer one
    is refused from its header (an over-long one shifted every parameter after it in silence,
    and any length up to 2^31 values was posted for)."""
    _, refused = run(_a_server_answering_more_than_its_shard, 2)
    shard = sum(p.numel() for p in mlp().parameters())
    assert refused == f"OK from rank 0 announces {shard + 7} values (at most {shard})"


def test_a_relay_names_only_its_own_workers_each_once_in_turn():
    """Server 0 of a two-level job takes a relay's HOLDS (the workers its next push holds, whose
    batches then count as in the parameters) only where it names workers of that relay's group,
    each once, for the push in turn; a worker's is refused, and so is one to another server."""
    from shardwise.ps.validation import Rules, Turn, check

    rules = Rules(
        server=0,
        world_size=6,
        clients=frozenset({1, 2}),
        relays=True,
        coordinates=True,
        hears_rounds=False,
        shard_numel=10,
        workers=3,
        groups={1: frozenset({3, 4}), 2: frozenset({5})},
    )
    turn = Turn(greeted=True, clock=7, pulling=False, pushed=False)

    def holds(src, named, clock=7, rules=rules, turn=turn):
        head = _header(Kind.HOLDS, clock, numel=len(named))
        return check(rules, src, head, torch.tensor(named, dtype=torch.int64), turn)

    assert holds(1, [3, 4]) is None and holds(1, [4]) is None and holds(2, [5]) is None
    assert holds(1, [5]) == "HOLDS names ranks that are not its workers, or one twice: [5]"
    assert holds(1, [3, 3]) == "HOLDS names ranks that are not its workers, or one twice: [3, 3]"
    assert holds(1, []).startswith("HOLDS names ranks")
    assert holds(1, [3, 4, 3]) == "HOLDS names 3 ranks; its group holds 2"  # (counted first)
    assert holds(1, [3], clock=8) == "HOLDS for clock 8 out of turn (its clock is 7)"
    pushed = Turn(greeted=True, clock=7, pulling=False, pushed=True)
    assert "its last push waits to be applied" in holds(1, [3], turn=pushed)
    head = _header(Kind.HOLDS, 7, numel=1)
    assert "has a torch.float32 payload" in check(rules, 1, head, torch.tensor([3.0]), turn)
    other = Rules(**{**rules.__dict__, "server": 1, "coordinates": False})
    flat = Rules(**{**rules.__dict__, "clients": frozenset({3, 4, 5}), "relays": False})
    for refused in (holds(1, [3], rules=other), holds(3, [3], rules=flat)):
        assert refused.startswith("HOLDS to a server other than server 0 of a two-level job")
