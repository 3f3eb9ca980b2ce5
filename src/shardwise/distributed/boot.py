"""What every process a shardwise launcher starts runs first: die with the launcher.

    python .../distributed/boot.py -m shardwise train ...    # a rank of `shardwise train`
    python .../distributed/boot.py SCRIPT ARGS...            # a rank of `shardwise run`

Run by its path, not as a module, so that nothing heavy is imported before the parent-death
signal is set: a launcher killed while its workers import torch (seconds; a minute for 64 ranks
under memory pressure) must not leave them running on. The launcher puts its pid in
`SHARDWISE_PARENT_PID` before it starts them, so a worker whose launcher died before the request
(its parent is then another process) sees it and leaves at once. Only the standard library is
imported here.
"""

from __future__ import annotations

import ctypes
import gc
import os
import runpy
import signal
import sys

PARENT_ENV = "SHARDWISE_PARENT_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux; elsewhere a no-op),
    and leave now if the parent this process was started by is already gone."""
    if not sys.platform.startswith("linux"):
        return
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


def main() -> None:
    die_with_parent()
    # Python put this file's folder, the package's own, first on the path: its modules must not
    # shadow top-level ones. What `python -m MODULE` or `python SCRIPT` would put there instead:
    args = sys.argv[1:]
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


if __name__ == "__main__":
    main()
