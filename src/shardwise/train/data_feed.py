"""The trainer's data: the loader a config asks for, its batches epoch after epoch, the batches
left out (`train.skip_batches`, a rollback's), and the sample ledger."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from shardwise.config import Config
from shardwise.data import ledger
from shardwise.data.balance import weighted_sizes
from shardwise.data.mixture import Mixture
from shardwise.data.queue_loader import QueueLoader
from shardwise.data.sharded_loader import ShardedLoader, loader
from shardwise.distributed import runtime
from shardwise.job_sections import DataStage
from shardwise.jobs import Job, build_splits, run_text_of


def make_loader(
    cfg: Config, job: Job, shard: tuple[int, int], global_replicas: int | None = None
) -> ShardedLoader | QueueLoader:
    """The training data: each step's global batch split over the replicas, or (`data.mode:
    queue`) chunks each rank claims from the job's store, in rounds of `strategy.period`
    chunks per rank. `global_replicas`: the replicas the global batch is made for, where
    another number trains it now (an elastic job's survivors: the same batch, re-dealt)."""
    if cfg.data.mode == "queue":
        return QueueLoader(
            job.splits.train,
            cfg.data.batch_size,
            replicas=shard[0],
            period=cfg.strategy.period,
            store=runtime.store(),
            seed=cfg.train.seed,
        )
    sizes = batch_sizes(cfg, shard[0], global_replicas)
    return loader(job.splits.train, sizes, shuffle=True, seed=cfg.train.seed, shard=shard)


def stage_loader(
    cfg: Config, stage: DataStage, shard: tuple[int, int], global_replicas: int | None = None
) -> ShardedLoader:
    """The loader of a `data.stages` stage: its data (the split made as the run's own is,
    with train.seed; a mixture of its parts' training data) in its own order (its seed),
    from a fresh epoch; `global_replicas` as `make_loader`'s."""
    run_text = run_text_of(cfg.data)  # (a character model reads the run's characters' ids)
    if stage.mixture:
        parts = [
            build_splits(cfg.model_copy(update={"data": d}), run_text).train
            for d in stage.parts(cfg.data)
        ]
        weights = [part.weight for part in stage.mixture]
        train = Mixture(parts, weights, seed=cfg.train.seed if stage.seed is None else stage.seed)
    else:
        train = build_splits(cfg.model_copy(update={"data": stage.data(cfg.data)}), run_text).train
    seed = cfg.train.seed if stage.seed is None else stage.seed
    sizes = batch_sizes(cfg, shard[0], global_replicas)
    return loader(train, sizes, shuffle=True, seed=seed, shard=shard)


def batch_sizes(cfg: Config, replicas: int, global_replicas: int | None = None) -> int | list[int]:
    """The loader's batch size: the same for every replica, or shares by `data.rank_weights`;
    or, where the global batch was made for `global_replicas`, that batch dealt evenly."""
    if global_replicas not in (None, replicas):
        return weighted_sizes(cfg.data.batch_size * global_replicas, [1.0] * replicas)
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
    number a rollback leaves out and the ledger records; from each data stage's first step
    on, the stage's loader's."""

    def __init__(
        self,
        loader,
        skip: set[int],
        ledger_dir: Path | None,
        rank: int,
        stages: Sequence[tuple[int, Callable[[], ShardedLoader]]] = (),
    ) -> None:
        """`skip`: global batches (1-based) never trained on; `ledger_dir`: where the sample
        ledger goes (None: no ledger); `stages`: (first step, its loader's maker) of each
        data stage after the first, in order."""
        self.loader, self.skip = loader, set(skip)
        self.ledger_dir, self.rank = ledger_dir, rank
        self.drawn = 0
        self.stages, self.stage = list(stages), 0  # stage 0: the run's own data
        self.first = loader
        self._batches = _endless(loader)

    def _enter_stages(self, step: int) -> None:
        """The stage `step` belongs to, entered from a fresh epoch where it is a new one."""
        while self.stage < len(self.stages) and step >= self.stages[self.stage][0]:
            self._switch(self.stage + 1)

    def _switch(self, stage: int) -> None:
        self.loader = self.stages[stage - 1][1]() if stage else self.first
        self.stage = stage
        self._batches = _endless(self.loader)

    @property
    def global_batch(self) -> int:
        return self.loader.global_batch

    def next(self, step: int):
        """The next global batch's slice for this rank, leaving out the batches to skip."""
        self._enter_stages(step)
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
            ledger.write(self.ledger_dir, self.rank, step, self.drawn, self.loader, self.stage)

    def state_dict(self) -> dict[str, Any]:
        return {
            "loader": self.loader.state_dict(),
            "drawn": self.drawn,
            "skip": sorted(self.skip),
            "batch_sizes": getattr(self.loader, "sizes", None),  # a queue has none
            "stage": self.stage,
        }

    def load_state_dict(self, data: dict[str, Any], resize: bool) -> None:
        """Go on from a checkpoint's data position; with `resize`, from its batch sizes too
        (where the balancing had got to)."""
        stage = int(data.get("stage", 0))
        if not 0 <= stage <= len(self.stages):
            raise ValueError(
                f"the checkpoint's data is in stage {stage}, and this run's data.stages make "
                f"{len(self.stages) + 1}: resume with the stages it was saved with"
            )
        if stage != self.stage:
            self._switch(stage)  # (a rollback may go back to an earlier one)
        self.loader.load_state_dict(data["loader"])
        sizes = data.get("batch_sizes")
        if resize and sizes and len(sizes) == self.loader.replicas:
            self.loader.resize([int(b) for b in sizes])
        self._batches = _endless(self.loader)
        self.drawn, self.skip = int(data["drawn"]), self.skip | set(data["skip"])
