"""The `shardwise` command line.

    shardwise train [CONFIG] [--nproc N] [--set key=value ...]   # launches N local ranks
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m shardwise train CONFIG                                 # same job on several machines
    shardwise run --nproc 2 my_script.py [ARGS]                   # your own script
    shardwise bench ddp --world-size 2                            # ours vs torch DDP
    shardwise bench zero --world-size 2                           # DDP, ZeRO-1/2/3 vs FSDP2
    shardwise bench comm --models gpt --steps 60 --rate 100mbit   # codecs on an emulated network
    shardwise export CHECKPOINT out.safetensors                   # full fp32 weights
    shardwise configs                                             # the built-in configs

Inside a worker process (torchrun's environment is set), `train` runs the job in-process;
otherwise it validates the config, creates the run directory and launches the workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import datetime
from pathlib import Path

from shardwise.config import (
    BUILTIN_CONFIGS,
    ConfigError,
    dump_config,
    load_config,
    ranks_needed,
)


def _in_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _quiet_torch_elastic() -> None:
    # The agent logs every rendezvous step at INFO and a multi-screen report on failure;
    # our own one-line error says what failed.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.ERROR)


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.set or [])
    if args.nproc is not None:
        overrides.append(f"launch.nproc={args.nproc}")
    cfg = load_config(args.config, overrides)
    needed = ranks_needed(cfg.strategy)
    if cfg.strategy.name == "ps" and args.nproc is None:  # the processes are the roles
        cfg = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"nproc": needed})})
    if needed is not None and not _in_worker() and needed != cfg.launch.nproc:
        raise ConfigError(
            f"config error: strategy {cfg.strategy.name!r} needs {needed} ranks, "
            f"but launch.nproc is {cfg.launch.nproc}"
        )
    if _in_worker():
        import shardwise as sw
        from shardwise.trainer import train

        try:
            train(cfg, args.run_dir)
        finally:
            sw.shutdown()
        return 0
    from shardwise.launcher import launch

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or Path(cfg.launch.runs_dir) / f"{cfg.name}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "config.yaml"
    resolved.write_text(dump_config(cfg))
    print(f"shardwise: {cfg.name} on {cfg.launch.nproc} rank(s), run directory {run_dir}")
    if cfg.strategy.name == "ps":  # a supervisor of our own: one dead worker must not end it
        from shardwise.ps.launch import run_ps_job

        return run_ps_job(cfg, resolved, run_dir)
    _quiet_torch_elastic()
    launch(
        ["shardwise", "train", str(resolved), "--run-dir", str(run_dir)],
        cfg.launch.nproc,
        cfg.launch.threads_per_rank,
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from shardwise.launcher import launch_script

    _quiet_torch_elastic()
    launch_script(args.script, args.args, args.nproc, args.threads_per_rank)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from shardwise.bench import run_benchmark

    _quiet_torch_elastic()
    return run_benchmark(args)


def cmd_export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out)
    print(f"shardwise: wrote full fp32 weights to {out}")
    return 0


def cmd_configs(_: argparse.Namespace) -> int:
    for path in sorted(BUILTIN_CONFIGS.glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ")
        print(f"{path.stem:10s} {first}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training job")
    train.add_argument("config", nargs="?", help="YAML file or built-in name (default: digits)")
    train.add_argument("--nproc", type=int, help="local ranks (overrides launch.nproc)")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    train.add_argument("--run-dir", help="run directory (default: runs/<name>-<time>)")
    train.set_defaults(func=cmd_train)

    bench = sub.add_parser("bench", help="benchmark ours against the torch rival")
    bench.add_argument(
        "suite",
        choices=["ddp", "zero", "comm", "pipeline", "tp", "ps"],
        help="what to benchmark",
    )
    bench.add_argument("--world-size", type=int, default=2, help="ranks")
    bench.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt")
    bench.add_argument("--steps", type=int, help="timed steps per repetition (per suite)")
    bench.add_argument("--reps", type=int, help="interleaved repetitions (per suite)")
    bench.add_argument("--out", help="JSON result file (comm: output directory)")
    bench.add_argument("--rate", default="100mbit", help="comm: emulated link bandwidth")
    bench.add_argument("--target-loss", type=float, help="comm: loss to reach (per model)")
    bench.set_defaults(func=cmd_bench)

    run = sub.add_parser("run", help="run your own script on N local ranks (like torchrun)")
    run.add_argument("--nproc", type=int, default=2, help="local ranks")
    run.add_argument("--threads-per-rank", type=int, help="default: cores / ranks")
    run.add_argument("script", help="a Python file that calls shardwise.init()")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(func=cmd_run)

    export = sub.add_parser("export", help="consolidate a checkpoint into one safetensors file")
    export.add_argument("checkpoint", help="a checkpoint directory (sharded or final)")
    export.add_argument("out", help="output .safetensors path")
    export.set_defaults(func=cmd_export)

    configs = sub.add_parser("configs", help="list the built-in configs")
    configs.set_defaults(func=cmd_configs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        print(f"shardwise: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # launch failures: the worker printed its own traceback
        from shardwise.launcher import LaunchError

        if isinstance(e, LaunchError):
            print(f"shardwise: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
