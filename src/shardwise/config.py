"""Typed, validated configuration of a training job. YAML in, `Config` out; the CLI overrides.

Every field says what it means. Validation happens before any worker process starts, and an
invalid file fails with one line naming the field path, the bad value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

PACKAGE_DIR = Path(__file__).resolve().parent
BUILTIN_CONFIGS = PACKAGE_DIR / "configs"
PACKAGE_DATA = PACKAGE_DIR / "datasets"


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(_Section):
    dataset: Literal["digits", "text"] = Field(
        "digits", description="'digits': scikit-learn's 8x8 handwritten digits; 'text': a file"
    )
    path: str | None = Field(
        None,
        description="text file for dataset=text; relative paths are tried from the working "
        "directory, then from shardwise's bundled datasets",
    )
    seq_len: int = Field(128, ge=2, description="characters per training sequence (text)")
    batch_size: int = Field(32, ge=1, description="samples per rank per step")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="share of data held out for eval")

    @field_validator("path")
    @classmethod
    def _file_exists(cls, path: str | None) -> str | None:
        if path is not None:
            resolve_data_path(path)  # raises a one-line error when missing
        return path

    @model_validator(mode="after")
    def _text_needs_a_file(self) -> DataConfig:
        if self.dataset == "text" and self.path is None:
            raise ValueError("dataset 'text' needs data.path")
        return self


class ModelConfig(_Section):
    name: Literal["mlp", "cnn", "gpt"] = Field("mlp", description="which model to train")
    hidden: list[int] = Field([128, 128], description="mlp: hidden layer widths")
    channels: tuple[int, int] = Field((16, 32), description="cnn: channels of the two conv blocks")
    d_model: int = Field(256, ge=8, description="gpt: embedding width")
    n_layer: int = Field(4, ge=1, description="gpt: transformer blocks")
    n_head: int = Field(4, ge=1, description="gpt: attention heads (must divide d_model)")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model})")
        if any(h < 1 for h in self.hidden):
            raise ValueError(f"hidden widths must be >= 1, got {self.hidden}")
        return self


class DDPConfig(_Section):
    name: Literal["ddp"] = Field("ddp", description="the parallelism strategy")
    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size in MiB")
    algorithm: Literal["native", "ring", "hierarchical"] = Field(
        "native", description="all-reduce: the backend's own, or our ring / hierarchical"
    )
    group_size: int | None = Field(
        None, ge=1, description="hierarchical: ranks per group (default: ranks per node)"
    )
    find_unused_parameters: bool = Field(
        False, description="allow parameters that receive no gradient (treated as zero)"
    )
    sync_batchnorm: bool = Field(True, description="BatchNorm statistics over the global batch")
    compression: str | None = Field(
        None,
        description="gradient codec: fp16, bf16, int8, topk:RATIO, randomk:RATIO, sign or "
        "powersgd:RANK",
        pattern=r"^(fp16|bf16|int8|sign|(topk|randomk)(:(0?\.\d+|1(\.0*)?))?|powersgd(:\d+(:\d+)?)?)$",
    )


class ZeROConfig(_Section):
    name: Literal["zero"] = Field("zero", description="the parallelism strategy")
    stage: Literal[1, 2, 3] = Field(
        1, description="1: optimizer state, 2: + gradients, 3: + parameters sharded"
    )
    bucket_mb: float = Field(25.0, gt=0, description="stages 1/2: flat unit size in MiB")
    mixed_precision: Literal["bf16", "fp16"] | None = Field(
        None, description="compute dtype over fp32 master weights; fp16 adds loss scaling"
    )
    offload: Literal["cpu", "disk"] | None = Field(
        None, description="master weights and optimizer state in host memory, or on disk"
    )
    offload_dir: str = Field(
        "shardwise-offload", description="offload=disk: directory of the memory-mapped files"
    )


class LocalSGDConfig(_Section):
    name: Literal["local_sgd"] = Field("local_sgd", description="the parallelism strategy")
    period: int = Field(4, ge=1, description="local steps between parameter averages")
    warmup_steps: int = Field(0, ge=0, description="fully synchronous steps first (post-local)")
    beta: float = Field(1.0, gt=0, le=1, description="new = beta * average + (1-beta) * local")


class GossipConfig(_Section):
    name: Literal["gossip"] = Field("gossip", description="the parallelism strategy")
    topology: Literal["ring", "torus", "exponential"] = Field("ring", description="peers")
    global_every: int | None = Field(
        None, ge=1, description="hybrid: a global average every K steps"
    )


class AdaptiveSyncConfig(_Section):
    name: Literal["adaptive"] = Field("adaptive", description="the parallelism strategy")
    threshold: float = Field(0.01, gt=0, description="relative drift that triggers an average")


class TPConfig(_Section):
    name: Literal["tp"] = Field("tp", description="the parallelism strategy")
    size: int | None = Field(None, ge=1, description="ranks per model (default: the world)")
    loss_parallel: bool = Field(
        True, description="loss from vocabulary-sharded logits (never gathered)"
    )


class PPConfig(_Section):
    name: Literal["pp"] = Field("pp", description="the parallelism strategy")
    stages: int | None = Field(None, ge=1, description="pipeline stages (default: the world)")
    schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="pipeline schedule")
    microbatches: int = Field(4, ge=1, description="micro-batches per step")
    split: list[int] | None = Field(
        None, description="first layer of stages 1..S-1; default: balanced by parameters"
    )


class MeshConfig(_Section):
    name: Literal["mesh"] = Field("mesh", description="the parallelism strategy")
    dp: int | None = Field(None, ge=1, description="data-parallel size (default: the rest)")
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline stages")
    data: Literal["ddp", "zero1", "zero2"] = Field(
        "ddp", description="strategy along the data dimension"
    )
    schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="pp > 1: schedule")
    microbatches: int = Field(4, ge=1, description="pp > 1: micro-batches per step")
    loss_parallel: bool = Field(True, description="tp > 1: loss from vocabulary slices")

    @model_validator(mode="after")
    def _one_model_dimension(self) -> MeshConfig:
        if self.tp > 1 and self.pp > 1:
            raise ValueError("tensor x pipeline parallel on one mesh is not supported yet")
        return self


class PSConfig(_Section):
    name: Literal["ps"] = Field("ps", description="the parallelism strategy")
    servers: int = Field(1, ge=1, description="server processes (ranks 0..servers-1)")
    workers: int = Field(2, ge=1, description="worker processes")
    mode: Literal["sync", "async", "ssp"] = Field("sync", description="consistency mode")
    staleness: int = Field(2, ge=0, description="ssp: clocks a worker may run ahead")
    rule: Literal["gradient", "average"] = Field(
        "gradient", description="push gradients, or push parameters to be averaged"
    )
    beta: float = Field(0.5, ge=0, le=1, description="average: new = beta*server+(1-beta)*worker")
    staleness_lr: bool = Field(False, description="scale each update's lr by 1/(1+staleness)")
    heartbeat_s: float = Field(0.5, gt=0, description="seconds between worker heartbeats")
    timeout_s: float = Field(10.0, gt=0, description="silence that declares a worker dead")
    snapshot_every: int = Field(0, ge=0, description="servers save their shard every K updates")
    relays: int = Field(
        0, ge=0, description="two-level: relays between workers and servers (sync/async)"
    )

    @model_validator(mode="after")
    def _relays_fit(self) -> PSConfig:
        if self.relays and self.mode == "ssp":
            raise ValueError("ps relays work with mode sync or async, not ssp")
        if self.relays > self.workers:
            raise ValueError(f"{self.relays} relays need at least as many workers")
        return self


StrategyConfig = Annotated[
    DDPConfig
    | ZeROConfig
    | LocalSGDConfig
    | GossipConfig
    | AdaptiveSyncConfig
    | TPConfig
    | PPConfig
    | MeshConfig
    | PSConfig,
    Field(discriminator="name"),
]


def ranks_needed(strategy: Any) -> int | None:
    """The world size a model-parallel strategy fixes, where its sizes fix one."""
    if strategy.name == "tp":
        return strategy.size
    if strategy.name == "pp":
        return strategy.stages
    if strategy.name == "ps":
        return strategy.servers + strategy.relays + strategy.workers
    if strategy.name == "mesh" and strategy.dp is not None:
        return strategy.dp * strategy.tp * strategy.pp
    return None


class OptimConfig(_Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="torch.optim optimizer")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd: momentum")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up steps")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="learning rate after warm-up"
    )


class TrainConfig(_Section):
    steps: int = Field(200, ge=1, description="optimizer steps to run")
    seed: int = Field(0, description="seed for model initialisation and data order")
    log_every: int = Field(10, ge=1, description="steps between logged (globally averaged) losses")
    eval_batch_size: int = Field(256, ge=1, description="per-rank batch size for evaluation")
    clip_grad_norm: float | None = Field(
        None, gt=0, description="clip gradients to this global L2 norm (any strategy)"
    )
    eval_every: int = Field(0, ge=0, description="evaluate every K steps too (0: at the end only)")
    delay_s: list[float] = Field(
        [],
        description="artificial seconds added to every step of data-parallel rank i "
        "(parameter server: worker i), to emulate stragglers",
    )
    delay_rotate: bool = Field(
        False,
        description="move the delays one rank on every step (transient stragglers: each rank "
        "is slow one step in N) instead of keeping them on the same ranks",
    )


class LaunchConfig(_Section):
    nproc: int = Field(2, ge=1, description="worker processes on this machine")
    threads_per_rank: int | None = Field(
        None, ge=1, description="torch threads per rank (default: cores / local ranks)"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process-group backend; auto = nccl with CUDA, gloo otherwise"
    )
    comm_timeout_s: float = Field(
        300.0, gt=0, description="seconds before a stuck collective fails the job"
    )
    runs_dir: str = Field("runs", description="where run directories are created")


class Config(_Section):
    name: str = Field("job", description="run name; the run directory starts with it")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    strategy: StrategyConfig = Field(default_factory=DDPConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)


def resolve_data_path(path: str) -> Path:
    """Find a data file from the working directory or the bundled datasets; one-line error."""
    for candidate in (Path(path), PACKAGE_DATA / path):
        if candidate.is_file():
            return candidate.resolve()
    raise ValueError(f"dataset file not found: {path}")


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: --set {dotted}: {key} is not a section")
        node = child
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key.path=value` strings; values are parsed as YAML scalars (`1e-3`, `true`, `[1, 2]`)."""
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"config error: --set expects key=value, got {item!r}")
        parsed.append((key.strip(), yaml.safe_load(value)))
    return parsed


