"""Predicted per-rank costs of a job before it runs: model-state bytes by category and the bytes
each collective sends per step, for a model and the strategy of a config (issue #16).

The model may live on the meta device: only parameter shapes, dtypes and module structure are
read. Each strategy's costs follow from how it lays its state out, stated here as formulas
over those shapes:

    DDP          parameters, gradients in flat buckets (bucket_mb, reverse registration order),
                 Adam's two moments: 4P + 4P + 8P; one all-reduce per bucket
    ZeRO 1/2/3   flat units padded to a multiple of N (S = ceil(U / N) elements per rank);
                 stage 1 keeps full gradients, 2 only the reduced slice, 3 frees the full
                 parameters after each use; one reduce-scatter per unit, one all-gather per
                 unit after the step (stage 3: before forward and before backward instead)
    local SGD    DDP's memory without buckets; every `period` steps, one all-reduce of all
                 parameters

Bytes follow `comm.accounting`: what this rank sends, the textbook volume for native
collectives (an all-reduce of b bytes over n ranks: 2(n-1)b/n, rounded down per call). The
memory categories are `memory.memory_report`'s, at its moment (after backward, before the
step): parameters, master weights, gradients, optimizer state.

The trainer's own per-step collective (one all-reduce of 3 + N float64 that agrees on the loss
and on whether to go on) is `trainer_comm`; every `log_every` steps a gradient norm adds one
more small all-reduce for strategies that shard gradients, left out here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.activations import saved_bytes
from shardwise.comm.accounting import native_volume
from shardwise.section import StrategySection
from shardwise.strategies.grad_buckets import assign_buckets
from shardwise.strategies.zero.stage3 import stage3_units

FP32 = 4
# Optimizer state per parameter tensor: bytes per element held, and bytes of scalar state
# (Adam's step counter is a float32 tensor per parameter).
OPTIMIZER_STATE = {"adamw": (2, FP32), "adam": (2, FP32), "sgd": (1, 0)}
HALF = {"bf16": 2, "fp16": 2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Costs:
    """One rank's predicted model state (bytes by category) and bytes sent per step by op."""

    memory: dict[str, int] = field(default_factory=dict)
    comm: dict[str, int] = field(default_factory=dict)  # per step, averaged over a sync period
    activations: int | None = None  # peak bytes saved for backward (None: no batch given)
    notes: list[str] = field(default_factory=list)

    def add_comm(self, op: str, nbytes: float) -> None:
        self.comm[op] = self.comm.get(op, 0) + nbytes

    def as_dict(self) -> dict:
        memory = {**self.memory, "total": sum(self.memory.values())}
        return {
            "memory": memory,
            "activations": self.activations,
            "comm": dict(sorted(self.comm.items())),
            "notes": self.notes,
        }


