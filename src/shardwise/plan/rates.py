"""Seconds at the rates `shardwise calibrate` measured: one collective call by its kind,
payload and group, the wait for ranks to arrive after compute, and the rates of a rank while
every rank computes at once."""

from __future__ import annotations

import itertools


def call_seconds(cal: dict, kind: str, volume: float, ranks: int | None = None) -> float:
    """Seconds of one call of `kind` that sends `volume` bytes among `ranks` ranks (None:
    all): the calibration's mean times for that group size (all ranks' where it has none),
    linear between the payloads it measured, and past the largest at its fitted bandwidth."""
    rates = cal["collectives"][kind]
    rates = rates.get("groups", {}).get(str(ranks), rates)
    return _piecewise(rates["points"], volume, 1 / rates["bandwidth"])


def _piecewise(points: list[list[float]], x: float, slope_past: float) -> float:
    """The line through (x, y) `points` at `x`: the first y below them, and past the last
    point at `slope_past`."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1] + (x - points[-1][0]) * slope_past


def arrival_wait(cal: dict, compute_s: float) -> float:
    """Seconds a rank waits for the others to arrive at the first collective after
    `compute_s` of compute, beyond what a call after a short burst (as every collective was
    calibrated) already includes: the calibration's `arrival_waits` between the bursts it
    measured, and past the longest along their last segment. It grows less than in
    proportion to the compute: a line through bursts of 1-20 ms put the GPT's wait after
    85 ms of compute on 4 ranks of 2 cores at 22 ms, where bursts of 99 ms waited 14."""
    points = cal["arrival_waits"]
    (b0, w0), (b1, w1) = points[-2:]
    last_slope = max(0.0, (w1 - w0) / (b1 - b0)) if b1 > b0 else 0.0
    return max(0.0, _piecewise(points, compute_s, last_slope) - points[0][1])


def shared_rates(cal: dict, world: int) -> dict | None:
    """The rates of a rank while all `world` ranks compute at once, where each has a core of
    its own (no more ranks than the machine's concurrency): they contend only for memory and
    caches, as the calibration's `shared` rates measured (2 ranks on this 2-core VM: element-
    wise work at 36-60 GB/s each against 66-72 GB/s alone; their steps' compute was priced
    15-29% short at the rates of one alone). None where ranks outnumber the cores (they take
    turns, priced by the concurrency) or the calibration has no shared rates."""
    if "shared" in cal and world <= round(cal.get("concurrency", 1)):
        return {**cal, **cal["shared"]}
    return None
