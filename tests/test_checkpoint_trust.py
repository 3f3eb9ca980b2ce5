"""Checkpoints we can trust: a re-save never leaves nothing loadable, a manifest is checked
before anything it names is read (one `CheckpointError` line per problem), and the JSON a run
leaves is strict even when a loss is NaN. Single process: shardwise runs in a world of one."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import shardwise as sw
from harness import main_in_process
from shardwise.checkpoint import reshardable as checkpoint
from shardwise.checkpoint import run_checkpoint, run_saver
from shardwise.checkpoint.reshardable import CheckpointError, read_full_state, sha256_file
from shardwise.distributed import runtime
from shardwise.nn.models import MLP
from shardwise.observe.run_output import MetricsFile, strict_json, write_summary


@pytest.fixture(autouse=True)
def _alone():
    yield
    runtime.shutdown()  # leave no process group behind for the tests that follow


def _prepared():
    torch.manual_seed(0)
    return sw.prepare(MLP([5, 4, 3]), sw.ZeRO(stage=1), lr=1e-2)


def _train(model, opt, steps: int) -> dict[str, torch.Tensor]:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in sw.full_state_dict(model).items()}


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint of step 2, and the model, optimizer and weights it was saved from."""
    model, opt = _prepared()
    weights = _train(model, opt, 2)
    sw.save_checkpoint(model, opt, tmp_path / "ckpt", step=2)
    return tmp_path / "ckpt", model, opt, weights


