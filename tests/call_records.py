"""Evidence that every rank issued the same collectives: each rank's flight-recorder counts and
running hashes of the calls it made (op, shape and dtype, in order) per group, compared across
the group's ranks. A hang needs ranks that disagree here; ranks that agree cannot hang on it."""

from __future__ import annotations

from shardwise.comm.flight import collective_groups, recorder


def my_calls() -> dict[str, tuple[int, int]]:
    """This rank's collectives so far: group -> (calls, running hash of their signatures)."""
    counts, hashes = collective_groups(dict(recorder.seq)), collective_groups(dict(recorder.hash))
    return {group: (n, hashes[group]) for group, n in counts.items()}


def assert_same_calls(by_rank: list[dict[str, tuple[int, int]]]) -> None:
    """Every rank of each group issued the same calls in it (world: every rank)."""
    groups = {g for calls in by_rank for g in calls}
    assert "world" in groups
    for group in groups:
        members = range(len(by_rank)) if group == "world" else map(int, group.split(","))
        seen = {rank: by_rank[rank].get(group) for rank in members}
        assert len(set(seen.values())) == 1, f"group {group}: {seen}"
