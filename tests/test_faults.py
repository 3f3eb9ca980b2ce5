"""Failures named in seconds and survived: a hung rank, ranks issuing different collectives, a
NaN in one rank's gradient (and a rollback that makes no progress), a full disk, and a kill in
the middle of a checkpoint write. Each fault is injected into a real job; the evidence is what
the job printed, its files, and its timing as seen from outside (the fault's marker time, the
launcher's exit)."""

from __future__ import annotations

import json
import re
import resource
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import finish, run_cli, run_python, start_cli, train_args
from shardwise.checkpoint import run_checkpoint
from shardwise.faults import injection as faults
from shardwise.faults.nonfinite import all_finite
from shardwise.faults.watchdog import first_difference

NAN_JOB = ["optim.schedule=constant", "optim.warmup_steps=0"]  # lr independent of step count


def _job(run_dir: Path, *sets: str, nproc: int = 2, env: dict | None = None):
    return run_cli(*train_args(run_dir, *sets, nproc=nproc), env=env, timeout=240)


def _fired_at(run_dir: Path, name: str) -> float:
    return float((run_dir / "faults" / name).read_text())


@pytest.mark.alone  # (a 3 s hang timeout; bounded in seconds)
def test_a_hung_rank_is_named_and_every_rank_exits_within_seconds(tmp_path):
    run = tmp_path / "run"
    result = _job(
        run,
        "train.steps=40",
        "launch.hang_timeout_s=3",
        nproc=3,
        env={"SHARDWISE_FAULT": "hang:rank=1:step=12"},
    )
    ended = time.time()  # the launcher returns once every rank has exited
    assert result.returncode != 0
    assert ended - _fired_at(run, "hang-rank1-step12") < 15
    report = (run / "hang_report.txt").read_text()
    head = report.splitlines()[0]
    # (DDP's gradients, summed in shared memory on this one host, in the algorithm's group)
    assert head.startswith("shardwise: hang: all_reduce_shared #") and "(group 0,1,2," in head
    assert "ranks 0, 2 wait in it; rank 1 never arrived" in head
    assert "rank 1 stack (main thread):" in report
    assert "faults/injection.py" in report  # where it sleeps
    assert head in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # the launcher's: the hung rank, not rank 0
    assert last.startswith("shardwise: hang: rank 1 never arrived at all_reduce_shared #"), last
    assert result.returncode == 3


@pytest.mark.alone  # (bounded in seconds)
def test_ranks_issuing_different_collectives_are_named_with_both_calls(tmp_path):
    """With the default hang timeout (a minute), a desync that hangs ends every rank within
    5 s of the fault: the watchdogs compare the call they all wait in."""
    run = tmp_path / "run"
    result = _job(
        run,
        "train.steps=40",
        nproc=3,
        env={"SHARDWISE_FAULT": "desync:rank=1:step=12"},
    )
    ended = time.time()  # the launcher returns once every rank has exited
    assert result.returncode != 0
    assert ended - _fired_at(run, "desync-rank1-step12") < 5
    head = (run / "hang_report.txt").read_text().splitlines()[0]
    assert head.startswith("shardwise: desync: ranks issued different calls as call #")
    assert "rank 1 issued broadcast #" in head and "ranks 0, 2 issued all_reduce #" in head


def test_the_per_call_check_names_a_desync_before_it_hangs(tmp_path):
    result = _job(
        tmp_path / "run",
        "train.steps=20",
        "launch.desync_check_per_call=true",
        "launch.hang_timeout_s=60",  # a hang would take a minute: the check must come first
        env={"SHARDWISE_FAULT": "desync:rank=1:step=5"},
    )
    assert result.returncode != 0
    line = next(x for x in result.stderr.splitlines() if x.startswith("shardwise: desync"))
    assert "rank 1 issued broadcast #" in line and "rank 0 issued all_reduce #" in line


