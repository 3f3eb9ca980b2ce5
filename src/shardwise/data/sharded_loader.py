"""Data loading for data parallel: every step, a global batch cut into one slice per rank.

Each epoch has one seeded order of the dataset, the same on every rank. A step takes the next
`batch_size * replicas` samples of that order (the global batch) and rank i keeps the i-th
slice. The loader's position is therefore one number for the whole job, the samples of this
epoch's order already consumed, and it means the same on any number of ranks: a run saved on 4
ranks resumes on 2 or 3 with every remaining sample of the epoch seen exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from shardwise.arguments import whole_number
from shardwise.data.augment import Augmented, check_repeats, repeated_order
from shardwise.data.partition import Partitioner, epoch_order, proportional
from shardwise.distributed import runtime


def _checked_sizes(sizes: list[int], replicas: int) -> list[int]:
    if len(sizes) != replicas:
        raise ValueError(f"{len(sizes)} batch sizes for {replicas} ranks")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch sizes must be ints >= 1, got {sizes}")
    return list(sizes)


def _check_position(state: Any, keys: tuple[str, ...]) -> None:
    """A saved data position (`state_dict`) holds `keys`, each a whole number >= 0: a negative
    offset ended the epoch two batches in, a missing key was a `KeyError`."""
    if not isinstance(state, dict) or any(key not in state for key in keys):
        raise ValueError(f"a data position must hold {', '.join(keys)}; got {state!r:.200}")
    for key in keys:
        whole_number(f"data position {key}", state[key])


def _fetch(
    dataset: Dataset, plan: list[list[int]], num_workers: int, seed: int, epoch: int
) -> DataLoader:
    """The batches of `plan` (lists of indices) of `epoch`, read by torch's DataLoader."""
    if hasattr(dataset, "set_epoch"):  # (before the workers take their copies)
        dataset.set_epoch(epoch)  # `Augmented`: the epoch's draws
    # Its own generator: each iterator draws a seed, and a draw from the global one would
    # shift dropout's random numbers after a resume (which starts an iterator).
    generator = torch.Generator().manual_seed(seed + epoch)
    return DataLoader(dataset, batch_sampler=plan, num_workers=num_workers, generator=generator)


