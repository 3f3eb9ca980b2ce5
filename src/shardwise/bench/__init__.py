"""`shardwise bench SUITE`: launch the benchmark's ranks and print what rank 0 reports."""

from __future__ import annotations

import argparse

from shardwise.launcher import launch


def run_benchmark(args: argparse.Namespace) -> int:
    module = f"shardwise.bench.{args.suite}"
    argv = [module, "--models", args.models, "--steps", str(args.steps), "--reps", str(args.reps)]
    if args.out:
        argv += ["--out", args.out]
    launch(argv, args.world_size, threads_per_rank=None)
    return 0
