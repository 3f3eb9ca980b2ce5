"""Training recipes on top of any strategy: distillation, pruning, continual training."""
