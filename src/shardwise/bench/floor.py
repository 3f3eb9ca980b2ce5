"""The floor of a training step on this machine, measured in the benchmark's own run.

Two floors bound what any data-parallel implementation of a step can reach here:

    overlapped    the compute alone: the same model, batch and optimizer with no wrapper and
                  no communication, every rank computing at once (as the ranks of a job do,
                  sharing the machine's cores and memory bandwidth)
    unoverlapped  the compute plus the strategy's own bytes: the collectives one step of the
                  strategy issued (read from the flight recorder: op, shape, dtype), replayed
                  back to back straight on `torch.distributed`, with nothing else running
                  (one step's worth at a time, between the other variants' steps, so its
                  buffers come from memory as a step's do, not from the previous replay)

A step above the unoverlapped floor pays for more than computing and then communicating; a
step below it hides part of its communication behind compute. Both floors are timed as variants
of the benchmark's interleaved rounds, so each repetition has its own floor, next to the
step it bounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.comm.collectives import post_pairwise_gather
from shardwise.comm.direct import torch_all_gather_flat, torch_reduce_scatter_flat
from shardwise.comm.flight import KEEP, Call, recorder
from shardwise.comm.shared_memory import SharedMemoryCollectives


def calls_of(step: Callable[[], None]) -> list[Call]:
    """The collectives that one call of `step` issues on this rank, in order."""
    before = dict(recorder.seq)
    step()
    issued = sum(n - before.get(group, 0) for group, n in recorder.seq.items())
    if issued > KEEP:
        raise ValueError(f"a step issued {issued} collectives; the recorder keeps {KEEP}")
    return list(recorder.history)[len(recorder.history) - issued :]


def bare_collectives(calls: list[Call]) -> Callable[[], None]:
    """A step that issues the same collectives as `calls` straight on `torch.distributed`, on
    buffers made once, each waited for before the next (the world group: the benchmarks'
    strategies span it). Sums through shared memory go through one group and thread for the
    whole step, as a strategy's do."""
    # (the same on every rank)
    shared = any(call.op.endswith(("_shared", "_resident")) for call in calls)
    summing = SharedMemoryCollectives() if shared else None
    world = dist.get_world_size()
    gathered = [_nbytes(call) // world for call in calls if call.op == "all_gather_shared"]
    if gathered:  # (slots for the largest shard, as a strategy makes them)
        summing.reserve_gathers(max(gathered))
    issue = [_bare(call, summing) for call in calls]

    def step() -> None:
        for collective in issue:
            collective()

    return step


def _bare(call: Call, summing: SharedMemoryCollectives | None) -> Callable[[], None]:
    if call.op == "barrier":
        return dist.barrier
    if call.op == "barrier_shared":  # (ZeRO-3's meeting before its gathers read the shards)
        return lambda: summing.start_meeting().wait()
    dtype = getattr(torch, call.dtype)  # (a call with a tensor, from here on)
    tensor = torch.zeros(call.shape, dtype=dtype)
    world = dist.get_world_size()
    if call.op == "all_reduce":
        return lambda: dist.all_reduce(tensor)
    if call.op == "all_reduce_shared":  # (DDP's, where every rank is on one host's CPU)
        shared = summing.new_buffer(tensor.numel(), dtype, tensor.device)
        return lambda: summing.start(shared).wait()
    if call.op == "reduce_scatter_shared":  # (ZeRO's, where every rank is on one host's CPU)
        staged = summing.new_buffer(tensor.numel(), dtype, tensor.device)
        out = torch.empty(tensor.numel() // world, dtype=dtype)
        return lambda: summing.start_reduce_scatter(staged, out).wait()
    if call.op == "all_gather_shared":  # (ZeRO's, where every rank is on one host's CPU)
        shard = torch.zeros(tensor.numel() // world, dtype=dtype)
        return lambda: summing.start_all_gather(tensor.view(-1), shard).wait()
    if call.op == "all_gather_resident":  # (ZeRO-3's shards, where they lie in shared memory)
        shard = summing.new_buffer(tensor.numel() // world, dtype, tensor.device)
        return lambda: summing.start_gather_resident(tensor.view(-1), shard).wait()
    if call.op == "broadcast":
        return lambda: dist.broadcast(tensor, src=0)
    if call.op == "all_gather":  # (recorded: the gathered output)
        shard = torch.zeros(tensor.numel() // world, dtype=dtype)
        return lambda: torch_all_gather_flat(tensor.view(-1), shard)
    if call.op == "all_gather_pairwise":  # (ZeRO's, where gloo's ranks share one host)
        shard = torch.zeros(tensor.numel() // world, dtype=dtype)
        return lambda: post_pairwise_gather(tensor, shard).wait()
    if call.op == "reduce_scatter":  # (recorded: the full input)
        shard = torch.zeros(tensor.numel() // world, dtype=dtype)
        return lambda: torch_reduce_scatter_flat(shard, tensor.view(-1))
    if call.op == "all_to_all":
        received = torch.empty_like(tensor)
        return lambda: dist.all_to_all_single(received, tensor)
    raise ValueError(f"no bare replay of {call.describe()}: the floor covers collectives only")


def _nbytes(call: Call) -> int:
    return math.prod(call.shape) * getattr(torch, call.dtype).itemsize


def floor_figures(times: dict[str, list[float]], key: str) -> dict:
    """Variant `key`'s floors from the rounds' times by repetition: "compute" (the model
    alone) and f"bytes:{key}" (its collectives alone); and its step over each floor, by
    repetition (the headline is their median)."""
    own, compute, alone = times[key], times["compute"], times[f"bytes:{key}"]
    unoverlapped = [c + b for c, b in zip(compute, alone, strict=True)]
    over_compute = [s / c for s, c in zip(own, compute, strict=True)]
    over_floor = [s / u for s, u in zip(own, unoverlapped, strict=True)]
    return {
        "floor_overlapped_s": statistics.median(compute),
        "floor_unoverlapped_s": statistics.median(unoverlapped),
        "comm_alone_s": statistics.median(alone),
        "over_floor_overlapped": statistics.median(over_compute),
        "over_floor_unoverlapped": statistics.median(over_floor),
        "over_floor_unoverlapped_by_rep": over_floor,
    }


def by_rep(times: dict[str, list[float]], key: str, baseline: str) -> list[float]:
    """`key`'s step over `baseline`'s, repetition by repetition (each pair ran side by side)."""
    return [a / b for a, b in zip(times[key], times[baseline], strict=True)]
