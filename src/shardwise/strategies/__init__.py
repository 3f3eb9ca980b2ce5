"""Parallelism strategies, one per module."""

from shardwise.strategies.base import Strategy
from shardwise.strategies.ddp import DDP

__all__ = ["DDP", "Strategy"]
