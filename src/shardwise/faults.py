"""Fault injection for tests, demos and benchmarks.

From the config (`faults: [...]`) or the environment, with one grammar (several: commas):

    SHARDWISE_FAULT="kill:rank=1:step=37"

- `kill:rank=R:step=S`: rank R sends itself SIGKILL as step S begins.
- `hang:rank=R:step=S`: rank R stops issuing collectives at step S (it sleeps, alive).
- `nan:rank=R:step=S`: rank R's loss, and so its gradient, is NaN at step S.
- `slow:rank=R:factor=F`: rank R's forward and backward take F times as long (it sleeps).
- `desync:rank=R:step=S`: rank R broadcasts where the others all-reduce the loss at step S.
- `corrupt-checkpoint:step=S`: one file of step S's checkpoint is damaged after it is written.

In a parameter-server job, `kill`, `hang` and `slow` apply to every role by rank, and `step`
counts what that role does: a worker's steps, a server's updates, a relay's forwarded pushes
(a hung server or relay keeps beating: the others must tell that it is stuck, not dead).

Each fault fires once per run: a marker under `RUN_DIR/faults/` records it (its time is when it
fired), so a job that restarts and resumes does not fire it again.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "SHARDWISE_FAULT"
FIELDS = {  # kind -> the fields it needs
    "kill": ("rank", "step"),
    "hang": ("rank", "step"),
    "nan": ("rank", "step"),
    "desync": ("rank", "step"),
    "slow": ("rank", "factor"),
    "corrupt-checkpoint": ("step",),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    factor: float | None = None

    @property
    def name(self) -> str:
        parts = [self.kind] + [
            f"{key}{value}"
            for key, value in (("rank", self.rank), ("step", self.step), ("factor", self.factor))
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
            if set(args) != set(FIELDS[kind]):
                raise ValueError
            fault = Fault(
                kind,
                rank=int(args["rank"]) if "rank" in args else None,
                step=int(args["step"]) if "step" in args else None,
                factor=float(args["factor"]) if "factor" in args else None,
            )
        except ValueError:
            wanted = ":".join([kind] + [f"{f}=..." for f in FIELDS[kind]])
            raise ValueError(f"{where}expected {wanted}, got {item!r}") from None
        if (fault.factor is not None and fault.factor < 1) or (fault.step or 1) < 1:
            raise ValueError(f"{where}step must be >= 1 and factor >= 1 in {item!r}")
        faults.append(fault)
    return faults


class FaultInjector:
    """This rank's faults of the run; the trainer asks at each point whether one fires."""

    def __init__(
        self, rank: int, run_dir: Path, configured: list[str] = (), role: str = ""
    ) -> None:
        spec = ",".join([*configured, os.environ.get(ENV, "")])
        self.rank, self.where = rank, f"{role} rank {rank}" if role else f"rank {rank}"
        self.faults = [f for f in parse(spec) if f.rank in (None, rank)]
        self.fired_dir = Path(run_dir) / "faults"
        # the factor this rank's compute is slowed by (1: not slowed); never marked fired
        self.slow_factor = max((f.factor for f in self.faults if f.kind == "slow"), default=1.0)
        if self.slow_factor > 1:
            print(
                f"shardwise: fault injected on {self.where}: compute {self.slow_factor:g}x slower",
                flush=True,
            )

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
        if self._fires("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires("hang", step):
            while True:  # alive, but never issues another collective
                time.sleep(3600)

    def slow_down(self, started: float) -> None:
        """Under a `slow` fault, sleep so that the work begun at `started` (perf_counter) took
        `slow_factor` times as long."""
        if self.slow_factor > 1:
            time.sleep((self.slow_factor - 1) * (time.perf_counter() - started))

    def poisons_loss(self, step: int) -> bool:
        return self._fires("nan", step)

    def desyncs(self, step: int) -> bool:
        return self._fires("desync", step)

    def corrupts_checkpoint(self, step: int) -> bool:
        return self._fires("corrupt-checkpoint", step)


def corrupt(directory: Path) -> Path:
    """Flip bytes in the middle of a checkpoint's first tensor file; returns its path."""
    target = sorted(Path(directory).glob("rank*.safetensors"))[0]
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    target.write_bytes(bytes(data))
    return target