def find_config(name_or_path: str | None) -> Path:
    """A path to a YAML file, or the name of a built-in config (`digits`, `tiny_gpt`, ...)."""
    if name_or_path is None:
        return BUILTIN_CONFIGS / "digits.yaml"
    path = Path(name_or_path)
    if path.is_file():
        return path
    builtin = BUILTIN_CONFIGS / f"{name_or_path}.yaml"
    if builtin.is_file():
        return builtin
    names = ", ".join(sorted(p.stem for p in BUILTIN_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"config error: no such file or built-in config: {name_or_path} ({names})")


def load_config(name_or_path: str | None = None, overrides: list[str] = ()) -> Config:
    """Read, override and validate; raises `ConfigError` with a one-line message."""
    path = find_config(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config error: {path} is not valid YAML: {e}".splitlines()[0]) from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config error: {path} must hold a mapping at the top level")
    for key, value in parse_overrides(list(overrides)):
        if key == "strategy.name" and value != (raw.get("strategy") or {}).get("name"):
            raw["strategy"] = {}  # another strategy: the file's options were for the old one
        _set_dotted(raw, key, value)
    return validate(raw)


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        if loc[:1] == ["strategy"] and len(loc) > 2:  # drop pydantic's union tag (strategy.zero.x)
            loc.pop(1)
        where = ".".join(loc) or "config"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("value_error", "assertion_error") or "input" not in err:
            raise ConfigError(f"config error: {where}: {message}") from None
        raise ConfigError(f"config error: {where} = {err['input']!r}: {message}") from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
