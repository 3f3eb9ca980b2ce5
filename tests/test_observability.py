"""What a run measures, end to end: the per-rank step breakdown, TensorBoard files, the LR,
the merged timeline with its clock offsets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import run_cli, train_args
from shardwise.observe.phases import breakdown

pytestmark = pytest.mark.alone  # (its timing ratios and a merged timeline's error in milliseconds)

STEPS, BATCH, LR, SKEW = 30, 256, 0.01, 2.5
SETS = [
    "model.hidden=[512, 512]",  # per-sample compute well above a step's fixed costs
    f"data.batch_size={BATCH}",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "optim.name=sgd",
    f"optim.lr={LR}",
    "optim.warmup_steps=5",
    "optim.schedule=step",
    "optim.step_size=10",
    "optim.gamma=0.5",
    "optim.scale_lr=linear",  # from one rank's batch to the global batch of two: lr x 2
    "train.trace_steps=[10, 14]",
    f"faults=['slow:rank=1:factor=3', 'clock-skew:rank=1:seconds={SKEW}']",
]


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Path:
    """The run directory of the job above, run to its end once for this module's tests."""
    run = tmp_path_factory.mktemp("obs") / "run"
    job = run_cli(*train_args(run, *SETS, nproc=2, measure=True), timeout=240)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    return run


def _timing(run: Path, rank: int) -> list[dict]:
    lines = (run / "timing" / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines][5:]  # after allocation and lazy set-up


def test_step_breakdown_adds_up_and_names_the_fast_ranks_wait_idle(observed):
    lines = [_timing(observed, 0), _timing(observed, 1)]
    fast, slow = breakdown(lines)
    for rank in (fast, slow):  # the phases, each timed by its own clock, cover the step
        parts = rank["compute"] + rank["exposed_comm"] + rank["idle"]
        assert parts == pytest.approx(rank["step"], rel=0.05), rank
    # Rank 1 computes three times as slowly (its sleep is fitted to its last step's work, so a
    # noisy step moves it: at twice, one CI run measured 1.27x): the fast rank spends the
    # difference idle, waiting for it; the slow one hardly waits for anybody.
    gap = slow["compute"] - fast["compute"]
    assert gap > 0.25 * slow["compute"], (fast, slow)
    assert fast["idle"] == pytest.approx(gap, rel=0.3), (fast, slow)
    assert slow["idle"] < 0.15 * fast["idle"], (fast, slow)
    # Exposed communication is the transfer itself, what both ranks spent blocked in a step:
    # the lesser of their blocked times in it, read from their own lines (the step that
    # measured memory left out). The same for both ranks, whichever arrived last.
    by_step = [{line["step"]: line for line in rank} for rank in lines]
    steps = [s for s in by_step[0] if not any("memory" in rank[s] for rank in by_step)]
    least = sum(min(rank[s]["wait_s"] for rank in by_step) for s in steps) / len(steps)
    assert [fast["exposed_comm"], slow["exposed_comm"]] == pytest.approx([least, least])


def test_tensorboard_files_load_and_show_the_scaled_step_schedule(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(observed / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/samples_per_s"} <= tags
    assert {"comm/bytes", "eval/accuracy", "memory/activations_mib"} <= tags
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    metrics = [json.loads(x) for x in (observed / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["loss"] for r in metrics if "loss" in r}
    assert [e.value for e in loss] == pytest.approx([logged[e.step] for e in loss], rel=1e-6)
    # Step s runs at 2 lr (the linear scaling rule) times the warm-up, then x0.5 every 10 steps.
    for event in events.Scalars("train/lr"):
        i = event.step - 1
        expected = 2 * LR * ((i + 1) / 5 if i < 5 else 0.5 ** ((i - 5) // 10))
        assert event.value == pytest.approx(expected, rel=1e-6)


def test_merged_timeline_undoes_the_clock_skew_within_its_bound(observed):
    trace = json.loads((observed / "trace.json").read_text())
    events = trace["traceEvents"]
    for event in events:  # the Chrome trace format's fields, as Perfetto reads them
        assert {"name", "ph", "pid"} <= event.keys() and event["ph"] in ("X", "M"), event
        if event["ph"] == "X":
            assert {"ts", "dur", "tid"} <= event.keys() and event["dur"] >= 0, event
    # Rank 1's clock runs SKEW seconds ahead: rank 0's clock minus rank 1's is -SKEW, and each
    # measurement (before and after the window) holds it within its bound, a fraction of a ms.
    for measured in trace["otherData"]["offsets_to_rank0"]["1"]:
        assert abs(measured["offset_s"] + SKEW) <= measured["error_s"] + 1e-6, measured
        assert measured["error_s"] < 0.005, measured
    spans = [e for e in events if e["ph"] == "X"]
    phases = {(e["pid"], e["name"]) for e in spans}
    for rank in (0, 1):
        assert {"data", "forward", "forward+backward", "optimizer", "sync"} <= {
            name for r, name in phases if r == rank
        }
    # On the common axis the ranks meet in their all-reduces: rank 1 (slow) arrives while
    # rank 0 is still blocked in the same one. Uncorrected, 2.5 s would keep them apart.
    reduces = {r: [e for e in spans if e["pid"] == r and e["name"] == "all_reduce"] for r in (0, 1)}
    meetings = sum(
        1
        for a in reduces[0]
        for b in reduces[1]
        if max(a["ts"], b["ts"]) < min(a["ts"] + a["dur"], b["ts"] + b["dur"])
    )
    assert meetings >= 5, meetings  # at least one per traced step
    window = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
    assert window < 2 * 1e6, window  # 5 steps of ~15 ms, not the skew's 2.5 s
