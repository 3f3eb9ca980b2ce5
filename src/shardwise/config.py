"""Typed, validated configuration of a training job. YAML in, `Config` out; the CLI overrides.

Every field says what it means. Validation happens before any worker process starts, and an
invalid file fails with one line naming the field path, the bad value and what is allowed.

Here: `Config`, assembled from the job's sections (`job_sections`) and every strategy's (beside
the strategy), and how a config is found, read, overridden, validated, described and written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Union, get_args

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from shardwise import user_code
from shardwise.job_sections import (
    PACKAGE_DATA,
    DataConfig,
    DistillConfig,
    LaunchConfig,
    ModelConfig,
    OptimConfig,
    PruneConfig,
    StartConfig,
    TrainConfig,
)
from shardwise.ps.worker import PSConfig
from shardwise.strategies.ddp import DDPConfig
from shardwise.strategies.mesh_parallel import MeshConfig
from shardwise.strategies.pipeline import PPConfig
from shardwise.strategies.relaxed import AdaptiveSyncConfig, GossipConfig, LocalSGDConfig
from shardwise.strategies.section import Section, StrategySection
from shardwise.strategies.tensor_parallel import TPConfig
from shardwise.strategies.zero import ZeROConfig

__all__ = [  # (PACKAGE_DATA: where the bundled datasets are, for scripts and tests)
    "BUILTIN_CONFIGS",
    "PACKAGE_DATA",
    "SECTIONS",
    "Config",
    "ConfigError",
    "describe_section",
    "dump_config",
    "find_config",
    "load_config",
    "parse_overrides",
    "ranks_needed",
    "section_names",
    "validate",
]

PACKAGE_DIR = Path(__file__).resolve().parent
BUILTIN_CONFIGS = PACKAGE_DIR / "configs"


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


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
    distill: DistillConfig | None = Field(
        None, description="knowledge distillation from a frozen teacher (none: plain training)"
    )
    prune: PruneConfig | None = Field(
        None, description="global magnitude pruning, gradual (none: no pruning)"
    )
    start: StartConfig | None = Field(
        None,
        description="start from another run's checkpoint: resume, continue or finetune (none: "
        "from the model's own initialisation)",
    )
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
    def _layerwise_optimizers_on_whole_parameters(self) -> Config:
        if self.strategy.name == "ps" and self.optim.name in ("lars", "lamb"):
            raise ValueError(
                f"optim.name {self.optim.name!r} needs each parameter's norm, and a parameter "
                "server steps flat ranges of the parameters on each server: use a "
                "data-parallel strategy (ddp, zero, a mesh) or adamw/adam/sgd"
            )
        return self

    @model_validator(mode="after")
    def _distillation_on_data_parallel_classifiers(self) -> Config:
        if self.distill is None:
            return self
        if self.strategy.name not in ("ddp", "zero", "local_sgd", "gossip", "adaptive"):
            raise ValueError(
                f"distill needs a data-parallel strategy (ddp, zero, local_sgd, gossip, "
                f"adaptive), not {self.strategy.describe()}: the student's logits must be whole"
            )
        if self.data.dataset == "verses" or self.data.tokens is not None:
            raise ValueError(
                "distill weighs every row alike: not for padded per-token data (verses, tokens)"
            )
        if self.distill.cache is not None and (self.data.augment or self.data.stages):
            raise ValueError(
                "distill.cache holds the teacher's logits of each sample as it is stored: not "
                "with data.augment or data.stages (run the teacher online)"
            )
        return self

    @model_validator(mode="after")
    def _shrink_where_any_rank_can_go(self) -> Config:
        if self.train.on_failure == "stop":
            return self
        s = self.strategy
        plain = s.name == "ddp" or (s.name == "zero" and not getattr(s, "shard_group", None))
        if not plain:
            raise ValueError(
                f"train.on_failure {self.train.on_failure!r} needs data-parallel ddp or zero "
                f"(without hybrid sharding), not {s.describe()}: the others must be able to "
                "train on without any one rank"
            )
        if getattr(s, "compression", None):
            raise ValueError(
                f"train.on_failure {self.train.on_failure!r}: not with compression (a codec's "
                "residuals are one rank's, and go with it)"
            )
        if self.data.mode == "queue" or self.data.balance == "dynamic" or self.data.rank_weights:
            raise ValueError(
                f"train.on_failure {self.train.on_failure!r}: the global batch is dealt evenly "
                "over the ranks left; not with data.mode queue, dynamic balance or rank_weights"
            )
        if self.data.augment_repeats > 1:  # (its order is laid out for the ranks it began on)
            raise ValueError(
                f"train.on_failure {self.train.on_failure!r}: not with data.augment_repeats "
                "(each sample's repeats are laid out over the ranks the epoch began with)"
            )
        return self

    @model_validator(mode="after")
    def _stages_on_split_data(self) -> Config:
        if not self.data.stages:
            return self
        if self.strategy.name == "ps" or self.data.mode == "queue":
            raise ValueError("data.stages are for split data (data.mode split), not a work queue")
        if self.data.balance == "dynamic" or self.data.augment_repeats > 1:
            raise ValueError("data.stages: not with dynamic balance or repeated augmentation yet")
        for i, stage in enumerate(self.data.stages):  # (each stage's data whole, before a run)
            try:
                stage.data(self.data)
                stage.parts(self.data)
            except ValidationError as e:
                problem = e.errors()[0]["msg"].removeprefix("Value error, ")
                raise ValueError(f"data.stages[{i}]: {problem}") from None
        return self

    @model_validator(mode="after")
    def _start_where_the_state_is_whole(self) -> Config:
        if self.start is None:
            return self
        s = self.strategy
        if s.name in ("ps", "tp", "pp"):
            raise ValueError(
                f"start needs a strategy that loads a whole training state (ddp, zero, a "
                f"mesh, local_sgd, gossip, adaptive), not {s.describe()}"
            )
        if self.start.grow_vocab and self.start.mode == "resume":
            raise ValueError("start.grow_vocab changes the model: mode continue or finetune")
        return self

    @model_validator(mode="after")
    def _pruning_where_every_weight_is_ranked(self) -> Config:
        if self.prune is None:
            return self
        s = self.strategy
        if s.name in ("pp", "ps") or (s.name == "mesh" and s.pp > 1) or self.data.mode == "queue":
            raise ValueError(
                f"prune ranks every weight of the model on every step it prunes: not with "
                f"{s.describe()} or data.mode 'queue'"
            )
        if self.prune.pattern is not None:
            n, m = map(int, self.prune.pattern.split(":"))
            if n >= m:
                raise ValueError(f"prune.pattern {self.prune.pattern!r}: N must be below M")
        elif self.prune.sparsity == 0:
            raise ValueError("prune needs sparsity (global magnitude) or pattern (N:M)")
        if self.prune.end < self.prune.start:
            raise ValueError(f"prune.end {self.prune.end} is before prune.start {self.prune.start}")
        return self

    @model_validator(mode="after")
    def _augmentation_that_fits_the_data(self) -> Config:
        data = self.data
        if data.augment == "shift" and (
            data.dataset != "digits" or data.factory is not None or data.tokens is not None
        ):
            raise ValueError("data.augment 'shift' moves the digits' 8x8 images: dataset digits")
        if data.augment is not None and data.augment != "shift" and ":" not in data.augment:
            raise ValueError(
                f"data.augment {data.augment!r}: 'shift' or module:function (x, generator) -> x"
            )
        if data.augment not in (None, "shift"):
            try:
                user_code.load(data.augment)  # (it imports: before any rank starts)
            except ValueError as e:
                raise ValueError(f"data.augment: {e}") from None
        if data.augment is not None and (data.mode == "queue" or self.strategy.name == "ps"):
            raise ValueError(
                "data.augment needs the ordered loader, which gives it the epoch: not data.mode "
                "'queue' nor a parameter server's dealt batches"
            )
        if data.augment_repeats > 1 and data.augment is None:
            raise ValueError("data.augment_repeats needs data.augment")
        if data.augment_repeats > 1 and (data.rank_weights is not None or data.balance != "static"):
            raise ValueError("data.augment_repeats needs equal batch sizes per rank")
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
        if self.train.nonfinite == "rollback":
            raise ValueError(
                "train.nonfinite 'rollback' needs split data: a work queue's chunks are "
                "stepped as each rank claims them (skip or stop)"
            )
        return self

    @model_validator(mode="after")
    def _accumulate_where_a_step_is_one_batch(self) -> Config:
        s, k = self.strategy, self.train.accumulate
        if k > 1 and (s.name == "pp" or (s.name == "mesh" and s.pp > 1)):
            raise ValueError(
                f"train.accumulate {k}: a pipeline accumulates over its micro-batches already: "
                "set strategy.microbatches K times higher instead"
            )
        if k > self.data.batch_size:
            raise ValueError(
                f"train.accumulate {k}: a rank's batch of {self.data.batch_size} "
                "(data.batch_size) cannot be split into that many micro-batches"
            )
        if k > 1 and self.data.mode == "queue" and s.name != "ps":
            raise ValueError(
                f"train.accumulate {k}: data.mode 'queue' takes one local step per chunk"
            )
        return self

    @model_validator(mode="after")
    def _built_in_model_fits_the_data(self) -> Config:
        # (before any rank starts: a stage's too long windows failed the run when it began)
        name, data = self.model.name, self.data
        if name is None:
            return self
        if name != "gpt":
            if data.dataset != "digits" or data.tokens is not None:
                raise ValueError(f"model {name!r} needs data.dataset 'digits'")
            return self
        if data.dataset not in ("text", "verses") and data.tokens is None:
            raise ValueError("model 'gpt' needs data.dataset 'text' or 'verses', or data.tokens")
        if data.tokens is not None and not data.vocab_size:
            raise ValueError("model 'gpt' on data.tokens needs data.vocab_size")
        for i, stage in enumerate(data.stages):
            if stage.seq_len is not None and stage.seq_len > data.seq_len:
                raise ValueError(
                    f"data.stages[{i}].seq_len {stage.seq_len}: longer than model 'gpt' reads "
                    f"(its positions are data.seq_len's {data.seq_len})"
                )
        return self

    @model_validator(mode="after")
    def _micro_batches_that_divide_the_batch(self) -> Config:
        s = self.strategy
        staged = s.name == "pp" or (s.name == "mesh" and s.pp > 1)
        equal = self.data.rank_weights is None and self.data.balance == "static"
        if staged and equal and self.data.batch_size % s.microbatches:
            raise ValueError(
                f"strategy.microbatches {s.microbatches} does not divide data.batch_size "
                f"{self.data.batch_size} (a pipeline's micro-batches are equal shares of it)"
            )
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
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeys)
    except yaml.YAMLError as e:
        raise ConfigError(f"config error: {path} is not valid YAML: {e}".splitlines()[0]) from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config error: {path} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    if raw is None:  # (not the default job in silence: `{}` says that)
        raise ConfigError(f"config error: {path} holds no config (give its sections, or {{}})")
    if not isinstance(raw, dict):
        raise ConfigError(f"config error: {path} must hold a mapping at the top level")
    parsed = parse_overrides(list(overrides))
    # Another strategy named: the file's options were for the old one. First, so that the
    # options given beside it on the command line, before it or after, are the new one's.
    names = [value for key, value in parsed if key == "strategy.name"]
    if names and names[-1] != (raw.get("strategy") or {}).get("name"):
        raw["strategy"] = {}
    for key, value in parsed:
        _set_dotted(raw, key, value)
    return validate(raw)


class UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (where the last would win
    in silence: `train:` twice loses the first one's settings)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (line {key_node.start_mark.line + 1})"
                )
            if key is not None:  # (a key of keys: none in a config)
                seen.add(key)
        return super().construct_mapping(node, deep)


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
        field = Config.model_fields[name]
        # (a section that is off unless given, `distill: X | None`, has no factory: its class)
        section = field.default_factory or next(
            kind for kind in get_args(field.annotation) if kind is not type(None)
        )
        title = name if field.default_factory else f"{name} (optional: none unless given)"
    else:
        known = ", ".join([*section_names(), *by_strategy])
        raise ConfigError(f"config error: no section or strategy named {name!r} ({known})")
    rows = []
    for field_name, info in section.model_fields.items():
        kind = info.annotation
        kind = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
        default = "(required)" if info.is_required() else repr(info.default)
        rows.append((field_name, kind, default, info.description or ""))
    return title, rows


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
