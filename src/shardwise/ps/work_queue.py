"""The work queue of a parameter-server job: batches of sample indices, dealt on demand.

Server 0 keeps it. A worker asks for its next batch when it finished the last one (which then
counts as consumed); a dead worker's unfinished batch goes back to the front of the queue, so
every sample of every epoch is consumed exactly once, whoever dies.
"""

from __future__ import annotations

import collections

import torch


class WorkQueue:
    """Batches of sample indices, `epochs` shuffled passes, dealt to whoever asks next."""

    def __init__(
        self, size: int, batch: int, epochs: int, seed: int, limit: int | None = None
    ) -> None:
        self.queue: collections.deque[tuple[int, list[int]]] = collections.deque()
        for epoch in range(epochs):
            order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
            for start in range(0, size - batch + 1, batch):  # drop_last, as the loaders do
                self.queue.append((epoch, order[start : start + batch].tolist()))
        while limit is not None and len(self.queue) > limit:  # `limit` batches in all
            self.queue.pop()
        self.outstanding: dict[int, tuple[int, list[int]]] = {}
        self.consumed: list[int] = []

    @classmethod
    def for_batches(cls, batches: int, size: int, batch: int, seed: int) -> WorkQueue:
        """Exactly `batches` full batches: as many epochs as that takes (each epoch drops its
        last partial batch, so an epoch holds size // batch of them, not size / batch)."""
        per_epoch = size // batch
        if per_epoch < 1:
            raise ValueError(f"a dataset of {size} samples holds no batch of {batch}")
        return cls(size, batch, -(-batches // per_epoch), seed, limit=batches)

    def next(self, worker: int) -> tuple[int, list[int]] | None:
        """The worker finished its previous batch (if any) and wants another."""
        if worker in self.outstanding:
            self.consumed.extend(self.outstanding.pop(worker)[1])
        if not self.queue:
            return None
        self.outstanding[worker] = self.queue.popleft()
        return self.outstanding[worker]

    def finish(self, worker: int) -> None:
        if worker in self.outstanding:
            self.consumed.extend(self.outstanding.pop(worker)[1])

    def skip(self, batches: int) -> None:
        """A resumed job: the snapshot already holds the first `batches` batches' updates."""
        for _ in range(min(batches, len(self.queue))):
            self.consumed.extend(self.queue.popleft()[1])

    def give_back(self, worker: int) -> None:
        """A dead worker's unfinished batch goes to the front of the queue."""
        if worker in self.outstanding:
            self.queue.appendleft(self.outstanding.pop(worker))
