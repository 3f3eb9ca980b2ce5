"""Augmentation draws that are a pure function of (seed, epoch, sample, repeat): the same for
every sample at 1, 2 and 4 ranks, with 0 and 2 loader workers, and after a resume; repeated
augmentation puts a sample's repeats in one step on different ranks. Loaders for every rank
of a world in one process (`shard=`): no process group is needed to see what each rank reads."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import shardwise as sw
from shardwise.data import Augmented, sample_generator, shift_pixels

SAMPLES, BATCH, SEED = 48, 3, 7  # a global batch of 12 at 4 ranks: 4 steps an epoch


def _noise(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return x + torch.rand(x.shape, generator=generator)


def _dataset(repeats: int = 1) -> Augmented:
    base = TensorDataset(torch.arange(SAMPLES * 5.0).reshape(SAMPLES, 5), torch.arange(SAMPLES))
    return Augmented(base, _noise, seed=SEED, repeats=repeats)


def _drawn(world: int, workers: int, epochs: int = 2, repeats: int = 1, stop_after=None) -> dict:
    """(epoch, sample, repeat) -> (the augmented input, the rank, the step: the samples the
    epoch had consumed by then), over every rank's loader; with `stop_after`, each loader is
    saved after that many steps and a fresh one loaded from it reads the rest."""
    out = {}
    for rank in range(world):
        data = _dataset(repeats)
        loader = sw.data.loader(data, BATCH, seed=1, num_workers=workers, shard=(world, rank))
        steps = 0
        while loader.epoch < epochs:
            epoch = loader.epoch
            for x, _ in loader:
                for v, row in zip(loader.last_indices, x, strict=True):
                    key = (epoch, *divmod(v, repeats))
                    assert key not in out, key  # every (sample, repeat) once an epoch
                    out[key] = (row, rank, loader.offset)
                steps += 1
                if steps == stop_after:
                    saved = loader.state_dict()
                    loader = sw.data.loader(
                        data, BATCH, seed=1, num_workers=workers, shard=(world, rank)
                    )
                    loader.load_state_dict(saved)
                    break
    return out


def test_every_sample_draws_the_same_at_any_world_size_worker_count_and_after_a_resume():
    alone = _drawn(1, 0)
    assert len(alone) == 2 * SAMPLES  # every sample of both epochs, once
    base = _dataset().dataset
    for (epoch, sample, repeat), (row, _, _) in alone.items():  # the four numbers decide
        noise = torch.rand(5, generator=sample_generator(SEED, epoch, sample, repeat))
        assert torch.equal(row, base[sample][0] + noise)
    assert not torch.equal(alone[(0, 0, 0)][0], alone[(1, 0, 0)][0])  # another epoch, new draws
    for world, workers in [(2, 0), (4, 0), (1, 2), (4, 2)]:
        other = _drawn(world, workers)
        assert other.keys() == alone.keys(), (world, workers)
        assert all(torch.equal(other[k][0], alone[k][0]) for k in alone), (world, workers)
    resumed = _drawn(2, 0, stop_after=3)
    assert resumed.keys() == alone.keys()
    assert all(torch.equal(resumed[k][0], alone[k][0]) for k in alone)


@pytest.mark.parametrize("world,repeats,resume", [(2, 2, None), (4, 2, 2), (4, 3, None)])
def test_repeats_of_a_sample_are_in_one_step_on_different_ranks(world, repeats, resume):
    drawn = _drawn(world, 0, epochs=1, repeats=repeats, stop_after=resume)
    assert len(drawn) == SAMPLES * repeats  # each sample R times, no more, no less
    for sample in range(SAMPLES):
        seen = [drawn[(0, sample, r)] for r in range(repeats)]
        assert len({step for _, _, step in seen}) == 1, sample
        assert len({rank for _, rank, _ in seen}) == repeats, sample
        rows = [row for row, _, _ in seen]
        assert not torch.equal(rows[0], rows[1])  # each repeat augmented anew


def test_shifted_digits_and_bad_options():
    image, shifts = torch.arange(1.0, 65.0), set()
    for index in range(30):  # every direction of both axes among them
        moved = shift_pixels(8)(image, sample_generator(0, 0, index, 0))
        # the draw: (dy, dx) in {-1, 0, 1}, the generator's first two integers
        dy, dx = torch.randint(-1, 2, (2,), generator=sample_generator(0, 0, index, 0)).tolist()
        shifts.add((dy, dx))
        grid, out = image.reshape(8, 8), moved.reshape(8, 8)
        for i in range(8):
            for j in range(8):
                inside = 0 <= i - dy < 8 and 0 <= j - dx < 8
                assert out[i, j] == (grid[i - dy, j - dx] if inside else 0)
    assert {dy for dy, _ in shifts} == {dx for _, dx in shifts} == {-1, 0, 1}
    with pytest.raises(ValueError, match="repeats must be a whole number >= 1"):
        Augmented(_dataset().dataset, _noise, repeats=0)
    with pytest.raises(ValueError, match="equal batch sizes"):
        sw.data.loader(_dataset(2), [2, 4], shard=(2, 0))
    with pytest.raises(ValueError, match="would straddle two steps"):
        sw.data.loader(_dataset(4), 3, shard=(2, 0))  # 4 repeats, a global batch of 6
    saved = sw.data.loader(_dataset(2), 3, shard=(2, 0))
    next(iter(saved))
    elsewhere = sw.data.loader(_dataset(2), 2, shard=(2, 0))
    with pytest.raises(ValueError, match="laid out for them"):
        elsewhere.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="not a tuple"):
        Augmented([{"x": torch.zeros(3)}], _noise)[0]
