"""The trainer's data: the loader a config asks for, its batches epoch after epoch, the batches
left out (`train.skip_batches`, a rollback's), and the sample ledger."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.config import Config
from shardwise.data import ledger
from shardwise.data.balance import weighted_sizes
from shardwise.data.queue_loader import QueueLoader
from shardwise.data.sharded_loader import ShardedLoader, loader
from shardwise.distributed import runtime
from shardwise.jobs import Job


def make_loader(cfg: Config, job: Job, shard: tuple[int, int]) -> ShardedLoader | QueueLoader:
    """The training data: each step's global batch split over the replicas, or (`data.mode:
    queue`) chunks each rank claims from the job's store, in rounds of `strategy.period`
    chunks per rank."""
    if cfg.data.mode == "queue":
        return QueueLoader(
            job.splits.train,
            cfg.data.batch_size,
            replicas=shard[0],
            period=cfg.strategy.period,
            store=runtime.store(),
            seed=cfg.train.seed,
        )
    sizes = batch_sizes(cfg, shard[0])
    return loader(job.splits.train, sizes, shuffle=True, seed=cfg.train.seed, shard=shard)


def batch_sizes(cfg: Config, replicas: int) -> int | list[int]:
    """The loader's batch size: the same for every replica, or shares by `data.rank_weights`."""
    if cfg.data.rank_weights is None:
        return cfg.data.batch_size
    if len(cfg.data.rank_weights) != replicas:
        raise ValueError(
            f"data.rank_weights has {len(cfg.data.rank_weights)} weights for {replicas} "
            "data-parallel ranks"
        )
    return weighted_sizes(cfg.data.batch_size * replicas, cfg.data.rank_weights)


def _endless(loader: ShardedLoader | QueueLoader) -> Iterator:
    """Epoch after epoch, from the loader's position on."""
    while True:
        yield from loader


class DataFeed:
    """This rank's batches, counted as global batches drawn (skipped ones included): the
    number a rollback leaves out and the ledger records."""

    def __init__(self, loader, skip: set[int], ledger_dir: Path | None, rank: int) -> None:
        """`skip`: global batches (1-based) never trained on; `ledger_dir`: where the sample
        ledger goes (None: no ledger)."""
        self.loader, self.skip = loader, set(skip)
        self.ledger_dir, self.rank = ledger_dir, rank
        self.drawn = 0
        self._batches = _endless(loader)

    @property
    def global_batch(self) -> int:
        return self.loader.global_batch

    def next(self, step: int):
        """The next global batch's slice for this rank, leaving out the batches to skip."""
        while True:
            batch = next(self._batches)
            self.drawn += 1
            if self.drawn not in self.skip:
                break
        self.record(step)
        return batch

    def round(self, step: int) -> Iterator:
        """A work-queue round's chunks (`data.mode: queue`), each counted and recorded."""
        for batch in self.loader.round():
            self.drawn += 1
            self.record(step)
            yield batch

    def record(self, step: int) -> None:
        if self.ledger_dir is not None:
            ledger.write(self.ledger_dir, self.rank, step, self.drawn, self.loader)

    def state_dict(self) -> dict[str, Any]:
        return {
            "loader": self.loader.state_dict(),
            "drawn": self.drawn,
            "skip": sorted(self.skip),
            "batch_sizes": getattr(self.loader, "sizes", None),  # a queue has none
        }

    def load_state_dict(self, data: dict[str, Any], resize: bool) -> None:
        """Go on from a checkpoint's data position; with `resize`, from its batch sizes too
        (where the balancing had got to)."""
        self.loader.load_state_dict(data["loader"])
        sizes = data.get("batch_sizes")
        if resize and sizes and len(sizes) == self.loader.replicas:
            self.loader.resize([int(b) for b in sizes])
        self._batches = _endless(self.loader)
        self.drawn, self.skip = int(data["drawn"]), self.skip | set(data["skip"])
