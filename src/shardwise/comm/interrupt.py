"""Waits that give up when the job's membership changes (`train.on_failure: shrink`).

A rank blocked in a collective with a peer that died is told only if that peer was its
neighbour (gloo), and a rank waiting for a peer's key in the store is never told. Under
`interrupt_waits_with(check)`, every wait of the communication layer asks `check()` every
`POLL_S` while it lasts: a reason ends the wait with `PeerLost(reason)`.
"""

from __future__ import annotations

from collections.abc import Callable

POLL_S = 0.1


class PeerLost(RuntimeError):
    """A collective could not complete: a peer died, hung or left the job's membership."""


_check: Callable[[], str | None] | None = None


def interrupt_waits_with(check: Callable[[], str | None] | None) -> None:
    """From now on, a wait that lasts asks `check()` every `POLL_S`: a reason (not None) ends
    it with `PeerLost(reason)`, and a backend error in any wait is a `PeerLost` too. None (the
    default): waits block until the backend returns (or its own timeout)."""
    global _check
    _check = check


def active() -> bool:
    return _check is not None


def raise_if_interrupted() -> None:
    if _check is not None and (reason := _check()) is not None:
        raise PeerLost(reason)
