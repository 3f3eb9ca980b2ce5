"""Optimizers whose update depends on each parameter's norm: LARS and LAMB.

They are exact when the tensors they step are shards or slices of the model's parameters: the
strategy says which piece of which parameter each stepped tensor holds (`ParameterNorms`) and
sums the pieces' squares over the ranks that hold the rest."""

from shardwise.optim.lamb import LAMB
from shardwise.optim.lars import LARS
from shardwise.optim.layerwise import LayerwiseOptimizer, ParameterNorms, Piece

__all__ = ["LAMB", "LARS", "LayerwiseOptimizer", "ParameterNorms", "Piece"]
