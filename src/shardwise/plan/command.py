"""`shardwise plan`: what a job needs and how fast it runs, before any run.

--params P --devices N         model states of DP and ZeRO 1-3 (`model_states`)
--preset / --spec / --layers   every strategy for a transformer on a cluster, priced by
                               closed formulas and ranked (`search`)
--config NAME --nproc N        every exact strategy for a config on this machine, priced by
                               its cost models at the calibrated rates (`config_plan`)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from shardwise.config import UniqueKeys
from shardwise.plan.config_plan import plan_config
from shardwise.plan.model_states import PRECISIONS, print_model_states
from shardwise.plan.search import (
    MAX_SIZE,
    MIN_RATE,
    PRESETS,
    ClusterSpec,
    TransformerSpec,
    check_rate,
    check_size,
    search,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # (Numbers are taken as text and read by `read_numbers`: argparse's own error for a bad
    # one is a usage screen, and its float() takes nan and inf.)
    model = parser.add_argument_group("model (model states only: --params)")
    model.add_argument("--params", help="model parameters, e.g. 7.5e9")
    model.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS))
    spec = parser.add_argument_group("transformer (every strategy, priced and ranked)")
    spec.add_argument("--preset", choices=sorted(PRESETS), help="a transformer spec by name")
    spec.add_argument("--spec", help="YAML file: a mapping of the flags below (model and cluster)")
    for name in ("layers", "hidden", "heads", "seq", "vocab", "batch", "ffn"):
        spec.add_argument(f"--{name}", help=SPEC_HELP[name])
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--devices", help="devices (data-parallel ones for --params)")
    cluster.add_argument("--memory-gb", help="memory per device (default 80)")
    cluster.add_argument("--network-gbit", help="per device across nodes (400)")
    cluster.add_argument("--tflops", help="sustained bf16 TFLOP/s per device (400)")
    cluster.add_argument("--devices-per-node", help="devices sharing NVLink (8)")
    machine = parser.add_argument_group("a config on this machine (priced at its calibration)")
    machine.add_argument("--config", help="a built-in config or YAML file, e.g. tiny_gpt")
    machine.add_argument("--nproc", help="ranks (calibrate them first)")
    machine.add_argument("--set", action="append", default=[], help="key=value overrides")
    parser.add_argument("--top", default="10", help="plans shown in the table")
    parser.add_argument("--runnable", action="store_true", help="only plans shardwise runs")
    parser.add_argument("--json", action="store_true", help="one JSON list of plans")


SPEC_HELP = {
    "layers": "transformer blocks",
    "hidden": "hidden size",
    "heads": "attention heads",
    "seq": "sequence length",
    "vocab": "vocabulary size",
    "batch": "sequences per optimizer step (global batch)",
    "ffn": "MLP hidden units (default 4 x hidden)",
}
CLUSTER_FLAGS = ("devices", "memory_gb", "network_gbit", "tflops", "devices_per_node")
# Numbers a plan takes: whole ones (sizes and counts), and amounts with the least each may be.
WHOLE = (*SPEC_HELP, "devices", "devices_per_node", "nproc", "top")
AMOUNTS = {"params": 1.0, "memory_gb": MIN_RATE, "network_gbit": MIN_RATE, "tflops": MIN_RATE}


def number(key: str, value: object, name: str) -> int | float:
    """The plan's number `key` (one of WHOLE or AMOUNTS) from `value`, a flag's text or a
    YAML value: a whole number from 1 to MAX_SIZE (1e9 and 1000000000 alike), or a finite
    amount; else a one-line ValueError naming it `name`."""
    if isinstance(value, str):
        value = _parsed(value)
    if key in WHOLE:
        if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_SIZE:
            value = int(value)
        return check_size(name, value)
    return check_rate(name, value, least=AMOUNTS[key])


def _parsed(text: str) -> int | float | str:
    for kind in (int, float):  # (int first: exact, at any size)
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_numbers(args: argparse.Namespace) -> None:
    """Replace each numeric flag's text in `args` by its number (`number`)."""
    for name in (*WHOLE, *AMOUNTS):
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            setattr(args, name, number(name, getattr(args, name), flag))


