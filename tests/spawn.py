"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

A forkserver that has already imported torch and shardwise forks each rank, so a 4-rank test
starts in well under a second instead of paying four torch imports. Each rank sets the
environment torchrun would and the job's store (`comm/jobstore.py`, hosted here as a launcher
hosts it), calls `sw.init()`, runs the function and sends back its result (or its traceback).
Results are returned in rank order.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from shardwise.comm.jobstore import JobStoreServer, new_secret

_CTX = mp.get_context("forkserver")
# torch.optim imports torch._dynamo on a process's first optimizer (~3 s of CPU): done once here.
# transformers (the optional extra) costs ~3 s per import: once here too, where it is installed.
_PRELOAD = ["torch", "torch._dynamo", "preloaded"]
_CTX.set_forkserver_preload(
    _PRELOAD + (["transformers"] if importlib.util.find_spec("transformers") else [])
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, store: dict, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        **store,
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch

    import shardwise as sw

    torch.set_num_threads(1)
    try:
        sw.init(backend="gloo", timeout_s=60)
        # Plain pickle copies tensors by value; the queue's own pickler would share them through
        # file descriptors that die with this process.
        result = pickle.dumps(fn(*args))
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        sw.shutdown()


def run(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 120, dies: tuple[int, ...] = ()
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks and return each rank's return value (None for the
    ranks in `dies`, which are expected to kill themselves and report nothing)."""
    queue = _CTX.Queue()
    server = JobStoreServer(new_secret())
    env = server.environment()
    procs = [
        _CTX.Process(target=_worker, args=(r, world_size, env, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size - len(dies)):
            rank, status, payload = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the others will now block in a collective; stop them below
    finally:
        # Every rank has reported: the rest is their shutdown, which waits for every peer in
        # a last barrier; with a rank gone (or hung, in `dies`) or failed, it cannot be met.
        deadline = time.monotonic() + (0.5 if errors or dies else 5.0)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        server.close()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results.get(r) for r in range(world_size)]
