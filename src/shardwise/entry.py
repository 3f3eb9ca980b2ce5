"""The `shardwise` command's first lines: a job's zygote starts before anything heavy loads.

A command that starts a job's ranks on this machine (`train`, `run`) starts the job's zygote
(`distributed/zygote.py`) before it imports torch, so that the two imports run side by side on
two cores instead of one after the other; everything else goes straight to `cli.py`.
"""

from __future__ import annotations

import sys

from shardwise.distributed import zygote

LAUNCHING = ("train", "run")


def main() -> None:
    args = sys.argv[1:]
    if args[:1] and args[0] in LAUNCHING and not {"-h", "--help"} & set(args):
        zygote.start_early(args)
    from shardwise.cli import run

    run()
