"""Waiting for keys of the job's c10d store without holding its client.

A TCPStore client serves one request at a time: a blocking `wait` or `get` in one thread holds it
until the key appears, and every other thread's request (the watchdog's heartbeat, a checkpoint
writer's checksums) queues behind it, which can deadlock ranks that wait for each other's keys.
Polling with `check` keeps every request short.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from shardwise.comm import interrupt


def wait_for(store: dist.Store, keys: list[str], timeout_s: float) -> None:
    """Until every key exists; `TimeoutError` after `timeout_s` (`PeerLost` once the job's
    membership changed, under `interrupt.interrupt_waits_with`)."""
    deadline, pause, asked = time.monotonic() + timeout_s, 0.0005, time.monotonic()
    since = interrupt.membership()
    while not store.check(keys):
        if time.monotonic() - asked > interrupt.POLL_S:
            interrupt.raise_if_interrupted(since)
            asked = time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"store keys not set within {timeout_s:.0f} s: {keys[:4]}")
        time.sleep(pause)
        pause = min(0.01, pause * 2)


def get(store: dist.Store, key: str, timeout_s: float) -> bytes:
    """The key's value, once it exists."""
    wait_for(store, [key], timeout_s)
    return store.get(key)
