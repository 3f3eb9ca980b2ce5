"""Parallelism strategies, one per module."""

from shardwise.strategies.base import Strategy
from shardwise.strategies.ddp import DDP
from shardwise.strategies.mesh_parallel import MeshParallel
from shardwise.strategies.pipeline import Pipeline
from shardwise.strategies.relaxed import AdaptiveSync, Gossip, Hybrid, LocalSGD
from shardwise.strategies.tensor_parallel import TensorParallel
from shardwise.strategies.zero import ZeRO

__all__ = [
    "DDP",
    "AdaptiveSync",
    "Gossip",
    "Hybrid",
    "LocalSGD",
    "MeshParallel",
    "Pipeline",
    "Strategy",
    "TensorParallel",
    "ZeRO",
]
