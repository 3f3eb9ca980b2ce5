"""The `shardwise` command's first lines: a job's zygote is forked from the launcher.

A command that starts a job's ranks on this machine (`train`, `run`) forks the job's zygote
(`distributed/zygote.py`) as soon as it has imported torch and the command line, before it
starts a thread: the zygote goes on to import torch's compiler stack and shardwise's names while
the launcher reads the config and starts torchrun's agent, and torch is imported once for the
two. Everything else goes straight to `cli.py`.
"""

from __future__ import annotations

import sys

from shardwise.distributed import zygote

LAUNCHING = ("train", "run")


def main() -> None:
    args = sys.argv[1:]
    from shardwise.cli import run  # (torch with it)

    if args[:1] and args[0] in LAUNCHING and not {"-h", "--help"} & set(args):
        zygote.fork_early()  # (its forks end in SystemExit there: none runs what follows)
    run()
