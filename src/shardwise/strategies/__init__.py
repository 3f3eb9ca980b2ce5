"""Parallelism strategies, one per module."""

from shardwise.strategies.base import Strategy
from shardwise.strategies.ddp import DDP
from shardwise.strategies.relaxed import AdaptiveSync, Gossip, Hybrid, LocalSGD
from shardwise.strategies.zero import ZeRO

__all__ = ["DDP", "AdaptiveSync", "Gossip", "Hybrid", "LocalSGD", "Strategy", "ZeRO"]
