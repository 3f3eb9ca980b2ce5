"""Failover inside the job (`train.on_failure: shrink | replace`): a rank killed or hung mid-run
costs no restart and no checkpoint read; the survivors go on from the step in hand with the
same global batches, and a replacement joins with the state sent by its peers.

The evidence is the runs' own outputs, set against single-process training of the same job on
its global batches (4 ranks' worth each step, read in one process by a loader of one replica):
the final weights (within 1e-5; an uninterrupted 4-rank run is 4.8e-8 from it), and the sample
ledger, step by step: each step's samples are that step's global batch, and no sample is trained
on twice in an epoch.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness import run_cli, train_args
from shardwise.checkpoint.reshardable import load_model
from shardwise.config import load_config
from shardwise.data import ledger
from shardwise.data.sharded_loader import loader
from shardwise.jobs import OPTIMIZERS, base_lr, build_job, optimizer_kwargs, schedule

pytestmark = pytest.mark.alone  # (a 3 s hang timeout, and recoveries bounded in seconds)

STEPS = 60
SETS = [f"train.steps={STEPS}", "train.sample_ledger=true", "train.measure=false"]


def _train(run_dir: Path, *sets: str):
    return run_cli(*train_args(run_dir, *SETS, *sets, nproc=4), timeout=240)


@pytest.fixture(scope="module")
def single_process() -> tuple[dict[str, torch.Tensor], dict[int, list[int]]]:
    """The digits job trained in one process on 4 ranks' global batches: its final weights,
    and each step's batch (sorted sample indices)."""
    ranks = 4
    cfg = load_config("digits", [f"train.steps={STEPS}"])
    job = build_job(cfg)
    model = job.model
    opt = OPTIMIZERS[cfg.optim.name](model.parameters(), **optimizer_kwargs(cfg.optim))
    for group in opt.param_groups:  # (the job's rate for the global batch of 4 ranks)
        group["lr"] = base_lr(cfg.optim, cfg.data.batch_size, ranks)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg.optim, STEPS))
    data = loader(job.splits.train, cfg.data.batch_size * ranks, seed=cfg.train.seed, shard=(1, 0))
    batches, step = {}, 0
    while step < STEPS:
        for x, y in data:  # (each pass: the next epoch)
            step += 1
            batches[step] = sorted(data.last_indices)
            opt.zero_grad()
            job.loss_fn(model(x), y).backward()
            opt.step()
            scheduler.step()
            if step == STEPS:
                break
    return model.state_dict(), batches


def _batches(run_dir: Path) -> dict[int, list[int]]:
    """Each step's global batch (sorted sample indices), from every rank's ledger lines."""
    steps: dict[int, list[int]] = {}
    for lines in ledger.read(run_dir).values():
        for line in lines:
            steps.setdefault(line["step"], []).extend(line["indices"])
    return {step: sorted(indices) for step, indices in steps.items()}


def _trained_as_one_process(run_dir: Path, single_process) -> None:
    """The run trained on the single-process run's global batches, each sample once an epoch,
    and ended with its weights."""
    weights, batches = single_process
    assert _batches(run_dir) == batches
    epochs: dict[int, Counter] = {}
    for lines in ledger.read(run_dir).values():
        for line in lines:
            epochs.setdefault(line["epoch"], Counter()).update(line["indices"])
    assert all(max(seen.values()) == 1 for seen in epochs.values())
    ours = load_model(run_dir / "checkpoint")
    assert ours.keys() == weights.keys()
    worst = max((ours[k] - weights[k]).abs().max().item() for k in ours)
    assert worst < 1e-5, worst
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def _seconds_to_go_on(run_dir: Path, fault: str, step: int) -> float:
    """From the fault (its marker's time) to the end of `step` on rank 0 (its timing line)."""
    fired = float((run_dir / "faults" / fault).read_text())
    lines = [json.loads(x) for x in (run_dir / "timing" / "rank0.jsonl").read_text().splitlines()]
    done = [x["wall_time"] for x in lines if x["step"] == step]
    assert done, f"rank 0 never finished step {step}"
    return done[-1] - fired


def _events(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "membership" in x]


def test_ddp_survivors_of_a_killed_rank_go_on_with_the_same_batches(tmp_path, single_process):
    run_dir = tmp_path / "shrink"
    result = _train(run_dir, "train.on_failure=shrink", 'faults=["kill:rank=3:step=20"]')
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "step 20: rank 3 was killed by SIGKILL; the job goes on with 3 ranks" in out
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 3
    [event] = _events(run_dir)
    assert (event["step"], event["members"], event["left"]) == (20, ["0", "1", "2"], ["3"])
    assert _seconds_to_go_on(run_dir, "kill-rank3-step20", 20) < 10
    _trained_as_one_process(run_dir, single_process)


