"""The `shardwise` command line.

    shardwise train [CONFIG] [--nproc N] [--set key=value ...]   # launches N local ranks
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m shardwise train CONFIG                                 # same job on several machines
    shardwise run --nproc 2 my_script.py [ARGS]                   # your own script
    shardwise bench ddp --world-size 2                            # ours vs torch DDP
    shardwise bench zero --world-size 2                           # DDP, ZeRO-1/2/3 vs FSDP2
    shardwise bench comm --models gpt --steps 60 --rate 100mbit   # codecs on an emulated network
    shardwise bench backups                                       # PS backup workers, straggler
    shardwise bench faults                                        # recovery, stall, hang times
    shardwise bench balance                                       # per-rank batches, slow rank
    shardwise bench packing                                       # packed vs padded documents
    shardwise bench largebatch                                    # LARS/LAMB at 64x the batch
    shardwise bench overhead                                      # cost of the measurements
    shardwise bench calls --world-size 2                          # our comm layer, per call
    shardwise bench all [--quick]                                 # every strategy, one report
    shardwise bench planner [--quick] [--reps R] [--models M]     # predicted vs measured
    shardwise report RUN_DIR [RUN_DIR ...] [-o report.html]       # one page comparing runs
    shardwise plan --params 7.5e9 --devices 64 [--json]           # model states per device
    shardwise plan --preset 70b --devices 1024 [--json]           # every strategy, ranked
    shardwise calibrate --nproc 4                                 # rates for the step-time model
    shardwise export CHECKPOINT out.safetensors                   # full fp32 weights
    shardwise export CHECKPOINT hf-folder --hf                    # for from_pretrained
    shardwise configs                                             # the built-in configs
    shardwise config zero                                         # every field, its default

Inside a worker process (torchrun's environment is set), `train` runs the job in-process;
otherwise it validates the config, creates the run directory and launches the workers.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from shardwise.arguments import our_refusal
from shardwise.config import BUILTIN_CONFIGS, ConfigError, load_config
from shardwise.distributed.boot import in_rank
from shardwise.plan import calibrate as calibrate_module
from shardwise.plan import command as planner


def _quiet_torch_elastic() -> None:
    # The agent logs every rendezvous step at INFO, a multi-screen report on failure and a
    # warning on each stop signal; our own one-line error or stop line says what happened.
    # Its modules set their own loggers' levels as they are imported: imported first, so
    # that every one of them is quieted here.
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401

    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher")
    for name in [*prefixes, *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _config_source(args: argparse.Namespace) -> str | None:
    """The config to train with: CONFIG; with `--resume RUN_DIR` and no CONFIG, the run's own
    RUN_DIR/config.yaml (`--set` applies over either, and a resume says which it uses)."""
    if not args.resume:  # no resume, or a restarted rank (its launcher passes the config)
        return args.config
    run = Path(args.resume)
    if not run.is_dir():
        raise ConfigError(f"--resume: no run directory {args.resume}")
    if args.config is None and not (run / "config.yaml").is_file():
        raise ConfigError(f"--resume {args.resume}: it has no config.yaml; give the run's CONFIG")
    if os.environ.get("RANK", "0") == "0":  # (under torchrun: one line for the job)
        sets = f" and --set {' '.join(args.set)}" if args.set else ""
        base = f"{args.config} (not its config.yaml)" if args.config else "its own config.yaml"
        print(f"shardwise: resuming {args.resume} with {base}{sets}", flush=True)
    return args.config or str(run / "config.yaml")


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.set or [])
    if args.nproc is not None:
        overrides.append(f"launch.nproc={args.nproc}")
    if args.max_restarts is not None:
        overrides.append(f"launch.max_restarts={args.max_restarts}")
    cfg = load_config(_config_source(args), overrides)
    if in_rank():  # a rank of the job (under our launcher, or torchrun on any machine)
        import shardwise as sw
        from shardwise.distributed.boot import die_with_parent
        from shardwise.launch.job_runner import train_rank

        die_with_parent()
        try:
            train_rank(cfg, args.resume or args.run_dir, resume=args.resume is not None)
        finally:
            sw.shutdown()
        return 0
    from shardwise.launch.job_runner import fit_ranks, run_job

    _quiet_torch_elastic()
    run_dir, resume = args.run_dir, args.resume is not None
    if run_dir == "":  # (not "none given": the default would write runs/ here)
        raise ConfigError("--run-dir: an empty path (give a directory, or leave --run-dir out)")
    if resume:
        if not args.resume:
            raise ConfigError("--resume: which run directory? (--resume RUN_DIR)")
        if run_dir is not None and Path(run_dir).resolve() != Path(args.resume).resolve():
            raise ConfigError(
                f"--resume {args.resume} goes on in its own run directory: leave --run-dir out"
            )
        run_dir = args.resume
    return run_job(fit_ranks(cfg, nproc_given=args.nproc is not None), run_dir, resume)


def cmd_run(args: argparse.Namespace) -> int:
    from shardwise.distributed.launcher import launch_script

    _quiet_torch_elastic()
    launch_script(
        args.script,
        args.args,
        args.nproc,
        args.threads_per_rank,
        args.hang_timeout,
        bind_cores=args.bind_cores,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from shardwise.bench.suites import run_benchmark

    _quiet_torch_elastic()
    return run_benchmark(args)


def cmd_report(args: argparse.Namespace) -> int:
    from shardwise.observe.report import main as report_main

    argv = [*args.runs, *(["--out", args.out] if args.out else [])]
    return report_main(argv + (["--screenshot", args.screenshot] if args.screenshot else []))


def cmd_export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.hf_export import export_hf
    from shardwise.checkpoint.reshardable import export_checkpoint

    if args.hf or args.hf_config:
        out = export_hf(args.checkpoint, args.out, args.hf_config)
        print(f"shardwise: wrote a Hugging Face model folder (config.json, safetensors) to {out}")
        return 0
    out = export_checkpoint(args.checkpoint, args.out)
    print(f"shardwise: wrote full fp32 weights to {out}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Every field of a config section (or of a strategy's section), with default and meaning."""
    from shardwise.config import describe_section, section_names

    if args.section is None:
        print("sections: " + ", ".join(section_names()))
        print("strategies (strategy.name): " + ", ".join(section_names(strategies=True)))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    title, rows = describe_section(args.section)
    table = Table(title=title)
    for column in ("field", "type", "default", "description"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console = Console()
    (console if console.is_terminal else Console(width=140)).print(table)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from shardwise.plan.command import run

    return run(args)


def cmd_configs(_: argparse.Namespace) -> int:
    for path in sorted(BUILTIN_CONFIGS.glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ")
        print(f"{path.stem:10s} {first}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line like every other bad input (not the usage)."""

    def error(self, message: str):
        self.exit(2, f"shardwise: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardwise", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # (in this order in --help)
    for add_command in (_add_train, _add_bench, _add_run, _add_report, _add_export, _add_config):
        add_command(sub)
    for add_command in (_add_plan, _add_calibrate, _add_configs):
        add_command(sub)
    return parser


def _add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="run a training job")
    train.add_argument("config", nargs="?", help="YAML file or built-in name (default: digits)")
    train.add_argument("--nproc", type=int, help="local ranks (overrides launch.nproc)")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    train.add_argument("--run-dir", help="run directory (default: runs/<name>-<time>)")
    train.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest complete checkpoint, with the run's "
        "own config.yaml unless CONFIG is given (--set applies over either)",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        help="restart after a failed rank, resuming (launch.max_restarts)",
    )
    train.set_defaults(func=cmd_train)


def _at_least_one(text: str) -> int:
    """A flag's whole number >= 1 (argparse's one-line usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark ours against the torch rival")
    bench.add_argument(
        "suite",
        choices=[
            *("ddp", "zero", "comm", "pipeline", "tp", "ps", "backups", "faults", "balance"),
            "packing",
            *("overhead", "calls", "largebatch", "all", "planner"),
        ],
        help="what to benchmark",
    )
    bench.add_argument(
        "--world-size",
        type=_at_least_one,
        help="ranks (default 2; ddp, zero, pipeline, tp, calls, comm and overhead)",
    )
    bench.add_argument(
        "--models", default="mlp,gpt", help="comma-separated: mlp, gpt (planner: also mlp-small)"
    )
    bench.add_argument("--steps", type=_at_least_one, help="timed steps per repetition (per suite)")
    bench.add_argument("--reps", type=_at_least_one, help="interleaved repetitions (per suite)")
    bench.add_argument("--out", help="JSON result file (comm: output directory)")
    bench.add_argument(
        "--no-bind-cores",
        dest="bind_cores",
        action="store_false",
        help="ddp, zero, pipeline, tp, calls, overhead at one rank: leave the ranks unbound "
        "(by default each runs on cores of its own, as on a machine it has to itself)",
    )
    bench.add_argument("--rate", default="100mbit", help="comm: emulated link bandwidth")
    bench.add_argument("--target-loss", type=float, help="comm: loss to reach (per model)")
    bench.add_argument(
        "--variants", help="balance: equal, weighted, dynamic, queue; comm: its variants (commas)"
    )
    bench.add_argument(
        "--confirm", type=int, help="planner: fresh runs of the top choice and the 3 fastest"
    )
    bench.add_argument(
        "--quick", action="store_true", help="all: fewer steps and strategies; planner: 4 ranks"
    )
    bench.add_argument(
        "--strategies", help="planner: only these candidates (commas, as `plan --config` names)"
    )
    bench.add_argument(
        "--stored-calibration",
        action="store_true",
        help="planner: price every run with the stored calibration (no fresh one per round)",
    )
    bench.set_defaults(func=cmd_bench)


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run your own script on N local ranks (like torchrun)")
    run.add_argument("--nproc", type=int, default=2, help="local ranks")
    run.add_argument("--threads-per-rank", type=int, help="default: cores / ranks")
    run.add_argument(
        "--bind-cores",
        action="store_true",
        help="run each rank on cores of its own (steadier times where the job has the "
        "machine to itself)",
    )
    run.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="a collective unfinished this long (or a rank that left early) ends every rank "
        "with a report naming the rank that hangs (default 60)",
    )
    run.add_argument("script", help="a Python file that calls shardwise.init()")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(func=cmd_run)


def _add_report(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="one offline HTML page (and Markdown) comparing runs")
    report.add_argument("runs", nargs="+", help="run directories")
    report.add_argument("-o", "--out", help="HTML file (default: RUN_DIR/report.html, the first)")
    report.add_argument("--screenshot", help="also a PNG of the page, by headless Chromium")
    report.set_defaults(func=cmd_report)


def _add_export(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="consolidate a checkpoint into one safetensors file")
    export.add_argument("checkpoint", help="a checkpoint directory (sharded or final)")
    export.add_argument("out", help="output .safetensors path (with --hf: a folder)")
    export.add_argument(
        "--hf",
        action="store_true",
        help="write a Hugging Face folder (config.json + safetensors) for from_pretrained",
    )
    export.add_argument(
        "--hf-config",
        metavar="PATH",
        help="the config.json to write with it (default: the one its run recorded); implies --hf",
    )
    export.set_defaults(func=cmd_export)


def _add_config(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="every field of a config section, with its default")
    config.add_argument(
        "section", nargs="?", help="data, model, optim, train, launch or a strategy name (zero)"
    )
    config.set_defaults(func=cmd_config)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="every strategy for a transformer on a cluster, priced and ranked (--params: "
        "ZeRO's model states)",
    )
    planner.add_arguments(plan)
    plan.set_defaults(func=cmd_plan)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    calibrate = sub.add_parser(
        "calibrate", help="measure compute and communication rates for the step-time model"
    )
    calibrate_module.add_arguments(calibrate)
    calibrate.set_defaults(func=lambda args: calibrate_module.run(args))


def _add_configs(sub: argparse._SubParsersAction) -> None:
    configs = sub.add_parser("configs", help="list the built-in configs")
    configs.set_defaults(func=cmd_configs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as e:
        if not (isinstance(e, ConfigError) or our_refusal(e)):  # (a user's code raised it)
            traceback.print_exc()
            return 1
        print(f"shardwise: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # launch failures: the worker printed its own traceback
        from shardwise.distributed.launcher import LaunchError

        if isinstance(e, LaunchError):
            print(f"shardwise: {e}", file=sys.stderr)
            return e.exit_code
        raise


def run() -> NoReturn:
    """The `shardwise` command (and `python -m shardwise`): `main`, then `exit_now`."""
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code
    exit_now(code)


def exit_now(code: int | str | None) -> NoReturn:
    """End the process with `code` as `sys.exit` would, without the interpreter's teardown.

    What exit runs that matters is run here: non-daemon threads are joined, the atexit
    handlers run (logging, multiprocessing, the job store's), stdout and stderr are flushed.
    What is skipped is the collection of every object and torch's C++ destructors: 0.75 s per
    rank of every job and 0.4 s per command, measured on 2 cores, for nothing (the process is
    ending; each file of ours is closed where it is written)."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    run()
