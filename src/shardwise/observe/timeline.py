"""A merged timeline of every rank's steps, in the Chrome trace format Perfetto opens.

With `train.trace_steps: [a, b]`, each rank records, from step a to step b, its phases (data,
forward, backward, optimizer, sync: `phases.py`) and every collective it was blocked in (from
the communication layer's accounting), on its own clock. Its offset to rank 0's clock is
measured before step a and after step b (`clock.py`). Each rank writes RUN_DIR/trace/rank{r}.json;
rank 0 then writes RUN_DIR/trace.json, every rank's events moved onto rank 0's clock (the offset
interpolated between the two measurements), one track per rank: open it at ui.perfetto.dev or
chrome://tracing. The offsets and their error bounds are in its `otherData`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardwise.observe.clock import Clock, Offset, interpolate

PHASE_TRACK, COMM_TRACK = 0, 1


class Timeline:
    """This rank's events while recording, timed by `perf_counter` and placed on `clock`."""

    def __init__(self, rank: int, clock: Clock) -> None:
        self.rank, self.clock = rank, clock
        self.events: list[dict[str, Any]] = []
        self.recording = False
        # perf_counter is steady and fine-grained; `clock` (wall time) places it once.
        self._base = (clock(), time.perf_counter())
        self.offsets: list[Offset] = []

    def to_clock(self, perf: float) -> float:
        wall, perf0 = self._base
        return wall + (perf - perf0)

    def span(self, name: str, start: float, end: float, track: int = PHASE_TRACK, **args) -> None:
        """An event from perf_counter time `start` to `end` (kept only while recording)."""
        if not self.recording:
            return
        event = {"name": name, "ph": "X", "ts": self.to_clock(start) * 1e6}
        event |= {"dur": max(0.0, end - start) * 1e6, "pid": self.rank, "tid": track}
        if args:
            event["args"] = args
        self.events.append(event)

    def collective(self, op: str, nbytes: int, blocked_s: float) -> None:
        """The communication layer's report of a call that just returned (or was waited on)."""
        if self.recording and blocked_s > 0:
            now = time.perf_counter()
            self.span(op, now - blocked_s, now, COMM_TRACK, bytes=nbytes)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        offsets = [o.as_dict() for o in self.offsets]
        path.write_text(json.dumps({"rank": self.rank, "offsets": offsets, "events": self.events}))


def merge(rank_files: list[Path], out: Path) -> dict[str, Any]:
    """One trace of every rank's events on rank 0's clock; written to `out` and returned."""
    events: list[dict[str, Any]] = []
    offsets: dict[str, Any] = {}
    for path in rank_files:
        recorded = json.loads(path.read_text())
        rank = int(recorded["rank"])
        measured = [Offset(**o) for o in recorded["offsets"]]
        first, last = measured[0], (measured[1] if len(measured) > 1 else None)
        offsets[str(rank)] = [o.as_dict() for o in measured]
        events.append(_metadata("process_name", rank, None, f"rank {rank}"))
        events.append(_metadata("process_sort_index", rank, None, rank))
        events.append(_metadata("thread_name", rank, PHASE_TRACK, "phases"))
        events.append(_metadata("thread_name", rank, COMM_TRACK, "collectives (blocked)"))
        for event in recorded["events"]:
            shift = interpolate(first, last, event["ts"] / 1e6)
            events.append({**event, "ts": event["ts"] + shift * 1e6})
    timed = [e for e in events if "ts" in e]
    origin = min((e["ts"] for e in timed), default=0.0)  # the trace starts at 0
    for event in timed:
        event["ts"] -= origin
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "clock": "rank 0's, from its first event",
            "origin_unix_s": origin / 1e6,
            "offsets_to_rank0": offsets,
        },
    }
    out.write_text(json.dumps(trace))
    return trace


def _metadata(name: str, pid: int, tid: int | None, value: Any) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    event = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event
