"""Your own model, data and loss in `shardwise train` (`model.factory`, `data.factory`,
`model.loss`), Hugging Face models from local files (`model.hf_config`, `model.hf_pretrained`)
and token files larger than memory (`data.tokens`), with every feature of a built-in job.

A job of factories defined in a folder outside the repository (found from the working
directory), on 2 ranks under ZeRO-2, killed at a step and resumed with --resume, ends with the
weights and the sample ledger of the same job run straight through, and leaves the files a
built-in run leaves (metrics, TensorBoard, its prediction beside the measurement, the report).
A Hugging Face GPT-2 built from a config.json trains on a memory-mapped token file the HF way
(dict batches, the model's own loss) on 2 ranks and ends where one process training on the same
global batches ends. `shardwise plan --config` prices both. Each way a factory can be wrong is
one line naming it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import shardwise as sw
from harness import finish, run_cli, set_args, start_cli
from shardwise import cli
from shardwise.checkpoint.hf_export import export_hf
from shardwise.config import ConfigError, load_config
from shardwise.data.datasets import Splits
from shardwise.data.sharded_loader import loader
from shardwise.data.token_file import TokenWindows, open_tokens, token_splits
from shardwise.jobs import OPTIMIZERS, Job, build_job, optimizer_kwargs
from shardwise.nn.dict_batches import call_with_keywords, output_loss
from shardwise.observe import report
from shardwise.plan import calibrate
from shardwise.train.validator import evaluate
from spawn import run

REPOSITORY = Path(__file__).resolve().parents[1]
STEPS = 20

MY_MODELS = """
from torch import nn

def build(width=16, classes=3):
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, classes))

def not_a_module():
    return "a model"
"""
MY_DATA = """
import torch
from torch.utils.data import TensorDataset