@dataclass(frozen=True)
class Job:
    """What the costs depend on besides the strategy's options."""

    model: nn.Module
    world_size: int
    rank: int = 0
    optimizer: str = "adamw"
    # (inputs, targets) of n samples, made inside the fake mode, and the loss: for activations.
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    global_batch: int = 0  # samples per step over all replicas

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def activations(
        self, samples: int, dtype: torch.dtype | None = None, layers=None
    ) -> tuple[int, list[int]] | None:
        """Bytes saved by one forward of `samples` through `layers` (default: the model), and
        per layer; None without a batch to trace."""
        if self.batch is None or samples < 1:
            return None
        made: dict[str, torch.Tensor] = {}

        def inputs() -> torch.Tensor:
            made["x"], made["y"] = self.batch(samples)
            return made["x"]

        def loss(out: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(out, made["y"])

        return saved_bytes(self.model if layers is None else layers, inputs, dtype, loss)


def nbytes(p: nn.Parameter) -> int:
    return p.numel() * p.element_size()


def optimizer_bytes(numels: list[int], optimizer: str, elem: int = FP32) -> int:
    """The optimizer's state for parameter tensors of `numels` elements each."""
    per_element, scalar = OPTIMIZER_STATE[optimizer]
    return sum(per_element * n * elem + scalar for n in numels)


def ddp_costs(job: Job, s: StrategySection) -> Costs:
    params = job.params()
    total = sum(nbytes(p) for p in params)
    costs = Costs(
        memory={
            "params": total,
            "master_weights": 0,
            "grads": total,  # every .grad a view into its bucket
            "optimizer": optimizer_bytes([p.numel() for p in params], job.optimizer),
        }
    )
    n = job.world_size
    costs.activations = _replica_activations(job)
    buckets = assign_buckets(list(reversed(params)), int(s.bucket_mb * 2**20))
    sizes = [sum(p.numel() for p in b) for b in buckets]
    elem = params[0].element_size()
    if s.compression is not None:
        costs.notes.append(f"compression {s.compression}: bytes not predicted")
    elif s.algorithm == "native":
        for numel in sizes:
            costs.add_comm("all_reduce", native_volume("all_reduce", numel * elem, n))
    elif s.algorithm == "ring":
        for numel in sizes:
            costs.add_comm("ring_all_reduce", ring_bytes(numel, n, job.rank) * elem)
    else:
        costs.notes.append(f"algorithm {s.algorithm}: bytes not predicted")
    return costs


def _replica_activations(job: Job, dtype: torch.dtype | None = None) -> int | None:
    """Data parallel: one forward of this rank's share of the global batch."""
    traced = job.activations(job.global_batch // job.world_size, dtype)
    return None if traced is None else traced[0]


def ring_bytes(numel: int, n: int, rank: int) -> int:
    """Elements rank `rank` sends in `comm.ring`'s all-reduce of `numel` elements: the tensor
    cut into n chunks (the first numel % n one longer); n-1 reduce-scatter sends (every chunk
    but chunk rank+1) and n-1 all-gather sends (every chunk but chunk rank+2)."""
    if n == 1:
        return 0
    chunks = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    return 2 * numel - chunks[(rank + 1) % n] - chunks[(rank + 2) % n]


def zero_costs(job: Job, s: StrategySection) -> Costs:
    n, params = job.world_size, job.params()
    if s.stage == 3:
        units = [[p for p in m.parameters() if p.requires_grad] for m in stage3_units(job.model)]
        covered = {id(p) for unit in units for p in unit}
        rest = [p for p in params if id(p) not in covered]
        units = [rest, *units] if rest else units
    else:
        units = assign_buckets(params, int(s.bucket_mb * 2**20))
    shards = [-(-sum(p.numel() for p in unit) // n) for unit in units]  # S per unit
    compute = HALF.get(s.mixed_precision, params[0].element_size())
    fp32_masters = s.mixed_precision is not None or s.offload is not None
    full = sum(S * n for S in shards) * compute  # every unit's padded compute buffer
    shard = sum(shards) * FP32
    memory = {
        "params": 0 if s.stage == 3 else full,
        # Stage 3's shards are copies (the full buffers come and go); with mixed precision or
        # offload, fp32 masters live beside the compute copy. Otherwise the optimizer steps
        # views of the parameters: no bytes of their own.
        "master_weights": shard if fp32_masters or s.stage == 3 else 0,
        "grads": shard if s.stage >= 2 else full + (shard if fp32_masters else 0),
        "optimizer": optimizer_bytes(shards, job.optimizer),
    }
    if s.stage == 1 and not fp32_masters:
        memory["grads"] = full  # the reduced slice is a view of the full gradient buffer
    costs = Costs(memory=memory)
    costs.activations = _replica_activations(job, DTYPES.get(s.mixed_precision))
    gathers = 2 if s.stage == 3 else 1
    for S in shards:
        unit_bytes = S * n * compute
        costs.add_comm("reduce_scatter", native_volume("reduce_scatter", unit_bytes, n))
        costs.add_comm("all_gather", gathers * native_volume("all_gather", unit_bytes, n))
    if s.mixed_precision == "fp16":
        costs.notes.append("fp16 loss scaling: its overflow all-reduce is not counted")
    return costs


def local_sgd_costs(job: Job, s: StrategySection) -> Costs:
    params = job.params()
    total = sum(nbytes(p) for p in params)
    costs = Costs(
        memory={
            "params": total,
            "master_weights": 0,
            "grads": total,
            "optimizer": optimizer_bytes([p.numel() for p in params], job.optimizer),
        }
    )
    costs.activations = _replica_activations(job)
    # One all-reduce of every parameter each `period` steps: per step, its share.
    volume = native_volume("all_reduce", total, job.world_size)
    costs.add_comm("all_reduce", volume / s.period)
    return costs


PREDICTORS: dict[str, Callable[[Job, StrategySection], Costs]] = {
    "ddp": ddp_costs,
    "zero": zero_costs,
    "local_sgd": local_sgd_costs,
}


def predict(job: Job, strategy: StrategySection) -> Costs:
    """The costs of `strategy` for `job`; strategies without a cost model say so in notes."""
    predictor = PREDICTORS.get(strategy.name)
    if predictor is None:
        return Costs(notes=[f"no cost model for strategy {strategy.name!r} yet"])
    return predictor(job, strategy)


def trainer_comm(world_size: int) -> dict[str, int]:
    """The trainer's own collective per step: the loss-and-flags all-reduce (`trainer._agree`)."""
    return {"all_reduce": native_volume("all_reduce", 8 * (3 + world_size), world_size)}


MODEL_STATE = ("params", "master_weights", "grads", "optimizer")


def for_run(job: Job, strategy: StrategySection) -> dict:
    """What `shardwise train` writes to RUN_DIR/prediction.json before its first step: this
    rank's predicted model state, and bytes per step with the trainer's own collective."""
    costs = predict(job, strategy)
    out = costs.as_dict()
    if costs.comm:
        out["comm_bytes_per_step"] = sum(costs.comm.values()) + sum(
            trainer_comm(job.world_size).values()
        )
    return out


def versus_measured(predicted: dict, memory: dict[str, int], comm_bytes_per_step: float) -> dict:
    """Predicted next to measured (model state by category, bytes per step), with the relative
    error of each, for the summary and the report."""
    rows: dict[str, dict] = {}
    if predicted.get("memory") and memory:
        for category in (*MODEL_STATE, "model_state"):
            want = (
                sum(predicted["memory"][c] for c in MODEL_STATE)
                if category == "model_state"
                else predicted["memory"][category]
            )
            got = (
                sum(memory[c] for c in MODEL_STATE)
                if category == "model_state"
                else memory[category]
            )
            rows[category] = _pair(want, got)
    if "comm_bytes_per_step" in predicted:
        rows["comm_bytes_per_step"] = _pair(predicted["comm_bytes_per_step"], comm_bytes_per_step)
    return {"rows": rows, "notes": predicted.get("notes", [])}


def _pair(predicted: float, measured: float) -> dict:
    error = (predicted - measured) / measured if measured else (0.0 if not predicted else None)
    return {"predicted": predicted, "measured": measured, "error": error}
