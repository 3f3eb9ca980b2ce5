"""Server 0's dealing of batches: the work queue, and the workers waiting on it.

A worker asks for its next batch (NEXT, directly or through its relay) when it finished the last
one. `Dealer` answers BATCH while the queue has one, END once the queue is empty and no other
worker still trains a batch, and otherwise holds the worker (WAIT): another's batch may come
back to the queue, when that worker dies, and is then dealt to a held worker. Only server 0
deals (`dealing`); every other server, and a server 0 given no work queue, has `NoDealing`,
which has nothing to deal and answers END.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from shardwise.ps.outbox import Outbox
from shardwise.ps.peers import Peers
from shardwise.ps.protocol import Kind
from shardwise.ps.work_queue import WorkQueue


class Dealing(Protocol):
    """What a server does with batch requests and with workers that end."""

    def plan(self) -> dict[str, int] | None:
        """What fixes every batch's samples (part of what a snapshot must have been written
        by); None when nothing is dealt."""

    def applied(self, workers: Iterable[int]) -> None:
        """An update holding the batches these workers train was made (or, in a sync round,
        they skipped)."""

    def snapshot(self) -> dict[str, Any]:
        """What a snapshot of the servers must hold of the dealing: the batches applied."""

    def restore(self, state: dict[str, Any], version_batches: int) -> None:
        """A resumed job: the batches the snapshot's updates hold (`snapshot()` then; without
        it, a snapshot of an earlier release: the first `version_batches`) are consumed."""

    def request(self, client: int, worker: int) -> bool:
        """`worker` (through `client`: itself, or its relay) finished its batch and wants the
        next one: answered now, or held. True when held (WAIT)."""

    def finished(self, worker: int) -> None:
        """`worker` closed: its last batch counts as consumed."""

    def lost(self, workers: Iterable[int]) -> None:
        """These workers died: their unfinished batches go back to the queue."""

    def late(self, worker: int) -> None:
        """`worker`'s update was not applied (late): its batch goes back to the queue."""

    def holding(self, worker: int) -> int:
        """The number of the batch `worker` trains (-1: none)."""

    def again(self, client: int, worker: int) -> bool:
        """`worker` did not receive the batch it holds (its server died before sending it):
        sent again; or, holding none, a plain request. True when held (WAIT)."""

    def release(self, worker: int) -> None:
        """`worker` no longer waits for an answer here (it will ask again)."""

    def consumed(self) -> tuple[int, int]:
        """(batches, samples) consumed (trained) so far."""


