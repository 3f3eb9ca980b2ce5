"""Where one rank's step goes: seconds per phase, each measured by its own clock.

    data       fetching the batch and moving it to the device
    forward    the model's forward calls (every micro-batch's, for a pipeline)
    backward   the rest of `train_step`: loss, backward, a slowed rank's emulated work
    optimizer  clipping, the optimizer's step, zeroing, the schedule
    sync       agreeing with the other ranks on the loss, its finiteness, stopping
    wait       blocked in collectives, waiting for data or for the other ranks

What the loop spends outside these (its own bookkeeping) is not counted anywhere: the
breakdown's sum falls short of the measured step time by that much, which shows whether the
phases cover the step.

Time blocked in a collective is taken out of the phase it falls in and counted once, as
`wait`, from the communication layer's own accounting (`comm.stats`). What is waiting for a
slower rank and what is the transfer itself needs every rank's figures: `breakdown` splits
them, after the run, from the ranks' timing files.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn

from shardwise import comm
from shardwise.observe.timeline import Timeline

PHASES = ("data", "forward", "backward", "optimizer", "sync")


class PhaseTimer:
    """Per-phase seconds of the current step on this rank, blocked time excluded."""

    def __init__(self, model: nn.Module, enabled: bool = True, sample_every: int = 1) -> None:
        self.enabled = self.active = enabled
        # On a GPU the host runs ahead of the kernels it launched: a phase ends when the
        # compute stream has finished its work (communication streams run on, unwaited). Those
        # waits cost a small model's step a third of its time, so on a GPU only every
        # `sample_every`-th step is measured; on a CPU every one is, at no such cost.
        device = next(model.parameters()).device
        self.on_gpu = device.type == "cuda"
        self.sample_every = sample_every if self.on_gpu else 1
        self._sync = torch.cuda.current_stream(device).synchronize if self.on_gpu else _nothing
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._forward_start: tuple[float, float] | None = None
        self.timeline: Timeline | None = None  # given while `train.trace_steps` records
        # Hooks on the plain module the strategy runs (a pipeline: this rank's stage; a mesh:
        # inside its outer strategy's model), so every forward call is timed, micro-batches
        # and recomputation included.
        module = model
        while isinstance(getattr(module, "module", None), nn.Module):
            module = module.module
        self._hooks = (
            [
                module.register_forward_pre_hook(self._forward_begins),
                module.register_forward_hook(self._forward_ends),
            ]
            if enabled
            else []
        )

    def start_step(self, step: int) -> None:
        """Whether this step is measured (see `sample_every`)."""
        self.active = self.enabled and step % self.sample_every == 0

    def _forward_begins(self, module, args) -> None:
        if self.active:
            self._forward_start = (time.perf_counter(), comm.stats.step_wait_s())

    def _forward_ends(self, module, args, output) -> None:
        if self._forward_start is not None:
            self._sync()
            started, waited = self._forward_start
            blocked, now = comm.stats.step_wait_s() - waited, time.perf_counter()
            self.seconds["forward"] += now - started - blocked
            self._forward_start = None
            if self.timeline is not None:
                self.timeline.span("forward", started, now)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase; forward calls inside it are left to `forward`."""
        if not self.active:
            yield
            return
        started, waited = time.perf_counter(), comm.stats.step_wait_s()
        forward = self.seconds["forward"]
        try:
            yield
        finally:
            self._sync()
            blocked, now = comm.stats.step_wait_s() - waited, time.perf_counter()
            inner = self.seconds["forward"] - forward
            self.seconds[name] += now - started - blocked - inner
            if self.timeline is not None:  # `backward`'s span holds the forward calls
                self.timeline.span("forward+backward" if name == "backward" else name, started, now)

    def take(self) -> dict[str, float]:
        """This step's seconds per phase (none, when not enabled); the next step starts from
        zero."""
        if not self.active:
            self.seconds = dict.fromkeys(PHASES, 0.0)
            return {}
        seconds, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return seconds

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _nothing() -> None:
    pass


def breakdown(ranks: list[list[dict]]) -> list[dict[str, float]]:
    """Per rank, the mean seconds per step in compute (every phase), exposed communication and
    idle time, and the measured step time, from each rank's timing lines (`timing/rank{r}.jsonl`);
    also how long asynchronous collectives were in flight before being waited for (overlapped
    with compute, at most).

    Of a step's blocked time, the part every rank spent is the transfer itself: the rank that
    arrived last at each meeting still waited that long. The rest of a rank's blocked time it
    spent idle, waiting for slower ranks to arrive. Per step: exposed = min over ranks of the
    blocked time, idle = this rank's blocked time - exposed. The step that measured memory
    is left out when there are others.
    """
    # The steps every rank measured by phase (on a GPU, a sample of them); without any, each
    # step's time outside collectives counts as compute.
    every = [{line["step"] for line in lines} for lines in ranks]
    phased = [{line["step"] for line in lines if "data_s" in line} for lines in ranks]
    steps = set.intersection(*phased) or set.intersection(*every)
    # The step that measured memory ran under the meters, which slow each rank by its own
    # amount: a rank that waited there waited for a meter, not for a slower peer.
    metered = {line["step"] for lines in ranks for line in lines if "memory" in line}
    steps = sorted(steps - metered or steps)
    by_step = [{line["step"]: line for line in lines} for lines in ranks]
    out = []
    for mine in by_step:
        totals = dict.fromkeys(("compute", "exposed_comm", "idle", "step", "overlapped_comm"), 0.0)
        for step in steps:
            least = min(r[step]["wait_s"] for r in by_step)
            line = mine[step]
            if "data_s" in line:
                totals["compute"] += sum(line[f"{p}_s"] for p in PHASES)
            else:
                totals["compute"] += line["step_s"] - line["wait_s"]
            totals["exposed_comm"] += least
            totals["idle"] += line["wait_s"] - least
            totals["step"] += line["step_s"]
            # (in flight under compute, at most: not a part of the step's sum)
            totals["overlapped_comm"] += line.get("overlap_s", 0.0)
        out.append({k: v / max(1, len(steps)) for k, v in totals.items()})
    return out
