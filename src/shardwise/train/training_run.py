"""One rank's training run: the job, its distributed model and the parts the trainer composes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.config import Config
from shardwise.data.balance import ThroughputBalancer
from shardwise.distributed.runtime import Runtime
from shardwise.faults.injection import FaultInjector
from shardwise.faults.nonfinite import NonFinitePolicy
from shardwise.faults.watchdog import Watchdog
from shardwise.jobs import Job
from shardwise.observe.metrics import MetricsWriter
from shardwise.observe.phases import PhaseTimer
from shardwise.observe.step_trace import StepTrace
from shardwise.recipes.pruning import Pruner
from shardwise.strategies.base import DistributedModel
from shardwise.train.data_feed import DataFeed
from shardwise.train.validator import Validator


@dataclass
class Wrapped:
    """What a step calls, as the run's faults make it (`FaultInjector.wrap_*`): the forward and
    backward, the training loss, and the all-reduce every rank agrees through."""

    compute: Callable
    loss: Callable
    reduce: Callable[[torch.Tensor], None]


@dataclass
class Measured:
    """What the run measured so far, for its summary."""

    loss: float = float("nan")  # the last step's, averaged over the global batch
    step_times: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)  # the whole step's, every rank's
    memory: dict[str, int] = field(default_factory=dict)  # at the last step (its fullest)
    predicted: dict[str, Any] = field(default_factory=dict)  # prediction.for_run, before step 1
    data_bytes: int = 0  # tensors alive beside the job's own (its dataset): not its peak's


@dataclass
class TrainingRun:
    """The parts of one rank's run (`build.py` makes them; the trainer composes them)."""

    cfg: Config
    rt: Runtime
    job: Job  # (its model: the distributed one)
    model: DistributedModel
    opt: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    out: Path
    feed: DataFeed
    checkpointer: Checkpointer
    policy: NonFinitePolicy
    watchdog: Watchdog
    validator: Validator
    faults: FaultInjector
    phases: PhaseTimer  # this rank's seconds per phase of the step
    wrapped: Wrapped
    measured: Measured
    balancer: ThroughputBalancer | None = None
    pruner: Pruner | None = None  # `prune:`
    trace: StepTrace | None = None  # `train.trace_steps`
    metrics: MetricsWriter | None = None  # made once a resume knows its step
    start_step: int = 0  # steps done before this process started (a resumed run)
    stop_signal: int = 0  # SIGTERM / SIGINT received: checkpoint after this step and leave
    stopped_by: dict[int, int] = field(default_factory=dict)  # agreed: rank -> its signal
    elastic: Any = None  # `train.on_failure: shrink | replace`: `elastic.Elastic`
    joiners_due: bool = False  # agreed: replacements wait to join (taken in as a step begins)

    @property
    def stopping(self) -> bool:
        """Every rank agreed to stop after this step (a rank was sent SIGTERM or SIGINT)."""
        return bool(self.stopped_by)

    def restore(self, data: dict[str, Any]) -> None:
        """Go on from a loaded checkpoint's data position (where the balancing had got to too)."""
        self.feed.load_state_dict(data, resize=self.balancer is not None)
