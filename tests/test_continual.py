"""Continual training: the three ways to start from another run's checkpoint, each shown by
what the new run's ranks wrote (its sample ledger, its metrics, its optimizer state in its own
checkpoint); vocabulary growth under ZeRO-3 leaving old rows and their Adam moments bit for bit,
read back from the files a checkpoint of the grown model wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shardwise as sw
from harness import finish, run_cli, start_cli, train_args
from shardwise.checkpoint.reshardable import read_full_state
from shardwise.checkpoint.run_checkpoint import SHARDED, RunCheckpointError, complete
from shardwise.config import ConfigError, load_config
from shardwise.data import datasets, ledger
from shardwise.data.sharded_loader import loader
from shardwise.jobs import build_splits
from shardwise.nn.models import TinyGPT
from shardwise.train.data_feed import stage_loader
from spawn import run

BASE = ["train.steps=20", "train.checkpoint_every=10", "train.sample_ledger=true"]
BASE += ["train.async_checkpoint=false", "train.log_every=1", "train.tensorboard=false"]
BASE += ["data.stages=[{at: 6, seed: 5}]"]  # from step 6 the digits in another order


def _ledger(run_dir: Path) -> dict[int, list[list[int]]]:
    """step -> each rank's indices (in rank order) and the epoch, from the run's ledger."""
    steps: dict[int, dict[int, dict]] = {}
    for rank, lines in ledger.read(run_dir).items():
        for line in lines:
            steps.setdefault(line["step"], {})[rank] = line
    return {s: [by_rank[r] for r in sorted(by_rank)] for s, by_rank in sorted(steps.items())}


def _newest(run_dir: Path) -> tuple[dict, dict, int]:
    """The full state in the run's newest checkpoint, read from its files."""
    return read_full_state(complete(run_dir / "checkpoints")[-1] / SHARDED)


def _adam_steps(run_dir: Path) -> set[float]:
    """Adam's step counts in the run's newest checkpoint."""
    _, states, _ = _newest(run_dir)
    return {float(s["step"]) for s in states.values()}


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "loss" in m]