class NoDealing:
    """A server that deals no batches: there is none to give, so any request hears END."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def plan(self) -> dict[str, int] | None:
        """None: nothing is dealt."""
        return None

    def applied(self, workers: Iterable[int]) -> None:
        """Nothing was dealt to them."""

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any], version_batches: int) -> None:
        """Nothing to skip."""

    def request(self, client: int, worker: int) -> bool:
        """END: there are no batches here."""
        self.outbox.send(client, Kind.END, worker)
        return False

    def finished(self, worker: int) -> None:
        """Nothing was dealt to it."""

    def lost(self, workers: Iterable[int]) -> None:
        """Nothing was dealt to them."""

    def late(self, worker: int) -> None:
        """Nothing was dealt to it."""

    def holding(self, worker: int) -> int:
        return -1

    def again(self, client: int, worker: int) -> bool:
        return self.request(client, worker)

    def release(self, worker: int) -> None:
        """Nothing held."""

    def consumed(self) -> tuple[int, int]:
        """Nothing consumed here."""
        return 0, 0


class Dealer:
    """Server 0's dealing: its `WorkQueue`, and the workers held until a batch or END."""

    def __init__(self, work: WorkQueue, peers: Peers, outbox: Outbox) -> None:
        self.work, self.peers, self.outbox = work, peers, outbox
        self.waiting: dict[int, int] = {}  # worker held for a batch -> client asking

    def plan(self) -> dict[str, int] | None:
        """The queue's plan (size, batch, seed, batches)."""
        return self.work.plan()

    def applied(self, workers: Iterable[int]) -> None:
        for worker in workers:
            self.work.mark_applied(worker)

    def snapshot(self) -> dict[str, Any]:
        below, above = self.work.applied()
        return {"applied_below": below, "applied_above": torch.tensor(above, dtype=torch.int64)}

    def restore(self, state: dict[str, Any], version_batches: int) -> None:
        """The snapshot's batches are consumed, the others dealt before it dealt first; a
        `ValueError` if its record of them does not fit this queue."""
        if "applied_below" not in state:
            self.work.restore(min(version_batches, self.work.total), [])
            return
        below, above = state["applied_below"], state.get("applied_above")
        if not isinstance(below, int) or not (
            isinstance(above, torch.Tensor) and above.dtype == torch.int64 and above.dim() == 1
        ):
            raise ValueError("its record of the batches applied is malformed")
        self.work.restore(below, above.tolist())

    def request(self, client: int, worker: int) -> bool:
        """BATCH, END, or WAIT (held: True); then the held workers are dealt to again."""
        batch = self.work.next(worker)
        held = False
        if batch is not None:
            self._give(client, worker, batch)
        elif self.work.outstanding:
            self.waiting[worker] = client  # another worker's batch may come back
            if worker == client:  # (a relay says IDLE itself once its whole group waits)
                self.peers.idle.add(client)
            self.outbox.send(client, Kind.WAIT, worker)
            held = True
        else:
            self.outbox.send(client, Kind.END, worker)
        self._deal()  # its finished batch may have been the last one others waited on
        return held

    def finished(self, worker: int) -> None:
        """Its batch is consumed; held workers may now hear END."""
        self.waiting.pop(worker, None)
        self.work.finish(worker)
        self._deal()

    def lost(self, workers: Iterable[int]) -> None:
        """Their batches go back to the front of the queue, dealt at once to held workers."""
        for worker in workers:
            self.waiting.pop(worker, None)
            self.work.give_back(worker)
        self._deal()

    def late(self, worker: int) -> None:
        """Its batch goes back to the front of the queue, for another worker."""
        self.work.give_back(worker, late=True)
        self._deal()

    def holding(self, worker: int) -> int:
        return self.work.outstanding.get(worker, -1)

    def again(self, client: int, worker: int) -> bool:
        if worker not in self.work.outstanding:
            return self.request(client, worker)
        self._give(client, worker, self.work.batch_of(self.work.outstanding[worker]))
        return False

    def release(self, worker: int) -> None:
        if self.waiting.pop(worker, None) is not None:
            self.peers.idle.discard(worker)

    def consumed(self) -> tuple[int, int]:
        """(batches, samples) of the queue consumed."""
        return self.work.consumed_batches, self.work.consumed_samples

    def _give(self, client: int, worker: int, batch: tuple[int, list[int]]) -> None:
        epoch, indices = batch
        number = self.work.outstanding[worker]
        payload = torch.tensor(indices)
        self.outbox.send(client, Kind.BATCH, epoch, worker, number, payload=payload)
        self.peers.note_served(client)

    def _deal(self) -> None:
        """Hand batches to held workers. With the queue empty, a worker waits while another
        still holds a batch (it may die and give it back), and gets END once none does."""
        for worker, client in sorted(self.waiting.items()):
            if client not in self.peers.live or client in self.peers.done:
                del self.waiting[worker]
                continue
            batch = self.work.next(worker)
            if batch is not None:
                self._give(client, worker, batch)
            elif not self.work.outstanding:
                self.outbox.send(client, Kind.END, worker)
            else:
                continue
            del self.waiting[worker]
            self.peers.idle.discard(client)


def dealing(work: WorkQueue | None, peers: Peers, outbox: Outbox) -> Dealing:
    """A `Dealer` of `work` (server 0's), or `NoDealing` where there is no work queue."""
    return NoDealing(outbox) if work is None else Dealer(work, peers, outbox)