def test_first_difference_names_the_first_differing_call():
    def call(seq, op):
        return {
            "op": op,
            "group": "world",
            "seq": seq,
            "shape": [4],
            "dtype": "float32",
            "site": "x",
        }

    views = {
        0: {"seq": {"world": 3}, "history": [call(1, "all_reduce"), call(2, "all_reduce")]},
        1: {"seq": {"world": 3}, "history": [call(1, "all_reduce"), call(2, "broadcast")]},
    }
    message = first_difference("world", views)
    assert "rank 0 issued all_reduce #2" in message and "rank 1 issued broadcast #2" in message


def test_a_nan_on_one_rank_skips_the_step_everywhere_and_names_the_rank(tmp_path):
    nan = {"SHARDWISE_FAULT": "nan:rank=1:step=5"}
    (faulty, out), (clean, clean_out) = finish(  # (the two jobs run at once)
        start_cli(*train_args(tmp_path / "nan", "train.steps=20", *NAN_JOB), env=nan),
        # the same job whose data leaves that batch out: one update fewer, the same updates
        start_cli(
            *train_args(tmp_path / "clean", "train.steps=19", "train.skip_batches=[5]", *NAN_JOB)
        ),
    )
    assert faulty == 0, out[-2000:]
    assert "step 5: non-finite loss on rank 1 (global batch 5)" in out
    lines = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    skipped = [x for x in lines if x.get("skipped")]
    assert [(x["step"], x["nonfinite_ranks"]) for x in skipped] == [(5, [1])]
    assert clean == 0, clean_out[-2000:]
    a = load_file(str(tmp_path / "nan" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "clean" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_gradient_check_finds_any_nonfinite_element_and_nothing_else(dtype):
    # Against its definition, elementwise: NaN, +inf or -inf anywhere (first, last, the
    # remainder a vectorised loop leaves) in any of the tensors, empty ones among them.
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 33, 4097, 100003]
    for bad in (float("nan"), float("inf"), -float("inf"), None):
        for which in range(1, len(sizes)):
            tensors = [torch.randn(n, generator=g).to(dtype) * 1e4 for n in sizes]
            n = sizes[which]
            for at in {0, n // 2, n - 1}:
                t = [x.clone() for x in tensors]
                if bad is not None:
                    t[which][at] = bad
                want = all(bool(torch.isfinite(x).all()) for x in t)
                assert bool(all_finite(t)) == want == (bad is None), (dtype, bad, which, at)
    assert bool(all_finite([])) and bool(all_finite([torch.empty(0)]))


def test_rollback_returns_to_the_checkpoint_and_leaves_the_bad_batches_out(tmp_path):
    bad = {"SHARDWISE_FAULT": "nan:rank=0:step=12,nan:rank=1:step=13"}
    sets = ["train.steps=20", "train.checkpoint_every=10", *NAN_JOB]
    rollback = ["train.nonfinite=rollback", "train.max_bad_steps=2"]
    (rolled, out), (clean, clean_out) = finish(  # (the two jobs run at once)
        start_cli(*train_args(tmp_path / "rolled", *sets, *rollback, measure=True), env=bad),
        start_cli(*train_args(tmp_path / "clean", *sets, "train.skip_batches=[12, 13]")),
    )
    assert rolled == 0, out[-2000:]
    assert "rolled back from step 13 to" in out
    assert "global batches [12, 13] left out" in out
    a = load_file(str(tmp_path / "rolled" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "clean" / "checkpoint" / "model.safetensors"))
    assert clean == 0, clean_out[-2000:]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Every step's line once, in order, where the rolled-back steps were run again: the
    # metrics, each rank's timing file and TensorBoard (before, steps 11-13 showed twice).
    metrics = (tmp_path / "rolled" / "metrics.jsonl").read_text()
    lines = [json.loads(x) for x in metrics.splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, 21))
    assert [x["rollback_to"] for x in lines if "rollback_to" in x] == [10]
    for rank in (0, 1):
        timing = (tmp_path / "rolled" / "timing" / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in timing] == list(range(1, 21))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "rolled" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 21))


