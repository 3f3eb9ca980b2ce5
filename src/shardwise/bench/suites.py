"""`shardwise bench SUITE`: which suite runs how, with what defaults."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.bench.whole_jobs import default_out
from shardwise.distributed.launcher import launch

# (timed steps per repetition, repetitions) when the command line does not say
DEFAULTS = {
    "ddp": (10, 5),
    "zero": (10, 5),
    "comm": (60, 1),
    "pipeline": (5, 4),
    "tp": (5, 3),
    "ps": (150, 1),
    "backups": (300, 1),
    "faults": (60, 2),
    "balance": (60, 5),
    "packing": (2, 4),
    "overhead": (150, 4),
    "calls": (10_000, 3),  # (calls each way, repetitions)
}


# The suites that run on `--world-size` ranks (the others run jobs of their own making).
SIZED = {"ddp", "zero", "pipeline", "tp", "calls", "comm", "overhead"}


def run_benchmark(args: argparse.Namespace) -> int:
    """Run `args.suite`, whose module is `shardwise.bench.<suite>_bench` (all: `everything`)."""
    if args.world_size is not None and args.suite not in SIZED:
        print(
            f"shardwise: bench {args.suite} does not take --world-size (it runs jobs of its "
            f"own sizes); the suites that do: {', '.join(sorted(SIZED))}",
            file=sys.stderr,
        )
        return 2
    args.world_size = args.world_size or 2
    if args.out:  # (made before the benchmark runs, not found missing after it)
        try:
            Path(args.out).expanduser().absolute().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"shardwise: bench: cannot write to --out {args.out}: {e}", file=sys.stderr)
            return 2
    if args.suite == "all":  # every strategy, a scaling series, one report
        from shardwise.bench.everything import main as everything_main

        argv = ["--out", args.out or default_out("all")]
        argv += ["--quick"] if args.quick else []
        return everything_main(argv + (["--steps", str(args.steps)] if args.steps else []))
    if args.suite == "planner":
        return run_planner_benchmark(args)
    if args.suite == "largebatch":  # one process: the recipe's accuracies
        from shardwise.bench.largebatch_bench import main as largebatch_main

        return largebatch_main(["--out", args.out] if args.out else [])
    steps, reps = DEFAULTS[args.suite]
    if not (args.suite == "overhead" and args.world_size == 1):
        args.steps, args.reps = args.steps or steps, args.reps or reps
    if args.suite == "comm":
        return run_comm_benchmark(args)
    if args.suite == "overhead" and args.world_size == 1:  # every strategy vs plain torch
        argv = ["shardwise.bench.one_rank_bench", "--models", args.models]
        argv += ["--steps", str(args.steps or 10), "--reps", str(args.reps or 5)]
        argv += ["--out", args.out] if args.out else []
        launch(argv, 1, threads_per_rank=None, bind_cores=args.bind_cores)
        return 0
    if args.suite in ("ps", "backups", "faults", "packing", "balance", "overhead"):
        return run_own_jobs_benchmark(args)
    module = f"shardwise.bench.{args.suite}_bench"  # one process per rank, launched here
    argv = [module, "--steps", str(args.steps), "--reps", str(args.reps)]
    if args.suite in ("ddp", "zero"):
        argv += ["--models", args.models]
    if args.out:
        argv += ["--out", args.out]
    launch(argv, args.world_size, threads_per_rank=None, bind_cores=args.bind_cores)
    return 0


def run_planner_benchmark(args: argparse.Namespace) -> int:
    """Whole jobs, each beside its prediction."""
    from shardwise.bench.planner_bench import main as planner_main

    argv = ["--out", args.out or default_out("planner")]
    argv += ["--quick"] if args.quick else []
    argv += ["--repeats", str(args.reps)] if args.reps else []
    argv += ["--models", args.models]
    argv += ["--confirm", str(args.confirm)] if args.confirm is not None else []
    argv += ["--strategies", args.strategies] if args.strategies else []
    argv += ["--stored-calibration"] if args.stored_calibration else []
    return planner_main(argv + (["--steps", str(args.steps)] if args.steps else []))


def run_own_jobs_benchmark(args: argparse.Namespace) -> int:
    """The suites that run in this process and start their own jobs (or none: packing)."""
    if args.suite == "ps":  # one job per variant
        from shardwise.bench.ps_bench import main

        return main(["--steps", str(args.steps), "--out", args.out or default_out("ps")])
    if args.suite == "backups":  # one job per variant and seed, interleaved
        from shardwise.bench.backups_bench import main as backups_main

        return backups_main(
            ["--steps", str(args.steps), "--out", args.out or default_out("backups")]
        )
    if args.suite == "faults":  # each job with its fault
        from shardwise.bench.faults_bench import main as faults_main

        argv = ["--steps", str(args.steps), "--repeats", str(args.reps)]
        return faults_main([*argv, "--out", args.out or default_out("faults")])
    argv = ["--steps", str(args.steps), "--reps", str(args.reps)]
    if args.suite == "packing":  # one process, both variants on the same documents
        from shardwise.bench.packing_bench import main as packing_main

        return packing_main([*argv, "--out", args.out] if args.out else argv)
    if args.suite == "balance":  # one job per variant and world size
        from shardwise.bench.balance_bench import main as balance_main

        if args.variants:
            argv += ["--variants", args.variants]
        return balance_main([*argv, "--out", args.out or default_out("balance")])
    from shardwise.bench.overhead_bench import main as overhead_main  # whole jobs, measured and not

    argv += ["--nproc", str(args.world_size)]
    return overhead_main([*argv, "--out", args.out or default_out("overhead")])


def run_comm_benchmark(args: argparse.Namespace) -> int:
    """On an emulated cluster (one host per rank) when namespaces are available."""
    from shardwise.distributed import emulated_cluster

    argv = ["--model", args.models.split(",")[0], "--steps", str(args.steps)]
    argv += ["--out-dir", args.out or default_out("comm")]
    if args.target_loss:
        argv += ["--target-loss", str(args.target_loss)]
    if args.variants:  # e.g. ddp,fp16,torch_fp16_hook,powersgd_r4,torch_powersgd_r4
        argv += ["--variants", args.variants]
    if not emulated_cluster.available():
        print("shardwise: no network namespaces here: measuring on loopback instead")
        launch(["shardwise.bench.comm_bench", *argv, "--network", "loopback"], args.world_size)
        return 0
    argv += ["--network", f"{args.world_size} hosts at {args.rate}"]
    with emulated_cluster.emulated(args.world_size, args.rate) as cluster:
        codes = cluster.run(argv, module="shardwise.bench.comm_bench", timeout=3600)
    return max(codes)