def test_resume_continue_and_finetune_each_start_as_they_say(tmp_path):
    first = tmp_path / "first"
    done = run_cli(*train_args(first, *BASE))
    assert done.returncode == 0, done.stderr[-3000:]
    step10 = complete(first / "checkpoints")[0]
    assert step10.name.endswith("10")
    start = lambda mode, where: [f"start.mode={mode}", f"start.checkpoint={where}"]  # noqa: E731
    more = ["train.steps=5", "train.checkpoint_every=5"]
    jobs = {
        # the same run going on from step 10, in another run directory
        "resume": start_cli(*train_args(tmp_path / "resume", *BASE, *start("resume", step10))),
        # weights and optimizer from the run's newest checkpoint (step 20)
        "continue": start_cli(
            *train_args(tmp_path / "continue", *BASE, *more, *start("continue", first))
        ),
        # the final weights, on 1 rank under ZeRO-3, lr 1e-30: the weights as they came
        "finetune": start_cli(
            *train_args(
                tmp_path / "finetune",
                *BASE,
                *more,
                *start("finetune", first / "checkpoint"),
                "strategy.name=zero",
                "strategy.stage=3",
                "optim.lr=1e-30",  # (below half an ulp of every weight)
                nproc=1,
            ),
        ),
    }
    for (name, _), (code, out) in zip(jobs.items(), finish(*jobs.values()), strict=True):
        assert code == 0, (name, out[-3000:])
        assert f"shardwise: {name} from " in out
    original = _ledger(first)

    # The data stage: step 6 starts a fresh epoch of the order seed 5 draws.
    train = build_splits(load_config("digits", BASE)).train
    first_batches = []
    for rank in (0, 1):
        fresh = loader(train, 32, shuffle=True, seed=5, shard=(2, rank))
        next(iter(fresh))
        first_batches.append(fresh.last_indices)
    assert [(line["stage"], line["epoch"]) for line in original[6]] == [(1, 0), (1, 0)]
    assert [line["indices"] for line in original[6]] == first_batches
    assert {line["stage"] for s in range(1, 6) for line in original[s]} == {0}

    # resume: steps 11-20 on exactly the samples of the run straight through (inside the
    # data stage: its position came back with it), to the same bits
    resumed = _ledger(tmp_path / "resume")
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[s] == original[s] for s in resumed)
    final = load_file(str(first / "checkpoint" / "model.safetensors"))
    again = load_file(str(tmp_path / "resume" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(final[k], again[k]) for k in final)

    # continue: a fresh epoch and schedule, the optimizer's 20 steps carried on to 25
    continued = _ledger(tmp_path / "continue")
    assert sorted(continued) == [1, 2, 3, 4, 5] and continued[1] == original[1]
    assert _metrics(tmp_path / "continue")[0]["lr"] == _metrics(first)[0]["lr"]  # warm-up's first
    assert _adam_steps(tmp_path / "continue") == {25.0}

    # finetune: a fresh optimizer (5 steps, not 25) on the run's final weights
    tuned = _ledger(tmp_path / "finetune")
    assert sorted(tuned) == [1, 2, 3, 4, 5] and tuned[1][0]["epoch"] == 0
    assert _adam_steps(tmp_path / "finetune") == {5.0}
    weights = load_file(str(tmp_path / "finetune" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(final[k], weights[k]) for k in final)


def test_a_data_stage_changes_the_sequence_length_and_bad_stages_are_one_line():
    cfg = load_config("tiny_gpt", ["data.stages=[{at: 3, seq_len: 32}]"])
    stage = stage_loader(cfg, cfg.data.stages[0], (2, 1))
    inputs, targets = next(iter(stage))
    assert inputs.shape == targets.shape == (8, 32)
    for sets, words in [
        (["data.stages=[{at: 6}, {at: 4}]"], "increasing steps"),
        (["data.stages=[{at: 1}]"], "greater than or equal to 2"),
        (["data.stages=[{at: 3, tokens: nowhere.bin}]"], "nowhere.bin"),
        (["data.stages=[{at: 3}]", "data.mode=queue"], "not a work queue"),
    ]:
        with pytest.raises(ConfigError, match=words) as err:
            load_config("digits", sets)
        assert "\n" not in str(err.value)


def test_a_text_stage_reads_its_characters_with_the_runs_vocabulary(tmp_path):
    """A character model's ids are places in its run's vocabulary: a stage's own file, which
    holds fewer characters, keeps them; one with a character the model never had is refused."""
    base = (Path(datasets.__file__).parent / "genesis_kjv.txt").read_text(encoding="utf-8")
    later = tmp_path / "later.txt"
    later.write_text("and God saw the light, that it was good. " * 8, encoding="utf-8")
    cfg = load_config("tiny_gpt", [f"data.stages=[{{at: 3, path: {later}, seq_len: 16}}]"])
    window, _ = stage_loader(cfg, cfg.data.stages[0], (1, 0)).dataset[0]
    vocab = sorted(set(base))
    assert "".join(vocab[i] for i in window.tolist()) == later.read_text()[:16]
    (tmp_path / "new.txt").write_text("and God saw the \u00e9t\u00e9 " * 8, encoding="utf-8")
    stage = cfg.data.stages[0].model_copy(update={"path": str(tmp_path / "new.txt")})
    with pytest.raises(ValueError, match=r"1 character\(s\) \('\u00e9'\) are not in the"):
        stage_loader(cfg, stage, (1, 0))


def test_a_mixture_stage_draws_each_source_by_its_weight(tmp_path):
    # Two token files told apart by their tokens: a's below 5, b's from 5. b is a quarter of
    # a's size and weighs 3 to a's 1: it repeats, each of its windows as often as any other.
    g = torch.Generator().manual_seed(0)
    for name, low, n in (("a", 0, 2000), ("b", 5, 500)):
        torch.randint(low, low + 5, (n,), generator=g).numpy().astype("uint16").tofile(
            tmp_path / name
        )
    mixture = f"[{{tokens: {tmp_path / 'a'}, weight: 1}}, {{tokens: {tmp_path / 'b'}, weight: 3}}]"
    sets = ["data.dataset=null", "data.path=null", f"data.tokens={tmp_path / 'a'}"]
    sets += ["data.vocab_size=10", "data.seq_len=16"]
    sets += ["model.name=gpt", f"data.stages=[{{at: 3, mixture: {mixture}}}]", "data.batch_size=20"]
    cfg = load_config("tiny_gpt", sets)
    drawn = stage_loader(cfg, cfg.data.stages[0], (1, 0))
    windows = [x for inputs, _ in drawn for x in inputs]  # one epoch
    from_b = [w for w in windows if int(w.min()) >= 5]
    assert all(int(w.max()) < 5 for w in windows if int(w.min()) < 5)  # no window mixes them
    assert len(drawn.dataset) == 140 and len(windows) == 140  # (112 + 28 windows)
    assert len(from_b) == 105  # 3 of 4
    counts = torch.unique(torch.stack(from_b), dim=0, return_counts=True)[1]
    assert int(counts.max()) - int(counts.min()) <= 1  # every b window as often, within one


def test_bad_starts_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="grow_vocab changes the model"):
        load_config("digits", ["start.mode=resume", "start.checkpoint=x", "start.grow_vocab=true"])
    with pytest.raises(ConfigError, match="start needs a strategy"):
        load_config("digits", ["start.mode=resume", "start.checkpoint=x", "strategy.name=ps"])
    sw.init()
    model, opt = sw.prepare(_gpt(13), sw.ZeRO(stage=3), lr=1e-2)
    for where, mode, words in [
        (tmp_path / "none", "continue", "no such checkpoint"),
        (tmp_path, "continue", "not a run's checkpoint"),
        (tmp_path, "restart", "start mode must be one of"),
    ]:
        with pytest.raises((RunCheckpointError, ValueError), match=words) as err:
            sw.start_from(where, model, opt, mode)
        assert "\n" not in str(err.value)
    sw.save_checkpoint(model, opt, tmp_path / "other")  # a model of another vocabulary
    with pytest.raises(RunCheckpointError, match=r"tok_emb.weight is \(13, 16\) there, \(20, 16\)"):
        sw.start_from(tmp_path / "other", *sw.prepare(_gpt(20), sw.ZeRO(stage=3)), "finetune")


def test_grown_rows_follow_the_old_rows_mean_and_covariance():
    g = torch.Generator().manual_seed(0)
    mixing = torch.randn(6, 6, generator=g)
    old = torch.randn(400, 6, generator=g) @ mixing + 3.0
    grown = sw.grow_rows(old, 400 + 20_000, torch.Generator().manual_seed(1))
    assert torch.equal(grown[:400], old)
    new = grown[400:].double()
    assert torch.allclose(new.mean(0), old.double().mean(0), atol=0.1)
    assert torch.allclose(torch.cov(new.T), torch.cov(old.double().T), rtol=0.06, atol=0.1)
    bias = sw.grow_rows(torch.tensor([1.0, 2.0, 6.0]), 5, g)
    assert bias.tolist() == [1.0, 2.0, 6.0, 3.0, 3.0]


def _gpt(vocab: int, tied: bool = True) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=vocab, seq_len=8, d_model=16, n_layer=1, n_head=4)
    if tied:
        model.head.weight = model.tok_emb.weight
    return model


