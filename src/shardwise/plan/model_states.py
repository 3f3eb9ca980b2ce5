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

`shardwise plan --params 7.5e9 --devices 64 --precision mixed [--json]` prints the four.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from shardwise.plan.search import check_rate, check_size

PRECISIONS = {  # name -> (bytes per parameter, per gradient, K: optimizer state per parameter)
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
}
STAGES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass(frozen=True)
class ModelStates:
    """What one device holds of a model's state under one ZeRO stage, and sends per step."""

    strategy: str
    devices: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    total_bytes: float
    comm_bytes_per_step: float  # sent by one device per optimizer step (as many received)


def model_states(params: float, devices: int, stage: int, precision: str = "mixed") -> ModelStates:
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
    # A ring all-reduce sends 2 (N-1)/N of the gradients; ZeRO-3 a third more, its gathers
    # (the ZeRO paper's 2Ψ and 3Ψ are the large-N figures; comm accounting counts the same).
    volume = (3 if stage == 3 else 2) * params * g_bytes * (devices - 1) / devices
    return ModelStates(STAGES[stage], devices, *held, sum(held), volume)


def plans(params: float, devices: int, precision: str = "mixed") -> list[ModelStates]:
    """The model states of DP and of ZeRO stages 1-3."""
    return [model_states(params, devices, stage, precision) for stage in STAGES]


def print_model_states(params: float, devices: int, precision: str, as_json: bool) -> None:
    """The four stages' model states, as a table or one JSON list."""
    found = plans(params, devices, precision)
    if as_json:
        print(json.dumps([asdict(plan) for plan in found]))
        return
    print(f"{params:.3g} parameters on {devices} devices, {precision} precision")
    header = ("params", "grads", "optim", "total")
    print(f"{'strategy':8s} " + " ".join(f"{h:>9s}" for h in header) + f" {'comm/step':>10s}")
    for plan in found:
        gb = [plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes, plan.total_bytes]
        cells = " ".join(f"{b / 1e9:8.3f}G" for b in gb)
        print(f"{plan.strategy:8s} {cells} {plan.comm_bytes_per_step / 1e9:9.2f}G")