class ShardedLoader:
    """This rank's slices of the global batches; iterating again starts the next epoch.

    `sizes[i]` is replica i's slice of every global batch (equal by default; weighted by
    capacity, or re-planned from measured throughput with `resize`, which takes effect from the
    next batch on). `epoch` and `offset` (samples of the epoch's order consumed by all ranks
    together) are its position: `state_dict()` saves them, and a loader with another number of
    replicas loaded from them goes on with the same samples. `last_indices` are the dataset
    indices of the batch it yielded last (for the sample ledger); `last_repeats`, how many of
    them at its end repeat earlier samples (a last batch smaller than the ranks wraps around).
    """

    def __init__(
        self,
        dataset: Dataset,
        sizes: list[int],
        replicas: int,
        index: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        num_workers: int = 0,
    ) -> None:
        self.dataset, self.replicas, self.index = dataset, replicas, index
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_workers = num_workers
        self.sizes = _checked_sizes(sizes, replicas)
        self._resized = False
        self.epoch = 0
        self.offset = 0
        self.last_indices: list[int] = []
        # Of that batch, how many at its end repeat samples from the epoch's start: a last
        # batch smaller than the ranks wraps around so that every rank has one (evaluation
        # leaves them out, so every sample counts once).
        self.last_repeats = 0

    @property
    def batch_size(self) -> int:
        """This rank's samples per step."""
        return self.sizes[self.index]

    @property
    def global_batch(self) -> int:
        return sum(self.sizes)

    def resize(self, sizes: list[int]) -> None:
        """New per-replica batch sizes, from the next batch on (every rank must resize alike)."""
        if isinstance(self.dataset, Augmented) and self.dataset.repeats > 1:
            raise ValueError("repeated augmentation keeps its batch sizes: they lay out its order")
        self.sizes, self._resized = _checked_sizes(sizes, self.replicas), True

    def order(self, epoch: int) -> list[int]:
        """The epoch's order of sample indices, the same on every rank (an `Augmented`
        dataset's repeats: each sample's in one step, on different ranks)."""
        repeats = self.dataset.repeats if isinstance(self.dataset, Augmented) else 1
        if repeats == 1:
            return epoch_order(len(self.dataset), self.seed, epoch, self.shuffle)
        samples = epoch_order(len(self.dataset) // repeats, self.seed, epoch, self.shuffle)
        return repeated_order(samples, repeats, self.sizes)

    def _steps(self, order: list[int], start: int) -> Iterator[tuple[list[list[int]], int, int]]:
        """(every replica's indices, samples the whole step consumes, and the real ones among
        them: the rest are repeats at the end) from `start` on."""
        n, size = len(order), self.global_batch
        for begin in range(start, n, size):
            batch = order[begin : begin + size]
            real = len(batch)
            if real < size and self.drop_last:
                return
            sizes = self.sizes
            if real < size:  # the last, partial batch: split alike, every rank some
                if real < self.replicas:  # wrap around, like torch's DistributedSampler
                    batch = batch + order[: self.replicas - real]
                sizes = proportional(len(batch), self.sizes, minimum=1)
            bounds = [sum(sizes[:r]) for r in range(self.replicas + 1)]
            yield [batch[a:b] for a, b in itertools.pairwise(bounds)], min(size, n - begin), real

    def _my_batches(self, order: list[int], start: int) -> Iterator[tuple[list[int], int, int]]:
        """(my indices, samples consumed, how many of mine at the end are repeats)."""
        for slices, consumed, real in self._steps(order, start):
            begin = sum(len(s) for s in slices[: self.index])
            mine = slices[self.index]
            yield mine, consumed, len(mine) - min(len(mine), max(0, real - begin))

    def parts(self, epoch: int) -> list[list[int]]:
        """Every replica's samples of `epoch` at the present sizes (for the skew report)."""
        parts: list[list[int]] = [[] for _ in range(self.replicas)]
        for slices, _, _ in self._steps(self.order(epoch), 0):
            for part, mine in zip(parts, slices, strict=True):
                part.extend(mine)
        return parts

    def __iter__(self) -> Iterator[Any]:
        order = self.order(self.epoch)
        if self.offset == 0 and len(order) < self.global_batch and self.drop_last:
            raise ValueError(
                f"a dataset of {len(order)} samples does not fill one global batch of "
                f"{self.global_batch} ({self.sizes} per rank)"
            )
        self._resized = True
        while self._resized:  # (re)plan the rest of the epoch with the present sizes
            self._resized = False
            plan = list(self._my_batches(order, self.offset))
            indices = [mine for mine, _, _ in plan]
            fetch = _fetch(self.dataset, indices, self.num_workers, self.seed, self.epoch)
            for (mine, consumed, repeats), batch in zip(plan, fetch, strict=True):
                self.offset += consumed
                self.last_indices, self.last_repeats = mine, repeats
                yield batch
                if self._resized:
                    break
        self.epoch, self.offset = self.epoch + 1, 0

    def __len__(self) -> int:
        """Steps in a whole epoch."""
        full, rest = divmod(len(self.dataset), self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}
        if isinstance(self.dataset, Augmented) and self.dataset.repeats > 1:
            state["repeat_layout"] = list(self.sizes)  # (the order depends on it)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("queue"):
            raise ValueError("the data position was saved by a work queue (data.mode: queue)")
        _check_position(state, ("epoch", "offset", "seed"))
        if state["offset"] > len(self.dataset):  # (past the end: the epoch skipped whole)
            raise ValueError(
                f"data position offset {state['offset']} is past the dataset's "
                f"{len(self.dataset)} samples"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"data position saved with seed {state['seed']}, not {self.seed}")
        layout = state.get("repeat_layout")
        if layout is not None and state["offset"] and list(layout) != self.sizes:
            raise ValueError(
                f"data position saved mid-epoch with repeated augmentation over batches "
                f"{list(layout)}: the order is laid out for them, not {self.sizes}"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


class PartitionedLoader:
    """This rank's part of each epoch (a `Partitioner` decides whose samples are whose), in
    batches of `batch_sizes[index]`; iterating again starts the next epoch.

    Every rank takes the same number of steps (a rank with one step more would wait forever in
    a collective): as many as the part with the fewest full batches holds, the rest of each part
    being left for the epoch (give parts proportional to the batch sizes, `Weighted`, and
    nothing is left but remainders). Its position is (epoch, step), for this number of parts.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_sizes: list[int],
        index: int,
        partition: Partitioner,
        seed: int,
        num_workers: int = 0,
    ) -> None:
        self.dataset, self.batch_sizes, self.index = dataset, list(batch_sizes), index
        self.partition, self.seed, self.num_workers = partition, seed, num_workers
        self.epoch = self.step = 0
        self.last_indices: list[int] = []

    @property
    def replicas(self) -> int:
        return len(self.batch_sizes)

    def parts(self, epoch: int) -> list[list[int]]:
        return self.partition.split(len(self.dataset), self.replicas, self.seed, epoch)

    def steps(self, parts: list[list[int]]) -> int:
        return min(len(part) // b for part, b in zip(parts, self.batch_sizes, strict=True))

    def __iter__(self) -> Iterator[Any]:
        parts = self.parts(self.epoch)
        steps, size = self.steps(parts), self.batch_sizes[self.index]
        if steps == 0:
            raise ValueError(
                f"a part of {min(len(p) for p in parts)} samples does not fill one batch "
                f"(batch sizes {self.batch_sizes})"
            )
        mine = parts[self.index]
        plan = [mine[s * size : (s + 1) * size] for s in range(self.step, steps)]
        fetch = _fetch(self.dataset, plan, self.num_workers, self.seed, self.epoch)
        for indices, batch in zip(plan, fetch, strict=True):
            self.step += 1
            self.last_indices = indices
            yield batch
        self.epoch, self.step = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.steps(self.parts(self.epoch))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "parts": self.replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        _check_position(state, ("epoch", "step", "seed", "parts"))
        if state["seed"] != self.seed or state["parts"] != self.replicas:
            raise ValueError(
                f"data position saved with seed {state['seed']} over {state['parts']} parts, "
                f"not seed {self.seed} over {self.replicas} (a partitioned loader's position "
                "holds for its own number of ranks)"
            )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def loader(
    dataset: Dataset,
    batch_size: int | list[int],
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int = 0,
    shard: tuple[int, int] | None = None,
    partition: Partitioner | None = None,
) -> ShardedLoader | PartitionedLoader:
    """A loader yielding `batch_size` samples per step from this rank's slice of each global
    batch; the global batch per step is `batch_size * world_size`. `batch_size` may also be
    one size per rank (e.g. [3, 9]: a rank three times as fast takes three times the
    samples); `sw.train_step` weighs the gradients so the update stays the global batch's mean.

    `drop_last` keeps every rank at the same number of full steps (a rank with one step more
    would wait forever in a collective); without it, the last partial global batch is split as
    evenly as it goes. `shard` = (replicas, index) overrides (world size, rank): ranks that
    split one model (tensor or pipeline parallel) must read the same batches;
    `sw.data_shard(model)` says how.

    With `partition` (`shardwise.data.partition`: contiguous, strided, hashed, stratified,
    weighted), each rank reads its own part of the epoch instead, and `batch_size` may be one
    size per rank (e.g. [3, 9] with `Weighted([1, 3])`).
    """
    if shard is None:
        rt = runtime.init()  # the existing runtime, or a world of one
        shard = (rt.world_size, rt.rank)
    replicas, index = shard
    whole_number("shard replicas", replicas, least=1)
    if whole_number("shard index", index) >= replicas:
        raise ValueError(f"shard index must be below its {replicas} replicas, got {index}")
    whole_number("loader seed", seed)
    sizes = batch_size if isinstance(batch_size, list) else [batch_size] * replicas
    sizes = _checked_sizes(sizes, replicas)
    if isinstance(dataset, Augmented):
        check_repeats(dataset.repeats, sizes)
    if partition is not None:
        if isinstance(dataset, Augmented) and dataset.repeats > 1:
            raise ValueError("repeated augmentation lays out the ordered loader, not a partition")
        return PartitionedLoader(dataset, sizes, index, partition, seed, num_workers)
    return ShardedLoader(dataset, sizes, replicas, index, shuffle, seed, drop_last, num_workers)