def run(args: argparse.Namespace) -> int:
    """`shardwise plan`: model states of DP and ZeRO 1-3 (--params), every exact strategy for
    a config on this machine (--config), or every strategy for a transformer on a cluster,
    ranked (--preset / --spec / --layers ...)."""
    try:
        read_numbers(args)
        _one_question(args)
        if args.params is not None:
            if args.devices is None:
                raise ValueError("--params needs --devices")
            print_model_states(args.params, args.devices, args.precision, args.json)
            return 0
        if args.config is not None:
            return plan_config(args.config, args.set, args.nproc or 2, args.json, args.top)
        spec, cluster = _spec_and_cluster(args)
        started = time.perf_counter()
        fits, rejected = search(spec, cluster)  # (a ValueError where it would take long)
    except (ValueError, OSError) as e:
        print(f"shardwise: plan: {(str(e) or type(e).__name__).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.runnable:
        fits = [p for p in fits if not p.unsupported]
        rejected = [p for p in rejected if not p.unsupported]
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps([p.as_dict() for p in fits + rejected]))
    else:
        _print_plans(spec, cluster, fits, rejected, elapsed, args.top)
    return 0 if fits else 1  # (the same answer whatever the output's form)


def _one_question(args: argparse.Namespace) -> None:
    """The flags given ask one of the three questions (`run`): else a one-line `ValueError`
    naming those another one reads, which would be ignored in silence."""

    def given(names) -> list[str]:
        return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, [])]

    transformer = given(("preset", "spec", *SPEC_HELP))
    others = transformer + given((*CLUSTER_FLAGS[1:], "config", "nproc", "set"))
    if args.params is not None and others:  # (it reads --devices alone of the cluster's)
        raise ValueError(f"--params prices model states alone: not with {', '.join(others)}")
    if args.config is not None and (others := transformer + given(CLUSTER_FLAGS)):
        raise ValueError(
            f"--config prices the config on this machine: not with {', '.join(others)}"
        )
    if args.config is None and (others := given(("nproc", "set"))):
        raise ValueError(f"{', '.join(others)}: only with --config")


def _spec_and_cluster(args: argparse.Namespace) -> tuple[TransformerSpec, ClusterSpec]:
    values: dict = {}
    if args.preset:
        values.update(asdict(PRESETS[args.preset]))
    if args.spec:
        values.update(_read_spec(args.spec))
    for name in (*SPEC_HELP, *CLUSTER_FLAGS):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    missing = [n for n in (*SPEC_HELP, "devices") if n != "ffn" and values.get(n) is None]
    if missing:
        raise ValueError(
            "need --params (model states), or a transformer and devices: missing "
            + ", ".join(f"--{n}" for n in missing)
        )
    spec = TransformerSpec(**{k: values[k] for k in SPEC_HELP if values.get(k) is not None})
    cluster = ClusterSpec(**{k: values[k] for k in CLUSTER_FLAGS if values.get(k) is not None})
    return spec, cluster


def _read_spec(path: str) -> dict:
    """The plan flags a YAML file sets, each checked (`number`); a null is left unset."""
    try:
        loaded = yaml.load(Path(path).read_text(), Loader=UniqueKeys) or {}
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ValueError(f"{path}: not YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must hold a mapping of plan flags")
    known = set(SPEC_HELP) | set(CLUSTER_FLAGS)
    unknown = sorted(set(loaded) - known, key=str)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown} (known: {sorted(known)})")
    return {k: number(k, v, f"{path}: {k}") for k, v in loaded.items() if v is not None}


def _print_plans(spec, cluster, fits, rejected, elapsed: float, top: int) -> None:
    print(
        f"{spec.params() / 1e9:.1f}B-parameter transformer (L={spec.layers}, h={spec.hidden}, "
        f"s={spec.seq}, batch {spec.batch}) on {cluster.devices} devices of "
        f"{cluster.memory_gb:g} GB, {cluster.network_gbit:g} Gbit/s, {cluster.tflops:g} TFLOP/s: "
        f"{len(fits)} plans fit, {len(rejected)} do not ({1000 * elapsed:.0f} ms)"
    )
    if not fits and not rejected:  # (no mesh at all: say what one needs)
        print(
            f"no dp x tp x pp makes {cluster.devices} devices with dp dividing the batch "
            f"({spec.batch}), tp the heads ({spec.heads}; 64 at most) and pp at most the "
            f"layers ({spec.layers})"
        )
        return
    header = f"{'#':>3} {'strategy':40s} {'step s':>8} {'mem GB':>7} {'act GB':>7} {'comm GB':>8}"
    print(header + "  shardwise")
    for i, plan in enumerate(fits[:top], 1):
        comm = sum(plan.comm_bytes.values()) / 1e9
        print(
            f"{i:>3} {plan.strategy:40s} {plan.step_time_s:8.3f} "
            f"{plan.memory['total'] / 1e9:7.1f} {plan.memory['activations'] / 1e9:7.1f} "
            f"{comm:8.2f}  {'yes' if not plan.unsupported else 'no: ' + plan.unsupported}"
        )
    if rejected:
        closest = min(rejected, key=lambda p: p.memory["total"])
        print(f"rejected, e.g. the closest to fitting: {closest.strategy}: {closest.reason}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
