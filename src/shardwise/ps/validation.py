"""What a parameter server (or a relay) accepts, from whom: every message checked before use.

A message is refused, with one line saying why, when its kind is not one this sender may send
here (ROUND only from server 0 to a server that hears rounds; NEXT only to server 0 or a relay;
LOST, FINISHED and HOLDS only from relays, HOLDS naming workers of the relay's own group, each
once), when it comes out of turn (before the sender's HELLO, a second HELLO, a PUSH or PULL for
another clock than the sender's, a second PULL while one waits, a PUSH or HOLDS while its
previous push waits to be applied), when its payload is missing, extra, of another size than
the kind implies (a PUSH carries exactly this server's shard) or not finite, or when an integer
field is out of range. A refused message is dropped and answered ERROR; its sender stays
connected, and its next message is judged on its own. (`protocol.recv` has refused what is
malformed on the wire before: truncated, of an unknown kind, shorter than announced.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.ps.protocol import COORDINATOR, Kind


@dataclass(frozen=True)
class Rules:
    server: int  # this server's (or relay's) rank
    world_size: int
    clients: frozenset[int]  # the ranks that push and pull: workers, or relays
    relays: bool  # the clients are relays (they report their workers' ends, ask on their behalf)
    coordinates: bool  # it deals batches (server 0, or a relay for its group): NEXT is for it
    hears_rounds: bool  # server 0 announces this server's sync rounds to it
    shard_numel: int  # a PUSH's payload length
    workers: int  # workers in the job: at most this many behind one push
    # the ranks that decide sync rounds: server 0, and its backup with replicas
    coordinators: frozenset[int] = frozenset({COORDINATOR})
    # relay -> the workers it serves (server 0 of a two-level job: whom a HOLDS may name)
    groups: dict[int, frozenset[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    """Where a client stands in the protocol, as the server sees it."""

    greeted: bool  # its HELLO was accepted
    # The clock of its next PUSH (and of the PULL after it); None until its first PULL says it
    # (a client takes its first clock from server 0's answer to its HELLO, which another
    # server's may not equal in sync mode, where it is the round in hand there)
    clock: int | None
    pulling: bool  # a PULL of its waits for an answer
    pushed: bool  # a PUSH of its waits to be applied (sync: its round is not complete)


def _payload(payload: torch.Tensor | None, dtype: torch.dtype | None, numel: int | None) -> str:
    """What is wrong with the payload ('' when nothing): `dtype` None means none expected."""
    if dtype is None:
        return "" if payload is None else "has a payload it should not have"
    if payload is None:
        return "has no payload"
    if payload.dtype != dtype:
        return f"has a {payload.dtype} payload, expected {dtype}"
    if numel is not None and payload.numel() != numel:
        return f"has {payload.numel()} values, expected {numel}"
    return ""


def finite(values: torch.Tensor) -> bool:
    """Whether every value is finite: a tensor's least and greatest values are finite exactly
    when all are (one read of the tensor, no mask as large as it)."""
    return not values.numel() or bool(torch.stack(torch.aminmax(values)).isfinite().all())


def check(
    rules: Rules, src: int, h: torch.Tensor, payload: torch.Tensor | None, turn: Turn
) -> str | None:
    """None if the message may be handled, else one line saying what is wrong with it."""
    kind = Kind(int(h[0]))
    a, b, c = int(h[1]), int(h[2]), int(h[3])
    if src in rules.coordinators and rules.server not in rules.coordinators:
        return _check_round(rules, kind, payload)
    if src not in rules.clients:
        return f"{kind.name} from rank {src}, which is not a client of this server"
    if kind == Kind.HELLO:
        if turn.greeted:
            return "a second HELLO"
        return f"HELLO {problem}" if (problem := _payload(payload, torch.uint8, None)) else None
    if not turn.greeted:
        return f"{kind.name} before HELLO"
    if kind in (Kind.PUSH, Kind.SKIP):
        return _check_push(rules, kind, payload, (a, b, c), turn)
    if kind == Kind.HOLDS:
        return _check_holds(rules, src, a, payload, turn)
    if kind in (Kind.PULL, Kind.DONE, Kind.IDLE):
        if problem := _payload(payload, None, None):
            return f"{kind.name} {problem}"
        if kind == Kind.PULL and (turn.pulling or a < 0 or turn.clock not in (None, a)):
            why = "another PULL waits" if turn.pulling else f"its clock is {turn.clock}"
            return f"PULL for clock {a} out of turn ({why})"
        return None
    if kind in (Kind.NEXT, Kind.LOST, Kind.FINISHED):
        if not rules.coordinates:
            return f"{kind.name} to a server other than server 0"
        if kind != Kind.NEXT and not rules.relays:
            return f"{kind.name} from a worker (only relays report their workers)"
        if problem := _payload(payload, None, None):
            return f"{kind.name} {problem}"
        if not 0 <= a < rules.world_size or (a and not rules.relays and a != src):
            return f"{kind.name} for rank {a}"
        return None
    return f"{kind.name}, which no client sends to a server"


def _check_round(rules: Rules, kind: Kind, payload: torch.Tensor | None) -> str | None:
    """From server 0 to another server: only ROUND in sync mode, naming clients of this one."""
    if kind != Kind.ROUND or not rules.hears_rounds:
        return f"{kind.name} from server 0, which sends this server only ROUND in sync mode"
    if _payload(payload, torch.int64, None):
        return f"ROUND {_payload(payload, torch.int64, None)}"
    members = payload.tolist()
    if len(members) > len(rules.clients) or not set(members) <= rules.clients:
        return f"ROUND names ranks that are not clients of this server: {members[:8]}"
    return None


def _check_holds(
    rules: Rules, src: int, clock: int, payload: torch.Tensor | None, turn: Turn
) -> str | None:
    """From a relay to server 0, just before its push of `clock`: workers of its own group,
    each once."""
    if not (rules.coordinates and rules.relays):
        return "HOLDS to a server other than server 0 of a two-level job (only relays send it)"
    if clock != turn.clock or turn.pushed:
        why = "its last push waits to be applied" if turn.pushed else f"its clock is {turn.clock}"
        return f"HOLDS for clock {clock} out of turn ({why})"
    if problem := _payload(payload, torch.int64, None):
        return f"HOLDS {problem}"
    group = rules.groups.get(src, frozenset())
    if payload.numel() > len(group):  # (before reading them: up to MAX_INDICES may come)
        return f"HOLDS names {payload.numel()} ranks; its group holds {len(group)}"
    named = payload.tolist()
    if not named or len(set(named)) < len(named) or not set(named) <= group:
        return f"HOLDS names ranks that are not its workers, or one twice: {named[:8]}"
    return None


def _check_push(
    rules: Rules,
    kind: Kind,
    payload: torch.Tensor | None,
    fields: tuple[int, int, int],
    turn: Turn,
) -> str | None:
    """A PUSH (or SKIP) for the client's clock, in turn, carrying this server's shard."""
    clock, version, count = fields
    if clock != turn.clock or turn.pushed:
        why = (
            "its last one waits to be applied"
            if turn.pushed
            else "before its first PULL"
            if turn.clock is None
            else f"its clock is {turn.clock}"
        )
        return f"{kind.name} for clock {clock} out of turn ({why})"
    # (a server whose shard is empty gets pushes without a payload, and SKIP carries none)
    dtype = torch.float32 if rules.shard_numel and kind == Kind.PUSH else None
    if problem := _payload(payload, dtype, rules.shard_numel):
        return f"{kind.name} {problem}"
    # (the version a worker computed on may be another server's: only its sign is checked;
    # a relay's push sums at most every worker's, a worker's is its own: a mean over more
    # would weigh it as several)
    if version < 0 or not 0 <= count <= (rules.workers if rules.relays else 1):
        return f"{kind.name} with version {version}, count {count}"
    if payload is not None and not finite(payload):
        bad = int((~payload.isfinite()).sum())
        return f"PUSH with {bad} non-finite values of {payload.numel()}: never applied"
    return None
