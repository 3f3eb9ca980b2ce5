"""Partitioners: which samples of an epoch each rank trains on.

One interface, `split(size, parts, seed, epoch) -> one list of sample indices per part`, and
five ways to fill it. Each is deterministic given (seed, epoch), so every rank computes every
rank's part without a message, and each covers the dataset exactly once per epoch (every index
in exactly one part).

- `Contiguous`: the epoch's order cut into consecutive runs (sizes differ by at most one).
- `Strided`: the epoch's order dealt round-robin (sizes differ by at most one).
- `Hashed`: a sample goes to the part whose hash with the sample's key is highest (rendezvous
  hashing): when the dataset grows, existing samples stay where they were, and when the number
  of parts changes, only about 1/parts of them move. Sizes are only balanced on average.
- `Stratified`: every part gets the same mix of labels (or of any discrete feature): each
  label's samples, shuffled, are dealt round-robin, the dealing going on from one label to the
  next (each label's count per part differs by at most one, and so do the sizes).
- `Weighted`: shares proportional to given weights (the largest remainders get the leftover
  samples): a rank twice as fast gets twice the samples.

`sw.data.loader(dataset, batch_size, partition=...)` reads this rank's part.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class Partitioner(Protocol):
    def split(self, size: int, parts: int, seed: int, epoch: int) -> list[list[int]]:
        """One list of sample indices per part; together, each of range(size) exactly once."""
        ...


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's order of sample indices (one seeded permutation), the same on every rank."""
    if not shuffle:
        return list(range(size))
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _cut(order: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(order[start : start + n])
        start += n
    return out


def _check(size: int, parts: int) -> None:
    if size < 0 or parts < 1:
        raise ValueError(f"cannot split {size} samples into {parts} parts")


@dataclass(frozen=True)
class Contiguous:
    shuffle: bool = True

    def split(self, size: int, parts: int, seed: int, epoch: int) -> list[list[int]]:
        _check(size, parts)
        base, extra = divmod(size, parts)
        sizes = [base + (1 if r < extra else 0) for r in range(parts)]
        return _cut(epoch_order(size, seed, epoch, self.shuffle), sizes)


@dataclass(frozen=True)
class Strided:
    shuffle: bool = True

    def split(self, size: int, parts: int, seed: int, epoch: int) -> list[list[int]]:
        _check(size, parts)
        order = epoch_order(size, seed, epoch, self.shuffle)
        return [order[r::parts] for r in range(parts)]


def _score(key: str, part: int) -> int:
    digest = hashlib.blake2b(f"{key}\0{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _owner(key: str, parts: int) -> int:
    return max(range(parts), key=lambda part: _score(key, part))


@dataclass(frozen=True)
class Hashed:
    """`key(index)`: a sample's stable identity (default: its index, stable while the dataset
    only grows at the end); the order within a part is shuffled per epoch."""

    key: Callable[[int], object] | None = None
    shuffle: bool = True
    # (size, parts) -> each sample's part: the same every epoch, computed once
    _owners: dict = field(default_factory=dict, compare=False, repr=False)

    def owners(self, size: int, parts: int) -> list[int]:
        """The part each sample belongs to (the same every epoch)."""
        if (size, parts) not in self._owners:
            keys = [str(self.key(i) if self.key else i) for i in range(size)]
            self._owners[size, parts] = [_owner(k, parts) for k in keys]
        return self._owners[size, parts]

    def split(self, size: int, parts: int, seed: int, epoch: int) -> list[list[int]]:
        _check(size, parts)
        owners = self.owners(size, parts)
        out: list[list[int]] = [[] for _ in range(parts)]
        for i in epoch_order(size, seed, epoch, self.shuffle):
            out[owners[i]].append(i)
        return out


@dataclass(frozen=True)
class Stratified:
    """`labels[i]`: sample i's label (or any discrete feature to spread evenly)."""

    labels: Sequence[int]

    def split(self, size: int, parts: int, seed: int, epoch: int) -> list[list[int]]:
        _check(size, parts)
        if len(self.labels) != size:
            raise ValueError(f"{len(self.labels)} labels for a dataset of {size} samples")
        order = epoch_order(size, seed, epoch, shuffle=True)
        by_label: dict[int, list[int]] = {}
        for i in order:
            label = self.labels[i]
            if label != int(label):  # (0.5 and 0.7 were both label 0: no stratification)
                raise ValueError(f"stratified labels must be whole numbers, got {label!r}")
            by_label.setdefault(int(label), []).append(i)
        dealt = [i for label in sorted(by_label) for i in by_label[label]]
        return [dealt[r::parts] for r in range(parts)]


def proportional(total: int, weights: Sequence[float], minimum: int = 0) -> list[int]:
    """`total` cut into integers proportional to `weights` (largest remainders get the
    leftovers, ties to the first), each at least `minimum` (taken from the largest)."""
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    if total < minimum * len(weights):
        raise ValueError(f"{total} cannot give each of {len(weights)} parts {minimum}")
    exact = [total * w / sum(weights) for w in weights]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda r: exact[r] - sizes[r], reverse=True)
    for r in by_remainder[: total - sum(sizes)]:
        sizes[r] += 1
    for r in range(len(sizes)):
        while sizes[r] < minimum:
            sizes[max(range(len(sizes)), key=sizes.__getitem__)] -= 1
            sizes[r] += 1
    return sizes


@dataclass(frozen=True)
class Weighted:
    """Part r gets a share of the samples proportional to `weights[r]`."""

    weights: Sequence[float]
    shuffle: bool = True

    def sizes(self, size: int, parts: int) -> list[int]:
        if len(self.weights) != parts:
            raise ValueError(f"{len(self.weights)} weights for {parts} parts")
        return proportional(size, self.weights)

    def split(self, size: int, parts: int, seed: int, epoch: int) -> list[list[int]]:
        _check(size, parts)
        return _cut(epoch_order(size, seed, epoch, self.shuffle), self.sizes(size, parts))
