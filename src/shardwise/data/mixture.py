"""A mixture of datasets by weight, as one map-style dataset whose samples are a pure function of
(weights, sizes, seed): the same on every rank, after every resume, in every loader worker.

Of `size` samples (default: all the sources' samples together), source s holds its weight's
share (largest remainder: the shares add up to `size` exactly), as one block of indices; the
k-th sample of source s's block is its sample `order_s[k % len_s]`, `order_s` a permutation
seeded by (seed, s). A source with fewer samples than its share repeats, each pass over all of
its samples before any of them comes again; one with more is subsampled, the same subset every
epoch. The loader shuffles the blocks together.

    data = Mixture([web, code, books], weights=[0.6, 0.3, 0.1], seed=0)
    source, sample = data.source_of(i)      # where sample i comes from
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset


def shares(weights: Sequence[float], size: int) -> list[int]:
    """`size` split by `weights` (largest remainder, ties to the earlier source)."""
    total = float(sum(weights))
    exact = [w / total * size for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda s: (-(exact[s] - counts[s]), s))
    for s in by_remainder[: size - sum(counts)]:
        counts[s] += 1
    return counts


class Mixture(Dataset):
    """Several datasets' samples in proportion to `weights` (see the module's docstring)."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float],
        seed: int = 0,
        size: int | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(
                f"a mixture needs one weight per dataset, got {len(weights)} for {len(datasets)}"
            )
        if any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be > 0, got {list(weights)}")
        lengths = [len(d) for d in datasets]  # type: ignore[arg-type]
        if any(n == 0 for n in lengths):
            raise ValueError(f"a mixture's datasets must hold samples, got sizes {lengths}")
        self.datasets, self.lengths = list(datasets), lengths
        self.counts = shares(weights, sum(lengths) if size is None else size)
        self.starts = [sum(self.counts[:s]) for s in range(len(self.counts))]
        self.orders = [
            torch.randperm(n, generator=torch.Generator().manual_seed(1_000_003 * seed + s))
            for s, n in enumerate(lengths)
        ]

    def __len__(self) -> int:
        return sum(self.counts)

    def source_of(self, index: int) -> tuple[int, int]:
        """(source, that source's sample index) of mixture sample `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"mixture index {index} out of range [0, {len(self)})")
        # (the last block starting at or before it: a share rounded to none is an empty block)
        source = bisect.bisect_right(self.starts, index) - 1
        k = index - self.starts[source]
        return source, int(self.orders[source][k % self.lengths[source]])

    def __getitem__(self, index: int) -> Any:
        source, sample = self.source_of(index)
        return self.datasets[source][sample]
