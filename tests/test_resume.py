"""Exact resume: a job that loses a rank restarts and resumes from its newest checkpoint, a job
stopped by SIGTERM saves one and continues with --resume, and either way it ends bit-identical
to the same job run straight through: parameters, optimizer moments, strategy state (PowerSGD's
error feedback and Q matrices, ZeRO's shards) and random generators, compared file by file.
A run resumed on another number of ranks sees every sample of the epoch once (its ranks'
sample ledger says) and ends where plain single-process training on the same global batches
ends. A SIGTERM to one worker stops the whole job the same way (exit 143, no final model);
`--resume` then uses the run's own config, and refuses another job's checkpoint in one line
without touching the run directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import set_args, start_cli, wait_until
from ledger_replay import replay_ledger
from shardwise.checkpoint import run_checkpoint
from shardwise.config import load_config
from shardwise.data import ledger
from shardwise.jobs import build_job

STEPS = 60
RUNS = ("straight", "stopped")


def _train(run_dir: Path, *sets: str, env: dict | None = None, extra=(), nproc: int = 2):
    """The digits job of STEPS steps, a checkpoint every 10, started (`extra`: --resume RUN, or
    --max-restarts N)."""
    argv = ["train", "digits", "--nproc", str(nproc), *extra]
    argv += set_args(
        f"train.steps={STEPS}", "train.checkpoint_every=10", "train.measure=false", *sets
    )
    return start_cli(*argv, *([] if "--resume" in extra else ["--run-dir", str(run_dir)]), env=env)


def _finish(job, code: int = 0) -> str:
    try:
        out, _ = job.communicate(timeout=240)
    finally:
        job.kill()  # (a job that hangs must not outlive its test)
    assert job.returncode == code, out[-3000:]
    return out


def _same_end(a: Path, b: Path) -> None:
    """The last checkpoints (each rank's whole state) and the final weights are identical."""
    last = f"checkpoints/{run_checkpoint.PREFIX}{STEPS:09d}"
    for name in ["checkpoint/model.safetensors", *(f"{last}/rank{r}.safetensors" for r in (0, 1))]:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys()
        differ = [k for k in x if not torch.equal(x[k], y[k])]
        assert not differ, (name, differ[:5])


@pytest.mark.parametrize(
    "strategy, corrupt",
    [
        (["strategy.compression=powersgd:2"], []),
        # ...and the newest checkpoint damaged (a fault from the config): back to the one before
        (["strategy.name=zero", "strategy.stage=2"], ["faults=[corrupt-checkpoint:step=30]"]),
    ],
    ids=["ddp-powersgd", "zero2-corrupt-newest"],
)
def test_a_killed_rank_restarts_and_resumes_bit_identically(tmp_path, strategy, corrupt):
    straight = _train(tmp_path / "straight", *strategy)  # (both jobs run at once)
    fault = {"SHARDWISE_FAULT": "kill:rank=1:step=37"}
    faulty = _train(
        tmp_path / "faulty", *strategy, *corrupt, env=fault, extra=["--max-restarts", "1"]
    )
    out = _finish(faulty)
    _finish(straight)
    assert "fault injected on rank 1: kill-rank1-step37" in out
    assert "shardwise: rank 1 was killed by SIGKILL; restarting every rank (restart 1 of 1)" in out
    # The rank that lost it says so in one line, no traceback (it has no bug to show).
    # (what it printed, where not: the message names the error that was not told apart)
    told = out[out.find("Traceback") - 200 :] if "Traceback" in out else out[-2000:]
    assert "Traceback" not in out and "shardwise: rank 0: " in out, told[:3000]
    assert (tmp_path / "faulty" / "faults" / "kill-rank1-step37").exists()  # fired once
    if corrupt:
        newest = tmp_path / "faulty" / "checkpoints" / f"{run_checkpoint.PREFIX}{30:09d}"
        assert f"skipping a checkpoint: checkpoint file corrupt (checksum): {newest}/rank" in out
        assert "(step 20)" in out
    else:  # step 30's checkpoint, or 20's if the kill came before the background save was done
        assert "resumed from" in out
    _same_end(tmp_path / "straight", tmp_path / "faulty")


@pytest.mark.alone  # (the signal must land in the job's last 2 s)
def test_sigterm_saves_a_checkpoint_and_resume_continues_bit_identically(tmp_path):
    straight = _train(tmp_path / "straight")  # (both jobs run at once)
    slow = ["train.delay_s=[0.05, 0.05]"]  # (sleeps only: the arithmetic is the same)
    stopped = _train(tmp_path / "stopped", *slow)
    metrics = tmp_path / "stopped" / "metrics.jsonl"

    def steps_done() -> int:
        return metrics.read_text().count('"loss"') if metrics.exists() else 0

    wait_until(lambda: steps_done() >= 15, job=stopped, every_s=0.1)
    stopped.send_signal(signal.SIGTERM)
    try:
        out, _ = stopped.communicate(timeout=120)
    finally:
        stopped.kill()
    assert stopped.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert out.strip().splitlines()[-1] == "shardwise: stopped by signal SIGTERM"  # no traceback
    saved = run_checkpoint.complete(tmp_path / "stopped" / "checkpoints")
    step = int(saved[-1].name.removeprefix(run_checkpoint.PREFIX))
    assert 15 <= step < STEPS and f"stopped after step {step}" in out
    resumed = _train(tmp_path / "stopped", extra=["--resume", str(tmp_path / "stopped")])
    assert f"(step {step})" in _finish(resumed)
    _finish(straight)
    _same_end(tmp_path / "straight", tmp_path / "stopped")
    # Per step of its own: the resumed process ran fewer (it was halved over all the run's),
    # but for what each process sends once: the check of the global batch its loader declares
    # (40 bytes, in its first step).
    summaries = [json.loads((tmp_path / r / "summary.json").read_text()) for r in RUNS]
    ran = [s["comm_bytes_total"] / s["comm_bytes_per_step"] for s in summaries]
    per_step = [(s["comm_bytes_total"] - 40) / n for s, n in zip(summaries, ran, strict=True)]
    assert per_step[0] == pytest.approx(per_step[1], rel=1e-12) and per_step[0] > 0
    # The run's time reads on over the resume (it started again from 0: plotted over time,
    # the resumed steps lay on top of the first ones).
    lines = (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
    times = [row["t"] for row in map(json.loads, lines) if "t" in row]
    assert len(times) == STEPS and times == sorted(times)


def _workers(run: Path) -> dict[int, int]:
    """rank -> pid of each worker of the job in `run` (Linux: read from /proc)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if str(run).encode() not in (proc / "cmdline").read_bytes().split(b"\0"):
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # not a process, or one that just ended
            continue
        ranks = [int(e.removeprefix(b"RANK=")) for e in env if e.startswith(b"RANK=")]
        found.update({rank: int(proc.name) for rank in ranks})
    return found


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.alone  # (the signal must land in the job's last 2 s)
def test_sigterm_to_one_worker_saves_and_resume_uses_the_runs_own_config(tmp_path, capsys):
    run = tmp_path / "run"
    own = ["name=small", "model.hidden=[16]", "train.delay_s=[0.05, 0.05]"]  # not digits' own
    job = _train(run, *own)
    metrics = run / "metrics.jsonl"
    wait_until(
        lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 15, job=job, every_s=0.1
    )
    os.kill(_workers(run)[1], signal.SIGTERM)  # one worker, not the launcher
    out = _finish(job, code=128 + signal.SIGTERM)
    newest = run_checkpoint.complete(run / "checkpoints")[-1]
    step = int(newest.name.removeprefix(run_checkpoint.PREFIX))
    assert (
        f"shardwise: rank 1 got SIGTERM: stopped after step {step} of {STEPS} with a checkpoint; "
        f"go on with: shardwise train --resume {run}"
    ) in out.splitlines()
    # Not all steps done: no final model, no summary (the exit code says it stopped).
    assert not (run / "checkpoint").exists() and not (run / "summary.json").exists()

    # Told to resume another job: one line, before anything in the run directory changes.
    from shardwise.cli import main

    before = _files(run)
    for args, why in [
        (["--set", "model.hidden=[32]"], "another model: its 0.weight is [16, 64], this config's"),
        (["digits"], "another model: its 0.weight is [16, 64], this config's is [128, 64]"),
        (["--set", "optim.name=sgd"], "optimizer 'adamw' saved it, this config has 'sgd'"),
        (["--set", "strategy.name=zero"], "strategy 'ddp' saved it, this config has 'zero'"),
    ]:
        assert main(["train", *args, "--resume", str(run)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"shardwise: --resume {run}: {newest} was saved by another job: ")
        assert why in line
        assert _files(run) == before

    # No CONFIG: the run's own config.yaml (its model, its name), from the step it stopped at.
    resumed = start_cli("train", "--resume", str(run))
    out = _finish(resumed)
    assert f"shardwise: resuming {run} with its own config.yaml" in out
    assert f"resumed from {newest} (step {step})" in out
    assert load_file(str(run / "checkpoint" / "model.safetensors"))["0.weight"].shape == (16, 64)
    assert '"name": "small"' in (run / "summary.json").read_text()


def test_a_corrupt_checkpoint_is_skipped_for_the_one_before(tmp_path, capsys, monkeypatch):
    _finish(_train(tmp_path / "run"))
    root = tmp_path / "run" / "checkpoints"
    newest, previous = run_checkpoint.complete(root)[-1], run_checkpoint.complete(root)[-2]
    shard = newest / "rank1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5] + b"xxxxx")
    found = run_checkpoint.newest(tmp_path / "run", 2, "ddp")
    assert (found.directory, found.world_size) == (previous, 2)
    assert found.step == int(previous.name.removeprefix(run_checkpoint.PREFIX))
    assert f"checkpoint file corrupt (checksum): {shard}" in capsys.readouterr().out
    assert run_checkpoint.newest(tmp_path / "run", 2, "zero-2") is None  # another strategy
    # A new job is refused that directory: its saves would be pruned as older than the run's.
    refused = _finish(_train(tmp_path / "run"), code=2)
    assert "holds another run's checkpoints (the newest step-000000060)" in refused
    # Resumed from the one before, the run keeps its next save and drops the one it left
    # behind, which a restart would resume from (pruned by step, the new save went instead).
    # (Its final weights gone: a run that finished is not resumed, as tested below.)
    shutil.rmtree(tmp_path / "run" / "checkpoint")
    sets = ("train.steps=55", "train.checkpoint_every=5", "train.keep_checkpoints=1")
    resumed = _finish(_train(tmp_path / "run", *sets, extra=["--resume", str(tmp_path / "run")]))
    assert f"resumed from {previous} (step 50)" in resumed
    assert [p.name for p in run_checkpoint.complete(root)] == ["step-000000055"]

    # The run finished (its summary and final weights written): resumed with no step left to
    # train, one line, and the run untouched. (Before: exit 0 after writing over its summary
    # with an empty one, NaN losses and no bytes; with fewer steps, config.yaml's and the
    # final checkpoint's step too, the weights being the later step's.)
    from shardwise.cli import main

    run, before = tmp_path / "run", _files(tmp_path / "run")
    start_from = f"start a new run from it (--set start.checkpoint={run} --set start.mode="
    for steps in (55, 30):
        assert main(["train", "--resume", str(run), *set_args(f"train.steps={steps}")]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"shardwise: --resume {run}: the run finished at step 55, train.steps is {steps}: "
            f"raise train.steps to train further, or {start_from}continue)"
        ]
    assert _files(run) == before
    # Stopped at its last step, after that step's checkpoint and before its final weights (a
    # signal in the last step): it resumes, and finishes.
    shutil.rmtree(run / "checkpoint")
    assert main(["train", "--resume", str(run), *set_args("train.steps=50")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"shardwise: --resume {run}: its newest checkpoint is at step 55, past "
        f"train.steps=50: raise train.steps, or {start_from}continue)"
    ]
    out = _finish(start_cli("train", "--resume", str(run)))
    assert f"resumed from {root / 'step-000000055'} (step 55)" in out
    assert (run / "checkpoint" / "model.safetensors").is_file()
    # Finished, with no checkpoint saved on the way: a resume would train over it from step 0
    # (before: it did, exit 0). The way on is a new run from its final weights.
    shutil.rmtree(root)
    before = _files(run)
    assert main(["train", "--resume", str(run), *set_args("train.steps=70")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"shardwise: --resume {run}: the run finished and saved no checkpoint to resume from; "
        f"to train further, {start_from}finetune)"
    ]
    other = tmp_path / "other"
    assert main(["train", "--resume", str(run), "--run-dir", str(other)]) == 2
    assert capsys.readouterr().err == (
        f"shardwise: --resume {run} goes on in its own run directory: leave --run-dir out\n"
    )
    monkeypatch.chdir(tmp_path)  # (the same directory, named relative: not another)
    assert main(["train", "--resume", str(run), "--run-dir", "run", *set_args("train.steps=70")])
    assert "the run finished and saved no checkpoint" in capsys.readouterr().err
    assert _files(run) == before and not other.exists()


# Batch sizes such that the resumed part crosses the end of the first epoch.
@pytest.mark.parametrize("before, after, batch", [(4, 2, 8), (2, 3, 12)], ids=["4to2", "2to3"])
def test_resume_on_another_number_of_ranks_sees_every_sample_once(tmp_path, before, after, batch):
    run = tmp_path / "run"
    sets = ["train.sample_ledger=true", f"data.batch_size={batch}", "optim.warmup_steps=0"]
    sets.append("train.async_checkpoint=false")  # step 30's checkpoint is complete at the kill
    killed = _train(run, *sets, env={"SHARDWISE_FAULT": "kill:rank=1:step=31"}, nproc=before)
    _finish(killed, code=1)
    out = _finish(_train(run, *sets, extra=["--resume", str(run)], nproc=after))
    assert f"(step 30, resharded from {before} to {after} ranks)" in out
    lines = [line for rank_lines in ledger.read(run).values() for line in rank_lines]
    assert {line["world_size"] for line in lines if line["step"] > 30} == {after}
    first_epoch = [i for line in lines if line["epoch"] == 0 for i in line["indices"]]
    assert len(first_epoch) == len(set(first_epoch))  # no sample twice
    # every sample once, but the tail that does not fill a global batch (drop_last)
    size = len(build_job(load_config("digits")).splits.train)
    assert size - batch * after < len(first_epoch) <= size
    assert any(line["epoch"] == 1 for line in lines)  # (the run went past the epoch's end)
    expected = replay_ledger(run, [f"train.steps={STEPS}", *sets], STEPS)
    final = load_file(str(run / "checkpoint" / "model.safetensors"))
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-5)
