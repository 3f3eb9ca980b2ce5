"""The trainer and its parts."""
