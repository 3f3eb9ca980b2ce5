"""The sections of a job's configuration besides its strategy's: `data`, `model`, `optim`,
`train` and `launch` (each strategy declares its own section beside its options). `config`
assembles them into one `Config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeFloat, PositiveInt, field_validator, model_validator

from shardwise import user_code
from shardwise.strategies.section import Section

PACKAGE_DATA = Path(__file__).resolve().parent / "data" / "datasets"


# A seed torch's generators take (`manual_seed`: a 64-bit integer), numpy's too (non-negative).
Seed = Annotated[int, Field(ge=0, lt=2**63)]


def resolve_data_path(path: str) -> Path:
    """Find a data file from the working directory or the bundled datasets; one-line error."""
    for candidate in (Path(path), PACKAGE_DATA / path):
        if candidate.is_file():
            return candidate.resolve()
    raise ValueError(f"dataset file not found: {path}")


# Where a model or the data comes from: one of these, exactly (the first is the default).
_DATA_SOURCES = ("dataset", "factory", "tokens")
_MODEL_SOURCES = ("name", "factory", "hf_config", "hf_pretrained")


def _importable(path: str | None) -> str | None:
    """A `module:function` that imports (a one-line error naming it where not)."""
    if path is not None:
        user_code.load(path)
    return path


def _existing(path: str | None) -> str | None:
    """A data file that exists (a one-line error naming it where not)."""
    if path is not None:
        resolve_data_path(path)
    return path


def _one_source(given: dict[str, Any]) -> None:
    named = [key for key, value in given.items() if value is not None]
    if len(named) > 1:
        raise ValueError(f"{' and '.join(named)} are exclusive: give one")


_STAGED = ("seq_len", "path", "tokens", "factory", "args")  # what a stage or a part may change


def _with(base: DataConfig, section: Section) -> DataConfig:
    """`base` with the data fields `section` gives (a new source replaces the old one)."""
    raw = base.model_dump()
    if getattr(section, "tokens", None) is not None or getattr(section, "factory", None):
        raw.update(dict.fromkeys(_DATA_SOURCES), path=None)  # (one source at a time)
    raw.update({k: v for k in _STAGED if (v := getattr(section, k, None)) is not None})
    raw["stages"] = []
    return DataConfig.model_validate(raw)


class DataSource(Section):
    """Another source of training data than the data section's (a stage's, a mixture part's)."""

    path: str | None = Field(None, description="text/verses: this file")
    tokens: str | None = Field(None, description="this token file")
    factory: str | None = Field(None, description="this data factory (module:function)")
    args: dict[str, Any] | None = Field(None, description="keyword arguments of factory")

    _files_exist = field_validator("path", "tokens")(_existing)
    _factory_imports = field_validator("factory")(_importable)


class MixturePart(DataSource):
    weight: float = Field(gt=0, description="this source's share of the stage's samples")


class DataStage(DataSource):
    at: int = Field(ge=2, description="the step this stage's data starts at")
    seed: Seed | None = Field(
        None, description="the order's seed from here (default train.seed; the split stays)"
    )
    seq_len: int | None = Field(None, ge=1, description="windows of this many tokens from here")
    mixture: list[MixturePart] | None = Field(
        None,
        description="several sources by weight, e.g. [{tokens: web.bin, weight: 3}, {tokens: "
        "code.bin, weight: 1}]: each part is this stage's data with its own source; as many "
        "samples as the parts hold together, each part its weight's share (repeated or "
        "subsampled, the same every epoch)",
    )

    def data(self, base: DataConfig) -> DataConfig:
        """The data section this stage trains on: `base` with this stage's fields."""
        return _with(base, self)

    def parts(self, base: DataConfig) -> list[DataConfig]:
        """Each mixture part's data section (none without a mixture)."""
        return [_with(self.data(base), part) for part in self.mixture or []]


