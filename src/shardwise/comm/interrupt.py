"""Waits that give up when the job's membership changes (`train.on_failure: shrink`).

A rank blocked in a collective with a peer that died is told only if that peer was its
neighbour (gloo), and a rank waiting for a peer's key in the store is never told. Under
`interrupt_waits_with(check)`, every wait of the communication layer asks `check()` every
`POLL_S` while it lasts: a reason ends the wait with `PeerLost(reason)`. So does a new
membership (`next_membership`): a wait begun under an earlier one (a communication thread's,
still blocked in the old group) can never complete.
"""

from __future__ import annotations

from collections.abc import Callable

POLL_S = 0.1


class PeerLost(RuntimeError):
    """A collective could not complete: a peer died, hung or left the job's membership."""


_check: Callable[[], str | None] | None = None
_membership = 0  # how many memberships the job had before the present one
# Whether waits are interrupted (`active()`), read as a module attribute where a call's path
# cannot afford a function call (`collectives._issue`).
waits_interrupted = False


def interrupt_waits_with(check: Callable[[], str | None] | None) -> None:
    """From now on, a wait that lasts asks `check()` every `POLL_S`: a reason (not None) ends
    it with `PeerLost(reason)`, and a backend error in any wait is a `PeerLost` too. None (the
    default): waits block until the backend returns (or its own timeout)."""
    global _check, waits_interrupted
    _check, waits_interrupted = check, check is not None


def active() -> bool:
    return _check is not None


def membership() -> int:
    """The present membership's number: what a wait notes as it begins."""
    return _membership


def next_membership() -> None:
    """The job goes on with other members: every wait begun before ends."""
    global _membership
    _membership += 1


def raise_if_interrupted(since: int) -> None:
    """`PeerLost` if the membership the wait began under (`since`) is over, or failed."""
    if since != _membership:
        raise PeerLost("the job's membership changed")
    if _check is not None and (reason := _check()) is not None:
        raise PeerLost(reason)
