"""A broken connection told apart from other errors: gloo reports one in a long message of its
own ("... Connection closed by peer [127.0.0.1]:33041. This is typically caused by ..."). A
rank that fails on one is usually the victim of another rank's death, not its cause."""

from __future__ import annotations

# (gloo's tcp pair: a read of EOF, a read or a sync-mode write that failed (EPIPE: "writev ...:
# Broken pipe"), and any call on a pair that closed meanwhile)
PHRASES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Broken pipe",
    "Socket closed",
    "Socket unexpectedly closed",
)


def broken_connection(text: str) -> str | None:
    """The phrase (lower case) if `text` reports a broken connection, else None."""
    return next((phrase.lower() for phrase in PHRASES if phrase in text), None)


def describe(error: BaseException) -> str:
    """A few words for an error: a broken connection's phrase, or its first line."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return broken_connection(text) or f"{type(error).__name__}: {text[:160]}"
