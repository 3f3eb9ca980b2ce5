"""Partitioners: each covers every sample exactly once per epoch (world sizes 1-5, dataset
sizes not divisible by them), deterministically; hashing keeps samples where they were when the
dataset grows; stratified parts share the label mix; weighted parts follow the weights; and the
partitioned loader reads exactly its rank's part."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import TensorDataset

import shardwise as sw
from shardwise.data.partition import Contiguous, Hashed, Stratified, Strided, Weighted
from shardwise.data.skew import format_report, skew_report

SIZE_FOR_LABELS = 1001
LABELS = [i * 7 % 5 for i in range(SIZE_FOR_LABELS)]  # five labels, mixed through the dataset


def _partitioners(world: int) -> dict:
    return {
        "contiguous": Contiguous(),
        "strided": Strided(),
        "hashed": Hashed(),
        "stratified": Stratified(LABELS),
        "weighted": Weighted([r + 1 for r in range(world)]),
    }


SIZE_FOR_LABELS = 1001


@pytest.mark.parametrize("name", ["contiguous", "strided", "hashed", "stratified", "weighted"])
def test_every_partitioner_covers_each_sample_exactly_once_per_epoch(name):
    for world in range(1, 6):
        partitioner = _partitioners(world)[name]
        sizes = [SIZE_FOR_LABELS] if name == "stratified" else [7, 97, 1001]
        for size in sizes:
            for epoch in (0, 1):
                parts = partitioner.split(size, world, seed=3, epoch=epoch)
                assert len(parts) == world
                seen = sorted(i for part in parts for i in part)
                assert seen == list(range(size)), (name, world, size, epoch)
                assert parts == partitioner.split(size, world, seed=3, epoch=epoch)  # determined
            if name != "hashed" and size > world:  # the order changes from epoch to epoch
                assert partitioner.split(size, world, 3, 0) != partitioner.split(size, world, 3, 1)


def test_even_partitioners_differ_by_at_most_one_and_weighted_follow_their_weights():
    for world in range(1, 6):
        for size in (97, 1001):
            for partitioner in (Contiguous(), Strided()):
                lengths = [len(p) for p in partitioner.split(size, world, 0, 0)]
                assert max(lengths) - min(lengths) <= 1
            weights = [r + 1 for r in range(world)]
            lengths = [len(p) for p in Weighted(weights).split(size, world, 0, 0)]
            for length, w in zip(lengths, weights, strict=True):
                assert abs(length - size * w / sum(weights)) < 1


def test_stratified_parts_hold_the_same_mix_of_labels():
    for world in range(2, 6):
        parts = Stratified(LABELS).split(len(LABELS), world, seed=1, epoch=0)
        counts = [collections.Counter(LABELS[i] for i in part) for part in parts]
        for label in set(LABELS):
            per_part = [c[label] for c in counts]
            assert max(per_part) - min(per_part) <= 1, (world, label, per_part)


def test_hashing_moves_few_samples_when_the_dataset_grows_by_one_percent():
    """Keys are the samples' identities (here: ids that are not their positions, shuffled in
    when the dataset grows); 1% more samples: at most ~2x the ideal share moves."""
    ids = [f"doc-{i * 7919 % 100_003}" for i in range(10_000)]
    grown = ids[:5000] + [f"new-{i}" for i in range(100)] + ids[5000:]  # inserted mid-way
    for world in (2, 3, 5):
        before = Hashed(key=ids.__getitem__).owners(len(ids), world)
        after = Hashed(key=grown.__getitem__).owners(len(grown), world)
        owner_after = dict(zip(grown, after, strict=True))
        moved = sum(owner_after[key] != owner for key, owner in zip(ids, before, strict=True))
        # Ideal: the 100 new samples take their share and nothing else moves.
        assert moved <= 2 * 100 * (world - 1) / world
        shares = collections.Counter(after)
        assert all(abs(n - len(grown) / world) < 0.05 * len(grown) / world for n in shares.values())


def test_the_partitioned_loader_reads_exactly_its_part_in_its_batch_size():
    data = TensorDataset(torch.arange(100).float(), torch.arange(100))
    partition = Weighted([1, 3])
    seen = []
    for rank, size in enumerate([3, 9]):
        loader = sw.data.loader(data, [3, 9], seed=5, shard=(2, rank), partition=partition)
        part = set(partition.split(100, 2, seed=5, epoch=0)[rank])
        batches = [y.tolist() for _, y in loader]
        assert len(batches) == len(loader) == 8  # 25 // 3 and 75 // 9: the fewer full batches
        assert all(len(b) == size for b in batches)
        assert all(set(b) <= part for b in batches)
        seen += [i for b in batches for i in b]
    assert len(seen) == len(set(seen)) == 8 * 12  # nobody's sample read twice
    # Resumed mid-epoch, it goes on with the same batches.
    loader = sw.data.loader(data, [3, 9], seed=5, shard=(2, 1), partition=partition)
    it = iter(loader)
    first = [next(it)[1].tolist() for _ in range(3)]
    again = sw.data.loader(data, [3, 9], seed=5, shard=(2, 1), partition=partition)
    again.load_state_dict(loader.state_dict())
    rest = [y.tolist() for _, y in again]
    whole = [
        y.tolist()
        for _, y in sw.data.loader(data, [3, 9], seed=5, shard=(2, 1), partition=partition)
    ]
    assert first + rest == whole
    with pytest.raises(ValueError, match="holds for its own number of ranks"):
        other = sw.data.loader(data, 4, seed=5, shard=(3, 0), partition=Strided())
        other.load_state_dict(loader.state_dict())


def test_skew_report_counts_samples_tokens_and_label_mix():
    labels = torch.arange(6).repeat_interleave(20)  # 120 samples, sorted by label
    classes = TensorDataset(torch.zeros(120, 2), labels)
    # Unshuffled contiguous parts of sorted data: rank 0 sees labels 0-2 only, rank 1 3-5.
    cut = skew_report(classes, Contiguous(shuffle=False).split(120, 2, 0, 0))
    dealt = skew_report(classes, Stratified(labels.tolist()).split(120, 2, 0, 0))
    assert [r["labels"] for r in cut["ranks"]] == [
        {"0": 20, "1": 20, "2": 20},
        {"3": 20, "4": 20, "5": 20},
    ]
    assert cut["max_label_tv_distance"] == pytest.approx(0.5)
    assert dealt["max_label_tv_distance"] == pytest.approx(0.0)
    # Sequences: tokens and Σ L² per rank, and the heaviest rank against the mean.
    lengths = [1, 2, 3, 4]
    sequences = [(torch.zeros(n), torch.zeros(n, dtype=torch.long)) for n in lengths]
    report = skew_report(sequences, [[0, 3], [1, 2]])
    assert [(r["tokens"], r["attention_cost"]) for r in report["ranks"]] == [(5, 17), (5, 13)]
    assert report["max_over_mean"]["attention_cost"] == pytest.approx(17 / 15)
    assert "rank 1:" in format_report(report)
