"""The consistency modes of a parameter server: what a push does, and when a pull is answered.

One object per mode, chosen once when the server starts (`mode_for`):

- `Async`: each push is applied on arrival; a pull is answered at once with the current
  parameters. Staleness is whatever the other workers pushed meanwhile.
- `SSP` (stale synchronous parallel, Ho et al. 2013): pushes as in async, but a worker's pull
  waits while it is more than `staleness` clocks ahead of the slowest active worker.
- `Sync`: lock-step. The pushes of a clock wait until every active client has pushed, then
  their mean over all the workers behind them is applied (the same arithmetic as single-process
  training on the global batch); a pull waits for the round that holds the client's own push.
  With several servers, server 0 (`Sync`) decides each round's members (who is idle, dead or
  late is known there first) and announces them (ROUND); the others (`SyncFollower`) apply
  exactly those pushes, so that every shard averages the same workers.
- `Sync` with backup workers (Chen et al., "Revisiting Distributed Synchronous SGD", 2016):
  a round closes once all but `backups` of the active clients pushed; a push that arrives
  after its round closed (computed on parameters an update has already replaced) is late:
  it is not applied, and counted (`ServerView.late`), and its batch goes back to the queue.

`settle` runs whenever membership changes (a worker idles, finishes or dies, a round is
announced): a sync round may be complete then.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from typing import Protocol

import torch


class ServerView(Protocol):
    """What a consistency mode sees of its server: the version, each client's clock, who is
    active and alive, and the updates it may apply or announce."""

    version: int
    start_version: int  # the version this server's life began at (0, or a snapshot's)
    clock: dict[int, int]

    def active(self) -> set[int]:
        """The clients that still take part (alive, not done)."""

    def is_live(self, client: int) -> bool:
        """Whether `client` is alive (a push of a dead one will not come)."""

    def apply(self, flat: torch.Tensor, staleness: int, behind: list[int]) -> None:
        """Apply one update made `staleness` versions ago from the pushes of `behind`."""

    def apply_round(self, members: list[int], pushes: list[tuple[torch.Tensor, int]]) -> None:
        """Apply the mean of a sync round's pushes (value, count)."""

    def announce_round(self, follower: int, members: list[int], version_after: int) -> None:
        """Tell another server which clients the sync round to `version_after` holds."""

    def late(self, client: int) -> None:
        """`client`'s push came after its round closed: not applied."""

    def skipped(self, client: int) -> None:
        """`client` skipped its clock on its own (no round holds it): nothing to apply, and the
        batch it trained is consumed."""


def round_complete(pending: Collection[int], active: set[int], backups: int = 0) -> bool:
    """Sync: a clock's round closes once every active client has pushed for it, or all but
    `backups` of them."""
    return bool(pending) and len(set(pending) & active) >= len(active) - backups


def sync_pull_ready(client: int, pending, version: int, clock: int, active: set[int]) -> bool:
    """Sync: a pull is answered after the round that holds the client's own push (or when no
    one is left to wait for)."""
    return client not in pending and (version >= clock or not active)


class Async:
    hears_rounds = False  # whether server 0 announces this server's sync rounds to it

    def batches_per_update(self, workers: int) -> int:
        return 1  # each push is an update

    def push(self, server: ServerView, client: int, version_used: int, value, count: int) -> None:
        # (a relay forwards each of its workers' pushes on its own in this mode: count is 1)
        if value is None:  # it skipped this clock
            server.skipped(client)
        else:
            # A client's version is its word (and another server's, with several): never
            # ahead of this one's, so an update is never scaled by more than 1 (staleness_lr).
            staleness = max(0, server.version - version_used)
            server.apply(value / count, staleness=staleness, behind=[client])

    def holds(self, client: int) -> bool:
        """Whether a push of `client` waits to be applied (it may not push again before)."""
        return False

    def first_clock(self, server: ServerView) -> int:
        """The clock a greeted client begins at: where every client began in this server's
        life, each counting its own pushes from there. (Not the version: that counts every
        client's updates, and a worker greeted after the others had pushed began that far
        ahead, which let SSP's others run ahead of it by as much.)"""
        return server.start_version

    def may_answer(self, server: ServerView, client: int, clock: int) -> bool:
        return True

    def settle(self, server: ServerView) -> None:
        pass

    def forget(self, client: int) -> None:
        """`client` died: drop what it left here."""

    def take_over(self, server: ServerView) -> None:
        """This server (a backup) now serves its shard: whatever its primary owed others."""


class SSP(Async):
    def __init__(self, staleness: int) -> None:
        self.staleness = staleness

    def may_answer(self, server: ServerView, client: int, clock: int) -> bool:
        slowest = min((server.clock[w] for w in server.active()), default=clock)
        return clock - slowest <= self.staleness