def test_zero2_drops_a_hung_rank_then_takes_a_replacement_in(tmp_path, single_process):
    """ZeRO-2: the optimizer state of the dropped rank's shard lives on in its neighbour's copy;
    the replacement, at step 40, receives every shard from its peers."""
    run_dir = tmp_path / "replace"
    result = _train(
        run_dir,
        "strategy.name=zero",
        "strategy.stage=2",
        "train.on_failure=replace",
        "launch.hang_timeout_s=3",
        'faults=["hang:rank=2:step=20","rejoin:step=40"]',
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    # (ZeRO-2's gradients: summed in shared memory, the ranks on one host's CPU)
    assert "rank 2 never arrived at reduce_scatter_shared" in out
    assert "step 20: rank 2 hung in step 20; the job goes on with 3 ranks" in out
    assert "step 40: rank 2 (start 2) joined; the job goes on with 4 ranks" in out
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 4
    dropped, joined = _events(run_dir)
    assert (dropped["step"], dropped["members"], dropped["left"]) == (20, ["0", "1", "3"], ["2"])
    assert (joined["step"], joined["joined"]) == (40, ["2#1"])
    assert _seconds_to_go_on(run_dir, "hang-rank2-step20", 20) < 3 + 10
    _trained_as_one_process(run_dir, single_process)


def test_the_non_finite_policy_goes_on_across_a_re_form(tmp_path):
    """A step skipped on non-finite values before a rank is lost stays in the record, and the
    streak goes on (before, the re-formed run started a fresh policy: no step skipped)."""
    sets = ["train.steps=10", "train.measure=false", "train.on_failure=shrink"]
    sets += ['faults=["nan:rank=1:step=3","kill:rank=2:step=6"]']
    result = run_cli(*train_args(tmp_path / "run", *sets, nproc=3), timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-2000:]
    assert "step 6: rank 2 was killed by SIGKILL; the job goes on with 2 ranks" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_steps"] == [3]


def test_a_job_that_ends_on_every_rank_is_not_replaced(tmp_path):
    """Every rank stopping on purpose (here non-finite values under `train.nonfinite: stop`;
    a signal's agreed stop, exit 143, is the same) ends a 'replace' job with its exit code.
    Before, each rank was taken for lost and replaced, and the replacements waited to join a
    job that had ended: the launcher never returned."""
    sets = ["train.steps=10", "train.measure=false", "train.on_failure=replace"]
    sets += ["train.nonfinite=stop", 'faults=["nan:rank=1:step=3"]']
    result = run_cli(*train_args(tmp_path / "run", *sets, nproc=2), timeout=90)
    out = result.stdout + result.stderr
    assert result.returncode == 4, out[-2000:]
    assert "step 3: non-finite loss on rank 1" in out and "replacement" not in out


def test_a_job_that_cannot_lose_a_rank_refuses_to_shrink():
    from shardwise.config import ConfigError

    with pytest.raises(ConfigError, match="needs data-parallel ddp or zero"):
        load_config("digits", ["strategy.name=local_sgd", "train.on_failure=shrink"])
    with pytest.raises(ConfigError, match="dealt evenly"):
        load_config("digits", ["train.on_failure=shrink", "data.balance=dynamic"])
    # (before: accepted, and the first re-form failed the job, the data's order laid out
    # for the ranks the epoch began with)
    repeats = ["data.augment=shift", "data.augment_repeats=2", "train.on_failure=replace"]
    with pytest.raises(ConfigError, match=r"not with data\.augment_repeats"):
        load_config("digits", repeats)


def test_torch_tensor_types_survive_the_transfer_packing():
    """Shards cross the wire as one flat tensor per dtype: every key comes back in place."""
    from shardwise.train.elastic import _pack, _unpack

    state = {
        "a": torch.randn(3, 2),
        "b": torch.tensor(7.0),
        "c": torch.arange(5),
        "d": torch.randn(4).double(),
    }
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    _unpack(_pack(state), back)
    assert all(torch.equal(state[k], back[k]) for k in state)


def test_a_joiner_that_died_or_has_no_name_yet_is_not_taken_in():
    """On a real store: a replacement that died after asking is passed over (before, the
    members' rendezvous waited for it until the comm timeout, then failed with a traceback),
    and one counted but whose name is not set yet waits for the next step (before, reading
    the missing name was an AttributeError)."""
    import torch.distributed as dist

    from shardwise.distributed.membership import Membership, first_epoch

    store = dist.HashStore()
    members = [Membership(store, m, first_epoch(2), settle_s=1.0) for m in ("0", "1")]
    Membership(store, "1#1", first_epoch(0), 1.0).ask_to_join()
    members[0].store.set("elastic/gone/1#1", "exited with code 1")  # (as the launcher says)
    store.add("elastic/joins", 1)  # a second joiner between its count and its name
    first = [m.admit(step=7) for m in members]
    assert first[0] == first[1]  # (every member enters the one epoch decided)
    assert (first[0].members, first[0].joined, first[0].passed_over) == (["0", "1"], [], ["1#1"])
    assert "rank 1 (start 2) died before it was taken in" in first[0].why
    assert members[0].joiners_waiting() == 1
    store.set("elastic/join/2", "1#2")
    second = [m.admit(step=8) for m in members]
    assert (second[0].members, second[0].joined) == (["0", "1", "1#2"], ["1#2"])
    assert members[1].joiners_waiting() == 0
