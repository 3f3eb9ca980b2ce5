"""Data loading for data parallel: each rank iterates over its own shard of the dataset.

`loader` uses torch's `DistributedSampler` (a permutation shared by all ranks through the seed,
then every rank takes every world_size-th index) and advances the epoch automatically, so each
epoch is shuffled differently yet identically on all ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise import runtime


class ShardedLoader:
    """A DataLoader over this rank's shard; iterating it again starts the next epoch."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int = 0,
    shard: tuple[int, int] | None = None,
) -> ShardedLoader:
    """A loader yielding `batch_size` samples per step from this rank's shard.

    The global batch per step is `batch_size * world_size`. `drop_last` keeps every rank at the
    same number of steps (a rank with one step more would wait forever in a collective).
    `shard` = (replicas, index) overrides (world size, rank): ranks that split one model
    (tensor or pipeline parallel) must read the same batches; `sw.data_shard(model)` says how.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shard is None:
        rt = runtime.init()  # the existing runtime, or a world of one
        shard = (rt.world_size, rt.rank)
    replicas, index = shard
    sampler = DistributedSampler(
        dataset,
        num_replicas=replicas,
        rank=index,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return ShardedLoader(
        DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            # Its own generator: each new iterator draws a seed, and from the global generator
            # that draw would shift dropout's random numbers after a resume.
            generator=torch.Generator().manual_seed(seed),
        ),
        sampler,
    )
