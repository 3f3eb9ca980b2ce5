"""Ours vs FSDP2 and DeepSpeed; the same as `shardwise bench zero` (see src/shardwise/bench)."""

import sys

from shardwise.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "zero", *sys.argv[1:]]))
