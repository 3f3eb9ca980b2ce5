"""The work queue of a parameter-server job: batches of sample indices, dealt on demand.

Server 0's `Dealer` (`dealer.py`) keeps it. A worker asks for its next batch when it finished
the last one (which then counts as consumed); a dead worker's unfinished batch goes back to the
front of the queue, so every sample of every epoch is consumed exactly once, whoever dies.

Nothing is built up front (every batch was, about 1.5 GiB per million batches). The job's
batches are numbered 0, 1, ...: batch b is the (b mod E)-th slice of epoch b // E's seeded order
(E full batches an epoch), computed when it is dealt. Memory is the current epoch's order (and
the one before, for batches given back across an epoch's end), the batches given back, those
outstanding, and the consumed ones above the mark below which all are consumed.

A batch is *applied* once an update that holds it is made: a snapshot of the servers at a
version holds exactly the batches applied by then, which is what a resumed job must not deal
again (`applied`, `restore`). Applied comes before consumed (the worker asks for its next batch
after its update); a worker that dies in between leaves its batch consumed, not given back: it
is in the parameters already.
"""

from __future__ import annotations

import collections

import torch


class WorkQueue:
    """Batches of sample indices, `epochs` shuffled passes, dealt to whoever asks next."""

    def __init__(
        self, size: int, batch: int, epochs: int, seed: int, limit: int | None = None
    ) -> None:
        self.size, self.batch, self.seed = size, batch, seed
        self.per_epoch = size // batch if batch > 0 else 0  # drop_last, as the loaders do
        total = epochs * self.per_epoch
        self.total = total if limit is None else min(total, limit)  # `limit` batches in all
        self.cursor = 0  # the next batch never dealt
        self.returned: collections.deque[int] = collections.deque()  # given back: dealt first
        self.outstanding: dict[int, int] = {}  # worker -> the batch it trains
        self.in_an_update: set[int] = set()  # workers whose outstanding batch is applied
        self.late_with: dict[int, int] = {}  # batch given back late -> the worker that was
        self.below = 0  # every batch below this one is consumed...
        self.above: set[int] = set()  # ...and so are these (consumed out of order)
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> its order (two epochs at most)

    @classmethod
    def for_batches(cls, batches: int, size: int, batch: int, seed: int) -> WorkQueue:
        """Exactly `batches` full batches: as many epochs as that takes (each epoch drops its
        last partial batch, so an epoch holds size // batch of them, not size / batch)."""
        per_epoch = size // batch
        if per_epoch < 1:
            raise ValueError(f"a dataset of {size} samples holds no batch of {batch}")
        return cls(size, batch, -(-batches // per_epoch), seed, limit=batches)

    def plan(self) -> dict[str, int]:
        """What fixes every batch's samples (a resumed job must deal the same ones)."""
        return {"size": self.size, "batch": self.batch, "seed": self.seed, "batches": self.total}

    def __len__(self) -> int:
        """Batches still to deal (not counting those outstanding)."""
        return len(self.returned) + self.total - self.cursor

    @property
    def consumed_batches(self) -> int:
        return self.below + len(self.above)

    @property
    def consumed_samples(self) -> int:
        return self.consumed_batches * self.batch

    def next(self, worker: int) -> tuple[int, list[int]] | None:
        """The worker finished its previous batch (if any) and wants another: (epoch, indices),
        or None when none is left to deal."""
        self.finish(worker)
        # (a batch a worker was late with goes to another one first: it would be late again)
        b = next((b for b in self.returned if self.late_with.get(b) != worker), None)
        if b is not None:
            self.returned.remove(b)
        elif self.cursor < self.total:
            b, self.cursor = self.cursor, self.cursor + 1
        elif self.returned:
            b = self.returned.popleft()
        else:
            return None
        self.late_with.pop(b, None)
        self.outstanding[worker] = b
        return self.batch_of(b)

    def finish(self, worker: int) -> None:
        """The worker's batch (if it holds one) is trained: it counts as consumed."""
        self.in_an_update.discard(worker)
        if worker in self.outstanding:
            self._consume(self.outstanding.pop(worker))

    def mark_applied(self, worker: int) -> None:
        """An update holding the batch `worker` trains was made (or it skipped its step)."""
        if worker in self.outstanding:
            self.in_an_update.add(worker)

    def applied(self) -> tuple[int, list[int]]:
        """The batches applied so far: (every one below this, and these above it)."""
        done = self.above | {self.outstanding[w] for w in self.in_an_update}
        below = self.below
        while below in done:  # (raise the mark over what is now contiguous)
            done.remove(below)
            below += 1
        return below, sorted(done)

    def restore(self, below: int, above: list[int]) -> None:
        """A resumed job: the snapshot holds the updates of every batch under `below` and of
        those in `above` (`applied()` when it was written). Those count as consumed; the
        others dealt before it go to the front of the queue, in order. A `ValueError` names
        what does not fit this queue."""
        assert not self.outstanding and not self.returned and self.cursor == self.below == 0
        if not 0 <= below <= self.total:
            raise ValueError(f"{below} batches applied, of {self.total}")
        if above != sorted(set(above)) or any(not below < b < self.total for b in above):
            raise ValueError(f"batches applied above {below} must be distinct, under {self.total}")
        self.below, self.above = below, set(above)
        self.cursor = above[-1] + 1 if above else below
        self.returned.extend(b for b in range(below, self.cursor) if b not in self.above)

    def give_back(self, worker: int, late: bool = False) -> None:
        """A dead worker's unfinished batch goes to the front of the queue; so does one whose
        update came too late to be applied (`late`: dealt to another worker first). A batch
        already applied is consumed instead (its update is made: it must not count twice)."""
        if worker in self.in_an_update:
            self.finish(worker)
        elif worker in self.outstanding:
            b = self.outstanding.pop(worker)
            self.returned.appendleft(b)
            if late:
                self.late_with[b] = worker

    def batch_of(self, b: int) -> tuple[int, list[int]]:
        """Batch `b` of the job: (its epoch, its sample indices)."""
        epoch, start = divmod(b, self.per_epoch)
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = torch.randperm(self.size, generator=g)
        start *= self.batch
        return epoch, self._orders[epoch][start : start + self.batch].tolist()

    def _consume(self, b: int) -> None:
        assert b >= self.below and b not in self.above, f"batch {b} consumed twice"
        self.above.add(b)
        while self.below in self.above:  # (raise the mark over what is now contiguous)
            self.above.remove(self.below)
            self.below += 1
