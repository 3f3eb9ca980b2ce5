"""Model-state memory per device for data parallel and ZeRO stages 1-3, before any run.

The first piece of the planner (issue #16): what each device holds of a model of P
parameters trained data-parallel over N devices, by the ZeRO paper's accounting (Rajbhandari et
al., 2020, section 3.1 and Figure 1):

    precision "mixed": parameters and gradients in fp16 (2 + 2 bytes each), and K = 12 bytes of
                       optimizer state per parameter (Adam's fp32 master copy, momentum and
                       variance)
    precision "fp32":  parameters and gradients in fp32 (4 + 4), K = 8 (momentum and variance)

    stage 0 (DP)  params + grads + K P              on every device
    stage 1       optimizer state / N
    stage 2       optimizer state and gradients / N
    stage 3       optimizer state, gradients and parameters / N

Communication per step per device follows the same paper (section 7): 2 P elements of
gradients for DP and stages 1-2 (all-reduce, or reduce-scatter + all-gather), 3 P for stage 3
(parameters gathered for forward and backward, gradients reduce-scattered).

`shardwise plan --params 7.5e9 --devices 64 --precision mixed [--json]` prints the four plans.
`shardwise plan --preset 70b --devices 1024` (or --layers --hidden ... or --spec FILE) prices
every strategy for a transformer on a cluster (`plan_search`) and ranks them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from shardwise.plan.search import (
    MAX_SIZE,
    MIN_RATE,
    PRESETS,
    Cluster,
    TransformerSpec,
    check_rate,
    check_size,
    divisors,
    search,
)

PRECISIONS = {  # name -> (bytes per parameter, per gradient, K: optimizer state per parameter)
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
}
STAGES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass(frozen=True)
class Plan:
    strategy: str
    devices: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    total_bytes: float
    comm_bytes_per_step: float  # sent and received by one device, per optimizer step


def model_states(params: float, devices: int, stage: int, precision: str = "mixed") -> Plan:
    """Bytes one device holds of parameters, gradients and optimizer state."""
    check_rate("params", params, least=1.0)
    check_size("devices", devices)
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {sorted(STAGES)}, got {stage}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    p_bytes, g_bytes, k = PRECISIONS[precision]
    shard = 1 / devices
    param_share = shard if stage >= 3 else 1
    grad_share = shard if stage >= 2 else 1
    optim_share = shard if stage >= 1 else 1
    held = (p_bytes * params * param_share, g_bytes * params * grad_share, k * params * optim_share)
    volume = (3 if stage == 3 else 2) * params * g_bytes if devices > 1 else 0.0
    return Plan(STAGES[stage], devices, *held, sum(held), volume)


def plans(params: float, devices: int, precision: str = "mixed") -> list[Plan]:
    return [model_states(params, devices, stage, precision) for stage in STAGES]


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
    """`shardwise plan`: model states of DP and ZeRO 1-3 (--params), or every strategy for a
    transformer on a cluster, ranked (--preset / --spec / --layers ...)."""
    try:
        read_numbers(args)
        if args.params is not None:
            return _model_states(args)
        if args.config is not None:
            return _plan_config(args)
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
        return 0
    _print_plans(spec, cluster, fits, rejected, elapsed, args.top)
    return 0 if fits else 1


def _spec_and_cluster(args: argparse.Namespace) -> tuple[TransformerSpec, Cluster]:
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
    cluster = Cluster(**{k: values[k] for k in CLUSTER_FLAGS if values.get(k) is not None})
    return spec, cluster


def _read_spec(path: str) -> dict:
    """The plan flags a YAML file sets, each checked (`number`); a null is left unset."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
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


def _plan_config(args: argparse.Namespace) -> int:
    """Every exact strategy for a config on `--nproc` ranks of this machine, ranked by the
    predicted step time at its calibration."""
    from shardwise.config import ConfigError, load_config
    from shardwise.plan import calibrate

    nproc = args.nproc or 2
    calibration = calibrate.load(nproc)
    if calibration is None:
        raise ValueError(
            f"no calibration for {nproc} ranks on this machine: run shardwise calibrate "
            f"--nproc {nproc}"
        )
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    started = time.perf_counter()
    rows = []
    for name, sets in config_candidates(cfg, nproc).items():
        predicted = price_config(args.config, [*args.set, *sets], nproc, calibration)
        memory = predicted["memory"]["total"] + (predicted["activations"] or 0)
        rows.append(
            {
                "strategy": name,
                "sets": sets,
                "batch_size": predicted["batch_size"],
                "memory_bytes": memory,
                "comm_bytes_per_step": predicted.get("comm_bytes_per_step", 0),
                "step_time_s": predicted["step_time_s"]["total"],
                "parts": predicted["step_time_s"],
            }
        )
    rows.sort(key=lambda r: r["step_time_s"])
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{args.config} on {nproc} ranks of this machine, {len(rows)} strategies priced in "
        f"{time.perf_counter() - started:.1f} s (rank 0: model state + activations; "
        f"{calibrate.age_note(calibration)})"
    )
    print(f"{'#':>3} {'strategy':22s} {'step ms':>8} {'memory MiB':>11} {'comm MiB':>9}")
    for i, row in enumerate(rows[: args.top], 1):
        print(
            f"{i:>3} {row['strategy']:22s} {1000 * row['step_time_s']:8.1f} "
            f"{row['memory_bytes'] / 2**20:11.1f} {row['comm_bytes_per_step'] / 2**20:9.2f}"
        )
    print(
        "run the first: shardwise train "
        + args.config
        + " --nproc "
        + str(nproc)
        + " "
        + " ".join(f"--set {kv}" for kv in [*args.set, *rows[0]["sets"]])
    )
    return 0


