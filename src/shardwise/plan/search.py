"""Which strategy, on how many devices, and will it fit: every combination of data, tensor and
pipeline parallel sizes, ZeRO stage, micro-batch size, activation checkpointing and optimizer
offload for a transformer on a cluster, each priced in memory per device, bytes per step and
step time by closed formulas, ranked by step time, with the reason each rejected one fails.

The formulas, per device (Ψ: the parameters one tensor x pipeline rank holds; mixed precision:
bf16 parameters and gradients, K = 12 bytes of fp32 master weights and Adam moments):

    model states    2Ψ + 2Ψ + 12Ψ, divided by dp for what ZeRO shards (stage 1: optimizer
                    state; 2: + gradients; 3: + parameters) (Rajbhandari et al., 2020);
                    offload moves the optimizer state and masters to host memory
    activations     per layer and micro-batch, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes under
                    tensor parallel t (Korthikanti et al., 2022, without sequence parallel);
                    with checkpointing, 2·s·b·h per layer plus one layer's full set; a pipeline's
                    first stage holds min(pp, m) micro-batches of its L/pp layers (1F1B)
    compute         2·Ψ_total FLOPs per token forward, twice that backward (and once more
                    forward under checkpointing), plus attention's 4·s·h per token per layer
                    forward, at the device's sustained rate; a pipeline adds its bubble,
                    (pp - 1) / m of the compute
    communication   tensor parallel: 4 all-reduces of s·b·h bf16 per layer and micro-batch
                    (2 more with recompute), exposed; pipeline: one activation forward and one
                    gradient backward per micro-batch and stage boundary; data parallel: once
                    per step, after the last micro-batch (a pipeline's, or accumulation's:
                    ZeRO-2/3 hold full gradients meanwhile), an all-reduce (ZeRO-1/2:
                    reduce-scatter + all-gather) of the gradients overlapped with that
                    micro-batch's backward; ZeRO-3: a reduce-scatter and two gathers of the
                    parameters per micro-batch, under its compute; every collective costs
                    volume / bandwidth + latency, over NVLink inside a node and the network
                    across nodes
    HSDP            ZeRO-3 sharded over the K data-parallel ranks of a node and replicated across
                    the dp/K nodes: model states / K; a reduce-scatter and two all-gathers of the
                    gradients' size among K over NVLink, and an all-reduce of 1/K of them among
                    dp/K over the network
    offload         gradients out and parameters back over PCIe, and Adam on the host at
                    `host_adam_s_per_param` seconds per parameter

Pure Python, a few microseconds per plan: 70B on 1,024 devices and 1T on 10,000 devices
answer in milliseconds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

from shardwise.strategies.pipeline_schedule import bubble_formula, held_microbatches

GB = 1e9
# Sizes and counts (devices, layers, hidden, batch, ...) are whole numbers from 1 to MAX_SIZE,
# rates and amounts finite numbers from MIN_RATE to MAX_RATE: every formula below stays a
# finite float, and the divisors the search walks are found in a moment.
MAX_SIZE = 10**9
MIN_RATE, MAX_RATE = 1e-6, 1e15
MAX_PLANS = 100_000  # under a second of pricing; real clusters make a few thousand at most


def check_size(name: str, value: object) -> int:
    """`value` if it is a whole number from 1 to MAX_SIZE, else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        raise ValueError(
            f"{name} must be a whole number from 1 to {MAX_SIZE:,}, got {_shown(value)}"
        )
    return value


