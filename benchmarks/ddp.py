"""Ours vs torch DDP; the same as `shardwise bench ddp` (see src/shardwise/bench/ddp_bench.py)."""

import sys

from shardwise.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ddp", *sys.argv[1:]]))
