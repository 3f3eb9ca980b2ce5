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

from torch import nn

from shardwise import comm

PHASES = ("data", "forward", "backward", "optimizer", "sync")


class PhaseTimer:
    """Per-phase seconds of the current step on this rank, blocked time excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._forward_start: tuple[float, float] | None = None
        # Hooks on the plain module the strategy runs (a pipeline: this rank's stage; a mesh:
        # inside its outer strategy's model), so every forward call is timed, micro-batches
        # and recomputation included.
        module = model
        while isinstance(getattr(module, "module", None), nn.Module):
            module = module.module
        self._hooks = [
            module.register_forward_pre_hook(self._forward_begins),
            module.register_forward_hook(self._forward_ends),
        ]

    def _forward_begins(self, module, args) -> None:
        self._forward_start = (time.perf_counter(), comm.stats.step_wait_s())

    def _forward_ends(self, module, args, output) -> None:
        if self._forward_start is not None:
            started, waited = self._forward_start
            blocked = comm.stats.step_wait_s() - waited
            self.seconds["forward"] += time.perf_counter() - started - blocked
            self._forward_start = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase; forward calls inside it are left to `forward`."""
        started, waited = time.perf_counter(), comm.stats.step_wait_s()
        forward = self.seconds["forward"]
        try:
            yield
        finally:
            blocked = comm.stats.step_wait_s() - waited
            inner = self.seconds["forward"] - forward
            self.seconds[name] += time.perf_counter() - started - blocked - inner

    def take(self) -> dict[str, float]:
        """This step's seconds per phase; the next step starts from zero."""
        seconds, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return seconds

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def breakdown(ranks: list[list[dict]]) -> list[dict[str, float]]:
    """Per rank, the mean seconds per step in compute (every phase), exposed communication and
    idle time, and the measured step time, from each rank's timing lines (`timing/rank{r}.jsonl`).

    Of a step's blocked time, the part every rank spent is the transfer itself: the rank that
    arrived last at each meeting still waited that long. The rest of a rank's blocked time it
    spent idle, waiting for slower ranks to arrive. Per step: exposed = min over ranks of the
    blocked time, idle = this rank's blocked time - exposed.
    """
    steps = sorted(set.intersection(*({line["step"] for line in lines} for lines in ranks)))
    by_step = [{line["step"]: line for line in lines} for lines in ranks]
    out = []
    for mine in by_step:
        totals = dict.fromkeys(("compute", "exposed_comm", "idle", "step"), 0.0)
        for step in steps:
            least = min(r[step]["wait_s"] for r in by_step)
            line = mine[step]
            totals["compute"] += sum(line.get(f"{p}_s", 0.0) for p in PHASES)
            totals["exposed_comm"] += least
            totals["idle"] += line["wait_s"] - least
            totals["step"] += line["step_s"]
        out.append({k: v / max(1, len(steps)) for k, v in totals.items()})
    return out
