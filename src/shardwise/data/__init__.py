"""Data for many ranks: loaders, partitioners, balancing, queue, skew, ledger, datasets."""

from shardwise.data.sharded_loader import PartitionedLoader, ShardedLoader, loader

__all__ = ["PartitionedLoader", "ShardedLoader", "loader"]
