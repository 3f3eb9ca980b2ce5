"""A job's zygote: one process that imports torch and shardwise once, and forks each rank.

    zygote.fork_early()                            # `shardwise train|run`: a fork of itself
    python .../distributed/zygote.py FD ARGS...   # other launchers; FD: its listening socket

Every rank's process would otherwise import torch, its compiler stack (which the first optimizer
imports) and shardwise before any work: 2.7-3.2 s of CPU a rank on 2 cores, more than a short
job's training. A launcher has one zygote per job beside the processes it starts for the ranks
(`boot.py`): the `shardwise` command forks it from itself once torch is imported
(`fork_early`, named `sw-zygote` in `ps`), other launchers start it (`running`). Each rank's
process asks the zygote for a fork that runs the rank
(`boot.run_forked`), passes its signals on, and exits as the fork exits. So torchrun's agent and
the parameter-server supervisor keep their own processes, pids, exit codes and signals, and the
forks, which share the zygote's imported pages, do the work.

One connection per rank, on a Unix socket in Linux's abstract namespace (no file, so nothing is
left behind by a launcher that is killed), taken only from processes of this user (their
credentials, from the kernel), as a private folder would; SOCK_SEQPACKET: one message a read.
  rank -> zygote: {"argv": [...], "cwd": "...", "env": {...}}, with the rank's stdin, stdout and
                  stderr passed along (SCM_RIGHTS);
  zygote -> rank: {"pid": N} once forked, then {"exit": CODE} (negative: the signal that ended
                  it).
A rank process whose connection closes (killed, SIGKILL included) has its fork SIGKILLed. The
forks die with the zygote and the zygote with the launcher (parent-death signals), and the
zygote is single-threaded when it forks (nothing it imports starts a thread).

Started, it runs by its path, as `boot.py` does: the standard library and `boot` until the
socket listens.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if __package__:
    from shardwise.distributed import boot
else:  # run by path (the zygote itself): its sibling, and nothing heavy yet
    import boot

# What every rank imports before its work (torch._dynamo: `torch.optim` does, for its first
# optimizer; then every name `import shardwise` offers); each rank still imports what its own
# work needs beyond these.
PRELOAD = ("torch", "torch._dynamo", "shardwise.cli")
PROCESS_NAME = b"sw-zygote"  # (/proc/PID/comm: what `ps` and `top` show; 15 bytes at most)
PR_SET_NAME = 15
MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}  # glibc's M_* parameters
REQUEST_S = 5.0  # seconds a connected rank process gets to send its request


def supported() -> bool:
    """Linux: the parent-death signal, and pidfds to learn when a fork ends."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


_early: int | None = None  # the pid of this launcher's zygote, forked by `fork_early`
_launcher_name: bytes | None = None  # in a forked zygote: the launcher's name, for its ranks


def start(job_args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start a zygote with the ranks' base `env`; it and the name that ranks find it by (what
    `boot.ZYGOTE_ENV` holds). `job_args` name the job in its command line, as in its ranks'."""
    name = f"@shardwise-zygote-{secrets.token_hex(8)}"  # ('@': the abstract namespace)
    # Listening before any rank starts (a rank that found no socket would import torch itself);
    # the zygote accepts once its imports are done.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(boot.socket_address(name))
        listener.listen(256)
        process = subprocess.Popen(
            [sys.executable, __file__, str(listener.fileno()), *job_args],
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=[listener.fileno()],
            start_new_session=True,  # a terminal's Ctrl-C is for the ranks, via the launcher
        )
    return process, name


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # (a fork still running ends with it)
        process.kill()
    process.wait()


