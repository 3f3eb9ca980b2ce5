"""What every worker process of a local job does first: die with the process that started it.

`shardwise train` and `shardwise run` start their ranks with torchrun's agent, and the parameter
server's supervisor starts its roles itself. If that parent is killed (even with SIGKILL, which
it cannot handle), Linux's parent-death signal ends the workers too, instead of leaving them
training with parent pid 1. `python -m shardwise.worker SCRIPT ARGS...` runs a user's script
that way (what `shardwise run` launches).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request: follow it now
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    die_with_parent()
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
