"""A server's sends, one thread per destination: the serving loop never waits on a client.

A send over c10d returns once the peer has taken the message; a client that stopped reading
(stopped, hung, or gone without closing) would hold a serving loop that sent to it directly,
and every other client with it. Here each destination has a queue and a thread that sends its
messages in order; a send that fails puts (rank, None, reason) into the server's inbox, where
the loop marks that client lost, as when its messages end.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from shardwise.comm.broken import describe
from shardwise.ps import protocol
from shardwise.ps.protocol import Kind

CLOSE_TIMEOUT_S = 30.0  # how long `close` waits for each destination's last messages


class Outbox:
    def __init__(self, group, inbox: queue.Queue) -> None:
        self.group, self.inbox = group, inbox
        # Whether a message to a rank goes out (a backup server sends nothing while its primary
        # serves, then only to the clients that came over to it): None, everything.
        self.delivers: Callable[[int], bool] | None = None
        self.queues: dict[int, queue.Queue] = {}
        self.threads: dict[int, threading.Thread] = {}

    def send(self, dst: int, kind: Kind, *ints: int, payload: torch.Tensor | None = None) -> None:
        if self.delivers is not None and not self.delivers(dst):
            return
        if dst not in self.queues:
            self.queues[dst] = queue.Queue()
            thread = threading.Thread(
                target=self._run, args=(dst,), daemon=True, name=f"ps-send-{dst}"
            )
            self.threads[dst] = thread
            thread.start()
        self.queues[dst].put((kind, ints, payload))

    def _run(self, dst: int) -> None:
        broken = False
        while (item := self.queues[dst].get()) is not None:
            if broken:  # (what is queued after a failure is dropped)
                continue
            kind, ints, payload = item
            try:
                protocol.send(dst, kind, *ints, payload=payload, group=self.group)
            except Exception as e:
                broken = True
                self.inbox.put((dst, None, f"a send to it failed ({describe(e)})"))

    def close(self) -> None:
        """Send what is queued (each destination at most CLOSE_TIMEOUT_S more), then stop."""
        for q in self.queues.values():
            q.put(None)
        for thread in self.threads.values():
            thread.join(timeout=CLOSE_TIMEOUT_S)