def _train(model, opt, vocab: int, steps: int) -> None:
    replicas, index = sw.data_shard(model)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, vocab, (4 * replicas, 9), generator=g)[4 * index :][:4]
        loss = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
        sw.train_step(model, idx[:, :-1], idx[:, 1:], loss)
        opt.step()
        opt.zero_grad()


def _grow(root: str) -> dict:
    """Train a tied GPT of 13 tokens under ZeRO-3, save; grow it to 20 tokens under ZeRO-3 and
    under a dp1 x tp2 mesh (vocabulary-parallel embedding), save those; train the grown one."""
    root_dir = Path(root)
    small, opt = sw.prepare(_gpt(13), sw.ZeRO(stage=3), lr=1e-2)
    _train(small, opt, 13, 3)
    sw.Checkpointer(root_dir / "small", small, opt, asynchronous=False).save(3)
    small.close()
    for name, strategy in [("zero3", sw.ZeRO(stage=3)), ("mesh", sw.MeshParallel(dp=1, tp=2))]:
        grown, opt = sw.prepare(_gpt(20), strategy, lr=1e-2)
        step, _ = sw.start_from(root_dir / "small", grown, opt, "continue", grow_vocab=True, seed=7)
        saver = sw.Checkpointer(root_dir / name, grown, opt, asynchronous=False)
        saver.save(step)
        saver.close()
        if name == "zero3":
            _train(grown, opt, 20, 2)  # and it trains
        grown.close()
    return {"rank": torch.distributed.get_rank()}


def test_vocabulary_growth_under_zero3_keeps_old_rows_and_moments_bitwise(tmp_path):
    run(_grow, 2, str(tmp_path), timeout_s=300)
    old_params, old_states, _ = read_full_state(
        complete(tmp_path / "small" / "checkpoints")[-1] / SHARDED
    )
    emb = "tok_emb.weight"
    assert "head.weight" not in old_params  # (tied: one tensor)
    for name in ("zero3", "mesh"):
        params, states, _ = _newest(tmp_path / name)
        assert params[emb].shape == (20, 16)
        assert torch.equal(params[emb][:13], old_params[emb])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(states[emb][key][:13], old_states[emb][key])
            assert not states[emb][key][13:].any()
        assert all(torch.equal(params[k], v) for k, v in old_params.items() if k != emb)
        if name == "zero3":
            first = params[emb]
        else:  # the same seeded rows, whatever the strategy
            assert torch.equal(params[emb], first)
    new = first[13:].double()
    assert (new.mean(0) - old_params[emb].double().mean(0)).abs().max() < 0.05
