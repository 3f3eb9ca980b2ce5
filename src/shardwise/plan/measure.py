"""How `shardwise calibrate` times this machine: compute rates on one rank and on all at once,
each collective's mean seconds at each payload (each call right after a burst of compute, as
in a training step), and the wait for ranks to arrive after longer bursts. Every function here
runs on every rank of the calibration's job; `calibrate.worker` calls them and keeps what rank 0
writes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

SIZES = (8, 4096, 64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # payloads, bytes
CALLS = 100  # calls timed per payload (or as many as POINT_S allows): enough for the slow few
POINT_S = 1.5  # in ten to weigh in the mean


def _throughput(fn: Callable[[], object], window_s: float = 0.3, windows: int = 3) -> float:
    """Calls of `fn` per second: the median over `windows` windows, each long enough to
    include the time slices a rank loses to others on shared cores (one call's time would
    not: it may run uninterrupted); the median, since a virtual machine's rates drift."""
    fn()
    rates = []
    for _ in range(windows):
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < window_s:
            fn()
            calls += 1
        rates.append(calls / elapsed)
    return statistics.median(rates)


def compute_rates(windows: int = 3) -> dict[str, float]:
    """This rank's FLOP/s on 512 x 512 matmuls, bytes/s of element-wise work on 16 MiB, the
    seconds of one small operator with autograd recording, and of reading one sample (each
    the median of `windows` timing windows)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    flop_rate = 2 * 512**3 * _throughput(lambda: a @ b, windows=windows)
    x = torch.randn(4 * 1024 * 1024)  # 16 MiB: beyond the caches, as activations are
    bytes_rate = 3 * x.numel() * 4 * _throughput(lambda: x + x, windows=windows)
    w = torch.randn(16, requires_grad=True)

    def small_ops() -> None:
        y = w
        for _ in range(200):
            y = y * 1.0001
        y.sum().backward()

    # 200 forward ops, 200 backward, the sum
    op_overhead = 1 / (401 * _throughput(small_ops, windows=windows))
    return {
        "flop_rate": flop_rate,
        "bytes_rate": bytes_rate,
        "op_overhead_s": op_overhead,
        "sample_read_s": _sample_read_s(windows),
    }


def concurrency(is_main: bool, times: int = 3, windows: int = 3) -> float:
    """How many ranks' worth of matmuls the machine does at once: the ranks' summed rate when
    all run over one rank's alone, the median of `times` such ratios measured in turn. One
    ratio can catch a neighbour's burst on a shared VM: 1.63 for 2 ranks on 2 cores, where
    calibrations minutes before and after measured 1.99 and 2.0 (and a step's compute was
    priced 23% too slow with it)."""
    import torch.distributed as dist

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    ratios = []
    for _ in range(times):
        dist.barrier()
        alone = torch.tensor([_throughput(lambda: a @ b, windows=windows) if is_main else 0.0])
        dist.barrier()
        summed = torch.tensor([_throughput(lambda: a @ b, windows=windows)])
        dist.all_reduce(summed)
        dist.broadcast(alone, 0)
        ratios.append(summed.item() / alone.item())
    return statistics.median(ratios)


def _sample_read_s(windows: int) -> float:
    """Seconds per sample that torch's DataLoader takes to read batches of 32 from a
    map-style dataset in memory, one sample at a time, and collate them (what the trainer's
    loader does each step)."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
    loader = DataLoader(data, batch_sampler=[range(i, i + 32) for i in range(0, 1024, 32)])
    return 1 / (1024 * _throughput(lambda: sum(1 for _ in loader), windows=windows))


def _fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares t = latency + volume / bandwidth over (volume, seconds) points."""
    n = len(points)
    mx = sum(v for v, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((v - mx) ** 2 for v, _ in points)
    slope = sum((v - mx) * (t - my) for v, t in points) / sxx if sxx else 0.0
    latency = max(my - slope * mx, 0.0)
    return {"latency_s": latency, "bandwidth": 1 / slope if slope > 0 else float("inf")}


def timings(points: list[list[float]]) -> dict:
    """A kind's stored timings: its (volume, seconds) points and the line through them."""
    return {**_fit(points), "points": points}


@dataclass
class _Pace:
    """How a point is timed: `calls` calls (or as many as POINT_S seconds allow), each right
    after `burst()`, about a millisecond of one rank's compute, as in a training step."""

    burst: Callable[[], object]
    calls: int = CALLS

    def mean(self, call: Callable[[], object], with_burst: bool = False) -> float:
        """Mean seconds of `call()` issued right after a burst (`with_burst`: of the burst and
        the call); rank 0's clock decides when time is up, so every rank makes the same calls."""
        import torch.distributed as dist

        call()
        total, calls, go = 0.0, 0, torch.ones(1)
        began = time.perf_counter()
        while calls < self.calls and go.item():
            burst_started = time.perf_counter()
            self.burst()
            started = burst_started if with_burst else time.perf_counter()
            call()
            total += time.perf_counter() - started
            calls += 1
            if calls % 10 == 0:  # (a tiny broadcast, out of the timed calls)
                go.fill_(float(time.perf_counter() - began < POINT_S))
                dist.broadcast(go, 0)
        return total / calls


