"""SIGTERM and SIGINT handled for a while: what a training loop and a supervisor both need."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def handling_stop_signals(handler: Callable):
    """`handler(signum, frame)` for SIGTERM and SIGINT inside; the previous handlers after."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
