"""Checkpoints: the reshardable format, exact run checkpoints and resume, state trees."""
