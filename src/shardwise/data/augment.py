"""Augmentation whose random draws are a pure function of the sample, not of who reads it.

A loader worker's or a rank's random generator depends on how many workers and ranks there
are, and restarts with every iterator: the same sample gets other crops on 2 ranks than on 4,
with 2 workers than with none, after a resume than straight through (pytorch#5059: workers
forked with one NumPy seed draw the same numbers). Here each sample's draws come from a
generator seeded by (seed, epoch, the sample's index in the dataset, its repeat), hashed: the
same on any number of ranks and workers, and after a resume (the loader gives the epoch).

Repeated augmentation (Hoffer et al. 2019, DeiT's RASampler): with `repeats=R` each sample is
drawn R times an epoch, each repeat augmented differently, and `sw.data.loader` places the R
repeats of a sample in the same step on R different ranks (when R <= ranks; more repeats than
ranks share them round-robin).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from shardwise.arguments import whole_number

Augment = Callable[[Any, torch.Generator], Any]  # (sample's input, its generator) -> input


def sample_generator(seed: int, epoch: int, index: int, repeat: int) -> torch.Generator:
    """A generator seeded by the four numbers alone (blake2b of them: no two tuples alike)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}/{repeat}".encode(), digest_size=8)
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)


class Augmented(Dataset):
    """`dataset`'s samples, each input passed through `augment(x, generator)` with the sample's
    own generator; `repeats` copies of each sample an epoch. Index v is sample v // repeats,
    repeat v % repeats. `set_epoch` (the loader calls it) picks the epoch's draws."""

    def __init__(self, dataset: Dataset, augment: Augment, seed: int = 0, repeats: int = 1):
        whole_number("augmentation repeats", repeats, least=1)
        self.dataset, self.augment, self.seed, self.repeats = dataset, augment, seed, repeats
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset) * self.repeats

    def __getitem__(self, augmented_index: int) -> Any:
        index, repeat = divmod(int(augmented_index), self.repeats)
        sample = self.dataset[index]
        if not isinstance(sample, Sequence) or isinstance(sample, str) or not sample:
            raise ValueError(
                f"augmentation: sample {index} is a {type(sample).__name__}, not a tuple "
                "(input, ...) whose input the augmentation takes"
            )
        x, *rest = sample
        generator = sample_generator(self.seed, self.epoch, index, repeat)
        return (self.augment(x, generator), *rest)


def repeated_order(order: list[int], repeats: int, sizes: list[int]) -> list[int]:
    """The loader's order of an epoch of `Augmented(..., repeats=R)` indices from `order` (the
    epoch's permutation of the samples): each sample's R repeats, consecutive, then dealt
    across the ranks within every global batch (equal `sizes`), so that a sample's repeats land
    in one step on R different ranks."""
    check_repeats(repeats, sizes)
    ranks, per_rank = len(sizes), sizes[0]
    flat = [s * repeats + r for s in order for r in range(repeats)]
    out = []
    for begin in range(0, len(flat), ranks * per_rank):
        batch = flat[begin : begin + ranks * per_rank]
        out += [v for rank in range(ranks) for v in batch[rank::ranks]]
    return out


def check_repeats(repeats: int, sizes: list[int]) -> None:
    """Repeats land in one step on different ranks only with equal batches per rank that the
    repeats divide; else one-line ValueError."""
    if repeats == 1:
        return
    if len(set(sizes)) != 1:
        raise ValueError(f"repeated augmentation needs equal batch sizes per rank, got {sizes}")
    if sum(sizes) % repeats:
        raise ValueError(
            f"repeated augmentation: {repeats} repeats do not divide the global batch of "
            f"{sum(sizes)}: a sample's repeats would straddle two steps"
        )


@dataclass(frozen=True)
class shift_pixels:
    """A flattened `side` x `side` image moved by up to `most` pixels each way (zeros come in):
    the digits' augmentation."""

    side: int
    most: int = 1

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        most, side = self.most, self.side
        dy, dx = torch.randint(-most, most + 1, (2,), generator=generator).tolist()
        image = x.reshape(*x.shape[:-1], side, side)
        moved = torch.roll(image, shifts=(dy, dx), dims=(-2, -1))
        if dy:
            moved[..., slice(0, dy) if dy > 0 else slice(dy, None), :] = 0
        if dx:
            moved[..., slice(0, dx) if dx > 0 else slice(dx, None)] = 0
        return moved.reshape(x.shape)
