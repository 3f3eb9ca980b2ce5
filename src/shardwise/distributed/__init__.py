"""Processes and their groups: runtime, device mesh, launcher, signals."""