class Sync:
    def __init__(self, followers: list[int], backups: int = 0) -> None:
        self.followers = followers  # the other servers, told each round's members
        self.backups = backups  # a round closes without the last `backups` active clients
        # (version after, members) of the last rounds decided: announced again by a backup that
        # takes over deciding them (its primary may have died before announcing the last ones)
        self.recent: collections.deque[tuple[int, list[int]]] = collections.deque(maxlen=8)
        # client -> (sum of its pushed values, how many workers' pushes it holds), this clock
        self.pending: dict[int, tuple[torch.Tensor, int]] = {}

    hears_rounds = False

    def batches_per_update(self, workers: int) -> int:
        return workers  # one update averages every worker's batch

    def push(self, server: ServerView, client: int, version_used: int, value, count: int) -> None:
        # Without backups a round never closes without an active client: an older version is
        # a client that waited for a batch meanwhile, and its push joins the round in hand.
        if self.backups and version_used < server.version:  # its round closed without it
            server.late(client)
            return
        self.pending[client] = (value, count)  # (value None: it skipped; still a member)
        self.settle(server)

    def holds(self, client: int) -> bool:
        return client in self.pending

    def first_clock(self, server: ServerView) -> int:
        """The round in hand: a sync clock is a round, and the server's version counts them."""
        return server.version

    def may_answer(self, server: ServerView, client: int, clock: int) -> bool:
        return sync_pull_ready(client, self.pending, server.version, clock, server.active())

    def settle(self, server: ServerView) -> None:
        """Once every active client pushed this clock (or all but the backups), apply the mean
        and announce it."""
        if round_complete(self.pending, server.active(), self.backups):
            members = sorted(self.pending)
            self.recent.append((server.version + 1, members))
            for follower in self.followers:
                server.announce_round(follower, members, server.version + 1)
            server.apply_round(members, [self.pending.pop(m) for m in members])

    def forget(self, client: int) -> None:
        self.pending.pop(client, None)

    def take_over(self, server: ServerView) -> None:
        """Announce the last rounds again: the primary that decided them may have died before
        it sent them (a follower takes each round once)."""
        for version_after, members in self.recent:
            for follower in self.followers:
                server.announce_round(follower, members, version_after)

    def announce(self, server: ServerView, members: list[int], version_after: int) -> None:
        raise ValueError("only server 0 decides sync rounds")


class SyncFollower(Sync):
    hears_rounds = True

    def __init__(self, backups: int = 0) -> None:
        super().__init__(followers=[], backups=backups)
        self.rounds: collections.deque[list[int]] = collections.deque()  # announced, not applied
        self.versions: dict[int, int] = {}  # client -> the version its pending push used

    def push(self, server: ServerView, client: int, version_used: int, value, count: int) -> None:
        # (a push late by server 0's count may come before this server applied the round it
        # missed: it is held, and dropped once that round is applied)
        self.versions[client] = version_used
        super().push(server, client, version_used, value, count)

    def announce(self, server: ServerView, members: list[int], version_after: int) -> None:
        """Queue the round, if it is the next one (with replicas a round can come twice: from
        server 0 and from its backup, which announces its last ones again when it takes over)."""
        if version_after == server.version + len(self.rounds) + 1:
            self.rounds.append(members)

    def settle(self, server: ServerView) -> None:
        """Apply each announced round once its members' pushes are in (a member that died
        here before its push arrived is left out); then a held push of a client the round
        left out is late."""
        while self.rounds:
            members = self.rounds[0]
            if any(m not in self.pending and server.is_live(m) for m in members):
                return  # a push is still on its way
            self.rounds.popleft()
            pushes = [self.pending.pop(m) for m in members if m in self.pending]
            server.apply_round(members, pushes)
            if self.backups:  # a held push of a client the round left out came too late
                for client in [c for c in self.pending if self.versions[c] < server.version]:
                    del self.pending[client]
                    server.late(client)

    def forget(self, client: int) -> None:
        pass  # keep its push: server 0 may have counted it in a round

    def take_over(self, server: ServerView) -> None:
        """Nothing owed: server 0 decides the rounds."""


def mode_for(
    mode: str, staleness: int, shard: int, followers: list[int], backups: int = 0
) -> Async | Sync:
    """The mode of the server of `shard`; `followers`: the ranks server 0 announces sync rounds
    to (every other shard's servers)."""
    if mode == "async":
        return Async()
    if mode == "ssp":
        return SSP(staleness)
    if shard > 0:
        return SyncFollower(backups)
    return Sync(followers=followers, backups=backups)
