"""`shardwise calibrate`: how fast this machine computes and communicates, measured once with as
many ranks as the jobs it will predict, stored and reused by the step-time model.

Rank 0 measures alone, then every rank at once, with the threads per rank training uses:

    flop_rate        matrix multiplies (512 x 512 fp32), FLOP/s (rank 0 alone)
    bytes_rate       element-wise work on 16 MiB tensors, bytes read and written per second
    op_overhead_s    one small operator call with autograd recording, seconds
    sample_read_s    one sample read and collated by torch's DataLoader, seconds
                     (`shared`: the same four with every rank at once, measured before and
                     after each pass over the collectives, each the median of those
                     measurements, then the mean over ranks)
    concurrency      how many ranks' work the machine does at once: the ranks' summed matmul
                     rate when all run over the rate of one alone (about the cores when ranks
                     outnumber them), the median of three such ratios measured in turn
    collectives      per kind (all_reduce, all_gather, reduce_scatter; send: one message from
                     rank 0 to 1; exchange: every rank sends right, receives from the left, as
                     a ring's step; post: posting one isend or irecv, as pipeline stages do
                     while both compute; prefetched_all_reduce, _all_gather,
                     _reduce_scatter: what one started a burst earlier adds to its caller,
                     as ZeRO's and DDP's buckets but the last; shared_all_reduce,
                     shared_reduce_scatter and shared_all_gather, where every rank is on one
                     host: DDP's sum, ZeRO-2/3's and ZeRO's gathers through shared memory,
                     `comm.shared_memory`): the mean seconds
                     of one call at payloads of 8 B to 4 MiB over --calls calls (100, or as
                     many as 1.5 s allow), each right after a burst of compute as in a
                     training step, averaged over --passes passes (3) taken in turns
                     (`points`: volume, seconds; the volume is the bytes one rank sends, as
                     `comm.accounting` counts them), and the least-squares line t = latency
                     + volume / bandwidth through them. A mean, not a median: a step's time
                     is the sum of its calls, and on shared cores a few calls in ten take
                     several times the typical one
    arrival_waits    (burst, wait) seconds: what one small collective costs right after each
                     rank's burst of about 1, 5, 20 and 80 ms of compute: waking, and waiting
                     for ranks that share cores to arrive. It grows with the burst but less
                     than in proportion, since ranks taking turns on cores drift apart by
                     about a time slice, not by a share of their work (4 ranks on 2 cores:
                     2.4, 4.9, 6.9 and 13.7 ms after 0.9, 4.1, 23 and 99 ms)
    measured_at      when, in Unix seconds: `plan` and `train` say how old the rates they
                     price at are (a shared machine's drift in hours)

The result lives in `$XDG_CACHE_HOME/shardwise/calibration/` (default ~/.cache), one file per
host, world size and threads per rank, or where `--out` says.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from shardwise.comm import shared_memory
from shardwise.plan import measure
from shardwise.plan.measure import CALLS

# What the step-time model prices calls by (a calibration without one of them is redone).
KINDS = {"all_reduce", "all_gather", "reduce_scatter", "send", "post", "exchange"}
KINDS |= {"prefetched_all_reduce", "prefetched_all_gather", "prefetched_reduce_scatter"}


def cache_path(nproc: int, threads: int | None = None) -> Path:
    """Where the calibration of `nproc` ranks on this host is kept."""
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "shardwise" / "calibration" / f"{socket.gethostname()}-n{nproc}-t{threads}.json"


MAX_FILE_BYTES = 1 << 20  # (a calibration of 64 ranks is about 30 KB)
# The ranges of what the step-time model reads, checked before it is used: rates are divided
# by, and within these every sum and quotient of a prediction stays a finite number.
RATE = (1.0, 1e18)  # FLOP/s, bytes/s
SECONDS = (0.0, 3600.0)
VOLUME = (0.0, 1e15)  # bytes
ALONE = {"flop_rate": RATE, "bytes_rate": RATE, "op_overhead_s": SECONDS, "sample_read_s": SECONDS}


def load(nproc: int, path: str | Path | None = None) -> dict | None:
    """The stored calibration for `nproc` ranks (or the file `path`), or None where there is
    none; a one-line ValueError naming the file and the field where it cannot be used."""
    file = Path(path) if path else cache_path(nproc)
    if not file.is_file():
        return None
    try:
        data = _read(file)
        check(data, nproc)
    except ValueError as e:
        raise ValueError(f"{file}: {e}: run shardwise calibrate --nproc {nproc} again") from None
    return data


def _read(file: Path) -> object:
    with file.open("rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"over {MAX_FILE_BYTES} bytes, not a calibration")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # (not JSON, not UTF-8, nested too deep)
        raise ValueError(f"not JSON ({(str(e) or type(e).__name__).splitlines()[0]})") from None


def check(data: object, nproc: int) -> None:
    """A ValueError naming the first field of the calibration `data` of `nproc` ranks that the
    step-time model cannot use: missing, not a number, NaN, infinite or out of its range."""
    data = _mapping("the file", data)
    if type(data.get("nproc")) is not int or data["nproc"] != nproc:
        raise ValueError(f"nproc must be {nproc}, got {_short(data.get('nproc'))}")
    for key, bounds in ALONE.items():
        if key != "sample_read_s" or key in data:  # (absent: a sample is read in no time)
            _number(key, _get(data, key), *bounds)
    for key, value in _mapping("shared", data.get("shared", {})).items():
        if key not in ALONE:  # (the shared rates replace the others', and no other field)
            raise ValueError(f"shared.{key}: not one of {sorted(ALONE)}")
        _number(f"shared.{key}", value, *ALONE[key])
    if "concurrency" in data:
        _number("concurrency", data["concurrency"], 0.01, nproc)
    if "measured_at" in data:
        _number("measured_at", data["measured_at"], 0.0, 1e11)
    if nproc > 1:
        _check_collectives(data)


def _check_collectives(data: dict) -> None:
    """Each collective's timings (and its sub-groups') and the arrival waits."""
    collectives = _mapping("collectives", _get(data, "collectives"))
    for kind in sorted(KINDS):
        _get(collectives, kind, "collectives")
    for kind, timings in collectives.items():
        _check_timings(f"collectives.{kind}", timings)
        groups = _mapping(f"collectives.{kind}.groups", timings.get("groups", {}))
        for ranks, group in groups.items():
            _check_timings(f"collectives.{kind}.groups.{ranks}", group)
    _pairs("arrival_waits", _get(data, "arrival_waits"), SECONDS, SECONDS, least=2)


def _check_timings(where: str, value: object) -> None:
    """One kind's timings: its (volume, seconds) points and the line through them."""
    timings = _mapping(where, value)
    _number(f"{where}.latency_s", _get(timings, "latency_s", where), *SECONDS)
    bandwidth = _get(timings, "bandwidth", where)
    if bandwidth != float("inf"):  # (_fit's, where the seconds do not grow with the bytes)
        _number(f"{where}.bandwidth", bandwidth, *RATE)
    _pairs(f"{where}.points", _get(timings, "points", where), VOLUME, SECONDS, least=1)