def fork_early() -> None:
    """Fork this launcher's zygote now, once the launcher has imported torch and the command
    line, and before it starts a thread: the zygote imports only the rest (torch's compiler
    stack, shardwise's names) while the launcher goes on. A zygote started as its own process
    would import torch a second time: 1.3-1.5 s more CPU a job on 2 cores, for no earlier start
    (its imports are what a rank waits for, and a fork's are the same less torch's). It ends as
    this process exits; its forks take the job's threads from their own environment."""
    global _early
    if not supported() or os.environ.get(boot.ZYGOTE_ENV) == "0" or boot.in_rank():
        return
    name = f"@shardwise-zygote-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(boot.socket_address(name))
    listener.listen(256)
    launcher = os.getpid()
    # What the imports made is not garbage: out of the collector's passes, which would write to
    # every page the two processes share (each write then copies it).
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:  # (no zygote: each rank imports for itself)
        listener.close()
        return
    if pid == 0:  # the zygote, and each rank forked from it: none returns to the launcher's code
        try:
            _become_zygote(launcher)
            _preload_and_serve(listener)
        except SystemExit:
            raise
        except BaseException:  # (a rank's script that raised: said as Python says it)
            sys.excepthook(*sys.exc_info())
            raise SystemExit(1) from None
        raise SystemExit(0)  # (a rank's script that ran to its end)
    listener.close()
    _early, os.environ[boot.ZYGOTE_ENV] = pid, name
    atexit.register(_stop_fork, pid)


