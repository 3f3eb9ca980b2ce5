"""Fault injection for tests, demos and benchmarks.

    SHARDWISE_FAULT="kill:rank=1:step=37"        (several: separated by commas)

`kill:rank=R:step=S`: rank R sends itself SIGKILL as step S begins. Each fault fires once per
run: a marker under `RUN_DIR/faults/` records it, so a job that restarts and resumes does not
kill itself again.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

ENV = "SHARDWISE_FAULT"
KINDS = ("kill",)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @property
    def name(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}"


def parse(spec: str) -> list[Fault]:
    """`kill:rank=1:step=37,kill:rank=0:step=5` -> faults; a one-line error when malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, *fields = item.split(":")
        try:
            args = dict(field.split("=", 1) for field in fields)
            fault = Fault(kind, int(args.pop("rank")), int(args.pop("step")))
        except (ValueError, KeyError):
            raise ValueError(f"{ENV}: expected KIND:rank=R:step=S, got {item!r}") from None
        if kind not in KINDS or args:
            raise ValueError(f"{ENV}: unknown fault or field in {item!r} (faults: {KINDS})")
        faults.append(fault)
    return faults


class FaultInjector:
    """This rank's faults of the run, fired at the steps they name."""

    def __init__(self, rank: int, run_dir: Path, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.faults = [f for f in parse(spec) if f.rank == rank]
        self.fired_dir = Path(run_dir) / "faults"

    def before_step(self, step: int) -> None:
        for fault in self.faults:
            marker = self.fired_dir / fault.name
            if fault.step == step and not marker.exists():
                self.fired_dir.mkdir(parents=True, exist_ok=True)
                marker.write_text("fired\n")
                print(f"shardwise: fault injected: {fault.name}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