def _get(mapping: dict, key: str, where: str = "") -> object:
    if key not in mapping:
        field = f"{where}.{key}" if where else key
        raise ValueError(f"{field} is missing (a file from an older shardwise?)")
    return mapping[key]


def _mapping(where: str, value: object) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {_short(value)}")
    return value


def _number(where: str, value: object, least: float, most: float) -> None:
    # (NaN fails every comparison; JSON's true is an int to Python, so it is turned away first)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value <= most:
        raise ValueError(
            f"{where} must be a number from {least:g} to {most:g}, got {_short(value)}"
        )


def _pairs(where: str, value: object, xs: tuple, ys: tuple, least: int) -> None:
    """A list of at least `least` [x, y] pairs within the ranges `xs` and `ys`, x ascending."""
    if not isinstance(value, list) or len(value) < least:
        raise ValueError(f"{where} must be a list of {least} or more [x, y], got {_short(value)}")
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{where}[{i}] must be a pair [x, y], got {_short(pair)}")
        _number(f"{where}[{i}][0]", pair[0], *xs)
        _number(f"{where}[{i}][1]", pair[1], *ys)
        if i and pair[0] < value[i - 1][0]:
            raise ValueError(f"{where}[{i}][0] is below the x before it: x must ascend")


def _short(value: object) -> str:
    """`value` for a one-line message: a container by its kind (its repr may be long, or too
    deeply nested to make), anything else by its repr, cut at 40 characters."""
    if isinstance(value, list):
        return f"an array of {len(value)}"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