def build(samples=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    cut = samples * 3 // 4
    return {"train": TensorDataset(x[:cut], y[:cut]), "eval": TensorDataset(x[cut:], y[cut:])}

def one_dataset():
    return TensorDataset(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
"""
MY_LOSSES = """
import torch.nn.functional as F

def smoothed(output, target):
    return F.cross_entropy(output, target, label_smoothing=0.1)

def corrupt(output, target):
    raise ValueError("corrupt record 77")
"""
BROKEN = "raise RuntimeError('this module is broken')\n"
USER_YAML = f"""
name: mine
model: {{factory: "my_models:build", args: {{width: 16}}, loss: "my_losses:smoothed"}}
data: {{factory: "my_data:build", args: {{samples: 256}}, batch_size: 8}}
strategy: {{name: zero, stage: 2}}
train: {{steps: {STEPS}, checkpoint_every: 5, sample_ledger: true, log_every: 5, eval_every: 10}}
"""


@pytest.fixture(autouse=True)
def _imports_undone(monkeypatch):
    """What a factory's import leaves in this process (its folder on sys.path, its modules)
    goes with the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in ("my_models", "my_data", "my_losses", "broken"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's folder, outside the repository: factories, a loss and the job's config."""
    where = tmp_path_factory.mktemp("my_project")
    assert not where.resolve().is_relative_to(REPOSITORY)
    files = {"my_models.py": MY_MODELS, "my_data.py": MY_DATA, "my_losses.py": MY_LOSSES}
    files |= {"broken.py": BROKEN, "user.yaml": USER_YAML}
    for name, text in files.items():
        (where / name).write_text(text)
    return where


def _train(project: Path, *args: str, env: dict | None = None, code: int = 0) -> str:
    done = run_cli("train", *args, cwd=project, env=env)
    assert done.returncode == code, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


def _steps(metrics: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def test_a_factory_job_killed_and_resumed_ends_as_the_job_run_straight_through(
    project, uncalibrated
):
    straight, stopped = project / "straight", project / "stopped"
    killed = {"SHARDWISE_FAULT": "kill:rank=1:step=13"}
    ended = finish(  # (the two jobs run at once)
        start_cli("train", "user.yaml", "--run-dir", str(straight), cwd=project),
        start_cli("train", "user.yaml", "--run-dir", str(stopped), cwd=project, env=killed),
    )
    assert [code for code, _ in ended] == [0, 1], [out[-3000:] for _, out in ended]
    out = _train(project, "--resume", str(stopped))
    assert "resumed from" in out

    a = load_file(str(straight / "checkpoint" / "model.safetensors"))
    b = load_file(str(stopped / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    for rank in (0, 1):  # the same samples at the same steps: the data position was exact
        ledger = f"ledger/rank{rank}.jsonl"
        assert (stopped / ledger).read_text() == (straight / ledger).read_text()

    # What a built-in run leaves: every step's metrics once, TensorBoard, the report.
    assert _steps(stopped / "metrics.jsonl") == list(range(1, STEPS + 1))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(stopped / "tensorboard"))
    events.Reload()
    # (each step once: what the killed attempt wrote after its checkpoint is purged)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert {e.step for e in events.Scalars("eval/accuracy")} == {10, 20}
    summary = json.loads((stopped / "summary.json").read_text())
    assert 0 <= summary["eval_accuracy"] <= 1 and summary["steps"] == STEPS
    page = project / "report.html"
    assert report.main([str(straight), str(stopped), "-o", str(page)]) == 0
    rows = page.with_suffix(".md").read_text().splitlines()
    assert any(row.startswith("| zero-2 (2 ranks) [stopped] | 20 | ") for row in rows), rows
    # Priced before step 1 from the factory's model: exactly its model state.
    rows = json.loads((straight / "summary.json").read_text())["predicted"]["rows"]
    assert rows["model_state"]["error"] == 0.0 and abs(rows["activations"]["error"]) < 0.01


def _gpt2_project(where: Path) -> Path:
    """A tiny GPT-2 config.json and a uint16 token file of 4,000 ids (nanoGPT's layout)."""
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(
        vocab_size=37, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        architectures=["GPT2LMHeadModel"],
    ).save_pretrained(where / "gpt2")  # fmt: skip
    ids = np.random.default_rng(0).integers(0, 37, size=4000).astype(np.uint16)
    ids.tofile(where / "train.bin")
    (where / "hf.yaml").write_text(
        "model: {hf_config: gpt2/config.json}\n"
        "data: {tokens: train.bin, seq_len: 16, batch_size: 4, test_fraction: 0.1}\n"
        "train: {steps: 4, log_every: 1}\n"
    )
    return where


@pytest.mark.parametrize(
    ("strategy", "replicas"),
    [([], 2), (["--set", "strategy.name=pp", "--set", "strategy.microbatches=2"], 1)],
    ids=["ddp", "pipeline"],
)
def test_an_hf_config_model_trains_on_a_token_file_as_one_process_would(
    tmp_path, uncalibrated, monkeypatch, strategy, replicas
):
    """Data parallel (2 replicas) or the model split in two stages (one replica, its batch
    in micro-batches): the same global batches, the same end."""
    project = _gpt2_project(tmp_path)
    run = tmp_path / "run"
    _train(project, "hf.yaml", "--nproc", "2", *strategy, "--run-dir", str(run))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and _steps(run / "metrics.jsonl") == [1, 2, 3, 4]
    assert np.isfinite(summary["eval_loss"]) and "eval_accuracy" not in summary  # (an LM's)
    trained = load_file(str(run / "checkpoint" / "model.safetensors"))
    # A Hugging Face folder from the final checkpoint (its config recorded by the run, a
    # pipeline's too, whose stages hold no HF model): transformers loads the same weights.
    exported = export_hf(run / "checkpoint", tmp_path / "exported")
    hf_model = pytest.importorskip("transformers").GPT2LMHeadModel.from_pretrained(exported)
    reloaded = hf_model.state_dict()
    assert all(torch.equal(reloaded[k], trained[k]) for k in trained)

    # One process, the same model (seeded alike) and the same global batches, the HF way.
    monkeypatch.chdir(project)
    cfg = load_config("hf.yaml")
    job = build_job(cfg)
    opt = OPTIMIZERS[cfg.optim.name](job.model.parameters(), **optimizer_kwargs(cfg.optim))
    global_batch = replicas * 4
    batches = loader(
        job.splits.train, global_batch, shuffle=True, seed=cfg.train.seed, shard=(1, 0)
    )
    for _, batch in zip(range(4), batches, strict=False):  # (the first 4 batches)
        job.model(batch).loss.backward()
        opt.step()
        opt.zero_grad()
    expected = job.model.state_dict()
    assert trained.keys() == expected.keys()
    # fp32: the two ranks' mean gradients averaged vs one mean over the whole batch differ in
    # rounding only, which AdamW's normalised steps carry into the weights (measured 4e-7; the
    # bound test_hf_models holds our strategies to).
    diff = max((trained[k] - expected[k]).abs().max().item() for k in trained)
    assert diff < 1e-5, diff


def _made_up_calibration(nproc: int) -> dict:
    """A calibration as `shardwise calibrate` writes it, with made-up rates (the ranking's
    inputs, not its accuracy, are what is checked)."""
    rates = {"flop_rate": 1e11, "bytes_rate": 7e10, "op_overhead_s": 4e-6, "sample_read_s": 3e-6}
    points = [[8, 1e-4], [4096, 2e-4], [4 << 20, 2e-3]]
    timings = {"latency_s": 1e-4, "bandwidth": 2e9, "points": points}
    return {
        **{"host": "h", "nproc": nproc, "threads_per_rank": 1, "measured_at": 1.7e9},
        **rates,
        "concurrency": 2.0,
        "shared": dict(rates),
        "collectives": {kind: dict(timings) for kind in calibrate.KINDS},
        "arrival_waits": [[1e-3, 1e-4], [5e-3, 2e-4], [0.1, 1e-3]],
    }


def test_plan_config_prices_factory_and_hf_models(project, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calibrate.cache_path(2).parent.mkdir(parents=True)
    calibrate.cache_path(2).write_text(json.dumps(_made_up_calibration(2)))
    hf = _gpt2_project(tmp_path)
    for where, config in ((project, "user.yaml"), (hf, "hf.yaml")):
        monkeypatch.chdir(where)
        assert cli.main(["plan", "--config", config, "--nproc", "2", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert {"ddp", "zero1", "zero2", "zero3"} <= {row["strategy"] for row in rows}
        assert all(row["memory_bytes"] > 0 and row["step_time_s"] > 0 for row in rows)


# ---- one line for each way a factory is wrong ----------------------------------------------
CONFIG_ERRORS = [
    ("model.factory=nowhere:build", "model.factory: nowhere:build: no module named 'nowhere'"),
    ("model.factory=my_models:nothing", "model.factory: my_models:nothing: module 'my_models' "),
    ("data.factory=my_data:nothing", "data.factory: my_data:nothing: module 'my_data' has no "),
    ("model.loss=my_losses:nothing", "model.loss: my_losses:nothing: module 'my_losses' has no"),
    ("model.factory=broken:build", "importing 'broken' failed: RuntimeError: this module is "),
    ("model.factory=my_models", "'my_models' is not an import path: write module:function"),
    ("model.name=gpt", "config error: model: name and factory are exclusive: give one"),
]


@pytest.mark.parametrize("override, says", CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS])
def test_a_missing_module_or_function_is_one_line_before_any_rank(
    override, says, project, monkeypatch, capsys
):
    monkeypatch.chdir(project)
    assert cli.main(["train", "user.yaml", *set_args(override)]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert says in line and out == ""


WRONG_RETURNS = [
    (
        ["model.args={depth: 2}"],
        "model.factory my_models:build: got an unexpected keyword argument 'depth' (given ",
    ),
    (
        ["model.factory=my_models:not_a_module", "model.args={}"],
        "model.factory my_models:not_a_module: returned a str, not a torch.nn.Module",
    ),
    (
        ["data.factory=my_data:one_dataset", "data.args={}"],
        "data.factory my_data:one_dataset: returned a TensorDataset, not a pair (train, eval)",
    ),
]


def test_a_value_error_in_the_users_code_keeps_its_type_and_traceback(project, run_dir):
    """Our refusals are one line; a ValueError raised in the user's own loss (or dataset, or
    model) was printed as one too, its type and place lost: `shardwise: rank 0: corrupt
    record 77`."""
    out = _train(
        project,
        "user.yaml",
        "--run-dir",
        str(run_dir),
        *set_args("model.loss=my_losses:corrupt", "train.steps=2"),
        code=1,
    )
    assert "Traceback (most recent call last)" in out, out[-3000:]
    assert 'my_losses.py", line 8, in corrupt' in out and "ValueError: corrupt record 77" in out


def test_a_factory_that_returns_the_wrong_thing_is_one_line_naming_it(project, monkeypatch):
    monkeypatch.chdir(project)
    for overrides, says in WRONG_RETURNS:
        with pytest.raises(ValueError, match="^" + re.escape(says)):
            build_job(load_config("user.yaml", overrides))
    monkeypatch.setitem(sys.modules, "transformers", None)  # (not installed)
    (project / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^Hugging Face models need transformers: pip install "):
        build_job(load_config("user.yaml", ["model.factory=null", "model.hf_config=config.json"]))


# ---- the token file ------------------------------------------------------------------------------
def test_token_windows_read_the_file_mapped_and_resume_at_the_exact_sample(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) * 7  # (every id tells its position)
    ids.tofile(tmp_path / "train.bin")
    splits = token_splits(tmp_path / "train.bin", "uint16", seq_len=10, test_fraction=0.2)
    train, test = splits.train, splits.test
    assert isinstance(train.tokens, np.memmap) and train.tokens.base is test.tokens.base
    assert (len(train), len(test)) == ((800 - 1) // 10, (200 - 1) // 10)
    x, y = train[3]
    assert torch.equal(x, torch.arange(30, 40) * 7) and torch.equal(y, torch.arange(31, 41) * 7)
    assert x.dtype == torch.int64
    x, _ = test[0]  # the held-out tail
    assert torch.equal(x, torch.arange(800, 810) * 7)
    with pytest.raises(IndexError):
        train[len(train)]
    dicts = TokenWindows(open_tokens(tmp_path / "train.bin", "uint16"), 10, as_dicts=True)
    assert torch.equal(dicts[1]["input_ids"], dicts[1]["labels"])  # (HF shifts them itself)
    ids[:5].tofile(tmp_path / "eval.bin")
    with pytest.raises(ValueError, match="5 tokens hold no window of seq_len 10"):
        token_splits(tmp_path / "train.bin", "uint16", 10, 0.2, eval_path=tmp_path / "eval.bin")
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match="7 bytes is not a whole number of uint16 tokens"):
        open_tokens(tmp_path / "odd.bin", "uint16")
    (tmp_path / "empty.bin").write_bytes(b"")  # (0 bytes is a whole number of tokens: none)
    with pytest.raises(ValueError, match=r"empty\.bin: the token file is empty"):
        open_tokens(tmp_path / "empty.bin", "uint16")
    # Ids of another tokenizer's: a line naming the file and the id, not an embedding's error.
    small = token_splits(tmp_path / "train.bin", "uint16", 10, 0.2, vocab_size=300).train
    assert torch.equal(small[3][0], torch.arange(30, 40) * 7)  # (all below 300)
    with pytest.raises(ValueError, match=r"train.bin: token id 301 \(window 4\) is not within"):
        small[4]

    # The data position: a loader saved after 5 steps and a fresh one loaded from it go on with
    # the very windows the uninterrupted one reads (over the end of the epoch too).
    def batches(shard_loader, n):
        return [
            (shard_loader.last_indices, b[0])
            for _, b in zip(range(n), _endless(shard_loader), strict=False)
        ]

    whole = loader(train, 8, seed=3, shard=(2, 1))
    straight = batches(whole, 15)
    first = loader(train, 8, seed=3, shard=(2, 1))
    batches(first, 5)
    resumed = loader(train, 8, seed=3, shard=(2, 1))
    resumed.load_state_dict(first.state_dict())
    for (i, a), (j, b) in zip(straight[5:], batches(resumed, 10), strict=True):
        assert i == j and torch.equal(a, b)


def _endless(shard_loader):
    while True:
        yield from shard_loader


def test_a_token_file_feeds_the_builtin_gpt_and_hf_models_as_pairs_or_dicts(tmp_path, monkeypatch):
    monkeypatch.chdir(_gpt2_project(tmp_path))
    gpt = ["model.hf_config=null", "model.name=gpt", "model.d_model=16", "model.n_head=2"]
    with pytest.raises(ConfigError, match=r"model 'gpt' on data\.tokens needs data\.vocab_size$"):
        load_config("hf.yaml", gpt)  # (before any rank starts)
    for sets, dicts in [
        ([*gpt, "data.vocab_size=37"], False),
        ([], True),
        (["data.windows=pairs"], False),
    ]:
        job = build_job(load_config("hf.yaml", sets))
        assert job.dict_batches == dicts == isinstance(job.splits.train[0], dict)
        x, y = job.batch_like()(2)  # (what the planner traces)
        assert torch.isfinite(job.loss_fn(job.model(x), y))  # HF on pairs: its logits' loss
    # Another tokenizer's ids, and windows past GPT-2's 16 learned positions: one line each,
    # as the built-in GPT's (an embedding's IndexError of 80-170 lines, before)
    np.array([5, 40, *range(38)], dtype=np.uint16).tofile("wide.bin")
    wide = ["data.tokens=wide.bin", "data.test_fraction=0.5"]
    with pytest.raises(
        ValueError, match=r"token id 40 \(window 0\) is not within the model's vocab_size 37$"
    ):
        build_job(load_config("hf.yaml", wide))  # (its first sample is read as it is built)
    with pytest.raises(ValueError, match=r"^data\.seq_len 17 is past the model's 16 positions"):
        build_job(load_config("hf.yaml", ["data.seq_len=17"]))


def test_hf_pretrained_loads_the_saved_weights_sharded_or_not(tmp_path, monkeypatch):
    monkeypatch.chdir(_gpt2_project(tmp_path))
    saved = build_job(load_config("hf.yaml", ["train.seed=7"])).model
    saved.save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")
    assert (tmp_path / "pretrained" / "model.safetensors.index.json").is_file()  # sharded
    sets = ["model.hf_config=null", "model.hf_pretrained=pretrained"]
    job = build_job(load_config("hf.yaml", sets))
    assert all(p.is_meta for p in job.model.parameters())  # read by each rank's strategy
    loaded = job.materialized().model  # (here: whole)
    assert type(loaded) is type(saved)
    expected = saved.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    shapes = build_job(load_config("hf.yaml", sets), device="meta").model  # the planner's
    assert all(p.is_meta for p in shapes.parameters())
    with pytest.raises(
        ConfigError, match=r"model\.hf_pretrained: gpt2/\.\. is not a folder with a "
    ):
        load_config("hf.yaml", ["model.hf_config=null", "model.hf_pretrained=gpt2/.."])


class _Classifier(torch.nn.Module):
    """A model that takes keyword inputs and returns its logits and, given labels, its loss."""

    def __init__(self, sequence: bool = False) -> None:
        super().__init__()
        self.linear, self.sequence = torch.nn.Linear(4, 3), sequence

    def forward(self, features, labels=None):
        logits = self.linear(features)
        logits = logits[:, None].expand(-1, 2, -1) if self.sequence else logits
        if labels is None:
            return {"logits": logits}
        # In fp32, as Hugging Face's losses are (fp16's 2**16 loss scale overflows a half loss).
        loss = F.cross_entropy(logits.float().reshape(-1, 3), labels.reshape(-1))
        return {"logits": logits, "loss": loss}


def test_dict_batches_are_evaluated_with_the_models_loss_and_accuracy_for_classifiers():
    g = torch.Generator().manual_seed(0)
    features, labels = torch.randn(12, 4, generator=g), torch.randint(0, 3, (12,), generator=g)
    data = [{"features": f, "labels": y} for f, y in zip(features, labels, strict=True)]
    splits = Splits(data, data, 3, 4)
    model = call_with_keywords(_Classifier())
    own = Job(model, splits, output_loss, dict_batches=True)
    loss = lambda out, y: F.cross_entropy(out["logits"], y)  # noqa: E731
    mine = Job(model, splits, loss, dict_batches=True, labels_apart=True)
    logits = model.linear(features)
    for job in (own, mine):  # (`mine`: the labels go to the loss, the model gets the rest)
        scored = evaluate(model, data, job.loss_fn, 5, False, job.inputs_targets)
        assert scored.loss == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)
        assert scored.accuracy == (logits.argmax(-1) == labels).sum().item() / 12
    sequences = [
        {"features": f, "labels": torch.stack([y, y])}
        for f, y in zip(features, labels, strict=True)
    ]
    lm = call_with_keywords(_Classifier(sequence=True))
    scored = evaluate(lm, sequences, output_loss, 5, False, own.inputs_targets)
    assert scored.accuracy is None and scored.targets == 24  # no accuracy but a classifier's


def fp16_gradient_norms() -> tuple[float, float]:
    """This rank's fp32 master gradients after one ZeRO-2 fp16 step of a model whose output is
    a dict, and one process's fp32 gradients of the same global batch (the norms)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(8, 4, generator=g) / 16  # (small gradients: no fp16 overflow at 2**16)
    batch = {"features": features, "labels": torch.randint(0, 3, (8,), generator=g)}
    torch.manual_seed(0)
    reference = call_with_keywords(_Classifier())
    output_loss(reference(batch)).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    torch.manual_seed(0)
    model, opt = sw.prepare(
        call_with_keywords(_Classifier()), sw.ZeRO(stage=2, mixed_precision="fp16"), lr=0.0
    )
    rank = torch.distributed.get_rank()
    mine = {k: v[4 * rank : 4 * rank + 4] for k, v in batch.items()}
    model.train_step(mine, mine["labels"], output_loss)
    opt.step()
    shards = [p.grad.flatten() for p in model.optimizer_params() if p.grad is not None]
    square = torch.cat(shards).float().pow(2).sum()
    torch.distributed.all_reduce(square)  # (each rank holds a shard of the gradient)
    model.close()
    return square.sqrt().item(), expected


def test_fp16_loss_scaling_reaches_the_loss_inside_a_models_output():
    # The loss scaler's gradient hook used to go on tensor outputs only: a model returning its
    # own loss in an object got gradients 2**16 too small after unscaling.
    for got, expected in run(fp16_gradient_norms, 2):
        assert got == pytest.approx(expected, rel=1e-2)  # (fp16 compute: 1e-2)
