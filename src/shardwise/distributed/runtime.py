"""Process-group bring-up: one call that works under torchrun, our launcher or plain `python`.

`init()` reads the environment torchrun's agent sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
...). Without it, the process is a world of size 1 with a real (gloo) process group, so every
strategy runs the same code path in a single process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.arguments import finite_number
from shardwise.comm import jobstore
from shardwise.comm.collectives import forget_volumes
from shardwise.distributed import leaving

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Runtime:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout: timedelta
    # The process group that `rank` and `world_size` refer to: None is the whole world. A device
    # mesh hands a strategy a runtime for one of its dimensions (see `shardwise.distributed.mesh`).
    group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


_runtime: Runtime | None = None
_store: dist.Store | None = None  # the job's keys: below its token and attempt (and epoch)
_job_keys: dist.Store | None = None  # below the attempt only: what outlives an epoch
_client: jobstore.JobStoreClient | None = None  # this rank's connection to the job's store
_services: list = []  # what lives as long as the group and stops before it (`attach`)
_init_hooks: list = []  # called with the runtime once `init` made it (`on_init`)
WATCHDOG_ENV = "SHARDWISE_WATCHDOG_S"  # set by `shardwise run`: the scripts' hang timeout
_announced = False  # this rank said it leaves
_failed = False  # ... before its work was done


def _pick_backend(backend: str | None) -> str:
    if backend in (None, "auto"):
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError(
            "backend 'nccl' needs a CUDA GPU and a torch built with NCCL; this process has "
            "neither (use 'gloo', or 'auto' to pick)"
        )
    return backend


def _device(backend: str, local_rank: int) -> torch.device:
    """This rank's device (NCCL: its GPU, made the current one)."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Runtime:
    """Join (or create) the process group and return this process's `Runtime`.

    `timeout_s` bounds every collective: a peer that dies or hangs ends the job with an error
    after that long instead of a silent hang. Calling `init` again returns the same runtime.
    """
    global _runtime, _store, _job_keys
    finite_number("timeout_s", timeout_s, above=0)  # (NaN passed `<= 0`: failed in bring-up)
    backend = _pick_backend(backend)  # (checked here too: a bad one is not taken in silence)
    if _runtime is not None:
        return _runtime
    timeout = timedelta(seconds=timeout_s)
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", 0))
    device = _device(backend, local_rank)
    if not dist.is_initialized():
        # NCCL binds its communicators to this rank's GPU up front (barriers included).
        bound = {"device_id": device} if backend == "nccl" else {}
        if "RANK" in env and "WORLD_SIZE" in env:
            store, rank, world_size = _job_store(env, timeout)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bound
            )
        else:  # plain `python script.py`: a world of one, same code path
            store = dist.HashStore()
            dist.init_process_group(
                backend, store=store, rank=0, world_size=1, timeout=timeout, **bound
            )
        _store = _job_keys = store
        # A script that forgets `shutdown()` still leaves cleanly (gloo aborts a process that
        # exits with its group alive).
        atexit.register(shutdown)
    world_size = dist.get_world_size()
    _runtime = Runtime(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
        device=device,
        backend=backend,
        timeout=timeout,
    )
    for hook in _init_hooks:
        hook(_runtime)
    return _runtime


def init_joiner(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Runtime:
    """A replacement for a lost rank of an elastic job (`membership.py`): the job's store, and
    no process group until the members take it in (`reform`)."""
    global _runtime, _store, _job_keys
    backend = _pick_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(backend, local_rank)
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = _job_store(os.environ, timeout)
    _store = _job_keys = store
    atexit.register(shutdown)
    _runtime = Runtime(rank, world_size, local_rank, world_size, device, backend, timeout)
    return _runtime


def attach(service) -> None:
    """Tie `service` (anything with `stop()`: a watchdog thread) to the process group: `shutdown`
    stops it first, while the group and the store it may read are still there."""
    _services.append(service)


def on_init(hook) -> None:
    """Call `hook(runtime)` each time `init` joins a job (whoever calls it: `sw.init`,
    `sw.prepare`, a loader, `sw.ps.serve`): how a layer above starts what a job needs."""
    _init_hooks.append(hook)


def _job_store(env, timeout: timedelta) -> tuple[dist.Store, int, int]:
    """The store the job's ranks meet in, below this start's prefix: the job's own
    authenticated store where a shardwise launcher hosts one, else torchrun's (several
    machines under torchrun: README, trusted network)."""
    # torchrun's agent keeps its store when it restarts the ranks after a failure: the keys of
    # each attempt (gloo's addresses among them) must not meet the last one's.
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    if jobstore.ADDRESS_ENV in env:
        global _client
        # Kept here: the C++ side of a Python store does not keep its Python object alive, and
        # without it every request would fall through to the base class ("Not implemented").
        _client = jobstore.JobStoreClient.from_environment(timeout.total_seconds())
        store = dist.PrefixStore(f"attempt-{attempt}", _client)
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        # (our launcher notes a rank that ended before it joined: said at once, not later)
        leaving.arrive(store, rank, world_size, timeout.total_seconds())
        return store, rank, world_size
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"shardwise/attempt-{attempt}", store), rank, world_size