STALE_S = 6 * 3600  # older than this, a calibration is said to be old


def age_note(calibration: dict, now: float | None = None) -> str:
    """How long ago `calibration` was measured, with a hint to measure again where it is old:
    on a shared machine the rates drift (here the matmul rate by 7% in a day, and the step
    times predicted with it)."""
    at = calibration.get("measured_at")
    if not isinstance(at, (int, float)):
        return "calibrated at an unknown time: recalibrate before comparing with runs"
    age_s = (time.time() if now is None else now) - at
    note = f"calibrated {age_s / 3600:.1f} h ago"
    if age_s > STALE_S:
        note += ": rates drift on a shared machine; recalibrate before comparing with runs"
    return note


BURSTS = (2, 10, 40, 160)  # 256 x 256 matmuls: about 1, 5, 20 and 80 ms of one rank's compute


def _averaged(tables: list[dict]) -> dict:
    """Several passes' collective timings as one: each point's mean seconds over the passes,
    and the line through them."""
    out = {}
    for kind, first in tables[0].items():
        passes = [t[kind] for t in tables]
        points = [
            [volume, statistics.mean(p["points"][i][1] for p in passes)]
            for i, (volume, _) in enumerate(first["points"])
        ]
        out[kind] = measure.timings(points)
        if "groups" in first:
            out[kind]["groups"] = _averaged([p["groups"] for p in passes])
    return out


def worker(out: str, passes: int, calls: int, quick: bool = False) -> None:
    """One rank of `shardwise calibrate`: measure, agree, and (rank 0) write the file.
    `quick`: one timing window per rate and one concurrency ratio, not medians of three."""
    import torch.distributed as dist

    from shardwise import api
    from shardwise.distributed import runtime

    rt = api.init(backend="gloo")
    threads = torch.get_num_threads()
    dist.barrier()
    # Alone (the others wait): how fast one rank's own work runs when nothing competes.
    windows = 1 if quick else 3
    alone = measure.compute_rates(windows) if rt.is_main else {}
    dist.barrier()
    # Every rank at once: the machine shared as in training; measured again after each pass
    # over the collectives, and each rate the median of those: the element-wise rate of one
    # measurement moved between 72 and 104 GB/s from one calibration to the next.
    shared = [measure.compute_rates(windows)]
    result = {
        "host": socket.gethostname(),
        "nproc": rt.world_size,
        "threads_per_rank": threads,
        "torch": torch.__version__,
        "measured_at": time.time(),  # (Unix seconds: a shared machine's rates drift in hours)
        **alone,
        # How many ranks' worth of work the machine does at once: N on N free cores, fewer
        # when ranks share cores (then a step is bounded by all ranks' work over this).
        "concurrency": measure.concurrency(rt.is_main, times=windows, windows=windows),
    }
    if rt.world_size > 1:
        # Passes over every point, in turns: a point's mean over 100 calls moves by 15-30%
        # from one minute to the next on shared cores, so each is the mean of several passes.
        n = rt.world_size
        groups = {g: dist.new_subgroups(g)[0] for g in range(2, n) if n % g == 0}
        one_host = rt.num_nodes == 1 and shared_memory.supported()
        summing = shared_memory.SharedMemoryCollectives(rt.timeout) if one_host else None
        tables, waits = [], []
        for _ in range(passes):
            tables.append(measure.collective_rates(groups, calls, summing))
            waits.append(measure.wait_points(BURSTS, calls))
            shared.append(measure.compute_rates(windows))
        result["collectives"] = _averaged(tables)
        bursts = range(len(waits[0]))  # (each pass's points: one per burst length)
        means = [[statistics.mean(w[b][i] for w in waits) for i in (0, 1)] for b in bursts]
        result["arrival_waits"] = means
    result["shared"] = _mean_over_ranks(
        {k: statistics.median(rates[k] for rates in shared) for k in shared[0]}, rt.world_size
    )
    result["concurrency"] = min(result["concurrency"], rt.world_size)
    if rt.is_main:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    runtime.shutdown()


