"""Pull-based data (`data.mode: queue`): each rank takes the next chunk when it is ready.

With a split global batch, every rank trains the same number of samples per step and a fast
rank waits for a slow one. Here the epoch's seeded order is cut into chunks of `batch_size`
samples (the last one may be shorter), and a rank that finished its chunk claims the next with
one atomic `add` on the job's store (torch.distributed's TCPStore): a rank twice as fast takes
about twice the chunks. Claims are numbered, so every chunk is claimed by exactly one rank.

Training goes in rounds of `period` x `replicas` chunks (local SGD: `strategy.period` local
steps per rank on average). A rank takes chunks until it claims one past the round's end, which
it keeps for the next round (or, past the epoch's end, drops), then meets the others to
average. At that point every chunk of the round has been trained by the rank that claimed it,
so the position is one number per epoch, `offset`, the chunks done, the same on every rank.
A checkpoint saves (epoch, offset); a job that resumes from it (after a rank died, say) deals
every later chunk again, the dead rank's included, from store keys of its own, so each sample
of an epoch is trained exactly once in the lineage of the final weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, default_collate

from shardwise.data.partition import epoch_order


class QueueLoader:
    """This rank's chunks of each round, claimed from the job's store as it is ready."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        replicas: int,
        period: int,
        store: Any,
        seed: int,
        key: str = "shardwise/queue",
    ) -> None:
        if batch_size < 1 or period < 1:
            raise ValueError(f"batch size and period must be >= 1, got {batch_size}, {period}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.replicas, self.store = replicas, store
        self.chunks_per_round = period * replicas  # `period` per rank on average
        # Keys of their own for each attempt of the job (a restarted job deals afresh).
        self.key = f"{key}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.epoch = self.offset = 0
        self.generation = 0  # bumped on every load: a resumed position deals from new keys
        self._dealing: tuple[int, int, int] | None = None  # (generation, epoch, first chunk)
        self._held: int | None = None  # a chunk claimed past the last round's end
        self.last_indices: list[int] = []

    def chunks(self, epoch: int) -> list[list[int]]:
        """The epoch's order (the split loader's: one seeded permutation) in chunks."""
        order = epoch_order(len(self.dataset), self.seed, epoch)
        return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    def _claim(self) -> int:
        """The next unclaimed chunk of this epoch (its index; it may be past the epoch's end).
        Claims count from where this process began dealing the epoch, under keys of that
        start: a resumed position never meets an earlier attempt's counter."""
        generation, epoch, first = self._dealing
        counter = f"{self.key}/g{generation}/e{epoch}/from{first}"
        return first + self.store.add(counter, 1) - 1

    def round(self) -> Iterator[Any]:
        """This rank's batches of the next round, claimed one by one; afterwards `offset` (and
        `epoch`, at an epoch's end) have moved past the round on every rank alike."""
        chunks = self.chunks(self.epoch)
        if self._dealing is None or self._dealing[:2] != (self.generation, self.epoch):
            self._dealing = (self.generation, self.epoch, self.offset)
        end = min(self.offset + self.chunks_per_round, len(chunks))
        while True:
            claimed = self._held if self._held is not None else self._claim()
            self._held = None
            if claimed >= end:
                if claimed < len(chunks):
                    self._held = claimed  # the next round's: trained then, by this rank
                break
            self.last_indices = chunks[claimed]
            yield default_collate([self.dataset[i] for i in chunks[claimed]])
        self.offset = end
        if end == len(chunks):
            self.epoch, self.offset = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The position between rounds (the same on every rank)."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "queue": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("queue") != 1 or state["seed"] != self.seed:
            raise ValueError(
                "the checkpoint's data position is not a work queue's with seed "
                f"{self.seed}: resume with the data.mode and seed it was saved with"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.generation += 1
        self._dealing, self._held = None, None
