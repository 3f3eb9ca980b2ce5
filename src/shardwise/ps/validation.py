"""What a parameter server accepts, from whom: every message checked before it is used.

A message is refused, with one line saying why, when its kind is not one this sender may send
to this server (ROUND only from server 0 to a server that hears rounds; NEXT only to server 0;
LOST and FINISHED only from relays), when it comes before the sender's HELLO (or is a second
HELLO), when its payload is missing, extra, of another dtype or size than the kind implies
(a PUSH carries exactly this server's shard), or when an integer field is out of range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.ps.protocol import COORDINATOR, Kind


@dataclass(frozen=True)
class Rules:
    server: int  # this server's rank
    world_size: int
    clients: frozenset[int]  # the ranks that push and pull: workers, or relays
    relays: bool  # the clients are relays (they report their workers' ends, ask on their behalf)
    coordinates: bool  # this is server 0: it deals batches (if there is a queue) and hears ends
    hears_rounds: bool  # server 0 announces this server's sync rounds to it
    shard_numel: int  # a PUSH's payload length
    workers: int  # workers in the job: at most this many behind one push


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


def check(
    rules: Rules,
    src: int,
    h: torch.Tensor,
    payload: torch.Tensor | None,
    greeted: bool,
) -> str | None:
    """None if the message may be handled, else one line saying what is wrong with it."""
    kind = Kind(int(h[0]))
    a, b, c = int(h[1]), int(h[2]), int(h[3])
    if src == COORDINATOR and rules.server != COORDINATOR:
        if kind != Kind.ROUND or not rules.hears_rounds:
            return f"{kind.name} from server 0, which sends this server only ROUND in sync mode"
        if _payload(payload, torch.int64, None):
            return f"ROUND {_payload(payload, torch.int64, None)}"
        members = payload.tolist()
        if len(members) > len(rules.clients) or not set(members) <= rules.clients:
            return f"ROUND names ranks that are not clients of this server: {members[:8]}"
        return None
    if src not in rules.clients:
        return f"{kind.name} from rank {src}, which is not a client of this server"
    if kind == Kind.HELLO:
        if greeted:
            return "a second HELLO"
        return f"HELLO {problem}" if (problem := _payload(payload, torch.uint8, None)) else None
    if not greeted:
        return f"{kind.name} before HELLO"
    if kind == Kind.PUSH:  # (a server whose shard is empty gets pushes without a payload)
        dtype = torch.float32 if rules.shard_numel else None
        if problem := _payload(payload, dtype, rules.shard_numel):
            return f"PUSH {problem}"
        # (the version a worker computed on may be another server's: only its sign is checked)
        if a < 0 or b < 0 or not 0 <= c <= rules.workers:
            return f"PUSH with clock {a}, version {b}, count {c}"
        return None
    if kind in (Kind.PULL, Kind.DONE, Kind.IDLE):
        if problem := _payload(payload, None, None):
            return f"{kind.name} {problem}"
        return f"PULL with clock {a}" if kind == Kind.PULL and a < 0 else None
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
