"""What every strategy's cost model shares: the job it prices (`CostJob`), what it answers
(`Costs`: one rank's model state by category and its collectives per step) and the memory
formulas common to strategies (issue #16). Each strategy's own formulas live in its module of
`plan.cost_models`; `plan.predictors` says which prices which.

The model may live on the meta device: only parameter shapes, dtypes and module structure are
read. Bytes follow `comm.accounting`: what this rank sends, the textbook volume for native
collectives (an all-reduce of b bytes over n ranks: 2(n-1)b/n, rounded down per call). The
memory categories are `memory.memory_report`'s, at its moment (after backward, before the
step): parameters, master weights, gradients, optimizer state.

The trainer's own per-step collective (one all-reduce of 3 + N float64 that agrees on the loss
and on whether to go on) is `trainer_comm`; every `log_every` steps a gradient norm adds one
more small all-reduce for strategies that shard gradients, left out here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from shardwise.comm.accounting import native_volume
from shardwise.plan.activations import saved_bytes
from shardwise.strategies.grad_buckets import bucket_bytes

if TYPE_CHECKING:
    from shardwise.config import Config
    from shardwise.jobs import Job

FP32 = 4
# Optimizer state per parameter tensor: bytes per element held, and bytes of scalar state
# (Adam's step counter is a float32 tensor per parameter).
OPTIMIZER_STATE = {
    "adamw": (2, FP32),
    "adam": (2, FP32),
    "sgd": (1, 0),
    "lars": (1, 0),  # its momentum buffer
    "lamb": (2, FP32),
}
HALF = {"bf16": 2, "fp16": 2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_STATE = ("params", "master_weights", "grads", "optimizer")
T = TypeVar("T")


@dataclass
class Calls:
    """Calls of one collective per step, alike in payload: what the step-time model prices."""

    op: str
    nbytes: float  # sent by this rank over all of them
    calls: float
    ranks: int | None  # the group's size (None: every rank)
    prefetched: bool = False  # started one unit ahead and waited for after its compute
    in_path: bool = False  # priced inside a pipeline's ops, on its schedule's critical path
    kind: str | None = None  # the calibrated collective it is priced as (None: by its op)


@dataclass
class Costs:
    """One rank's predicted model state (bytes by category) and collectives per step."""

    memory: dict[str, int] = field(default_factory=dict)
    traffic: list[Calls] = field(default_factory=list)  # per step, averaged over a sync period
    activations: int | None = None  # peak bytes saved for backward (None: no batch given)
    peak: int | None = None  # the most bytes alive at once in a step (None: no batch given)
    optimizer_numels: list[int] = field(default_factory=list)  # the tensors its optimizer steps
    notes: list[str] = field(default_factory=list)

    def add_comm(
        self,
        op: str,
        nbytes: float,
        calls: float = 1,
        ranks: int | None = None,
        prefetched: bool = False,
        in_path: bool = False,
        kind: str | None = None,
    ) -> None:
        """`calls` of `op` sending `nbytes` in all, among `ranks` ranks (None: every rank)."""
        if nbytes:  # (a collective over one rank sends nothing)
            self.traffic.append(Calls(op, nbytes, calls, ranks, prefetched, in_path, kind))

    @property
    def comm(self) -> dict[str, float]:
        """Bytes sent per step, by op."""
        return _by_op(self.traffic, lambda t: t.nbytes)

    @property
    def calls(self) -> dict[str, float]:
        """Collective calls per step, by op."""
        return _by_op(self.traffic, lambda t: t.calls)

    def as_dict(self) -> dict:
        memory = {**self.memory, "total": sum(self.memory.values())}
        return {
            "memory": memory,
            "activations": self.activations,
            "peak": self.peak,
            "comm": dict(sorted(self.comm.items())),
            "calls": dict(sorted(self.calls.items())),
            "notes": self.notes,
        }