def _edit_manifest(directory, edit) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _one_line_error(directory, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as info:
        read_full_state(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- file names in the manifest ------------------------------------------------------------------
@pytest.mark.parametrize("field", ["sha256", "strategy_state_sha256"])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_file_names_outside_the_directory_are_refused(ckpt, tmp_path, monkeypatch, field, where):
    directory = ckpt[0]
    # A copy outside with the right checksum: only the name can give it away.
    outside = tmp_path / "outside.safetensors"
    shutil.copy(directory / "rank0.safetensors", outside)
    name = "../outside.safetensors" if where == "relative" else str(outside)

    def edit(manifest):
        if field == "sha256":
            manifest["sha256"] = {name: sha256_file(outside)}
        else:
            manifest["strategy_state_sha256"] = {name: sha256_file(outside)}

    _edit_manifest(directory, edit)
    read = []
    monkeypatch.setattr(checkpoint, "load_file", lambda p: read.append(p) or load_file(p))
    message = _one_line_error(directory, "unexpected file name")
    assert repr(name) in message and f"{directory / 'manifest.json'}: {field}:" in message
    assert read == []  # refused before any shard was opened
    with pytest.raises(CheckpointError, match="unexpected file name"):
        sw.export_checkpoint(directory, tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


# ---- every field of the manifest -----------------------------------------------------------------
def _set(key, value):
    return lambda m: m.__setitem__(key, value)


MALFORMED = {
    "missing units": (lambda m: m.pop("units"), r"'units': Field required"),
    "missing sha256": (lambda m: m.pop("sha256"), r"'sha256': Field required"),
    "step a string": (_set("step", "2"), r"'step': Input should be a valid integer"),
    "step a float": (_set("step", 2.5), r"'step': Input should be a valid integer"),
    "step a bool": (_set("step", True), r"'step': Input should be a valid integer"),
    "world_size 0": (_set("world_size", 0), r"'world_size': Input should be greater than"),
    "strategy a number": (_set("strategy", 3), r"'strategy': Input should be a valid string"),
    "units a dict": (_set("units", {"params": []}), r"'units': Input should be a valid array"),
    "shape a string": (
        lambda m: m["units"][0].__setitem__("params", [["net.0.weight", "4x5"]]),
        r"'units\.0\.params\.0\.1': Input should be a valid array",
    ),
    "negative dim": (
        lambda m: m["units"][0].__setitem__("params", [["net.0.weight", [4, -5]]]),
        r"'units\.0\.params\.0\.1\.1': Input should be greater than or equal to 0",
    ),
    "param without shape": (
        lambda m: m["units"][0].__setitem__("params", [["net.0.weight"]]),
        r"'units\.0\.params\.0\.1': Field required",
    ),
    "checksum a number": (
        lambda m: m["sha256"].__setitem__("rank0.safetensors", 7),
        r"'sha256\.rank0\.safetensors': Input should be a valid string",
    ),
    "more shards than files": (_set("num_shards", 2), r"sha256 lists 1 files, expected 2"),
    "no shard files": (_set("sha256", {}), r"sha256 lists 0 files, expected 1"),
    "a shard too many": (
        lambda m: m["sha256"].__setitem__("rank1.safetensors", "0" * 64),
        r"unexpected file name 'rank1\.safetensors'",
    ),
    "unknown format": (_set("format", "other-v9"), r"unknown checkpoint format 'other-v9'"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_each_malformed_manifest_field_is_one_error_line(ckpt, case):
    directory = ckpt[0]
    edit, match = MALFORMED[case]
    _edit_manifest(directory, edit)
    assert str(directory / "manifest.json") in _one_line_error(directory, match)


@pytest.mark.parametrize("text", ["[]", "{", '{"format": NaN}', ""])
def test_a_manifest_that_is_not_an_object_is_one_error_line(ckpt, text):
    directory = ckpt[0]
    (directory / "manifest.json").write_text(text)
    _one_line_error(directory, "malformed checkpoint manifest .*manifest.json")


@pytest.mark.parametrize("case", ["missing units", "outside name"])
def test_cli_export_of_a_malformed_checkpoint_exits_2_with_one_line(ckpt, tmp_path, case, capsys):
    directory = ckpt[0]
    if case == "outside name":
        _edit_manifest(directory, _set("sha256", {"../rank0.safetensors": "0" * 64}))
    else:
        _edit_manifest(directory, MALFORMED[case][0])
    code, _, err = main_in_process(
        capsys, "export", str(directory), str(tmp_path / "w.safetensors")
    )
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("shardwise: ") and "manifest.json" in line
    assert not (tmp_path / "w.safetensors").exists()


# ---- a final checkpoint (the run's consolidated weights), and where an export writes -------------
def _final(tmp_path, model):
    """A run's final checkpoint as the trainer writes it (`save_model`): weights and meta.json."""
    directory = tmp_path / "final"
    checkpoint.save_model(directory, sw.full_state_dict(model), {"step": 2, "name": "t"})
    return directory


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = bytes(255 - b for b in data[offset : offset + 4])
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:100]),
    "empty": lambda p: p.write_bytes(b""),
    "header length": lambda p: p.write_bytes(b"\xff" * 8 + p.read_bytes()[8:]),
    "weights flipped": lambda p: _flip(p, p.stat().st_size - 8),  # (a valid file still)
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("recorded", [True, False], ids=["checksum", "older-no-checksum"])
def test_a_damaged_final_checkpoint_is_one_line_naming_its_file(
    ckpt, tmp_path, capsys, damage, recorded
):
    """Before, each of these was a safetensors traceback, or (flipped weights) exported as if
    whole: a final checkpoint carried no checksum. One saved by an older shardwise (no
    checksum in its meta.json) is still read, its file's own header the only check."""
    directory = _final(tmp_path, ckpt[1])
    weights = directory / "model.safetensors"
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["sha256"] == {"model.safetensors": sha256_file(weights)}
    if not recorded:
        (directory / "meta.json").write_text(json.dumps({"step": 2, "name": "t"}))
    whole = load_file(weights)
    DAMAGE[damage](weights)
    out = tmp_path / "w.safetensors"
    code, _, err = main_in_process(capsys, "export", str(directory), str(out))
    if damage == "weights flipped" and not recorded:  # (no check can tell: what it was)
        assert code == 0 and load_file(out).keys() == whole.keys()
        return
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert str(weights) in line and ("checksum" if recorded else "not a safetensors") in line
    assert not out.exists()


def test_a_bad_step_or_clip_norm_is_one_line_and_changes_nothing(ckpt, tmp_path):
    """Found by probing the Python API. Before: `save_checkpoint(step="x")` (or 2.7, None, -1)
    replaced a good checkpoint with one no load accepts; `clip_grad_norm_` with a negative
    `max_norm` flipped every gradient's sign, with NaN made them all NaN."""
    directory, model, opt, _ = ckpt
    saved = {p.name: p.read_bytes() for p in directory.iterdir()}
    for step in ("x", 2.7, None, -1, True):
        with pytest.raises(CheckpointError, match=r"step must be a whole number >= 0"):
            sw.save_checkpoint(model, opt, directory, step=step)
        with pytest.raises(ValueError, match=r"step must be a whole number >= 0"):
            sw.Checkpointer(tmp_path / "run", model, opt).save(step)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == saved
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    F.cross_entropy(model(torch.ones(2, 5)), torch.tensor([0, 1])).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for max_norm in (-1.0, math.nan):
        with pytest.raises(ValueError, match=r"max_norm must be a number >= 0"):
            sw.clip_grad_norm_(model, max_norm)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.equal(a, b) for a, b in zip(grads, after, strict=True))
    norm = sw.clip_grad_norm_(model, math.inf)  # (torch's way to ask the norm alone)
    assert torch.allclose(norm, torch.stack([g.norm() for g in grads]).norm())
    assert all(torch.equal(a, b) for a, b in zip(grads, after, strict=True))


def test_a_checkpointer_that_never_resumed_prunes_only_its_own_saves(tmp_path):
    """Found by probing the Python API: a fresh `Checkpointer` given a directory that held
    another run's checkpoints deleted them all at its first save (each save drops every later
    step, for a run gone back to an earlier one, and the oldest past `keep`)."""
    run = tmp_path / "run"

    def names() -> list[int]:
        return [
            int(p.name.removeprefix("step-")) for p in run_checkpoint.complete(run / "checkpoints")
        ]

    model, opt = _prepared()
    first = sw.Checkpointer(run, model, opt, keep=2, asynchronous=False)
    for step in (10, 20, 30):
        first.save(step)
    first.close()
    assert names() == [20, 30]  # (its own, past `keep`: pruned)
    torch.manual_seed(1)
    other_model, other_opt = sw.prepare(MLP([5, 6, 3]), sw.ZeRO(stage=2), lr=1e-2)
    other = sw.Checkpointer(run, other_model, other_opt, keep=2, asynchronous=False)
    for step in (1, 2, 3):
        other.save(step)
    other.close()
    assert names() == [2, 3, 20, 30]  # (before: [1], then [2, 3])
    # Resumed, a checkpointer adopts what the directory holds: its saves prune them as its own.
    again = sw.Checkpointer(run, model, opt, keep=2, asynchronous=False)
    assert again.resume()[0] == 30
    again.save(40)
    again.close()
    assert names() == [30, 40]


def test_a_run_checkpoint_without_its_reshardable_part_is_named_so(ckpt, tmp_path, capsys):
    """(Before: "malformed checkpoint manifest .../manifest.json: 'num_shards': Field required",
    the run checkpoint's own manifest read as the reshardable part's.)"""
    step = tmp_path / "run" / "checkpoints" / "step-000000002"
    shutil.copytree(ckpt[0], step / "sharded")
    (step / "manifest.json").write_text('{"format": "shardwise-run-checkpoint-v2"}')
    (step / "rank0.json").write_text("{}")
    code, _, err = main_in_process(capsys, "export", str(step), str(tmp_path / "w.safetensors"))
    assert code == 0, err  # (whole: its reshardable part is read)
    shutil.rmtree(step / "sharded")
    code, _, err = main_in_process(capsys, "export", str(step), str(tmp_path / "w.safetensors"))
    assert code == 2 and err == (
        f"shardwise: {step}: a run checkpoint without its reshardable part "
        f"({step / 'sharded' / 'manifest.json'} is missing)\n"
    )


def test_an_export_to_a_path_it_cannot_write_is_one_line_and_leaves_nothing(
    ckpt, tmp_path, capsys, monkeypatch
):
    """Before: a traceback each, after reading the whole checkpoint, and an export to a
    directory left its temporary file (`.out.tmp`) where the command ran."""
    directory, *_ = ckpt
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("")
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = {
        "folder": "it is a directory",
        "afile/x.safetensors": "afile is not a directory",
        "/proc/nope/x.safetensors": "No such file or directory",
    }
    for out, why in cases.items():
        code, _, err = main_in_process(capsys, "export", str(directory), out)
        assert code == 2, (out, err)
        (line,) = err.strip().splitlines()
        assert line.startswith(f"shardwise: cannot write {out}: ") and why in line, line
    code, _, err = main_in_process(capsys, "export", str(directory), "afile", "--hf")
    assert code == 2 and err.strip() == (
        "shardwise: cannot write a Hugging Face folder to afile: it is a file"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert list((tmp_path / "folder").iterdir()) == []


# ---- shard files that do not match the layout ----------------------------------------------------
def _edit_shard(directory, edit) -> None:
    """Change rank0.safetensors and give the manifest its new checksum, as a buggy or hostile
    writer would: only the layout check can tell."""
    path = directory / "rank0.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    _edit_manifest(directory, lambda m: m["sha256"].__setitem__(path.name, sha256_file(path)))


SHARD_EDITS = {
    "missing param": (lambda t: t.pop("unit0/param"), r"missing tensor unit0/param"),
    "too short": (
        lambda t: t.__setitem__("unit0/param", t["unit0/param"][:3].clone()),
        r"unit0/param holds 3 values on 1 shard\(s\), the manifest's layout needs \d+",
    ),
    "not flat": (
        lambda t: t.__setitem__("unit0/exp_avg", torch.zeros(2, 20)),
        r"unit0/exp_avg has shape \[2, 20\]",
    ),
}


@pytest.mark.parametrize("case", SHARD_EDITS)
def test_shard_tensors_that_do_not_match_the_layout_are_one_error_line(ckpt, case):
    directory = ckpt[0]
    edit, match = SHARD_EDITS[case]
    _edit_shard(directory, edit)
    assert str(directory / "rank0.safetensors") in _one_line_error(directory, match)


# ---- re-saving into an existing checkpoint -------------------------------------------------------
class Killed(Exception):
    pass


def _fail(*args, **kwargs):
    raise Killed


def _kill_between_renames(monkeypatch):
    """The old checkpoint is moved aside, then the save dies before the new one is in place."""
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(".tmp") and os.path.isdir(src):
            raise Killed
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


KILLS = {
    "writing a shard": lambda mp: mp.setattr(checkpoint, "save_file", _fail),
    "before the manifest": lambda mp: mp.setattr(checkpoint, "sha256_file", _fail),
    "between the renames": _kill_between_renames,
}


@pytest.mark.parametrize("kill", KILLS)
def test_an_interrupted_resave_leaves_the_previous_checkpoint_loadable(ckpt, monkeypatch, kill):
    directory, model, opt, saved = ckpt
    newer = _train(model, opt, 3)
    assert any(not torch.equal(saved[k], newer[k]) for k in saved)
    with monkeypatch.context() as mp:
        KILLS[kill](mp)
        with pytest.raises(Killed):
            sw.save_checkpoint(model, opt, directory, step=5)

    params, _, step = read_full_state(directory)
    assert step == 2
    assert all(torch.equal(params[k], saved[k]) for k in saved)
    fresh, fresh_opt = _prepared()
    assert sw.load_checkpoint(fresh, fresh_opt, directory) == 2
    assert all(torch.equal(v, saved[k]) for k, v in sw.full_state_dict(fresh).items())

    sw.save_checkpoint(model, opt, directory, step=5)  # the next save finishes the job
    params, _, step = read_full_state(directory)
    assert step == 5 and all(torch.equal(params[k], newer[k]) for k in newer)
    assert sorted(p.name for p in directory.parent.iterdir()) == ["ckpt"]


def test_the_next_save_removes_what_a_killed_save_left(ckpt):
    directory, model, opt, _ = ckpt
    for leftover in (".ckpt.tmp", ".ckpt.old"):
        (directory.parent / leftover).mkdir()
        (directory.parent / leftover / "rank0.safetensors").write_bytes(b"half written")
    sw.save_checkpoint(model, opt, directory, step=3)
    assert sorted(p.name for p in directory.parent.iterdir()) == ["ckpt"]
    assert read_full_state(directory)[2] == 3


def test_a_directory_holding_more_than_a_checkpoint_is_not_replaced(ckpt):
    directory, model, opt, _ = ckpt
    (directory / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds other files \('notes\.txt'\)"):
        sw.save_checkpoint(model, opt, directory, step=3)
    assert (directory / "notes.txt").read_text() == "mine" and read_full_state(directory)[2] == 2


# ---- a training run's checkpoint of another job --------------------------------------------------
def _for_run(hidden: int, optimizer=torch.optim.AdamW, **kwargs):
    torch.manual_seed(0)
    model, opt = sw.prepare(MLP([5, hidden, 3]), sw.DDP(), optimizer=optimizer, lr=1e-2, **kwargs)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def test_a_run_checkpoint_of_another_job_is_one_line_before_a_resume_and_at_load(tmp_path):
    model, opt, schedule = _for_run(4)
    _train(model, opt, 1)
    job = run_checkpoint.job_signature(MLP([5, 4, 3]), "adamw", "ddp")
    saver = run_saver.Saver(tmp_path, runtime.current(), keep=1, sync=True, job=job)
    saver.save(model, opt, schedule, 1, data={})
    assert run_checkpoint.resumable(tmp_path, 1, job).step == 1
    newest = run_checkpoint.complete(tmp_path / "checkpoints")[-1]

    # Before any rank starts, from the job recorded in the manifest.
    def signature(model: torch.nn.Module, optimizer: str = "adamw", strategy: str = "ddp"):
        return run_checkpoint.job_signature(model, optimizer, strategy)

    for other, why in [
        (
            signature(MLP([5, 6, 3])),
            "another model: its 0.weight is [4, 5], this config's is [6, 5]",
        ),
        (
            signature(MLP([5, 4, 3, 3])),
            "another model: it has no parameter 4.weight (this config's is [3, 3])",
        ),
        (signature(MLP([5, 4])), "another model: this config's has no parameter 2.bias"),
        (signature(MLP([5, 4, 3]), "sgd"), "optimizer 'adamw' saved it, this config has 'sgd'"),
        (
            signature(MLP([5, 4, 3]), strategy="zero"),
            "strategy 'ddp' saved it, this config has 'zero'",
        ),
    ]:
        with pytest.raises(run_checkpoint.JobMismatch) as info:
            run_checkpoint.resumable(tmp_path, 1, other)
        assert str(info.value) == f"{newest} was saved by another job: {why}"
    # A checkpoint older than that record is caught by the ranks' load, in one line too.
    _edit_manifest(newest, lambda manifest: manifest.pop("job"))
    found = run_checkpoint.resumable(tmp_path, 1, signature(MLP([5, 6, 3]), "sgd"))
    for (model, opt, schedule), why in [
        (_for_run(6), "size mismatch for 0.weight"),
        (_for_run(4, torch.optim.SGD, momentum=0.9), "another optimizer saved it"),
    ]:
        with pytest.raises(run_checkpoint.RunCheckpointError) as info:
            run_checkpoint.load(found, model, opt, schedule)
        message = str(info.value)
        assert message.startswith(f"{newest} does not fit this run's model or optimizer (")
        assert why in message and "\n" not in message and len(message) < 500


def test_a_malformed_job_record_falls_back_and_an_edited_step_is_refused(tmp_path):
    """A job record of `null` is a damaged checkpoint, which a resume falls back from (it was
    refused as another job's, so the older good one was never tried); so is a manifest edited
    to another step than its ranks saved (the resume went on from the ranks' step, whatever the
    manifest said)."""
    model, opt, schedule = _for_run(4)
    job = run_checkpoint.job_signature(MLP([5, 4, 3]), "adamw", "ddp")
    saver = run_saver.Saver(tmp_path, runtime.current(), keep=2, sync=True, job=job)
    for step in (1, 2):
        _train(model, opt, 1)
        saver.save(model, opt, schedule, step, data={})
    older, newer = run_checkpoint.complete(tmp_path / "checkpoints")
    _edit_manifest(newer, lambda manifest: manifest.update(job=None))
    found = run_checkpoint.resumable(tmp_path, 1, job)
    assert (found.directory, found.step) == (older, 1)
    _edit_manifest(newer, lambda manifest: manifest.update(job=job))
    _edit_manifest(newer, lambda manifest: manifest.update(step=7))
    with pytest.raises(run_checkpoint.RunCheckpointError) as info:
        run_checkpoint.check(newer, 1, None, job)
    assert str(info.value) == (
        f"{newer}: its manifest says step 7, its ranks' state step 2 (an edited manifest)"
    )
    found = run_checkpoint.resumable(tmp_path, 1, job)
    assert (found.directory, found.step) == (older, 1)


def _top(tree: dict, key: str) -> list:
    """The [key, node] pair of `key` in a rank file's top mapping."""
    return next(pair for pair in tree["dict"] if pair[0] == key)


EDITED_RANK_FILES = {
    "a node that is a list": (
        lambda t: _top(t, "data").__setitem__(1, [1, 2]),
        "malformed node: a list, not one kind and its value",
    ),
    "numpy's position past a C long": (
        lambda t: _top(t, "rng")[1]["dict"][2][1]["list"][2].__setitem__("value", 2**70),
        "OverflowError",
    ),
    "no random state": (
        lambda t: t.__setitem__("dict", [p for p in t["dict"] if p[0] != "rng"]),
        "its rank state has no 'rng'",
    ),
    "not safetensors": (None, "SafetensorError"),
}


@pytest.mark.parametrize("case", EDITED_RANK_FILES)
def test_a_rank_file_edited_with_its_checksum_is_one_line_and_leaves_the_model(tmp_path, case):
    """Files edited and their checksums with them (what a checksum cannot tell): the load is
    refused in one line before the model, its optimizer or a random generator changes."""
    model, opt, schedule = _for_run(4)
    _train(model, opt, 1)
    run_saver.Saver(tmp_path, runtime.current(), keep=1, sync=True).save(
        model, opt, schedule, 1, data={}
    )
    newest = run_checkpoint.complete(tmp_path / "checkpoints")[-1]
    edit, why = EDITED_RANK_FILES[case]
    name = "rank0.safetensors" if edit is None else "rank0.json"
    if edit is None:
        (newest / name).write_bytes(b"\xff" * 64)
    else:
        tree = json.loads((newest / name).read_text())
        edit(tree)
        (newest / name).write_text(json.dumps(tree))
    _edit_manifest(newest, lambda m: m["sha256"].__setitem__(name, sha256_file(newest / name)))
    found = run_checkpoint.resumable(tmp_path, 1, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.get_rng_state()
    with pytest.raises(run_checkpoint.RunCheckpointError) as info:
        run_checkpoint.load(found, model, opt, schedule)
    assert why in str(info.value) and "\n" not in str(info.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(generator, torch.get_rng_state())


def test_a_manifest_nested_past_parsing_is_skipped_in_a_line(tmp_path, capsys):
    model, opt, schedule = _for_run(4)
    saver = run_saver.Saver(tmp_path, runtime.current(), keep=2, sync=True)
    for step in (1, 2):
        saver.save(model, opt, schedule, step, data={})
    newest, previous = run_checkpoint.complete(tmp_path / "checkpoints")[-2:][::-1]
    (newest / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert run_checkpoint.newest(tmp_path, 1, None).directory == previous
    assert f"{newest}/manifest.json: malformed (nested too deep)" in capsys.readouterr().out


# ---- strict JSON ---------------------------------------------------------------------------------
def _strict(text: str):
    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_summary_json_is_strict_with_null_for_nonfinite_values(tmp_path):
    summary = {
        "name": "nan-run",
        "steps": 3,
        "final_train_loss": math.nan,
        "memory": {"peak": math.inf},
        "losses": [1.5, -math.inf],
    }
    write_summary(tmp_path, summary)
    written = _strict((tmp_path / "summary.json").read_text())
    assert written["final_train_loss"] is None and written["memory"] == {"peak": None}
    assert written["losses"] == [1.5, None] and written["steps"] == 3
    assert written["nonfinite"] == {
        "final_train_loss": "nan",
        "memory.peak": "inf",
        "losses.1": "-inf",
    }
    assert math.isnan(summary["final_train_loss"])  # the caller's dict is left as it was


def test_metrics_lines_are_strict_and_read_back_with_nulls(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsFile(path)
    for step, loss in ((1, 0.5), (2, math.nan), (3, math.inf)):
        metrics.write({"step": step, "loss": loss})
    metrics.close()
    # (0-dim tensors and numpy numbers, as a loop hands them: numbers, not a TypeError)
    assert _strict(strict_json({"grad_norm": torch.tensor(2.0), "n": np.int64(3)})) == {
        "grad_norm": 2.0,
        "n": 3,
    }
    with path.open("a") as f:
        f.write('{"step": 4, "lo')  # a line a crash cut short
    rows = [_strict(line) for line in path.read_text().splitlines()[:3]]
    assert rows[1] == {"step": 2, "loss": None, "nonfinite": {"loss": "nan"}}

    MetricsFile(path, keep_steps=2).close()  # a resume from step 2
    rows = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] is None


def test_plain_progress_lines_are_about_ten_a_run_and_one_a_minute_at_least(capsys, monkeypatch):
    from shardwise.observe import run_output

    clock = [0.0]
    monkeypatch.setattr(run_output.time, "monotonic", lambda: clock[0])
    progress = run_output.ProgressReporter(100_000, "job", enabled=True, every=10)
    for step in range(1, 40_001):
        clock[0] = step / 100  # (a step every 10 ms: a minute is 6,000 steps)
        progress.update(step, 1.0, 100.0)
    steps = [int(line.split()[1].split("/")[0]) for line in capsys.readouterr().out.splitlines()]
    assert steps == [6000, 10000, 16000, 20000, 26000, 30000, 36000, 40000]