def _mean_over_ranks(rates: dict[str, float], world_size: int) -> dict[str, float]:
    """Each rate's mean over the ranks (every rank calls this with its own)."""
    import torch.distributed as dist

    keys = sorted(rates)  # (the same names on every rank)
    summed = torch.tensor([rates[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(summed)
    return {k: v / world_size for k, v in zip(keys, summed.tolist(), strict=True)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # (Counts are read as text and checked in `run`: argparse's own error is a usage screen.)
    parser.add_argument("--nproc", default="2", help="ranks to calibrate for")
    parser.add_argument("--out", help="where to write it (default: the user's cache)")
    parser.add_argument(
        "--passes", default="3", help="passes over the collectives' points, averaged"
    )
    parser.add_argument(
        "--calls",
        default=str(CALLS),
        help=f"calls timed per point, at most (default {CALLS}; fewer: quicker, noisier)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one timing window per rate, not the median of three (about 10 s less, noisier)",
    )


def _count(flag: str, text: str) -> int:
    """The whole number >= 1 that `text` spells, else a one-line ValueError."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--{flag} must be a whole number >= 1, got {_short(text)}")
    return value


def run(args: argparse.Namespace) -> int:
    from shardwise.distributed.launcher import LaunchError, launch
    from shardwise.observe.run_output import check_writable_file

    try:
        for flag in ("nproc", "passes", "calls"):
            setattr(args, flag, _count(flag, str(getattr(args, flag))))
    except ValueError as e:
        print(f"shardwise: calibrate: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else cache_path(args.nproc)
    try:
        check_writable_file(out)  # (before the measuring, a minute at the defaults)
    except ValueError as e:
        print(f"shardwise: calibrate: {e}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        worker = ["--worker", str(out), str(args.passes), str(args.calls)]
        worker += ["--quick"] if args.quick else []
        launch(["shardwise.plan.calibrate", *worker], args.nproc)
    except LaunchError as e:
        print(f"shardwise: calibrate: {e}", file=sys.stderr)
        return 1
    result = json.loads(out.read_text())
    print(
        f"shardwise: calibrated {args.nproc} rank(s) in {time.perf_counter() - started:.0f} s: "
        f"{result['flop_rate'] / 1e9:.1f} GFLOP/s, {result['bytes_rate'] / 1e9:.1f} GB/s, "
        f"{result['op_overhead_s'] * 1e6:.1f} us per op alone; {result['concurrency']:.2f} "
        f"ranks at once -> {out}"
    )
    if "arrival_waits" in result:
        waits = result["arrival_waits"]
        print(
            "  a collective after compute: "
            + ", ".join(f"{1e3 * w:.2f} ms after {1e3 * b:.0f}" for b, w in waits)
        )
    for op, fit in result.get("collectives", {}).items():
        print(
            f"  {op}: {fit['latency_s'] * 1e6:.0f} us + bytes / {fit['bandwidth'] / 1e9:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:6] == ["--quick"])
    else:
        parser = argparse.ArgumentParser(prog="shardwise calibrate")
        add_arguments(parser)
        sys.exit(run(parser.parse_args()))