def _by_op(traffic: list[Calls], value: Callable[[Calls], float]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for t in traffic:
        totals[t.op] = totals.get(t.op, 0) + value(t)
    return totals


@dataclass(frozen=True)
class CostJob:
    """What the costs depend on besides the strategy's options."""

    model: nn.Module
    world_size: int
    rank: int = 0
    optimizer: str = "adamw"
    # (inputs, targets) of n samples, made inside the fake mode, and the loss: for activations.
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    global_batch: int = 0  # samples per step over all replicas
    backend: str = "gloo"  # torch.distributed's (gloo's reduce-scatter copies its buffer)
    accumulate: int = 1  # train.accumulate: a rank's batch runs in this many micro-batches
    num_nodes: int = 1  # hosts the ranks are spread over
    # Traces of the model on fake tensors that the strategies priced for it share, kept by the
    # planner's `config_plan.MetaJob` (None: each made anew). Keyed by the model itself, which
    # they keep alive: a model made for one strategy (a tensor-parallel shard) and let go
    # cannot leave its traces to another made later at the same address.
    traces: dict | None = field(default=None, compare=False, repr=False)

    @property
    def shared_cores(self) -> bool:
        """Whether the collectives run on the cores that compute (`grad_buckets.shares_cores`):
        gloo on one host."""
        return self.backend == "gloo" and self.num_nodes == 1

    @classmethod
    def of(cls, job: Job, cfg: Config, world_size: int, rank: int, global_batch: int) -> CostJob:
        """The costs' view of a training job (`jobs.Job`) under a config (`config.Config`)."""
        return cls(
            job.model,
            world_size,
            rank,
            cfg.optim.name,
            batch=job.batch_like(),
            loss_fn=job.loss_fn,
            global_batch=global_batch,
            backend=torch.distributed.get_backend()
            if torch.distributed.is_initialized()
            else "gloo",
            accumulate=cfg.train.accumulate,
            num_nodes=_num_nodes(world_size),
        )

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def traced(self, key: tuple, make: Callable[[], T]) -> T:
        """`make()`, a trace of this job's model that depends on nothing but the model and
        `key`: made once per model and key where the job keeps traces (`traces`)."""
        if self.traces is None:
            return make()
        key = (self.model, *key)
        if key not in self.traces:
            self.traces[key] = make()
        return self.traces[key]

    def micro(self, samples: int) -> int:
        """The largest of the `accumulate` micro-batches a rank's batch of `samples` is cut
        into (`strategies.accumulation.split_batch`: as equal as they go)."""
        return -(-samples // self.accumulate)

    def activations(
        self,
        samples: int,
        dtype: torch.dtype | None = None,
        layers: Sequence[nn.Module] | None = None,
    ) -> tuple[int, list[int]] | None:
        """Bytes saved by one forward of `samples` (its largest micro-batch, under
        accumulation: one is alive at a time) through `layers` (default: the model), and per
        layer; None without a batch to trace."""
        if self.batch is None or samples < 1:
            return None
        samples = self.micro(samples)
        made: dict[str, torch.Tensor] = {}

        def inputs() -> torch.Tensor:
            made["x"], made["y"] = self.batch(samples)
            return made["x"]

        def loss(out: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(out, made["y"])

        if layers is not None:
            return saved_bytes(layers, inputs, dtype, loss)
        total, per_layer = self.traced(
            ("saved", samples, dtype), lambda: saved_bytes(self.model, inputs, dtype, loss)
        )
        return total, list(per_layer)


def optimizer_bytes(numels: list[int], optimizer: str, elem: int = FP32) -> int:
    """The optimizer's state for parameter tensors of `numels` elements each."""
    per_element, scalar = OPTIMIZER_STATE[optimizer]
    return sum(per_element * n * elem + scalar for n in numels)


def replicated_memory(numels: list[int], optimizer: str, elem: int = FP32) -> dict[str, int]:
    """A rank that holds parameter tensors of `numels` elements whole, with their gradients
    (DDP's are views into its buckets: the same bytes) and the optimizer's state."""
    total = sum(numels) * elem
    return {
        "params": total,
        "master_weights": 0,
        "grads": total,
        "optimizer": optimizer_bytes(numels, optimizer, elem),
    }


def _num_nodes(world_size: int) -> int:
    """The hosts of the job being priced: this job's, where one runs (else one host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // max(1, local))


def bucket_sizes(
    numels: list[int], elem: int, bucket_mb: float | None, shared_cores: bool = True
) -> list[int]:
    """`grad_buckets.assign_buckets` on element counts, in the order given: a bucket closes
    when the next tensor would take it past bucket_mb (None: DDP's default for these, on cores
    that communicate too where `shared_cores`, `CostJob.shared_cores`)."""
    limit = bucket_bytes(bucket_mb, sum(numels) * elem, shared_cores)
    buckets, size = [], 0
    for n in numels:
        if size and (size + n) * elem > limit:
            buckets.append(size)
            size = 0
        size += n
    return [*buckets, size] if size else buckets


def numels(params: Iterable[torch.Tensor]) -> list[int]:
    """Elements of each of `params`."""
    return [p.numel() for p in params]


def replica_activations(job: CostJob, dtype: torch.dtype | None = None) -> int | None:
    """Data parallel: one forward of this rank's share of the global batch."""
    traced = job.activations(job.global_batch // job.world_size, dtype)
    return None if traced is None else traced[0]


def replica_costs(job: CostJob) -> Costs:
    """A rank that holds the whole model and its optimizer (DDP's memory without its
    buckets' extra, a relaxed strategy's): model state and activations, no traffic yet."""
    held = numels(job.params())
    costs = Costs(memory=replicated_memory(held, job.optimizer), optimizer_numels=held)
    costs.activations = replica_activations(job)
    return costs


def trainer_comm(world_size: int) -> dict[str, int]:
    """The trainer's own collective per step: the loss-and-flags all-reduce (`agree_step`)."""
    return {"all_reduce": native_volume("all_reduce", 8 * (4 + world_size), world_size)}
