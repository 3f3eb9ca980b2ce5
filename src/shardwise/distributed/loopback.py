"""A c10d store that listens on 127.0.0.1 only, and a torchelastic rendezvous around it.

torch's `TCPStore` server has no bind-address option: it listens on every interface. It does
accept a socket that is already listening (`master_listen_fd`), so a single-machine job binds
one to 127.0.0.1 and hands it over. torchrun's agent finds its store through a rendezvous
handler; for a one-node job, `LoopbackRendezvous` is that handler (registered as
`shardwise-loopback`): one node, rank 0, and this store for the agent and its workers alike
(`use_agent_store`). Jobs that span machines keep torchrun's c10d rendezvous (README: trusted
network).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

BACKEND = "shardwise-loopback"
HOST = "127.0.0.1"


def loopback_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server in this process, reachable from this machine only."""
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listening.bind((HOST, 0))
    listening.listen(512)
    port = listening.getsockname()[1]
    # The store owns the socket from here on: detached, Python never closes it under it.
    return dist.TCPStore(
        HOST,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listening.detach(),
    )


class LoopbackRendezvous(RendezvousHandler):
    """One node, on this machine: the agent is rank 0 and hosts a loopback store (one for the
    job's life: a restart's keys are kept apart by the restart count in their prefix)."""

    def __init__(self, run_id: str, timeout_s: float) -> None:
        self._run_id, self._timeout_s = run_id, timeout_s
        self._store: dist.TCPStore | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = loopback_store(self._timeout_s)
        where = RendezvousStoreInfo(HOST, self._store.port)
        return RendezvousInfo(dist.PrefixStore(self._run_id, self._store), 0, 1, where)

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


def _create(params: RendezvousParameters) -> LoopbackRendezvous:
    return LoopbackRendezvous(params.run_id, float(params.get("timeout", 300)))


rendezvous_handler_registry.register(BACKEND, _create)
