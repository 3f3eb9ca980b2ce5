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
Activations, tensor and pipeline parallel, and step time are the rest of #16, not here.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

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
    if params <= 0 or devices < 1:
        raise ValueError(f"need params > 0 and devices >= 1, got {params} and {devices}")
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
    parser.add_argument("--params", type=float, required=True, help="model parameters, e.g. 7.5e9")
    parser.add_argument("--devices", type=int, required=True, help="data-parallel devices")
    parser.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS))
    parser.add_argument("--json", action="store_true", help="one JSON list of plans")


def run(args: argparse.Namespace) -> int:
    """`shardwise plan`: the four plans as a table, or as JSON."""
    try:
        found = plans(args.params, args.devices, args.precision)
    except ValueError as e:
        print(f"shardwise: plan: {e}", file=sys.stderr)
        return 2
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
