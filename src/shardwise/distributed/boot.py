"""What every process a shardwise launcher starts runs first: die with the launcher.

    python .../distributed/boot.py -m shardwise train ...    # a rank of `shardwise train`
    python .../distributed/boot.py SCRIPT ARGS...            # a rank of `shardwise run`

Run by its path, not as a module, so that nothing heavy is imported before the parent-death
signal is set: a launcher killed while its workers import torch (seconds; a minute for 64 ranks
under memory pressure) must not leave them running on. The launcher puts its pid in
`SHARDWISE_PARENT_PID` before it starts them, so a worker whose launcher died before the request
(its parent is then another process) sees it and leaves at once. Only the standard library is
imported here.

Where the launcher runs a zygote (`zygote.py`, named by `SHARDWISE_ZYGOTE`), the rank's work
runs in a fork of it, which has imported torch already: this process hands it the rank's
arguments, environment and standard streams, passes on the signals it gets, and exits as the
fork exits. Where no zygote answers, the rank runs here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import runpy
import signal
import socket
import sys

PARENT_ENV = "SHARDWISE_PARENT_PID"
# Set by a launcher asked to bind ranks to cores (`launch.bind_cores`): how many cores a rank
# takes, local rank r the r-th run of that many among those the launcher may use.
CORES_ENV = "SHARDWISE_CORES_PER_RANK"
ZYGOTE_ENV = "SHARDWISE_ZYGOTE"
PR_SET_PDEATHSIG = 1
# Keep freed memory in the process: large gradient buffers are reallocated every step (glibc
# reads these as a process starts: a rank's, or the zygote's it is forked from).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
# What a rank's process passes on to its fork: the stop signals a launcher, torchrun's agent or
# a user sends (SIGKILL cannot be caught: the zygote kills the fork when this process is gone).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
MESSAGE_BYTES = 1 << 20  # the largest message either side takes (a request: argv and env)


def in_rank() -> bool:
    """Whether this process is a rank of a job (under our launcher, or torchrun anywhere)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux; elsewhere a no-op),
    and leave now if the parent this process was started by (`parent`, else the launcher named
    in the environment) is already gone."""
    if not sys.platform.startswith("linux"):
        return
    if parent is None:
        expected = os.environ.get(PARENT_ENV)
        parent = int(expected) if expected and expected.isdigit() else os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request: follow it now
        os.kill(os.getpid(), signal.SIGKILL)


def _announce_leaving(error: BaseException) -> None:
    """A script that fails tells the job's other ranks at once (if it joined the job at all:
    nothing is imported for it here)."""
    runtime = sys.modules.get("shardwise.distributed.runtime")
    if runtime is not None and not (isinstance(error, SystemExit) and not error.code):
        runtime.announce_leaving(f"{type(error).__name__}: {error}".splitlines()[0][:300])


def bind_cores() -> None:
    """Pin this rank to its own cores where the launcher asked (`CORES_ENV`). Called before
    the rank starts a thread (torch's, gloo's), which inherit it. A rank that stays on its
    cores finds its caches as it left them after a wait: on the 2-core VM, world 2, a float's
    all-reduce took 145-150 us bound against 170-200 unbound, every way of calling it."""
    per_rank = int(os.environ.get(CORES_ENV) or 0)
    if per_rank and hasattr(os, "sched_setaffinity"):  # (Linux's)
        usable = sorted(os.sched_getaffinity(0))
        first = int(os.environ.get("LOCAL_RANK", "0")) * per_rank
        if first + per_rank <= len(usable):  # (the launcher checked: all ranks fit)
            os.sched_setaffinity(0, usable[first : first + per_rank])


def usable_cores() -> int:
    """The cores this process may run on (a `taskset` or a container's cpuset counts)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cores_bound() -> bool:
    """Whether this rank runs on the cores `bind_cores` gave it."""
    per_rank = int(os.environ.get(CORES_ENV) or 0)
    return per_rank > 0 and hasattr(os, "sched_getaffinity") and usable_cores() == per_rank


def run(args: list[str]) -> None:
    """Run the rank: `-m MODULE ARGS...` or `SCRIPT ARGS...`, as `python` would."""
    bind_cores()
    # Python put this file's folder, the package's own, first on the path: its modules must not
    # shadow top-level ones. What `python -m MODULE` or `python SCRIPT` would put there instead:
    if args[:1] == ["-m"] and len(args) > 1:
        sys.path[0] = os.getcwd()
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args:
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        sys.argv = args
        try:
            runpy.run_path(args[0], run_name="__main__")
        except BaseException as e:
            _announce_leaving(e)
            raise
        finally:
            # The interpreter's last collections would walk every object torch made (its
            # compiler stack's too, which the first optimizer imports): 0.4 s of each rank's
            # exit on 2 cores. What lives this late is not garbage; finalizers still run.
            gc.freeze()
    else:
        sys.exit("usage: boot.py -m MODULE [ARGS...] | boot.py SCRIPT [ARGS...]")


def socket_address(name: str) -> str:
    """The Unix socket address a zygote's name stands for: '@NAME' is NAME in the abstract
    namespace (an environment variable cannot hold its leading NUL)."""
    return "\0" + name[1:] if name.startswith("@") else name


def run_forked(address: str, args: list[str]) -> int | None:
    """Have the zygote at `address` run the rank in a fork; its exit code (negative: the signal
    that ended it). None if no zygote took the request (nothing was forked): run it here."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV}
    request = json.dumps({"argv": args, "cwd": os.getcwd(), "env": env}).encode()
    try:
        connection.connect(socket_address(address))
        socket.send_fds(connection, [request], [0, 1, 2])
        reply = connection.recv(MESSAGE_BYTES)  # (waits while the zygote imports torch)
    except OSError:
        return None
    if not reply:  # the zygote could not start (it said why) or went away: nothing forked
        return None
    fork = int(json.loads(reply)["pid"])

    def pass_on(signum: int, frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # (it ended meanwhile)
            os.kill(fork, signum)

    for sig in FORWARDED:
        signal.signal(sig, pass_on)
    reply = connection.recv(MESSAGE_BYTES)
    if not reply:  # the zygote died, and the fork with it (its parent-death signal)
        print(f"shardwise: the zygote that ran pid {fork} is gone", file=sys.stderr, flush=True)
        return -int(signal.SIGKILL)
    return int(json.loads(reply)["exit"])


def exit_as(code: int) -> None:
    """End this process as the fork ended: the same exit code, or killed by the same signal."""
    if code < 0:
        with_signal = signal.Signals(-code)
        if with_signal not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(with_signal, signal.SIG_DFL)
        os.kill(os.getpid(), with_signal)
    os._exit(code & 0xFF)


def main() -> None:
    die_with_parent()
    args = sys.argv[1:]
    address = os.environ.get(ZYGOTE_ENV)
    if address and args:
        code = run_forked(address, args)
        if code is not None:
            exit_as(code)
    run(args)


if __name__ == "__main__":
    main()
