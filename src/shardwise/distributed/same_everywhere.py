"""What every rank of a group must hold alike before a collective step depends on it (the model
each prepares, the directory each saves into), checked in one tiny all-reduce.

A rank that differs would otherwise go on in silence (two models of the same parameter count
train "fine", each rank saves into its own half-written directory) or fail far from the cause:
a hang until the timeout, a shared-memory segment of the wrong size. Each rank describes what
it holds as lines of text; a digest of them crosses the wire, and where the digests differ,
every rank's lines are gathered (as bytes: never pickle) so that every rank raises the same
one-line error, naming the first rank that differs from rank 0 and the first line where.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from shardwise import comm
from shardwise.comm.named_tensors import all_gather_bytes

# The metadata of an option that each rank may set its own way (a directory on its own disk).
PER_RANK = "per_rank"


class NotTheSame(ValueError):
    """Ranks of one group hold different things where they must hold the same."""


def check_same_everywhere(
    lines: list[str],
    what: str,
    group: comm.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Collective over `group`: every rank's `lines` (what it holds of `what`, e.g. "the model")
    are the same, or every rank raises the same `NotTheSame`."""
    world, rank = comm.group_size(group), comm.group_rank(group)
    if world == 1:
        return
    text = "\n".join(lines).encode()
    # Each rank's slot: its digest (63 bits: an int64's, summed with the zeros of the others).
    slots = torch.zeros(world, dtype=torch.int64, device=device)
    slots[rank] = int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1
    comm.all_reduce(slots, group=group)
    digests = slots.tolist()
    other = next((r for r, d in enumerate(digests) if d != digests[0]), None)
    if other is None:
        return
    data = torch.tensor(list(text), dtype=torch.uint8)
    texts = all_gather_bytes(data, world, group, device)  # (each padded with zeros)
    difference = _first_difference(_lines(texts[0]), _lines(texts[other]), other)
    raise NotTheSame(f"{what} differs between ranks: {difference}")


def _lines(padded: torch.Tensor) -> list[str]:
    return bytes(padded.tolist()).rstrip(bytes(1)).decode(errors="replace").splitlines()


def _first_difference(first: list[str], theirs: list[str], other: int) -> str:
    for mine, its in zip(first, theirs, strict=False):
        if mine != its:
            return f"rank 0 has {mine}, rank {other} has {its}"
    if len(first) > len(theirs):
        return f"rank 0 has {first[len(theirs)]}, rank {other} has nothing in its place"
    return f"rank {other} has {theirs[len(first)]}, rank 0 has nothing in its place"


def describe_options(options: Any) -> str:
    """Options (a strategy's dataclass) as text that every rank writes alike where they are
    alike, but for fields marked `PER_RANK`: values that are numbers, strings, lists or dicts
    of them, nested options; of anything else (a function, a sample tensor) only its type,
    whose repr may hold an address or values."""
    if not dataclasses.is_dataclass(options):
        return type(options).__name__
    fields = [f for f in dataclasses.fields(options) if not f.metadata.get(PER_RANK)]
    values = (f"{f.name}={_describe_value(getattr(options, f.name))}" for f in fields)
    return f"{type(options).__name__}({', '.join(values)})"


_PLAIN = (type(None), bool, int, float, str)


def _describe_value(value: Any) -> str:
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, list | tuple) and all(isinstance(v, _PLAIN) for v in value):
        return repr(list(value))
    if isinstance(value, dict) and all(isinstance(v, _PLAIN) for v in (*value, *value.values())):
        return repr(sorted(value.items(), key=repr))
    return describe_options(value)