def reform(epoch: int, rank: int, world_size: int) -> Runtime:
    """Leave the present process group for a new one of `world_size` ranks, this process being
    `rank` (an elastic job's next epoch, `membership.py`): its keys below `epoch-N` of the job's
    store. The old group is never torn down: a rank still blocked in one of its operations
    (gloo tells only a dead peer's neighbours) would never finish tearing it down; it is left
    behind, its threads idle or blocked, for the process's life."""
    global _runtime, _store
    if _runtime is None or _job_keys is None:
        raise RuntimeError("shardwise is not initialised: call shardwise.init() first")
    _forget_world()
    _store = dist.PrefixStore(f"epoch-{epoch}", _job_keys)
    bound = {"device_id": _runtime.device} if _runtime.backend == "nccl" else {}
    dist.init_process_group(
        _runtime.backend,
        store=_store,
        rank=rank,
        world_size=world_size,
        timeout=_runtime.timeout,
        **bound,
    )
    _runtime = dataclasses.replace(
        _runtime, rank=rank, world_size=world_size, local_world_size=world_size
    )
    forget_volumes()  # (a collective over the world sends by the new world's size)
    return _runtime


def _forget_world() -> None:
    """What `destroy_process_group` does, but for shutting the groups down: each is kept
    alive for good (a reference never released), so that no destructor waits for its
    threads, at any point of the process's life or end."""
    c10d = dist.distributed_c10d
    world = c10d._world
    python_ref = ctypes.py_object  # (a reference to it; nothing crosses a wire here)
    for group in list(world.pg_map):
        ctypes.pythonapi.Py_IncRef(python_ref(group))
    c10d._update_default_pg(None)
    for table in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def job_keys() -> dist.Store:
    """The job's store below its attempt only: the keys that outlive an elastic job's epochs
    (its membership's)."""
    if _job_keys is None:
        raise RuntimeError("shardwise is not initialised: call shardwise.init() first")
    return _job_keys


def current() -> Runtime:
    """The runtime `init()` created; an error if it was not called."""
    if _runtime is None:
        raise RuntimeError("shardwise is not initialised: call shardwise.init() first")
    return _runtime


def current_or_alone() -> Runtime:
    """The runtime `init()` created, or, without one, this process alone (no process group):
    what a plain, unprepared model is trained in."""
    if _runtime is not None:
        return _runtime
    device = torch.device("cpu")
    return Runtime(0, 1, 0, 1, device, backend="none", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))


def store() -> dist.Store:
    """The job's store, below this start's prefix: what ranks tell each other outside
    collectives (heartbeats, checkpoint sums, the watchdog's records), and what a launcher
    reads. Under a shardwise launcher, the job's own authenticated store (`comm/jobstore.py`)."""
    if _store is None:
        return dist.distributed_c10d._get_default_store()  # a group someone else made
    return _store


def announce_leaving(reason: str) -> None:
    """Tell the job's other ranks that this one is leaving before its work is done (a failure:
    `reason` says which), so that a rank waiting for it in a collective names it at once
    instead of waiting out its timeouts. Best effort: never raises."""
    global _announced, _failed
    _failed = _failed or bool(reason)
    if _runtime is None or _announced or _runtime.world_size == 1:
        return
    _announced = True
    with contextlib.suppress(Exception):  # the store may be gone with the job
        leaving.announce(store(), _runtime.rank, reason)


def shutdown() -> None:
    """Leave the process group. Safe to call twice."""
    global _runtime, _store, _client, _announced, _failed, _job_keys
    while _services:
        _services.pop().stop()
    announce_leaving("")  # the end: a rank still waiting for this one is told at once
    if dist.is_initialized():
        if not _failed:  # (a failed rank's peers are not in a barrier to meet it there)
            _quiesce()
        dist.destroy_process_group()
    forget_volumes()
    if _client is not None:
        _client.close()
    _runtime = _store = _client = None
    _job_keys = None
    _announced = _failed = False


def _quiesce(timeout_s: float = 5.0) -> None:
    """One last barrier, so that the backend's worker threads are idle before teardown.

    gloo's worker thread releases a finished operation only after its waiter has been told,
    and that release may need the Python interpreter; a process that exits in between aborts
    ("terminate called without an active exception", exit code -6). After a barrier, the last
    operation is the barrier itself, issued here, outside autograd. A peer that is gone costs
    `timeout_s`, not a hang."""
    with contextlib.suppress(Exception):  # a peer already left: nothing to wait for
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    # The waiter is told before the worker thread lets go of the barrier's operation, and
    # letting go takes the GIL: give it the moment it needs (nothing is in flight after this).
    time.sleep(0.05)
