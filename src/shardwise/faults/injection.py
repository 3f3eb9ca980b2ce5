"""Fault injection for tests, demos and benchmarks.

From the config (`faults: [...]`) or the environment, with one grammar (several: commas):

    SHARDWISE_FAULT="kill:rank=1:step=37"

- `kill:rank=R:step=S`: rank R sends itself SIGKILL as step S begins.
- `hang:rank=R:step=S`: rank R stops issuing collectives at step S (it sleeps, alive).
- `nan:rank=R:step=S`: rank R's loss, and so its gradient, is NaN at step S.
- `slow:rank=R:factor=F[:step=S]`: rank R computes F times as slowly per sample: before each
  forward it sleeps F - 1 times its cost per sample so far (`PerSampleCost`, fitted from its
  real work, time waiting in collectives excluded) times its samples, so the step's fixed costs
  are not slowed and giving the rank fewer samples helps, as on slower hardware. From step S on,
  if given (a later `slow` fault on the same rank replaces an earlier one:
  `slow:rank=1:factor=2,slow:rank=1:factor=4:step=50`). Servers and relays, which have no
  samples, sleep F - 1 times the whole work (an update, a forwarded push).
- `desync:rank=R:step=S`: rank R broadcasts where the others all-reduce the loss at step S.
- `rejoin:step=S`: in an elastic job (`train.on_failure: replace`), the members wait for a
  replacement of a lost rank as step S begins and take it in there (not at the first step
  boundary after it is ready): a transition at a step of the test's choosing.
- `corrupt-checkpoint:step=S`: one file of step S's checkpoint is damaged after it is written.
- `clock-skew:rank=R:seconds=X`: rank R's clock for the timeline (`train.trace_steps`) runs X
  seconds ahead (negative: behind), as an unsynchronised host's would; the merged trace must
  measure the offset and undo it.

In a parameter-server job, `kill`, `hang` and `slow` apply to every role by rank, and `step`
counts what that role does: a worker's steps, a server's updates, a relay's forwarded pushes
(a hung server or relay keeps beating: the others must tell that it is stuck, not dead).

Each fault fires once per run: a marker under `RUN_DIR/faults/` records it (its time is when it
fired), so a job that restarts and resumes does not fire it again.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise import comm

ENV = "SHARDWISE_FAULT"
FIELDS = {  # kind -> the fields it needs
    "kill": ("rank", "step"),
    "hang": ("rank", "step"),
    "nan": ("rank", "step"),
    "desync": ("rank", "step"),
    "rejoin": ("step",),
    "slow": ("rank", "factor"),
    "corrupt-checkpoint": ("step",),
    "clock-skew": ("rank", "seconds"),
}
OPTIONAL = {"slow": ("step",)}  # kind -> the fields it may have


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    factor: float | None = None
    seconds: float | None = None

    @property
    def name(self) -> str:
        fields = (("rank", self.rank), ("step", self.step), ("factor", self.factor))
        parts = [self.kind] + [
            f"{key}{value}"
            for key, value in (*fields, ("seconds", self.seconds))
            if value is not None
        ]
        return "-".join(parts)


def parse(spec: str, source: str = ENV) -> list[Fault]:
    """`kill:rank=1:step=37,slow:rank=0:factor=3` -> faults; a one-line error when malformed."""
    where = f"{source}: " if source else ""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, *fields = item.split(":")
        if kind not in FIELDS:
            raise ValueError(f"{where}unknown fault {kind!r} in {item!r} (faults: {list(FIELDS)})")
        try:
            args = dict(field.split("=", 1) for field in fields)
            if not set(FIELDS[kind]) <= set(args) <= {*FIELDS[kind], *OPTIONAL.get(kind, ())}:
                raise ValueError
            fault = Fault(
                kind,
                rank=int(args["rank"]) if "rank" in args else None,
                step=int(args["step"]) if "step" in args else None,
                factor=float(args["factor"]) if "factor" in args else None,
                seconds=float(args["seconds"]) if "seconds" in args else None,
            )
        except ValueError:
            wanted = ":".join([kind] + [f"{f}=..." for f in FIELDS[kind]])
            raise ValueError(f"{where}expected {wanted}, got {item!r}") from None
        step_ok = fault.step is None or fault.step >= 1
        if not step_ok or (fault.rank is not None and fault.rank < 0):
            raise ValueError(f"{where}step must be >= 1 and rank >= 0 in {item!r}")
        if fault.factor is not None and not 1 <= fault.factor < math.inf:
            raise ValueError(f"{where}factor must be >= 1 and finite in {item!r}")
        if fault.seconds is not None and not math.isfinite(fault.seconds):
            raise ValueError(f"{where}seconds must be finite in {item!r}")
        faults.append(fault)
    return faults


class FaultInjector:
    """This rank's faults of the run. A training loop tells it each step as it begins
    (`before_step`: a kill or a hang happens there); the other faults are applied once, at
    set-up, by wrapping what they perturb (`wrap_loss`, `wrap_compute`, `wrap_reduce`,
    `wrap_save`): the trainer's step never asks whether a fault fires. (A parameter-server
    worker's own loop asks: `poisons_loss`, `slow_ahead`.)"""

    def __init__(
        self, rank: int, run_dir: Path, configured: list[str] = (), role: str = ""
    ) -> None:
        spec = ",".join([*configured, os.environ.get(ENV, "")])
        self.rank, self.where = rank, f"{role} rank {rank}" if role else f"rank {rank}"
        self.faults = [f for f in parse(spec) if f.rank in (None, rank)]
        self.fired_dir = Path(run_dir) / "faults"
        # (first step, factor) this rank's work is slowed by from then on; never marked fired
        self.slowdowns = sorted((f.step or 1, f.factor) for f in self.faults if f.kind == "slow")
        self._announced_slowdown = 1.0
        self.per_sample = PerSampleCost()
        self.step = 0  # the step under way (`before_step`)
        self._armed: list[Callable[[int], None]] = []  # the wrappers' faults, told each step

    def _has(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.faults)

    def _fires(self, kind: str, step: int | None = None) -> bool:
        """Whether a fault of `kind` fires (now: it is marked fired)."""
        for fault in self.faults:
            if fault.kind != kind or (step is not None and fault.step != step):
                continue
            marker = self.fired_dir / fault.name
            if marker.exists():
                continue
            self.fired_dir.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{time.time()}\n")
            print(f"shardwise: fault injected on {self.where}: {fault.name}", flush=True)
            return True
        return False

    def before_step(self, step: int) -> None:
        """`step` begins: this rank dies or hangs now if a fault says so, and the faults its
        wrappers apply (`wrap_loss`) fire or not for this step."""
        self.step = step
        if self._fires("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires("hang", step):
            while True:  # alive, but never issues another collective
                time.sleep(3600)
        for arm in self._armed:
            arm(step)

    def rejoins(self, step: int) -> bool:
        """Whether a `rejoin` fault takes a replacement in as `step` begins (on every rank:
        no marker, the members must agree)."""
        return any(f.kind == "rejoin" and f.step == step for f in self.faults)

    def clock(self) -> Callable[[], float]:
        """This rank's wall clock for the timeline: `time.time`, or skewed by `clock-skew`."""
        skew = sum(f.seconds for f in self.faults if f.kind == "clock-skew")
        if not skew:
            return time.time
        print(f"shardwise: fault injected on {self.where}: clock {skew:+g} s", flush=True)
        return lambda: time.time() + skew

    def slow_factor(self, step: int | None = None) -> float:
        """How many times slower this rank works at `step` (None: the first step); 1: not."""
        factor = 1.0
        for first, f in self.slowdowns:
            if first <= (step or 1):
                factor = f
        return factor

    def _announce(self, factor: float) -> None:
        if factor != self._announced_slowdown:
            self._announced_slowdown = factor
            print(f"shardwise: fault injected on {self.where}: work {factor:g}x slower", flush=True)

    def slow_down(self, started: float, waited: float = 0.0, step: int | None = None) -> None:
        """Under a `slow` fault, sleep so that the work begun at `started` (perf_counter) took
        `slow_factor(step)` times as long; `waited`: seconds of it spent waiting for peers,
        which are not work. For work that is done by the sample, see `slow_ahead`."""
        factor = self.slow_factor(step)
        self._announce(factor)
        if factor > 1:
            time.sleep((factor - 1) * max(0.0, time.perf_counter() - started - waited))

    def slow_ahead(self, samples: int, step: int | None = None) -> float:
        """Under a `slow` fault, sleep now F - 1 times what `samples` cost this rank so far
        (`PerSampleCost`; tell it each step's real work with `observe_work`); the seconds
        slept. A synchronous trainer calls it before the forward, as slow hardware is slow
        before its gradients exist: a rank that slept after them would make the others wait
        twice, in the gradient all-reduce for its real work and again for the sleep."""
        factor = self.slow_factor(step)
        self._announce(factor)
        if factor == 1 or self.per_sample.last is None:
            return 0.0
        seconds = (factor - 1) * self.per_sample.last * samples
        time.sleep(seconds)
        return seconds

    def observe_work(self, samples: int, work_s: float) -> None:
        """One step's real work on `samples` (sleeps and waiting for peers excluded)."""
        if self.slowdowns:
            self.per_sample.observe(samples, work_s)

    def poisons_loss(self, step: int) -> bool:
        return self._fires("nan", step)

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """The training loss, NaN on this rank (and so every gradient it sends) through the
        whole step of a `nan` fault (every micro-batch's). The fault fires as its step begins,
        whether or not this rank computes the loss (a pipeline's first stage does not)."""
        if not self._has("nan"):
            return loss_fn
        poisoned = [False]

        def arm(step: int) -> None:
            poisoned[0] = self._fires("nan", step)

        def loss(output, target):
            value = loss_fn(output, target)
            return value * float("nan") if poisoned[0] else value

        self._armed.append(arm)
        return loss

    def wrap_compute(self, compute: Callable, delay: Callable[[int], float] | None = None):
        """`compute(x, y, ...)`, a step's forward and backward on the samples of `y`, as this
        rank's faults make it: `slow` (F times the cost per sample, slept before it) and a
        straggler's fixed `delay(step)` seconds (`train.delay_s`), both before the gradients
        exist (after them, DDP's all-reduce, started during backward, would hide them). The
        real work (sleeps and waiting for peers left out) is what `slow` is fitted to."""
        if not self.slowdowns and delay is None:
            return compute

        def slowed(x, y, *args, **kwargs):
            samples = y.shape[0]
            if seconds := delay(self.step) if delay else 0.0:
                time.sleep(seconds)
            self.slow_ahead(samples, step=self.step)
            started, waited = time.perf_counter(), comm.stats.step_wait_s()
            result = compute(x, y, *args, **kwargs)
            real = time.perf_counter() - started - (comm.stats.step_wait_s() - waited)
            self.observe_work(samples, real)
            return result

        return slowed

    def wrap_reduce(self, reduce: Callable[[torch.Tensor], None]) -> Callable:
        """The collective every rank agrees through after backward: in the step of a `desync`
        fault this rank broadcasts first, where the others only all-reduce."""
        if not self._has("desync"):
            return reduce

        def desynced(t: torch.Tensor) -> None:
            if self._fires("desync", self.step):
                comm.broadcast(t, src=0)
            reduce(t)

        return desynced

    def wrap_save(self, save: Callable, wait: Callable[[], None]) -> Callable:
        """A checkpointer's `save(step, extra)`: after the save of a `corrupt-checkpoint` fault's
        step is written, one of its files is damaged (call it on the rank that reports)."""
        if not self._has("corrupt-checkpoint"):
            return save

        def saving(step: int, extra=None):
            path = save(step, extra)
            if self._fires("corrupt-checkpoint", step):
                wait()
                print(f"shardwise: fault injected: corrupted {corrupt(path)}", flush=True)
            return path

        return saving


class PerSampleCost:
    """This rank's marginal seconds per sample: the slope of a least-squares line through
    its recent (batch size, work time) pairs, so a step's fixed costs (launching kernels and
    collectives, hooks) are not slowed. Until batch sizes have varied, work / samples (an upper
    bound); afterwards the last slope holds while they stay put."""

    WARM_UP = 2  # the first steps are slow for other reasons (allocations, lazy set-up)

    def __init__(self, window: int = 64) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=window)
        self.slope: float | None = None
        self.seen = 0
        self.last: float | None = None  # the latest estimate

    def observe(self, samples: int, work_s: float) -> float:
        self.seen += 1
        if self.seen > self.WARM_UP:
            self.points.append((samples, work_s))
        if not self.points:
            self.last = work_s / max(samples, 1)
            return self.last
        ns = [n for n, _ in self.points]
        mean_n = sum(ns) / len(ns)
        spread = sum((n - mean_n) ** 2 for n in ns)
        if spread > 0 and max(ns) >= 1.1 * min(ns):
            mean_t = sum(t for _, t in self.points) / len(ns)
            slope = sum((n - mean_n) * (t - mean_t) for n, t in self.points) / spread
            if slope > 0:
                self.slope = slope
        upper = work_s / max(samples, 1)
        self.last = upper if self.slope is None else min(self.slope, upper)
        return self.last


def corrupt(directory: Path) -> Path:
    """Flip bytes in the middle of a checkpoint's first tensor file; returns its path."""
    target = sorted(Path(directory).glob("rank*.safetensors"))[0]
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    target.write_bytes(bytes(data))
    return target
