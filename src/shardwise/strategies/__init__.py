"""Parallelism strategies, one per module."""

from shardwise.strategies.base import Strategy
from shardwise.strategies.ddp import DDP
from shardwise.strategies.relaxed import AdaptiveSync, Gossip, LocalSGD
from shardwise.strategies.zero import ZeRO

__all__ = ["DDP", "AdaptiveSync", "Gossip", "LocalSGD", "Strategy", "ZeRO"]