def check_rate(name: str, value: object, least: float = MIN_RATE) -> float:
    """`value` if it is a finite number from `least` to MAX_RATE, else a ValueError."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not least <= value <= MAX_RATE:  # (NaN fails every comparison)
        raise ValueError(
            f"{name} must be a number from {least:g} to {MAX_RATE:g}, got {_shown(value)}"
        )
    return value


def _shown(value: object) -> str:
    """`value` for a one-line message (a YAML value may be a long list, or text of any length)."""
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class TransformerSpec:
    """A GPT-style decoder: learned positions, separate embedding and head, a GELU MLP of `ffn`
    hidden units (default 4 x hidden)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int  # sequences per optimizer step (the global batch)
    ffn: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "batch", "ffn"):
            if name != "ffn" or self.ffn is not None:
                check_size(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")

    @property
    def mlp(self) -> int:
        return self.ffn or 4 * self.hidden

    def layer_params(self) -> int:
        h = self.hidden
        return 4 * h * h + 4 * h + 2 * h * self.mlp + self.mlp + h + 4 * h  # attn, MLP, 2 norms

    def params(self) -> int:
        h = self.hidden
        return self.layers * self.layer_params() + 2 * self.vocab * h + self.seq * h + 2 * h


PRESETS = {
    "70b": TransformerSpec(
        layers=80, hidden=8192, heads=64, seq=4096, vocab=32000, batch=1024, ffn=36864
    ),
    "1t": TransformerSpec(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200, batch=4096),
    "tiny_gpt": TransformerSpec(layers=4, hidden=256, heads=4, seq=128, vocab=65, batch=32),
}


@dataclass(frozen=True)
class ClusterSpec:
    """The devices a plan runs on: how many, their memory, compute rate and links."""

    devices: int
    memory_gb: float = 80.0
    network_gbit: float = 400.0  # per device, across nodes
    tflops: float = 400.0  # sustained bf16 rate per device (an H100 SXM peaks at 989 dense)
    devices_per_node: int = 8
    nvlink_gbyte: float = 450.0  # per device, inside a node
    latency_s: float = 10e-6  # per collective call
    pcie_gbyte: float = 25.0  # host <-> device, for offload
    host_adam_s_per_param: float = 1e-9

    def __post_init__(self) -> None:
        check_size("devices", self.devices)
        check_size("devices_per_node", self.devices_per_node)
        for name in ("memory_gb", "network_gbit", "tflops", "nvlink_gbyte", "pcie_gbyte"):
            check_rate(name, getattr(self, name))
        for name in ("latency_s", "host_adam_s_per_param"):
            check_rate(name, getattr(self, name), least=0.0)

    def bandwidth(self, group: int, stride: int = 1) -> float:
        """Bytes/s of a group of `group` devices whose members are `stride` devices apart."""
        inside = group * stride <= self.devices_per_node
        return self.nvlink_gbyte * GB if inside else self.network_gbit / 8 * GB


@dataclass
class Plan:
    """One way to train the transformer: its mesh, ZeRO stage, micro-batches, checkpointing and
    offload, and once priced, what it needs and how fast it runs."""

    dp: int
    tp: int
    pp: int
    zero: int
    micro_batch: int
    microbatches: int
    checkpointing: bool
    offload: bool
    schedule: str = "1f1b"  # pp > 1: its pipeline schedule (strategies/pipeline_schedule.py)
    shard_group: int | None = None  # HSDP: ZeRO shards over this many dp ranks (None: all dp)
    memory: dict[str, float] = field(default_factory=dict)  # bytes per device by category
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per device per step
    time: dict[str, float] = field(default_factory=dict)  # seconds per step by part
    step_time_s: float = 0.0
    fits: bool = True
    reason: str = ""  # why it does not fit
    unsupported: str = ""  # why shardwise cannot run it (yet), where it cannot

    @property
    def strategy(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.shard_group:
            parts.append(f"hsdp{self.shard_group}")
        parts.append(f"mb{self.micro_batch}x{self.microbatches}")
        if self.checkpointing:
            parts.append("ckpt")
        if self.offload:
            parts.append("offload")
        return " ".join(parts)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["strategy"] = self.strategy
        out["sets"] = plan_sets(self)  # (what `shardwise train` takes, where it runs it)
        return out


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in about sqrt(n) steps (n up to MAX_SIZE: 31,623)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def _meshes(spec: TransformerSpec, n: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp x tp x pp = n devices, tp dividing the heads (64 at most), pp at
    most the layers and dp dividing the batch, by tp then pp. dp divides gcd(n, batch): its
    divisors are the few to try (walking n's, 10^9 devices took 49 s)."""
    found = []
    shared = divisors(math.gcd(n, spec.batch))
    for tp in (t for t in range(1, min(n, 64) + 1) if n % t == 0 and spec.heads % t == 0):
        for dp in reversed(shared):  # (pp ascending)
            pp = n // tp // dp
            if (n // tp) % dp == 0 and pp <= spec.layers:
                found.append((dp, tp, pp))
    return found


MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def _options(pp: int) -> list[tuple[int, bool, bool]]:
    """(ZeRO stage, checkpointing, offload) for a mesh of `pp` stages (every stage runs on
    any mesh's data axis); offload moves ZeRO's optimizer shards to the host, so needs a
    stage."""
    both = (False, True)
    return [(z, c, o) for z, c, o in itertools.product((0, 1, 2, 3), both, both) if z or not o]


def candidates(spec: TransformerSpec, cluster: ClusterSpec) -> list[Plan]:
    """Every combination the devices, heads, layers and batch allow (a ValueError, before any
    is made, where they allow more than MAX_PLANS)."""
    meshes = [
        (dp, tp, pp, [b for b in MICRO_BATCHES if spec.batch // dp % b == 0])
        for dp, tp, pp in _meshes(spec, cluster.devices)
    ]
    count = sum(
        len(micro) * (len(_options(pp)) + len(_hybrid_options(dp, tp, pp, cluster)))
        for dp, tp, pp, micro in meshes
    )
    if count > MAX_PLANS:
        raise ValueError(
            f"{cluster.devices} devices and a batch of {spec.batch} split {count} ways, more "
            f"than the {MAX_PLANS} priced at most: plan fewer devices, or a batch with fewer "
            "divisors"
        )
    plans = [
        Plan(dp, tp, pp, zero, b, spec.batch // dp // b, ckpt, offload)
        for dp, tp, pp, micro in meshes
        for b in micro
        for zero, ckpt, offload in _options(pp)
    ]
    return plans + [
        Plan(dp, tp, pp, 3, b, spec.batch // dp // b, ckpt, offload, shard_group=k)
        for dp, tp, pp, micro in meshes
        for b in micro
        for k, ckpt, offload in _hybrid_options(dp, tp, pp, cluster)
    ]


def _hybrid_options(
    dp: int, tp: int, pp: int, cluster: ClusterSpec
) -> list[tuple[int, bool, bool]]:
    """(shard group, checkpointing, offload) of HSDP (ZeRO-3 on whole-world data parallel)
    where the data-parallel ranks span several nodes: sharded over a node's ranks."""
    k = cluster.devices_per_node
    if tp > 1 or pp > 1 or dp <= k or dp % k:
        return []
    return [(k, c, o) for c, o in itertools.product((False, True), (False, True))]


def price(plan: Plan, spec: TransformerSpec, cluster: ClusterSpec) -> Plan:
    """Fill in the plan's memory, bytes and step time, and whether it fits."""
    h, tp = spec.hidden, plan.tp
    layers = -(-spec.layers // plan.pp)  # the heaviest stage's layers
    # Parameters of the heaviest stage: its layers and the first stage's embeddings (the last
    # stage's head is no larger); one stage alone holds both ends, and the final norm.
    ends = spec.vocab * h + spec.seq * h + (spec.vocab * h + 2 * h if plan.pp == 1 else 0)
    psi = (layers * spec.layer_params() + ends) / tp
    plan.memory = _memory(plan, spec, psi, layers)
    compute, bubble = _compute_s(plan, spec, cluster)
    tp_bytes, tp_time = _tensor_parallel(plan, spec, cluster, layers)
    pp_bytes, pp_time = _pipeline(plan, spec, cluster)
    dp_bytes, dp_time = _data_parallel(plan, cluster, psi, compute)
    plan.comm_bytes = {"tensor": tp_bytes, "pipeline": pp_bytes, "data": dp_bytes}
    plan.time = {
        "compute": compute,
        "bubble": bubble,
        "tensor": tp_time,
        "pipeline": pp_time,
        "data": dp_time,
        "offload": _offload_s(plan, cluster, psi),
    }
    plan.step_time_s = sum(plan.time.values())
    plan.unsupported = unsupported(plan)
    budget = cluster.memory_gb * GB
    if plan.memory["total"] > budget:
        m_ = plan.memory
        plan.fits = False
        plan.reason = (
            f"needs {m_['total'] / GB:.1f} GB of {cluster.memory_gb:g} GB (params "
            f"{m_['params'] / GB:.1f}, grads {m_['grads'] / GB:.1f}, optimizer "
            f"{m_['optimizer'] / GB:.1f}, activations {m_['activations'] / GB:.1f})"
        )
    return plan


def _memory(plan: Plan, spec: TransformerSpec, psi: float, layers: int) -> dict[str, float]:
    """Bytes per device by category: model states (ZeRO's shards, offload's host share),
    activations of the micro-batches in flight, and ZeRO-3's gathered layers."""
    h, s, a = spec.hidden, spec.seq, spec.heads
    tp, b, m = plan.tp, plan.micro_batch, plan.microbatches
    shard = plan.shard_group or plan.dp  # (HSDP: a node's ranks)
    params = 2 * psi / (shard if plan.zero >= 3 else 1)
    grads = 2 * psi / (shard if plan.zero >= 2 else 1)
    if plan.zero >= 2 and m > 1:  # micro-batches accumulate full gradients, reduced once
        grads += 2 * psi
    optimizer = 12 * psi / (shard if plan.zero >= 1 else 1)
    host = optimizer if plan.offload else 0.0
    if plan.offload:
        optimizer = 0.0
    full_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    in_flight = held_microbatches(plan.schedule, plan.pp, m, 2)
    if plan.checkpointing:
        activations = layers * in_flight * 2 * s * b * h + full_layer
    else:
        activations = layers * in_flight * full_layer
    logits = 4 * s * b * spec.vocab / tp  # fp32 logits for the loss, on the last stage
    activations += logits
    # ZeRO-3 gathers a layer's parameters for its use, and prefetches the next one.
    gathered = 2 * 2 * spec.layer_params() / tp if plan.zero == 3 else 0.0
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": activations,
        "gathered": gathered,
        "total": params + grads + optimizer + activations + gathered,
        "host": host,
    }


def _compute_s(plan: Plan, spec: TransformerSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """Seconds of compute per step, and of the pipeline's bubble."""
    # Forward: 2 FLOPs per parameter per token plus attention; backward twice that.
    s, tp, pp = spec.seq, plan.tp, plan.pp
    tokens = spec.batch * s / plan.dp
    forward = tokens * (2 * spec.params() + 4 * s * spec.hidden * spec.layers) / (tp * pp)
    passes = 4 if plan.checkpointing else 3
    compute = passes * forward / (cluster.tflops * 1e12)
    bubble = bubble_formula(plan.schedule, pp, plan.microbatches, 2)  # (v = 2 interleaved)
    return compute, compute * bubble / (1 - bubble)  # 1F1B: compute * (pp - 1) / M


def _tensor_parallel(
    plan: Plan, spec: TransformerSpec, cluster: ClusterSpec, layers: int
) -> tuple[float, float]:
    """Tensor parallel's bytes and seconds: 4 all-reduces per layer per micro-batch (6 with
    recompute), exposed."""
    tp = plan.tp
    if tp == 1:
        return 0.0, 0.0
    calls = (6 if plan.checkpointing else 4) * layers * plan.microbatches
    volume = 2 * (tp - 1) / tp * (2 * spec.seq * plan.micro_batch * spec.hidden)
    return calls * volume, calls * (volume / cluster.bandwidth(tp) + cluster.latency_s)


def _pipeline(plan: Plan, spec: TransformerSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """The pipeline's bytes and seconds: one activation forward, one gradient back, per
    micro-batch."""
    if plan.pp == 1:
        return 0.0, 0.0
    m = plan.microbatches
    message = 2 * spec.seq * plan.micro_batch * spec.hidden / plan.tp
    stride = plan.tp * plan.dp
    return 2 * m * message, 2 * m * (message / cluster.bandwidth(2, stride) + cluster.latency_s)


def _data_parallel(
    plan: Plan, cluster: ClusterSpec, psi: float, compute: float
) -> tuple[float, float]:
    """Data parallel's bytes and the seconds its gradients' reduction adds past the backward
    it overlaps. Micro-batches (a pipeline's, or accumulation's) reduce once per step, after
    the last backward: an all-reduce of the gradients (ZeRO: a reduce-scatter and, 1-2, the
    step's all-gather); ZeRO-3 gathers the parameters for each micro-batch's forward and
    backward instead, prefetched under its compute."""
    dp, m = plan.dp, plan.microbatches
    if dp == 1:
        return 0.0, 0.0
    if plan.shard_group:
        return _hybrid_data_parallel(plan, cluster, psi, compute)
    volume = (dp - 1) / dp * 2 * psi  # one reduce-scatter or all-gather of the bf16 gradients
    calls = 2 * m + 1 if plan.zero == 3 else 2
    dp_bytes = volume * calls
    transfer = dp_bytes / cluster.bandwidth(dp, plan.tp) + calls * cluster.latency_s
    # The last micro-batch's backward hides the reduction; ZeRO-3's gathers every one's.
    overlap = (compute / m) * (2 / 3) * (m if plan.zero == 3 else 1)
    return dp_bytes, max(0.0, transfer - overlap)


def _hybrid_data_parallel(
    plan: Plan, cluster: ClusterSpec, psi: float, compute: float
) -> tuple[float, float]:
    """HSDP's bytes and exposed seconds: within a shard group of K (a node), two all-gathers
    of the parameters per micro-batch and one reduce-scatter of the gradients per step;
    across the dp/K groups, an all-reduce of the 1/K slice (ZeRO-3's, reduced once after the
    last micro-batch, its gathers under each one's compute)."""
    k, replicas, m = plan.shard_group, plan.dp // plan.shard_group, plan.microbatches
    grad_bytes = 2 * psi
    inside = (2 * m + 1) * (k - 1) / k * grad_bytes
    across = 2 * (replicas - 1) / replicas * grad_bytes / k
    seconds = inside / cluster.bandwidth(k, plan.tp) + across / cluster.bandwidth(
        replicas, k * plan.tp
    )
    transfer = seconds + (2 * m + 2) * cluster.latency_s
    overlap = compute * (2 / 3)
    return inside + across, max(0.0, transfer - overlap)


def _offload_s(plan: Plan, cluster: ClusterSpec, psi: float) -> float:
    """Offload's seconds: fp32 gradients out, bf16 parameters back, Adam on the host."""
    if not plan.offload:
        return 0.0
    moved = psi / ((plan.shard_group or plan.dp) if plan.zero >= 1 else 1)
    return moved * 6 / (cluster.pcie_gbyte * GB) + moved * cluster.host_adam_s_per_param


def unsupported(plan: Plan) -> str:
    """Why shardwise cannot run `plan` yet ('' where it can, as `plan_sets` says): its mesh
    composes data parallel (ZeRO 1-3, bf16 and offload included) with tensor and pipeline
    parallel; micro-batches without a pipeline run as `train.accumulate`. Its DDP computes in
    fp32, where the search prices bf16."""
    if plan.zero == 0 and plan.dp > 1:
        return "DDP trains in fp32 (bf16 priced): the same with ZeRO-1 runs"
    if plan.pp > 1 and plan.zero >= 2 and plan.schedule not in ("gpipe", "1f1b"):
        return f"ZeRO-{plan.zero} under the {plan.schedule} schedule"
    return ""


def plan_sets(plan: Plan) -> list[str]:
    """`plan` as `shardwise train` overrides (`--set`): a mesh of its sizes with its ZeRO
    stage (bf16 over fp32 masters, as priced) along the data axis (HSDP: ZeRO-3 with its
    shard group), its schedule and micro-batches (without a pipeline: `train.accumulate`),
    and each replica's batch."""
    if plan.shard_group:
        sets = [
            "strategy.name=zero",
            "strategy.stage=3",
            f"strategy.shard_group={plan.shard_group}",
            "strategy.keep_gathered_mb=0",  # (as priced: every unit gathered again for backward)
        ]
        sets += ["strategy.mixed_precision=bf16"]
    else:
        sets = ["strategy.name=mesh", f"strategy.dp={plan.dp}", f"strategy.tp={plan.tp}"]
        sets += [f"strategy.pp={plan.pp}"]
        sets += [f"strategy.data=zero{plan.zero}", "strategy.mixed_precision=bf16"] * bool(
            plan.zero
        )
    sets += ["strategy.offload=cpu"] if plan.offload else []
    sets += ["strategy.activation_checkpointing=true"] if plan.checkpointing else []
    if plan.pp > 1:
        sets += [f"strategy.schedule={plan.schedule}", f"strategy.microbatches={plan.microbatches}"]
    elif plan.microbatches > 1:
        sets += [f"train.accumulate={plan.microbatches}"]
    return [*sets, f"data.batch_size={plan.micro_batch * plan.microbatches}"]


def search(spec: TransformerSpec, cluster: ClusterSpec) -> tuple[list[Plan], list[Plan]]:
    """(plans that fit, fastest first; plans that do not, each with its reason)."""
    priced = [price(plan, spec, cluster) for plan in candidates(spec, cluster)]
    fits = sorted((p for p in priced if p.fits), key=lambda p: p.step_time_s)
    rejected = [p for p in priced if not p.fits]
    return fits, rejected
