"""Throughput-adaptive per-rank batches: the shares follow a slowed rank's speed, and training
stays exactly the mean over the global batch. Evidence: the sizes each rank saw, and the sample
ledger of every rank."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

import shardwise as sw
from harness import run_cli, train_args
from ledger_replay import replay_ledger
from shardwise import comm
from shardwise.data import ledger
from shardwise.data.balance import ThroughputBalancer, weighted_sizes
from spawn import run as spawn

pytestmark = pytest.mark.alone  # (its shares follow the ranks' measured speeds)

WINDOW = 5  # steps per rebalancing window


def _emulated_training(seconds_per_sample: list[list[float]], change: int, steps: int):
    """Ranks whose work takes a known time per sample (sleep: emulated hardware, exact to
    ~0.1 ms), from `seconds_per_sample[0]` and, from step `change`, `[1]`; each step ends in an
    all-reduce, as data parallel's does. Returns the batch size this rank got at each step."""
    rt = sw.init()
    world = rt.world_size
    loader = sw.data.loader(TensorDataset(torch.arange(100_000)), 64, seed=1)
    balancer = ThroughputBalancer(loader, WINDOW, rt)
    sizes, batches = [], iter(loader)
    for step in range(1, steps + 1):
        (batch,) = next(batches)
        started = time.perf_counter()
        time.sleep(seconds_per_sample[step >= change][rt.rank] * len(batch))
        busy = time.perf_counter() - started
        comm.all_reduce(torch.zeros(world))  # the others wait here for the slowest
        balancer.observe(len(batch), busy)
        balancer.rebalance()
        sizes.append(len(batch))
    return sizes


@pytest.mark.parametrize(
    "before, after",
    [
        ([1, 2], [1, 4]),  # world 2: the second rank 2x slower, then 4x
        ([1, 1, 2], [2, 1, 1]),  # world 3: one of three 2x slower, then another one
    ],
)
def test_dynamic_shares_settle_within_three_windows_to_the_speed_ratio(before, after):
    """Starting from equal shares and again after the speeds change, after at most 3 windows
    each rank's share is within 10% of its speed's share (speed = 1 / time per sample)."""
    change, steps = 5 * WINDOW + 1, 10 * WINDOW
    per_sample = [[1.5e-4 * f for f in before], [1.5e-4 * f for f in after]]
    sizes = spawn(_emulated_training, len(before), per_sample, change, steps)
    for factors, first in ((before, 3 * WINDOW + 1), (after, change + 3 * WINDOW)):
        ideal = [(1 / f) / sum(1 / g for g in factors) for f in factors]
        for step in range(first, first + WINDOW):
            got = [rank_sizes[step - 1] for rank_sizes in sizes]
            shares = [n / sum(got) for n in got]
            off = [abs(s - i) / i for s, i in zip(shares, ideal, strict=True)]
            assert max(off) <= 0.1, (step, got, ideal)


STEPS, EVERY, CHANGE = 45, 5, 21  # slowed 2x from the start, 4x from step CHANGE
# What the weights depend on (the ledger's replay uses these too). SGD: AdamW divides by the
# root of each element's squared gradient, so a near-zero gradient's float32 rounding (sums in
# another order as the batch sizes change with the timing of a loaded machine) became weight
# differences of up to 4e-4 (seen in CI); plain momentum SGD keeps rounding at rounding's size.
JOB = [
    f"train.steps={STEPS}",
    "data.batch_size=128",
    "model.name=cnn",
    "model.channels=[32, 64]",
    "optim.name=sgd",
    "optim.lr=0.05",
]
SETS = [
    *JOB,
    "train.sample_ledger=true",
    "data.balance=dynamic",
    "launch.desync_check_every=1",  # every rank the same collectives, step by step
    f"data.balance_every={EVERY}",
    "data.rank_weights=[1, 2]",  # a wrong first guess: the slow rank starts with the most
    # (JOB's CNN: per-sample compute well above a step's fixed costs, as in real training)
    f"faults=[slow:rank=1:factor=2, slow:rank=1:factor=4:step={CHANGE}]",
]


def _slow_share(lines_by_rank: dict[int, list[dict]], steps: range) -> list[float]:
    """The slow rank's share of each step's samples, from what the ranks logged."""
    counts = {r: {line["step"]: len(line["indices"]) for line in lines_by_rank[r]} for r in (0, 1)}
    return [counts[1][s] / (counts[0][s] + counts[1][s]) for s in steps]


def test_dynamic_balance_follows_the_slow_rank_and_stays_exact(tmp_path):
    run = tmp_path / "run"
    job = run_cli(*train_args(run, *SETS, nproc=2), timeout=240)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    lines = ledger.read(run)
    # The skew report of the first epoch's plan, written at the start: the configured split.
    skew = json.loads((run / "data_skew.json").read_text())
    samples = [r["samples"] for r in skew["ranks"]]
    assert samples[1] / sum(samples) == weighted_sizes(256, [1, 2])[1] / 256
    # The shares follow the slow rank: 3 windows after a wrong first guess (2/3 to the slow
    # rank) it has clearly less than half, and 3 windows after its slowdown grows from 2x to
    # 4x, clearly less than before. How close they come to 1 / (1 + F) is asserted above, on
    # ranks whose time per sample is known; here the real CNN's per-sample speed varies with
    # the batch size (caches), SyncBatchNorm's meetings in the forward cost time that does not
    # scale with the batch, and the slow fault's per-sample cost is fitted from timings on 2
    # shared cores, so they land within some 35% of it, run to run.
    # (medians over two windows of each speed: one window's share is one measurement, which
    # moves with the shared cores' load: five steps' median once went from 0.22-0.25 to 0.29 in
    # CI, and the 2x window alone set a ratio of 0.818 once, against 0.58-0.63 in reruns. The
    # window that begins at CHANGE has its shares from the 2x window before it: a rebalance
    # reads the window just ended.)
    assert (CHANGE - 1) % EVERY == 0  # (CHANGE begins a window)
    shares = {
        factor: statistics.median(_slow_share(lines, range(first, last + 1)))
        for first, last, factor in (
            (3 * EVERY + 1, CHANGE + EVERY - 1, 2),
            (CHANGE + 3 * EVERY, STEPS, 4),
        )
    }
    assert shares[2] < 0.45 and shares[4] < 0.8 * shares[2], shares
    first_window = _slow_share(lines, range(1, EVERY + 1))
    assert first_window == [weighted_sizes(256, [1, 2])[1] / 256] * EVERY  # as configured
    # Batch sizes changed a dozen times: the weights still equal single-process training on
    # the global batches the ranks read.
    expected = replay_ledger(run, JOB, STEPS)
    final = load_file(str(Path(run) / "checkpoint" / "model.safetensors"))
    for name, value in expected.items():
        # 45 SGD steps through SyncBatchNorm: float32 sums in another order differ by rounding
        # (measured: the weights 1.2e-5 to 5.5e-5). The running statistics are means over
        # batches cut a dozen ways, summed by rank, then over ranks: measured up to 1.6e-4 on
        # a running mean near 0.9, so they are held to 1e-3 of their size.
        running = name.rsplit(".", 1)[-1].startswith("running_")
        torch.testing.assert_close(final[name], value, rtol=1e-3 if running else 0, atol=1e-4)
