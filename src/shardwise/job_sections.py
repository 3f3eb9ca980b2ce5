"""The sections of a job's configuration besides its strategy's: `data`, `model`, `optim`,
`train` and `launch` (each strategy declares its own section beside its options). `config`
assembles them into one `Config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardwise.strategies.section import Section

PACKAGE_DATA = Path(__file__).resolve().parent / "data" / "datasets"


def resolve_data_path(path: str) -> Path:
    """Find a data file from the working directory or the bundled datasets; one-line error."""
    for candidate in (Path(path), PACKAGE_DATA / path):
        if candidate.is_file():
            return candidate.resolve()
    raise ValueError(f"dataset file not found: {path}")


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
