"""Faults on purpose and by accident: fault injection and the hang/desync watchdog."""