def test_a_stop_asked_in_the_step_that_rolls_back_stops_at_the_checkpoint_gone_back_to(tmp_path):
    """SIGTERM during step 13, whose non-finite loss rolls the run back to step 10: the run
    stops there, saying so and how to go on, and releases its strategy. Before, the stop after
    a rollback left without its line (nor the model's close): nothing said where it stopped."""
    import signal

    from harness import wait_until

    bad = {"SHARDWISE_FAULT": "nan:rank=0:step=12,nan:rank=1:step=13"}
    sets = ["train.steps=20", "train.checkpoint_every=10", "train.measure=false", *NAN_JOB]
    sets += ["train.nonfinite=rollback", "train.max_bad_steps=2", "train.delay_s=[0.5, 0.5]"]
    job = start_cli(*train_args(tmp_path / "run", *sets), env=bad)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and '"step": 12,' in metrics.read_text(), job=job)
    job.send_signal(signal.SIGTERM)  # (in step 13: it sleeps 0.5 s)
    ((code, out),) = finish(job)
    assert "rolled back from step 13 to" in out and "(step 10)" in out, out[-3000:]
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped after step 10" in out, out[-3000:]
    assert out.strip().splitlines()[-1] == "shardwise: stopped by signal SIGTERM"


def test_rollback_gives_up_when_rolling_back_makes_no_progress(tmp_path):
    # SGD at lr 1e6: a step or two of finite losses, then every batch non-finite from weights
    # that are finite but enormous. Before: a checkpoint saved inside each streak was a "newer"
    # one to roll back to, and the run rolled back to the end and exited 0 (issue #29, 6).
    run = tmp_path / "run"
    sets = ["train.steps=30", "train.checkpoint_every=2", "train.nonfinite=rollback"]
    sets += ["optim.name=sgd", "optim.lr=1e6", *NAN_JOB]
    result = _job(run, *sets, nproc=1)
    assert result.returncode == 4, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "shardwise: the run stopped on non-finite values (train.nonfinite; see above)"
    )
    assert "Traceback" not in result.stderr
    (rolled,) = re.findall(r"rolled back from step (\d+) to .* \(step (\d+)\)", result.stdout)
    at, back_to = int(rolled[0]), int(rolled[1])
    first_bad = min(int(n) for n in re.findall(r"step (\d+): non-finite", result.stdout))
    given_up = re.search(
        rf"shardwise: steps (\d+)-(\d+) non-finite again, before the run got past step {at} "
        "where it rolled back: rolling back makes no progress: stopping",
        result.stderr,
    )
    assert given_up and int(given_up[1]) <= at, result.stderr[-2000:]
    # No checkpoint while bad steps were in a row: the one rolled back to came before them.
    saved = [
        int(p.name.removeprefix(run_checkpoint.PREFIX))
        for p in run_checkpoint.complete(run / "checkpoints")
    ]
    assert back_to == max(saved) < first_bad
    assert not (run / "summary.json").exists() and not (run / "checkpoint").exists()


@pytest.mark.alone  # (bounded in seconds)
def test_a_full_disk_ends_the_job_in_seconds_and_keeps_the_checkpoint(tmp_path):
    # A full disk, emulated without root: every process of the job may write files of at most
    # LIMIT bytes (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write past it fails with EFBIG),
    # and metrics.jsonl starts near the limit: rank 0 fails on it a few steps in. Before, its
    # process lingered until rank 1's watchdog gave up on it, 71 s later (issue #29, 12).
    run, limit = tmp_path / "run", 1 << 20
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n' * ((limit - 1500) // 12))

    def full_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    sets = ("train.steps=50", "train.checkpoint_every=2", "train.async_checkpoint=false")
    # (--resume: a new job refuses a run directory with another run's metrics.jsonl; with no
    # checkpoint to resume from, the run starts afresh and appends to it)
    args = [*train_args(None, *sets), "--resume", str(run)]
    result = run_cli(*args, preexec_fn=full_disk, timeout=240)
    ended = time.time()
    assert result.returncode != 0
    line = f"shardwise: rank 0: cannot write {run}/metrics.jsonl: [Errno 27] File too large"
    assert line in result.stderr.splitlines(), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (run / "hang_report.txt").exists()
    found = run_checkpoint.newest(run, 2, "ddp", warn=False)  # checksums verified
    assert found is not None and found.directory == run_checkpoint.complete(run / "checkpoints")[-1]
    # rank 0 failed a step or two after that checkpoint; every rank was gone seconds later
    assert ended - (found.directory / "manifest.json").stat().st_mtime < 10