class DataConfig(Section):
    dataset: Literal["digits", "text", "verses"] | None = Field(
        None,
        description="a built-in dataset, the default where no factory or tokens is given: "
        "'digits': scikit-learn's 8x8 handwritten digits; 'text': a file, in windows of "
        "seq_len characters (training windows start every seq_len / 2 characters, so each "
        "character is trained on about twice an epoch; evaluation windows do not overlap); "
        "'verses': a file cut into documents of varying length, one per line (for the "
        "character GPT)",
    )
    factory: str | None = Field(
        None,
        description="your own data: 'module:function' (e.g. my_data:build), imported from the "
        "working directory or PYTHONPATH and called with `args`; it returns the training and "
        "evaluation map-style datasets, as a pair (train, eval) or a dict with keys 'train' and "
        "'eval'. Samples are (input, target) pairs, or dicts of tensors with a 'labels' entry "
        "(Hugging Face batches: the model is called as model(**batch))",
    )
    args: dict[str, Any] = Field({}, description="keyword arguments of data.factory")
    tokens: str | None = Field(
        None,
        description="a token corpus larger than memory: a flat binary file of token ids "
        "(nanoGPT's train.bin), read through numpy.memmap, never whole; a sample is a window of "
        "seq_len tokens and its target the same window one token later (windows do not "
        "overlap); the last test_fraction is held out unless eval_tokens is given",
    )
    eval_tokens: str | None = Field(
        None, description="tokens: a held-out corpus of the same layout to evaluate on"
    )
    dtype: Literal["uint16", "uint32", "int32", "int64"] = Field(
        "uint16", description="tokens: the element type of the token files (nanoGPT's: uint16)"
    )
    vocab_size: int | None = Field(
        None, ge=2, description="tokens with model.name gpt: the vocabulary (ids are below it)"
    )
    windows: Literal["auto", "pairs", "dicts"] = Field(
        "auto",
        description="tokens: each window as an (input, target) pair, or as a dict {input_ids, "
        "labels} with labels = input_ids (Hugging Face causal LMs shift them themselves, so a "
        "window's last target goes unscored); auto: dicts for hf_config and hf_pretrained "
        "models, pairs otherwise",
    )
    path: str | None = Field(
        None,
        description="text file for dataset=text or verses; relative paths are tried from the "
        "working directory, then from shardwise's bundled datasets",
    )
    seq_len: int = Field(
        128, ge=2, description="tokens (characters) per training sequence (text, verses, tokens)"
    )
    packing: Literal["none", "pack"] = Field(
        "none",
        description="verses: 'none' pads each document to its own row of seq_len; 'pack' puts "
        "documents end to end in rows (bin packing), with attention kept inside each document",
    )
    batch_size: int = Field(
        32, ge=1, description="samples per rank per step (the global batch: this x ranks)"
    )
    augment: str | None = Field(
        None,
        description="training inputs' augmentation, its draws a pure function of (train.seed, "
        "epoch, sample, repeat): 'shift' (digits: moved up to a pixel each way) or "
        "module:function(x, generator) -> x of your own",
    )
    augment_repeats: int = Field(
        1,
        ge=1,
        description="repeated augmentation: each training sample this many times an epoch, "
        "augmented anew each time, the repeats in one step on different ranks",
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
    stages: list[DataStage] = Field(
        [],
        description="step-indexed changes of the training data, e.g. [{at: 500, seq_len: 256}, "
        "{at: 800, tokens: more.bin, seed: 1}]: from step `at` the loader draws from the data "
        "the stage describes, from a fresh epoch (checkpoints hold the stage and its position)",
    )

    @model_validator(mode="before")
    @classmethod
    def _digits_by_default(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and all(raw.get(k) is None for k in _DATA_SOURCES):
            return {**raw, "dataset": "digits"}
        return raw

    _files_exist = field_validator("path", "tokens", "eval_tokens")(_existing)

    _factory_imports = field_validator("factory")(_importable)

    @field_validator("rank_weights")
    @classmethod
    def _weights_positive(cls, weights: list[float] | None) -> list[float] | None:
        if weights is not None and (not weights or any(w <= 0 for w in weights)):
            raise ValueError(f"rank weights must be > 0, one per rank, got {weights}")
        return weights

    @model_validator(mode="after")
    def _sources_fit(self) -> DataConfig:
        _one_source({k: getattr(self, k) for k in _DATA_SOURCES})
        if self.eval_tokens is not None and self.tokens is None:
            raise ValueError("eval_tokens needs tokens (the training corpus)")
        if self.dataset in ("text", "verses") and self.path is None:
            raise ValueError(f"dataset {self.dataset!r} needs data.path")
        if self.path is not None and self.dataset not in ("text", "verses"):
            source = self.dataset or ("tokens" if self.tokens else "factory")
            raise ValueError(
                f"data.path is read by dataset 'text' or 'verses' only, and this data is "
                f"{source!r} (set data.dataset)"
            )
        if self.packing != "none" and self.dataset != "verses":
            raise ValueError(f"packing {self.packing!r} needs dataset 'verses'")
        starts = [stage.at for stage in self.stages]
        if starts != sorted(set(starts)):
            raise ValueError(f"data.stages must start at increasing steps, got {starts}")
        return self


class ModelConfig(Section):
    name: Literal["mlp", "cnn", "gpt"] | None = Field(
        None,
        description="a built-in model, the default (mlp) where no factory, hf_config or "
        "hf_pretrained is given: mlp or cnn (digits), gpt (text, verses, tokens)",
    )
    factory: str | None = Field(
        None,
        description="your own model: 'module:function' (e.g. my_models:build), imported from "
        "the working directory or PYTHONPATH and called with `args` (seeded by train.seed, "
        "the same on every rank); it returns a torch.nn.Module",
    )
    args: dict[str, Any] = Field({}, description="keyword arguments of model.factory")
    hf_config: str | None = Field(
        None,
        description="a Hugging Face model, freshly initialised from this config.json (or a "
        "folder holding one): the transformers class its 'architectures' names (pip install "
        "shardwise[hf])",
    )
    hf_pretrained: str | None = Field(
        None,
        description="a Hugging Face model loaded from this local folder: config.json and "
        "safetensors weights, one file or sharded (model.safetensors.index.json), in fp32; "
        "built on the meta device, each rank reads only the part its strategy keeps",
    )
    loss: str | None = Field(
        None,
        description="your own loss: 'module:function' taking (output, target), returning a "
        "scalar mean. Default: for (input, target) samples, cross-entropy over the output's "
        "last dimension (targets of -100 ignored); for dict samples, the output's own loss "
        "(output.loss or output['loss']: the Hugging Face idiom). With a loss, a dict sample's "
        "'labels' are its target and the model gets the other entries",
    )
    hidden: list[int] = Field([128, 128], description="mlp: hidden layer widths")
    channels: tuple[PositiveInt, PositiveInt] = Field(
        (16, 32), description="cnn: channels of the two conv blocks"
    )
    d_model: int = Field(256, ge=8, description="gpt: embedding width")
    n_layer: int = Field(4, ge=1, description="gpt: transformer blocks")
    n_head: int = Field(4, ge=1, description="gpt: attention heads (must divide d_model)")

    @model_validator(mode="before")
    @classmethod
    def _mlp_by_default(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and all(raw.get(k) is None for k in _MODEL_SOURCES):
            return {**raw, "name": "mlp"}
        return raw

    _code_imports = field_validator("factory", "loss")(_importable)

    @field_validator("hf_config")
    @classmethod
    def _config_exists(cls, path: str | None) -> str | None:
        if path is not None and not (
            Path(path).is_file() or (Path(path) / "config.json").is_file()
        ):
            raise ValueError(f"no config.json at {path}")
        return path

    @field_validator("hf_pretrained")
    @classmethod
    def _folder_exists(cls, path: str | None) -> str | None:
        if path is not None and not (Path(path) / "config.json").is_file():
            raise ValueError(f"{path} is not a folder with a config.json (and its weights)")
        return path

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        _one_source({k: getattr(self, k) for k in _MODEL_SOURCES})
        if self.d_model % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model})")
        if any(h < 1 for h in self.hidden):
            raise ValueError(f"hidden widths must be >= 1, got {self.hidden}")
        return self


class OptimConfig(Section):
    name: Literal["adamw", "adam", "sgd", "lars", "lamb"] = Field(
        "adamw",
        description="torch.optim's adamw, adam, sgd; or sw.optim's lars, lamb (layer-wise trust "
        "ratios of whole parameters under any strategy, for large batches)",
    )
    lr: float = Field(1e-3, gt=0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd, lars: momentum")
    eta: float = Field(0.001, gt=0, description="lars: trust coefficient")
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


class DistillConfig(Section):
    teacher: str = Field(
        description="module:function that builds the teacher nn.Module (its weights loaded: "
        "it is frozen); the student is the config's model"
    )
    args: dict[str, Any] = Field({}, description="keyword arguments of distill.teacher")
    temperature: float = Field(2.0, gt=0, description="softens both outputs: softmax(z / T)")
    alpha: float = Field(
        0.5, ge=0, le=1, description="weight of the teacher's term, T^2 KL; 1 - alpha: the labels'"
    )
    shard: bool = Field(
        False, description="shard the teacher over the ranks as ZeRO-3 does (about 1/N each)"
    )
    cache: str | None = Field(
        None,
        description="offline teacher: a file of its top-K logits for every training sample, "
        "read instead of running the teacher (built there first from distill.teacher where "
        "it does not exist)",
    )
    top_k: int | None = Field(
        None, ge=1, description="cache: the logits kept per sample (default: all of them)"
    )

    _teacher_imports = field_validator("teacher")(_importable)


class PruneConfig(Section):
    sparsity: float = Field(
        0.0, ge=0, lt=1, description="share of the weights (matrices and larger) pruned at the end"
    )
    pattern: str | None = Field(
        None,
        pattern=r"^[1-9]\d*:[1-9]\d*$",
        description="'N:M' (e.g. 2:4): keep N of every M consecutive weights along each "
        "weight's last dimension from prune.start on, instead of global magnitude pruning "
        "(sparsity 1 - N/M; prune.sparsity, end and every unused)",
    )
    start: int = Field(0, ge=0, description="the step pruning starts at")
    end: int = Field(0, ge=0, description="the step it reaches sparsity at (cubic in between)")
    every: int = Field(1, ge=1, description="steps between prunings while it rises")

    @field_validator("pattern", mode="before")
    @classmethod
    def _pattern_quoted(cls, pattern: Any) -> Any:
        if isinstance(pattern, int) and pattern > 60 and pattern % 60:  # (YAML 1.1: 2:4 is 124)
            n, m = divmod(pattern, 60)
            raise ValueError(f"YAML read an unquoted {n}:{m} as the number {pattern}: quote it")
        return pattern


class StartConfig(Section):
    mode: Literal["resume", "continue", "finetune"] = Field(
        description="resume: the same run going on (model, optimizer, schedule, random state, "
        "data position and step as saved); continue: weights and optimizer state, with a "
        "fresh schedule, data position and step count; finetune: weights only"
    )
    checkpoint: str = Field(
        description="a run directory (its newest checkpoint; finetune: else its final "
        "weights) or one checkpoint's directory"
    )
    grow_vocab: bool = Field(
        False,
        description="continue/finetune: tensors whose first dimension grew (embedding, output "
        "layer, tied or not) keep their rows and moments; new rows are drawn from the old "
        "rows' mean and covariance",
    )


class TrainConfig(Section):
    steps: int = Field(200, ge=1, lt=2**63, description="optimizer steps to run")
    seed: Seed = Field(0, description="seed for model initialisation and data order")
    log_every: int = Field(10, ge=1, description="steps between logged (globally averaged) losses")
    eval_batch_size: int = Field(256, ge=1, description="per-rank batch size for evaluation")
    clip_grad_norm: float | None = Field(
        None, gt=0, description="clip gradients to this global L2 norm (any strategy)"
    )
    accumulate: int = Field(
        1,
        ge=1,
        description="gradient accumulation: each rank's batch of a step runs forward and "
        "backward as this many micro-batches (as equal as they go), gradients synchronised "
        "once, in the last backward; the update is the whole batch's, the activations one "
        "micro-batch's (a pipeline: raise strategy.microbatches instead)",
    )
    eval_every: int = Field(0, ge=0, description="evaluate every K steps too (0: at the end only)")
    tensorboard: bool = Field(
        True, description="write TensorBoard event files to RUN_DIR/tensorboard (rank 0)"
    )
    measure: bool = Field(
        True,
        description="per-phase timing, gradient norm, activation memory, TensorBoard and "
        "the cost model's prediction of the run (false: only each step's time, waiting and "
        "bytes; what `bench overhead` compares; and no prediction, ~1 s less to start)",
    )
    trace_steps: list[int] = Field(
        [],
        description="[a, b]: record every rank's phases and collectives from step a to step b "
        "and merge them, clocks synchronised, into RUN_DIR/trace.json (Perfetto, chrome://tracing)",
    )

    delay_s: list[NonNegativeFloat] = Field(
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
    on_failure: Literal["stop", "shrink", "replace"] = Field(
        "stop",
        description="a rank that dies or hangs: every rank stops (and the job restarts from "
        "its newest checkpoint under launch.max_restarts); or the others go on without it "
        "from the step in hand, the same global batch dealt over them, no checkpoint read "
        "(data-parallel ddp and zero); replace: and the launcher starts a replacement, which "
        "the others take in at a step boundary and send the whole state",
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

    @field_validator("skip_batches")
    @classmethod
    def _batches_from_one(cls, batches: list[int]) -> list[int]:
        if any(b < 1 for b in batches):
            raise ValueError(f"global batches count from 1 (the run's first), got {batches}")
        return batches

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
    bind_cores: bool = Field(
        False,
        description="run each local rank on threads_per_rank cores of its own (steadier step "
        "times where the job has the machine to itself; off where other jobs share its cores)",
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