def _model_states(args: argparse.Namespace) -> int:
    if args.devices is None:
        raise ValueError("--params needs --devices")
    found = plans(args.params, args.devices, args.precision)
    if args.json:
        print(json.dumps([asdict(plan) for plan in found]))
        return 0
    print(f"{args.params:.3g} parameters on {args.devices} devices, {args.precision} precision")
    header = ("params", "grads", "optim", "total")
    print(f"{'strategy':8s} " + " ".join(f"{h:>9s}" for h in header) + f" {'comm/step':>10s}")
    for plan in found:
        gb = [plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes, plan.total_bytes]
        cells = " ".join(f"{b / 1e9:8.3f}G" for b in gb)
        print(f"{plan.strategy:8s} {cells} {plan.comm_bytes_per_step / 1e9:9.2f}G")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# ---- a config on this machine: every strategy shardwise runs, priced at the calibrated rates --
def config_candidates(cfg, nproc: int) -> dict[str, list[str]]:
    """Exact strategies for `cfg`'s model on `nproc` ranks, as --set overrides, each with and
    without activation checkpointing: DDP (native, ring), ZeRO 1-3, and where the model splits,
    tensor parallel, both pipeline schedules and dp x tp / dp x pp meshes."""
    from shardwise.jobs import build_job
    from shardwise.strategies.pipeline_stages import pipeline_layers

    model = build_job(cfg).model
    found = {
        "ddp": ["strategy.name=ddp"],
        "ddp-ring": ["strategy.name=ddp", "strategy.algorithm=ring"],
        **{f"zero{s}": ["strategy.name=zero", f"strategy.stage={s}"] for s in (1, 2, 3)},
    }
    heads = getattr(cfg.model, "n_head", 0) if cfg.model.name == "gpt" else 0
    try:
        layers = len(pipeline_layers(model))
    except ValueError:
        layers = 0
    for split in divisors(nproc)[1:]:
        dp = nproc // split
        if heads and heads % split == 0 and hasattr(model, "TP_PLAN"):
            found[f"tp{split}" if dp == 1 else f"dp{dp}-tp{split}"] = (
                ["strategy.name=tp"]
                if dp == 1
                else ["strategy.name=mesh", f"strategy.dp={dp}", f"strategy.tp={split}"]
            )
        if layers >= split and _pipelines(model, split):
            for schedule in ("gpipe", "1f1b"):
                name = f"pp{split}-{schedule}" if dp == 1 else f"dp{dp}-pp{split}-{schedule}"
                found[name] = (
                    ["strategy.name=pp", f"strategy.schedule={schedule}"]
                    if dp == 1
                    else [
                        "strategy.name=mesh",
                        f"strategy.dp={dp}",
                        f"strategy.pp={split}",
                        f"strategy.schedule={schedule}",
                    ]
                )
    with_ckpt = {
        f"{name}+ckpt": [*sets, "strategy.activation_checkpointing=true"]
        for name, sets in found.items()
        if cfg.model.name == "gpt"
    }
    return {**found, **with_ckpt}


def _pipelines(model, stages: int) -> bool:
    """Whether the model splits into `stages` stages that each hold parameters."""
    from shardwise.strategies.pipeline import Pipeline, check_stages
    from shardwise.strategies.pipeline_stages import pipeline_layers

    layers = pipeline_layers(model)
    try:
        check_stages(layers, [*Pipeline(stages=stages).stage_starts(layers), len(layers)])
    except ValueError:
        return False
    return True


def price_config(config: str, sets: list[str], nproc: int, calibration: dict) -> dict:
    """Predicted costs of `config` with `sets` on `nproc` ranks of this machine, at the global
    batch of the config's per-rank batch on every rank (model-parallel ranks share a batch)."""
    from shardwise.config import load_config
    from shardwise.jobs import build_job
    from shardwise.plan import costs, prediction, predictors

    base = load_config(config)
    cfg = load_config(config, [*sets, f"launch.nproc={nproc}"])
    replicas = predictors.replicas(cfg.strategy, nproc)
    global_batch = base.data.batch_size * nproc
    job = build_job(cfg)
    cost_job = costs.CostJob.of(job, cfg, nproc, 0, global_batch)
    predicted = prediction.for_run(cost_job, cfg.strategy, calibration)
    predicted["batch_size"] = global_batch // replicas  # per replica: what --set must say
    return predicted