def collective_rates(
    groups: dict[int, object], calls: int = CALLS, summing=None
) -> dict[str, dict]:
    """One pass over every kind and payload, `calls` calls a point; `groups`: this rank's group
    of each smaller size that divides the world (a mesh's axes: tensor parallel's all-reduces
    among t ranks), timed all groups at once. `summing`: a `SharedMemoryCollectives` where
    every rank is on one host, timed as `shared_all_reduce` (DDP's default there),
    `shared_reduce_scatter` (ZeRO-2/3's) and `shared_all_gather` (ZeRO's)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    a = torch.randn(256, 256)

    def burst() -> None:  # about a millisecond of one rank's compute: a step's between calls
        for _ in range(3):
            a @ a

    pace = _Pace(burst, calls)

    out = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        out[op] = _collective(op, None, n, pace)
        if groups:
            out[op]["groups"] = {
                str(g): _collective(op, group, g, pace) for g, group in groups.items()
            }
    if summing is not None:
        if not summing.slots:  # (collective: every rank has made the same ones)
            summing.reserve_gathers(max(SIZES))
        for op in ("shared_all_reduce", "shared_reduce_scatter", "shared_all_gather"):
            out[op] = _collective(op, None, n, pace, summing)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        out[f"prefetched_{op}"] = _prefetched(op, None, n, pace)
        if groups:  # (HSDP's shard groups and a mesh's data axis prefetch among g ranks)
            out[f"prefetched_{op}"]["groups"] = {
                str(g): _prefetched(op, group, g, pace) for g, group in groups.items()
            }
    out["send"] = _send(pace)
    points = [(size, _post_s(size, 2 * calls)) for size in SIZES]
    out["post"] = timings(_agreed(points, among=2))
    out["exchange"] = _exchange(pace)
    return out


def _send(pace: _Pace) -> dict:
    """One message from rank 0 to rank 1: half a round trip (the others wait)."""
    import torch.distributed as dist

    rank, points = dist.get_rank(), []
    for size in SIZES:
        t = torch.zeros(max(1, size // 4))

        def ping(t: torch.Tensor = t) -> None:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)

        dist.barrier()
        points.append((t.numel() * 4, pace.mean(ping) / 2))
    return timings([list(p) for p in points])  # (rank 0's: it writes)


def _exchange(pace: _Pace) -> dict:
    """A ring's step: every rank sends right while it receives from the left."""
    import torch.distributed as dist

    from shardwise import comm

    rank, n, points = dist.get_rank(), dist.get_world_size(), []
    right, left = (rank + 1) % n, (rank - 1) % n
    for size in SIZES:
        mine, theirs = torch.zeros(max(1, size // 4)), torch.zeros(max(1, size // 4))

        def step(mine: torch.Tensor = mine, theirs: torch.Tensor = theirs) -> None:
            comm.exchange([(mine, right)], [(theirs, left)])

        dist.barrier()
        points.append((mine.numel() * 4, pace.mean(step)))
    return timings(_agreed(points))


def _post_s(size: int, exchanges: int = 200) -> float:
    """Mean seconds to post one point-to-point call of `size` bytes through shardwise.comm (an
    isend, or an irecv), as neighbouring pipeline stages do: ranks 0 and 1 each compute a
    micro-batch's worth (about 0.1 ms), send to the other and receive from it, both at once.
    While both compute, the backend's threads wait for a core, and a call that needs them
    now and then stalls for a time slice: the mean counts those stalls. (Other ranks wait.)"""
    import torch.distributed as dist

    from shardwise import comm

    rank = dist.get_rank()
    dist.barrier()
    if rank > 1:
        dist.barrier()
        return 0.0
    other, a = 1 - rank, torch.randn(128, 128)
    mine, theirs = torch.zeros(max(1, size // 4)), torch.zeros(max(1, size // 4))
    posting, posts = 0.0, 0
    incoming = comm.irecv(theirs, other)
    for k in range(exchanges + 1):
        for _ in range(2):
            a @ a
        started = time.perf_counter()
        outgoing = comm.send(mine, other)
        sent = time.perf_counter()
        incoming.wait()
        waited = time.perf_counter()
        if k < exchanges:
            incoming = comm.irecv(theirs, other)
        if k > 0:  # (the first exchange warms up)
            posting += (sent - started) + (time.perf_counter() - waited)
            posts += 2 if k < exchanges else 1
        outgoing.wait()
    dist.barrier()
    return posting / posts


def _collective(op: str, group, n: int, pace: _Pace, summing=None) -> dict:
    """Mean seconds of one call of `op` among the `n` ranks of `group` (None: all), at each
    payload, and the line through them."""
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.comm.accounting import native_volume

    points = []
    for size in SIZES:
        numel = max(n, size // 4 // n * n)  # (n divides it)
        full, part = torch.zeros(numel), torch.zeros(numel // n)
        if op in ("shared_all_reduce", "shared_reduce_scatter"):  # (in a buffer it placed:
            full = summing.new_buffer(numel, torch.float32, torch.device("cpu"))  # as ours are)
        run = {
            "shared_all_reduce": lambda full=full: summing.start(full).wait(),
            "shared_reduce_scatter": lambda full=full, part=part: summing.start_reduce_scatter(
                full, part
            ).wait(),
            "shared_all_gather": lambda full=full, part=part: summing.start_all_gather(
                full, part
            ).wait(),
            "all_reduce": lambda full=full: comm.all_reduce(full, group),
            "all_gather": lambda full=full, part=part: comm.all_gather_into_tensor(
                full, part, group
            ),
            "reduce_scatter": lambda full=full, part=part: comm.reduce_scatter_tensor(
                part, full, group=group
            ),
        }[op]
        dist.barrier()
        volume = native_volume(op.removeprefix("shared_"), numel * 4, n)
        points.append((volume, pace.mean(run)))
    agreed = _agreed(points)
    return timings(agreed)


def _prefetched(op: str, group, n: int, pace: _Pace) -> dict:
    """Mean seconds an all-reduce, all-gather or reduce-scatter among the `n` ranks of `group`
    (None: all) started a burst of compute earlier adds to its caller's time, as ZeRO's and
    DDP's buckets but the last are: each call
    starts the next one, then waits for the one it started before the burst (which went on
    meanwhile; the two calls' wake-ups overlap).
    ZeRO-3 prefetches each unit's gather one unit ahead; ZeRO reduce-scatters each unit's
    gradients as backward makes them and waits for them all after it. What it adds is the
    burst and the wait together less the burst with nothing in flight: where ranks fill the
    cores, the backend's copies of the call in flight take cycles from the burst (ZeRO-3 on
    2 ranks of 2 cores computed 29% slower than priced when only the waits were). DDP
    all-reduces each bucket as backward fills it and waits for them all after backward."""
    from shardwise import comm
    from shardwise.comm.accounting import native_volume

    def start(full: torch.Tensor, part: torch.Tensor) -> comm.Handle:
        if op == "all_reduce":
            return comm.all_reduce(full, group=group, async_op=True)
        if op == "all_gather":
            return comm.all_gather_into_tensor(full, part, group, async_op=True)
        return comm.reduce_scatter_tensor(part, full, group=group, async_op=True)

    points = []
    for size in SIZES:
        numel = max(n, size // 4 // n * n)
        buffers = [(torch.zeros(numel), torch.zeros(numel // n)) for _ in range(2)]
        pending = [start(*buffers[0])]

        def call(pending=pending, buffers=buffers) -> None:
            following = start(*buffers[1])  # (into the other buffers: the first is in flight)
            pending[0].wait()
            pending[0] = following
            buffers.reverse()

        alone = pace.mean(lambda: None, with_burst=True)
        held = pace.mean(call, with_burst=True) - alone
        points.append((native_volume(op, numel * 4, n), max(held, 0.0)))
        pending[0].wait()
    agreed = _agreed(points)
    return timings(agreed)


def _agreed(points: list[tuple[float, float]], among: int | None = None) -> list[list[float]]:
    """The ranks' mean seconds at each point (each rank timed its own calls; with `among`,
    only the first `among` ranks did, the others give 0)."""
    import torch.distributed as dist

    seconds = torch.tensor([t for _, t in points], dtype=torch.float64)
    dist.all_reduce(seconds)
    n = among or dist.get_world_size()
    return [[v, t / n] for (v, _), t in zip(points, seconds.tolist(), strict=True)]


def wait_points(bursts: tuple[int, ...], calls: int = CALLS) -> list[list[float]]:
    """(mean burst, mean wait) seconds of a 4-byte all-reduce right after each rank's burst of
    `bursts` matmuls, the ranks' means: `calls` after the short bursts, fewer after the long
    ones (about a second's worth, at least 10)."""
    import torch.distributed as dist

    a, flag = torch.randn(256, 256), torch.zeros(1)
    points = []
    for matmuls in bursts:
        dist.barrier()
        waits, bursts = [], []
        for _ in range(max(10, min(calls, calls * 10 // matmuls))):
            started = time.perf_counter()
            for _ in range(matmuls):
                a @ a
            middle = time.perf_counter()
            dist.all_reduce(flag)
            waits.append(time.perf_counter() - middle)
            bursts.append(middle - started)
        mean = torch.tensor([statistics.mean(bursts), statistics.mean(waits)])
        dist.all_reduce(mean)
        points.append((mean / dist.get_world_size()).tolist())
    return points
