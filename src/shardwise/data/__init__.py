"""Data for many ranks: loaders, partitioners, balancing, queue, skew, ledger, datasets."""

from shardwise.data.augment import Augmented, sample_generator, shift_pixels
from shardwise.data.sharded_loader import PartitionedLoader, ShardedLoader, loader

__all__ = [
    "Augmented",
    "PartitionedLoader",
    "ShardedLoader",
    "loader",
    "sample_generator",
    "shift_pixels",
]
