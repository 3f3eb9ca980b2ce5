"""Each rank's clock offset to rank 0's, measured NTP-style through the job's process group.

Rank r sends its time t0 to rank 0, which answers with its own time T; r reads its clock again
at t1. T was read somewhere between t0 and t1, so rank 0's clock minus r's lies within

    offset = T - (t0 + t1) / 2  +-  (t1 - t0) / 2

whatever the two directions' delays: the bound is exact, and the round with the shortest round
trip gives the tightest one. Rank 0 answers the others one at a time, `rounds` rounds each.
Measured at the start and the end of a traced window, the offset may drift between the two;
`Offset.at` interpolates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise import comm

Clock = Callable[[], float]


@dataclass(frozen=True)
class Offset:
    """Rank 0's clock minus this rank's (seconds), within +- `error_s`, measured at local
    time `measured_at`."""

    offset_s: float
    error_s: float
    measured_at: float

    def as_dict(self) -> dict[str, float]:
        return {"offset_s": self.offset_s, "error_s": self.error_s, "measured_at": self.measured_at}


def measure_offset(device: torch.device, clock: Clock = time.time, rounds: int = 8) -> Offset:
    """This rank's offset to rank 0 (every rank of the world calls it; rank 0's is 0 +- 0).
    `device`: where the backend sends from (the GPU under NCCL)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    message = torch.zeros(2, dtype=torch.float64, device=device)
    if rank == 0:
        for peer in range(1, world):
            for _ in range(rounds):
                comm.recv(message, src=peer)
                message[1] = clock()
                comm.send(message, dst=peer).wait()
        return Offset(0.0, 0.0, clock())
    best: Offset | None = None
    for _ in range(rounds):
        t0 = clock()
        message[0] = t0
        comm.send(message, dst=0).wait()
        comm.recv(message, src=0)
        t1 = clock()
        theirs = message[1].item()
        measured = Offset(theirs - (t0 + t1) / 2, (t1 - t0) / 2, (t0 + t1) / 2)
        if best is None or measured.error_s < best.error_s:
            best = measured
    assert best is not None
    return best


def interpolate(first: Offset, last: Offset | None, local_time: float) -> float:
    """The offset at `local_time`, linear between two measurements (drift), or the first."""
    if last is None or last.measured_at == first.measured_at:
        return first.offset_s
    share = (local_time - first.measured_at) / (last.measured_at - first.measured_at)
    return first.offset_s + share * (last.offset_s - first.offset_s)