def _stop_fork(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _become_zygote(launcher: int) -> None:
    """In the launcher's fork: what a zygote started as its own process has. Its own session
    (a terminal's Ctrl-C is for the ranks, via the launcher), no stdin, output written as it is
    printed (line by line, as PYTHONUNBUFFERED's: a rank's lines must not wait), the
    allocator's settings that glibc reads from the environment only as a process starts, and a
    name of its own in `ps` and `top`."""
    os.setsid()
    boot.die_with_parent(launcher)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        # Line-buffered: a line (print's text and its newline) leaves in one write, not cut
        # in two by another rank's writing to the same pipe between them; text with no newline
        # yet waits for one or a flush, as Python's own on a terminal.
        stream = io.TextIOWrapper(raw, old.encoding, old.errors, line_buffering=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    for variable, value in boot.MALLOC_ENV.items():
        if variable not in os.environ:  # (one set there, glibc read as the launcher started)
            ctypes.CDLL(None).mallopt(MALLOPT[variable], int(value))
    global _launcher_name
    _launcher_name = Path("/proc/self/comm").read_bytes().strip()
    _set_name(PROCESS_NAME)


def _set_name(name: bytes) -> None:
    """This process's name in `ps` and `top` (/proc/PID/comm)."""
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


@contextlib.contextmanager
def running(job_args: list[str], env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A zygote for the job's ranks while inside, started with their base `env` (what is read
    as Python and torch start: threads, the allocator), or the one `fork_early` forked; yields
    what the ranks' environment needs to be forked from it ({} where zygotes are not supported,
    or `SHARDWISE_ZYGOTE=0` turns them off, or it is in the environment already)."""
    if _early is not None or not supported() or os.environ.get(boot.ZYGOTE_ENV) == "0":
        yield {}
        return
    process, name = start(job_args, env)
    try:
        yield {boot.ZYGOTE_ENV: name}
    finally:
        _stop(process)


@dataclass
class _Fork:
    pid: int
    connection: socket.socket  # to the rank's own process
    pidfd: int


class _BadRequest(ValueError):
    pass


def _peer_uid(connection: socket.socket) -> int:
    """The user of the process at the other end, as the kernel knows it (SO_PEERCRED)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    _, uid, _ = struct.unpack("3i", credentials)
    return uid


def _request(connection: socket.socket) -> tuple[list[str], str, dict[str, str], list[int]]:
    """A rank's request, checked: its arguments, folder, environment and three descriptors."""
    if (uid := _peer_uid(connection)) != os.getuid():
        raise _BadRequest(f"a request from another user (uid {uid})")
    data, fds, _, _ = socket.recv_fds(connection, boot.MESSAGE_BYTES, 3)
    try:
        message = json.loads(data)
        argv, cwd, env = message["argv"], message["cwd"], message["env"]
        ok = (
            isinstance(argv, list)
            and argv
            and all(isinstance(a, str) for a in argv)
            and isinstance(cwd, str)
            and isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            and len(fds) == 3
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        for fd in fds:
            os.close(fd)
        raise _BadRequest(f"a malformed request ({len(data)} bytes, {len(fds)} descriptors)")
    return argv, cwd, env, fds


def _become_rank(
    zygote: int, cwd: str, env: dict[str, str], fds: list[int], listener, forks
) -> None:
    """In the fork: the rank's own session, streams, folder and environment; nothing of the
    zygote's connections."""
    os.setsid()
    boot.die_with_parent(zygote)
    if _launcher_name is not None:  # (a rank is not the zygote in `ps`: the name it started as)
        _set_name(_launcher_name)
    listener.close()
    for fork in forks.values():
        fork.connection.close()
        os.close(fork.pidfd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ[boot.PARENT_ENV] = str(zygote)  # (what a rank checks it has not lost: its parent)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # (OpenMP read the zygote's, as it started)
        sys.modules["torch"].set_num_threads(int(threads))
    # As a fresh process would, a fork draws new seeds from the OS (Python's `random` does so
    # itself after a fork; numpy's global generator would repeat the zygote's in every rank).
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    # Its temporary folder from its own environment's TMPDIR, as a fresh process finds it, not
    # the one the zygote's imports asked for (torch's compiler stack, for its cache).
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None


def serve(listener: socket.socket) -> list[str]:
    """Fork a rank for each request until killed. Returns only in a fork: the rank's argv."""
    zygote = os.getpid()
    forks: dict[int, _Fork] = {}  # by the fd of its connection
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in events.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                connection.settimeout(REQUEST_S)  # (a client that sends nothing holds no one up)
                try:
                    argv, cwd, env, fds = _request(connection)
                    connection.setblocking(True)
                except (OSError, _BadRequest) as e:
                    print(f"shardwise: zygote: {e}", file=sys.stderr, flush=True)
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    events.close()
                    connection.close()
                    _become_rank(zygote, cwd, env, fds, listener, forks)
                    return argv
                for fd in fds:
                    os.close(fd)
                fork = _Fork(pid, connection, os.pidfd_open(pid))
                forks[connection.fileno()] = fork
                events.register(connection, selectors.EVENT_READ, fork)
                events.register(fork.pidfd, selectors.EVENT_READ, fork)
                with contextlib.suppress(OSError):  # (its process gone: seen as a close)
                    connection.send(json.dumps({"pid": pid}).encode())
            elif key.fileobj is key.data.connection:  # the rank's process went away
                fork = key.data
                events.unregister(fork.connection)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(fork.pid, signal.SIGKILL)
            else:  # the fork ended
                fork = key.data
                _, status = os.waitpid(fork.pid, 0)
                with contextlib.suppress(OSError):
                    fork.connection.send(
                        json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode()
                    )
                with contextlib.suppress(KeyError, ValueError):
                    events.unregister(fork.connection)
                events.unregister(fork.pidfd)
                os.close(fork.pidfd)
                forks.pop(fork.connection.fileno(), None)
                fork.connection.close()


def _preload_and_serve(listener: socket.socket) -> None:
    """Import what every rank needs, then serve; returns only in a fork, once its rank ended."""
    try:
        for module in PRELOAD:
            __import__(module)
        sys.modules["shardwise"].preload()
    except BaseException as e:  # the ranks then find no zygote and run in their own processes
        print(f"shardwise: zygote: cannot preload: {e!r}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if sys.modules["torch"].cuda.is_initialized():  # (a fork cannot use its parent's CUDA)
        print("shardwise: zygote: CUDA was initialised on import", file=sys.stderr, flush=True)
        raise SystemExit(1)
    argv = serve(listener)
    boot.run(argv)  # (in a fork: the rank)


def main() -> None:
    boot.die_with_parent()
    listener = socket.socket(fileno=int(sys.argv[1]))  # (bound by the launcher)
    sys.path[0] = os.getcwd()  # (not this folder: its modules would shadow top-level ones)
    _preload_and_serve(listener)


if __name__ == "__main__":
    main()