def test_nonfinite_stop_ends_the_run_naming_the_rank(tmp_path):
    result = _job(
        tmp_path / "run",
        "train.steps=20",
        "train.nonfinite=stop",
        env={"SHARDWISE_FAULT": "nan:rank=1:step=3"},
    )
    assert result.returncode != 0
    assert (
        "shardwise: step 3: non-finite loss on rank 1 (global batch 3); 1 bad step(s) in a "
        "row: stopping" in result.stderr
    )
    assert "Traceback" not in result.stderr


KILLED_WHILE_SAVING = """
import os, signal, sys
import torch
import shardwise as sw
from shardwise.checkpoint import run_saver

run_dir = sys.argv[1]
rt = sw.init()
torch.manual_seed(0)
model, opt = sw.prepare(torch.nn.Linear(4, 2), sw.DDP(), optimizer=torch.optim.SGD, lr=0.1)
schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
saver = run_saver.Saver(run_dir, rt, keep=2)
saver.save(model, opt, schedule, 10, data={})
saver.wait()
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
write = run_saver.save_file
def write_then_die(tensors, path):  # the first file of step 20 is written, then the kill
    write(tensors, path)
    os.kill(os.getpid(), signal.SIGKILL)
run_saver.save_file = write_then_die
saver.save(model, opt, schedule, 20, data={})
saver.wait()
"""


def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(KILLED_WHILE_SAVING))
    result = run_python(str(script), str(tmp_path), text=False)
    assert result.returncode == -9, result.stderr.decode()[-2000:]
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.glob(".step-*")], "the killed save left its temporary files"
    found = run_checkpoint.newest(tmp_path, 1, "ddp")
    assert found.step == 10
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 2).state_dict()  # the weights before the change
    saved = load_file(str(found.directory / "rank0.safetensors"))
    (weight,) = [v for k, v in saved.items() if k.startswith("s/model/") and k.endswith("weight")]
    assert torch.equal(weight, expected["weight"])
    run_checkpoint.remove_partial(tmp_path)
    assert not list(root.glob(".step-*"))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kill:rank=1", "expected kill:rank=...:step=..."),
        ("boom:rank=1:step=2", "unknown fault 'boom'"),
        ("slow:rank=0:factor=0.5", "factor must be >= 1"),
        ("nan:rank=x:step=2", "expected nan:rank=...:step=..."),
        ("slow:rank=1:step=3", "expected slow:rank=...:factor=..."),
        ("kill:rank=1:step=2:factor=3", "expected kill:rank=...:step=..."),
    ],
)
def test_malformed_faults_are_one_line(spec, message):
    with pytest.raises(ValueError, match=message):
        faults.parse(spec)


def test_a_later_slow_fault_replaces_an_earlier_one_from_its_step(tmp_path):
    injector = faults.FaultInjector(
        1, tmp_path, ["slow:rank=1:factor=2,slow:rank=1:factor=4:step=5"]
    )
    assert [injector.slow_factor(s) for s in (1, 4, 5, 9)] == [2, 2, 4, 4]
    assert faults.FaultInjector(0, tmp_path, ["slow:rank=1:factor=2"]).slow_factor(3) == 1


def test_per_sample_cost_is_the_slope_not_the_fixed_cost():
    cost = faults.PerSampleCost()
    # work = 5 ms fixed + 0.1 ms per sample; after the warm-up steps, sizes vary
    times = [(64, 1.0), (64, 1.0)] + [(n, 0.005 + 1e-4 * n) for n in (64, 32, 48, 64, 40)]
    estimates = [cost.observe(n, t) for n, t in times]
    assert estimates[2] == pytest.approx((0.005 + 64e-4) / 64)  # one size seen: work / n
    assert estimates[-1] == pytest.approx(1e-4)
