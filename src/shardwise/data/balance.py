"""Per-rank batch sizes that follow the ranks' speed, so a fast rank stops waiting for a slow one.

Synchronous data parallel runs at the pace of its slowest rank: with equal batches, a rank
twice as slow makes every other rank idle half of each step. Giving each rank a slice of the
global batch proportional to its throughput makes them finish together; the global batch, and
with `sw.train_step`'s weighting the update, stay the same.

`ThroughputBalancer` measures each rank's throughput over a window of `every` steps: samples
it trained on divided by its busy time (the step's wall time minus the time it spent blocked in
collectives, i.e. waiting for the others), takes the window's median step (a step slowed by
another process on a shared machine does not move the shares), sums the figures over the ranks
in one small all-reduce at the end of the window, and gives the loader new sizes proportional
to them. The first step at new sizes is not measured: it pays once for them (new tensor
shapes, a new loader iterator). A rank whose speed changes is followed within a window or two.
"""

from __future__ import annotations

import statistics

import torch

from shardwise import comm
from shardwise.arguments import finite_number, whole_number
from shardwise.data.partition import proportional
from shardwise.data.sharded_loader import ShardedLoader
from shardwise.distributed.runtime import Runtime


def weighted_sizes(global_batch: int, weights: list[float]) -> list[int]:
    """Per-rank batch sizes proportional to `weights` (capacity), adding up to `global_batch`."""
    if any(w <= 0 for w in weights):
        raise ValueError(f"rank weights must be > 0, got {weights}")
    return proportional(global_batch, weights, minimum=1)


class ThroughputBalancer:
    """Re-plans the loader's per-replica batch sizes every `every` steps from measured speed."""

    def __init__(
        self, loader: ShardedLoader, every: int, runtime: Runtime, minimum: int = 1
    ) -> None:
        """`minimum`: the fewest samples a replica is given (one per accumulated micro-batch)."""
        if not isinstance(loader, ShardedLoader):  # (a partitioned one: an AttributeError)
            raise TypeError(
                f"ThroughputBalancer re-plans a sharded loader's batch sizes, not a "
                f"{type(loader).__name__}'s (sw.data.loader without partition=)"
            )
        whole_number("balance_every", every, least=1)
        whole_number("minimum", minimum, least=1)
        if minimum * loader.replicas > loader.global_batch:  # (found only at the rebalance)
            raise ValueError(
                f"minimum={minimum} samples for each of {loader.replicas} replicas: more than "
                f"the global batch of {loader.global_batch}"
            )
        self.loader, self.every, self.runtime = loader, every, runtime
        self.minimum = minimum
        # ranks that share one replica's batch (tensor or pipeline parallel) count as one
        self.ranks_per_replica = runtime.world_size // loader.replicas
        self.rates_seen: list[float] = []  # samples/s of this window's measured steps
        self.steps = 0
        self.first_at_new_sizes = True  # the run's first step pays for lazy set-up
        self.rates: list[float] = []  # samples/s per replica over the last window

    def observe(self, samples: int, busy_s: float) -> None:
        """One step of this rank: samples trained on, seconds of it not spent waiting."""
        whole_number("samples", samples)
        # (a negative busy time gave this rank most of the batch)
        finite_number("busy_s", busy_s, least=0)
        self.steps += 1
        if self.first_at_new_sizes and self.every > 1:
            self.first_at_new_sizes = False
            return
        self.rates_seen.append(samples / max(busy_s, 1e-9))

    def rebalance(self) -> list[int] | None:
        """At the end of a window (every rank calls this after every step): the new sizes,
        already given to the loader; None between windows."""
        if self.steps < self.every:
            return None
        replicas, index = self.loader.replicas, self.loader.index
        rates = torch.zeros(replicas, dtype=torch.float64, device=self.runtime.device)
        rates[index] = statistics.median(self.rates_seen) / self.ranks_per_replica
        comm.all_reduce(rates)
        self.rates = rates.tolist()
        self.rates_seen, self.steps = [], 0
        sizes = proportional(self.loader.global_batch, self.rates, minimum=self.minimum)
        if sizes != self.loader.sizes:
            self.loader.resize(sizes)
            self.first_at_new_sizes = True
        return sizes
