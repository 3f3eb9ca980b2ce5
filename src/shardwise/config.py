"""Typed, validated configuration of a training job. YAML in, `Config` out; the CLI overrides.

Every field says what it means. Validation happens before any worker process starts, and an
invalid file fails with one line naming the field path, the bad value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from shardwise.ps.worker import PSConfig
from shardwise.strategies.ddp import DDPConfig
from shardwise.strategies.mesh_parallel import MeshConfig
from shardwise.strategies.pipeline import PPConfig
from shardwise.strategies.relaxed import AdaptiveSyncConfig, GossipConfig, LocalSGDConfig
from shardwise.strategies.section import Section, StrategySection
from shardwise.strategies.tensor_parallel import TPConfig
from shardwise.strategies.zero import ZeROConfig

PACKAGE_DIR = Path(__file__).resolve().parent
BUILTIN_CONFIGS = PACKAGE_DIR / "configs"
PACKAGE_DATA = PACKAGE_DIR / "data" / "datasets"


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


class DataConfig(Section):
    dataset: Literal["digits", "text", "verses"] = Field(
        "digits",
        description="'digits': scikit-learn's 8x8 handwritten digits; 'text': a file, in "
        "windows of seq_len characters; 'verses': a file cut into documents of varying length, "
        "one per line (for the character GPT)",
    )
    path: str | None = Field(
        None,
        description="text file for dataset=text or verses; relative paths are tried from the "
        "working directory, then from shardwise's bundled datasets",
    )
    seq_len: int = Field(128, ge=2, description="characters per training sequence (text, verses)")
    packing: Literal["none", "pack"] = Field(
        "none",
        description="verses: 'none' pads each document to its own row of seq_len; 'pack' puts "
        "documents end to end in rows (bin packing), with attention kept inside each document",
    )
    batch_size: int = Field(
        32, ge=1, description="samples per rank per step (the global batch: this x ranks)"
    )
    rank_weights: list[float] | None = Field(
        None,
        description="per-rank shares of the global batch, proportional to each rank's capacity "
        "(e.g. [1, 3]); gradients are weighted so the update stays the global batch's mean",
    )
    balance: Literal["static", "dynamic"] = Field(
        "static",
        description="dynamic: re-plan per-rank batch sizes from measured throughput every "
        "balance_every steps (starting from rank_weights, or equal shares)",
    )
    balance_every: int = Field(10, ge=1, description="dynamic balance: steps per window")
    mode: Literal["split", "queue"] = Field(
        "split",
        description="split: each step's global batch cut into one slice per rank; queue: each "
        "rank claims the next chunk of batch_size samples from the job's store when it is "
        "ready, so faster ranks take more (local SGD, averaged every period x ranks chunks, "
        "weighted by samples; a parameter server always deals its batches this way)",
    )
    test_fraction: float = Field(0.2, gt=0, lt=1, description="share of data held out for eval")

    @field_validator("path")
    @classmethod
    def _file_exists(cls, path: str | None) -> str | None:
        if path is not None:
            resolve_data_path(path)  # raises a one-line error when missing
        return path

    @field_validator("rank_weights")
    @classmethod
    def _weights_positive(cls, weights: list[float] | None) -> list[float] | None:
        if weights is not None and (not weights or any(w <= 0 for w in weights)):
            raise ValueError(f"rank weights must be > 0, one per rank, got {weights}")
        return weights

    @model_validator(mode="after")
    def _text_needs_a_file(self) -> DataConfig:
        if self.dataset in ("text", "verses") and self.path is None:
            raise ValueError(f"dataset {self.dataset!r} needs data.path")
        if self.packing != "none" and self.dataset != "verses":
            raise ValueError(f"packing {self.packing!r} needs dataset 'verses'")
        return self


class ModelConfig(Section):
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


# Every strategy's section, declared beside the strategy: the one place a name is dispatched.
SECTIONS = (
    DDPConfig,
    ZeROConfig,
    LocalSGDConfig,
    GossipConfig,
    AdaptiveSyncConfig,
    TPConfig,
    PPConfig,
    MeshConfig,
    PSConfig,
)
StrategyConfig = Annotated[Union[SECTIONS], Field(discriminator="name")]  # noqa: UP007


def ranks_needed(strategy: StrategySection) -> int | None:
    """The world size a model-parallel strategy fixes, where its sizes fix one."""
    return strategy.ranks_needed()


class OptimConfig(Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="torch.optim optimizer")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd: momentum")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up steps")
    schedule: Literal["constant", "step", "exponential", "cosine"] = Field(
        "constant",
        description="learning rate after warm-up: constant; step (x gamma every step_size "
        "steps); exponential (x gamma every step); cosine (down to min_lr_ratio at the end)",
    )
    step_size: int = Field(100, ge=1, description="schedule 'step': steps between decays")
    gamma: float | None = Field(
        None,
        gt=0,
        le=1,
        description="decay factor of 'step' (default 0.1) and 'exponential' (default 0.98)",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="schedule 'cosine': the final rate, a fraction of lr"
    )
    scale_lr: Literal["none", "linear"] = Field(
        "none",
        description="linear: lr * global batch / base_batch (the linear scaling rule: lr was "
        "tuned for base_batch samples per step)",
    )
    base_batch: int | None = Field(
        None,
        ge=1,
        description="scale_lr: the global batch lr was tuned for (default: "
        "data.batch_size, one rank's batch)",
    )


class TrainConfig(Section):
    steps: int = Field(200, ge=1, description="optimizer steps to run")
    seed: int = Field(0, description="seed for model initialisation and data order")
    log_every: int = Field(10, ge=1, description="steps between logged (globally averaged) losses")
    eval_batch_size: int = Field(256, ge=1, description="per-rank batch size for evaluation")
    clip_grad_norm: float | None = Field(
        None, gt=0, description="clip gradients to this global L2 norm (any strategy)"
    )
    eval_every: int = Field(0, ge=0, description="evaluate every K steps too (0: at the end only)")
    tensorboard: bool = Field(
        True, description="write TensorBoard event files to RUN_DIR/tensorboard (rank 0)"
    )
    measure: bool = Field(
        True,
        description="per-phase timing, gradient norm, activation memory and TensorBoard "
        "(false: only each step's time, waiting and bytes; what `bench overhead` compares)",
    )
    trace_steps: list[int] = Field(
        [],
        description="[a, b]: record every rank's phases and collectives from step a to step b "
        "and merge them, clocks synchronised, into RUN_DIR/trace.json (Perfetto, chrome://tracing)",
    )

    delay_s: list[float] = Field(
        [],
        description="artificial seconds added to every step of data-parallel rank i "
        "(parameter server: worker i), to emulate stragglers",
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="save a checkpoint that resumes the run exactly every N steps, under "
        "RUN_DIR/checkpoints (0: only the final weights)",
    )
    keep_checkpoints: int = Field(2, ge=1, description="how many of the newest checkpoints to keep")
    async_checkpoint: bool = Field(
        True,
        description="write checkpoints from a background thread after copying the state "
        "(training stalls only for the copy); false: write before the next step",
    )
    sample_ledger: bool = Field(
        False,
        description="write the dataset indices each rank trained on, per step, to "
        "RUN_DIR/ledger/rank{r}.jsonl (proof that resumes skip or repeat no sample)",
    )
    skip_batches: list[int] = Field(
        [],
        description="global batches (1 = the run's first) to leave out, e.g. ones known to "
        "produce non-finite values; the next batch takes their step",
    )
    nonfinite: Literal["skip", "stop", "rollback"] = Field(
        "skip",
        description="a non-finite loss or gradient on any rank: skip the update on every rank; "
        "stop the run; or skip, and after max_bad_steps bad steps in a row roll back to the "
        "last checkpoint and leave the offending batches out (no checkpoint is saved while bad "
        "steps are in a row; the run stops, exit code 4, where bad steps come again before it "
        "got past the step it rolled back at)",
    )
    max_bad_steps: int = Field(
        3,
        ge=1,
        description="consecutive non-finite steps before 'skip' stops the run or "
        "'rollback' rolls back",
    )
    delay_rotate: bool = Field(
        False,
        description="move the delays one rank on every step (transient stragglers: each rank "
        "is slow one step in N) instead of keeping them on the same ranks",
    )

    @field_validator("trace_steps")
    @classmethod
    def _a_window(cls, steps: list[int]) -> list[int]:
        if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ValueError(f"should be [first, last] with 1 <= first <= last, got {steps}")
        return steps


class LaunchConfig(Section):
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
    hang_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a collective unfinished this long ends every rank with a report naming "
        "the ranks that never arrived, and where each rank is",
    )
    desync_check_every: int = Field(
        100,
        ge=0,
        description="compare every rank's sequence of collectives through the store every N "
        "steps (0: never); a difference names the first differing call on each rank",
    )
    desync_check_per_call: bool = Field(
        False, description="debug: compare every collective before it is issued (slow)"
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="restart the job this many times when a rank fails (torchrun's agent), "
        "resuming from the newest checkpoint",
    )


class Config(Section):
    name: str = Field(
        "job",
        description="run name; the run directory starts with it (a plain name: no '/', not "
        "starting with '.')",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    strategy: StrategyConfig = Field(default_factory=DDPConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    faults: list[str] = Field(
        [],
        description="faults to inject, e.g. 'kill:rank=1:step=37' (grammar: faults/injection.py; "
        "added to those of SHARDWISE_FAULT)",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # The run directory is `launch.runs_dir/<name>-<time>`: a path in the name would put it
        # elsewhere (`../x` outside runs_dir), a leading dot would hide it.
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(
                f"should be a plain name (no '/', not starting with '.'), got {name!r}"
            )
        if not name.isprintable() or len(name) > 100:
            raise ValueError("should be at most 100 printable characters")
        return name

    @model_validator(mode="after")
    def _ps_keeps_no_rollback(self) -> Config:
        if self.strategy.name == "ps" and self.train.nonfinite == "rollback":
            raise ValueError(
                "train.nonfinite 'rollback' is for data-parallel runs, which checkpoint every "
                "rank; a parameter-server job's state lives on its servers: use skip or stop"
            )
        return self

    @model_validator(mode="after")
    def _queue_needs_replicas_that_pull(self) -> Config:
        if self.data.mode != "queue" or self.strategy.name == "ps":
            return self
        if self.strategy.name != "local_sgd" or self.strategy.warmup_steps:
            raise ValueError(
                "data.mode 'queue' needs strategy local_sgd (without warmup_steps) or ps: "
                "ranks that pull their data take different numbers of steps"
            )
        if self.data.rank_weights is not None or self.data.balance != "static":
            raise ValueError("data.mode 'queue' balances by itself: no rank_weights or balance")
        return self

    @model_validator(mode="after")
    def _verses_on_whole_models(self) -> Config:
        # The document mask does not travel between a pipeline's stages, and tensor parallel's
        # vocabulary-sharded loss does not leave padded targets out.
        s = self.strategy
        split = s.name in ("tp", "pp") or (s.name == "mesh" and (s.tp > 1 or s.pp > 1))
        if self.data.dataset == "verses" and split:
            raise ValueError(
                f"data.dataset 'verses' needs a data-parallel strategy, not {s.describe()}"
            )
        return self

    @field_validator("faults")
    @classmethod
    def _faults_parse(cls, faults: list[str]) -> list[str]:
        from shardwise.faults.injection import parse

        parse(",".join(faults), source="")  # a one-line error when malformed
        return faults


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
        try:
            parsed.append((key.strip(), yaml.safe_load(value)))
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(
                f"config error: --set {key.strip()}: {value!r} is not a YAML value ({problem})"
            ) from None
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


def section_names(strategies: bool = False) -> list[str]:
    if strategies:
        return [section.model_fields["name"].default for section in SECTIONS]
    return [name for name in Config.model_fields if name not in ("name", "strategy", "faults")]


def describe_section(name: str) -> tuple[str, list[tuple[str, str, str, str]]]:
    """(title, rows of field, type, default, description) for a section or a strategy."""
    by_strategy = {section.model_fields["name"].default: section for section in SECTIONS}
    if name in by_strategy:
        section, title = by_strategy[name], f"strategy: {name}"
    elif name in section_names():
        section, title = Config.model_fields[name].default_factory, name
    else:
        known = ", ".join([*section_names(), *by_strategy])
        raise ConfigError(f"config error: no section or strategy named {name!r} ({known})")
    rows = []
    for field_name, info in section.model_fields.items():
        kind = info.annotation
        kind = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
        rows.append((field_name, kind, repr(info.default), info.description or ""))
    return title, rows


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
