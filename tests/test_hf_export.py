"""`shardwise export CKPT DIR --hf`: a checkpoint of a Hugging Face model trained under our
strategies (sharded, any world size) becomes a folder transformers' `from_pretrained` loads with
every tensor exactly what `full_state_dict` gave; tied weights tied again; sharded writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_models as H
import shardwise as sw
from harness import main_in_process
from shardwise import cli
from shardwise.checkpoint.hf_export import export_hf, read_hf_config
from spawn import run


def train_and_checkpoint(run_dir: str, kind: str, strategy: str) -> dict:
    """4 AdamW steps of `kind`, a checkpoint at the end; the full state dict (rank 0)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    chosen = {"zero3": sw.ZeRO(stage=3), "zero2": sw.ZeRO(stage=2), "ddp": sw.DDP()}[strategy]
    model, opt = sw.prepare(H.build(kind), chosen, lr=1e-3)
    checkpointer = sw.Checkpointer(run_dir, model, opt, asynchronous=False)
    for step in range(4):
        batch = H.make_batch(kind, 2 * world, step)
        model(**H.rows(batch, 2 * rank, 2 * rank + 2)).loss.backward()
        opt.step()
        opt.zero_grad()
    # The model's config is recorded as the run first saves (a job refused at its resume
    # leaves the run directory's as it was), then found by the export. (Every rank looks
    # before any saves: rank 0, ahead, wrote it while rank 1 looked, in one CI run.)
    dist.barrier()
    assert not (Path(run_dir) / "hf_config.json").exists()
    dist.barrier()
    checkpointer.save(4)
    full = model.full_state_dict()
    model.close()
    return full


@pytest.mark.parametrize(("kind", "strategy"), [("gpt2", "zero3"), ("llama", "zero2")])
def test_export_hf_reloads_in_transformers_exactly(tmp_path, kind, strategy):
    run_dir = tmp_path / "run"
    full = run(train_and_checkpoint, 2, str(run_dir), kind, strategy)[0]
    checkpoint = next((run_dir / "checkpoints").glob("step-*"))
    out = tmp_path / "hf"
    assert cli.main(["export", str(checkpoint), str(out), "--hf"]) == 0  # (in this process)
    cls = H.model_class(kind)
    reloaded = cls.from_pretrained(out, dtype=torch.float32).state_dict()
    assert reloaded.keys() == full.keys()
    assert max((reloaded[k] - full[k]).abs().max().item() for k in full) == 0.0
    if kind == "gpt2":  # tied again: one tensor under both names
        model = cls.from_pretrained(out)
        assert model.lm_head.weight is model.transformer.wte.weight
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls.__name__]


def test_sharded_export_and_one_line_refusals(tmp_path, capsys):
    run_dir = tmp_path / "run"
    full = run(train_and_checkpoint, 2, str(run_dir), "llama", "ddp")[0]
    checkpoint = next((run_dir / "checkpoints").glob("step-*"))
    out = export_hf(checkpoint, tmp_path / "sharded", max_shard_bytes=8_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = H.transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(reloaded[k], full[k]) for k in full)

    (run_dir / "hf_config.json").unlink()  # a run that recorded no config
    with pytest.raises(ValueError, match="pass --hf-config"):
        export_hf(checkpoint, tmp_path / "none")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="names no architectures"):
        read_hf_config(bad)
    code, _, err = main_in_process(capsys, "export", str(checkpoint), str(tmp_path / "x"), "--hf")
    assert code != 0 and "pass --hf-config" in err
    assert len(err.strip().splitlines()) == 1, err
    # Another model's config, or another size's: refused, nothing written (a folder that
    # transformers loaded as a fresh model, every weight unused, before).
    for kind, why in [
        ("gpt2", "which the GPT2LMHeadModel of"),
        ("llama", "a config of another size"),
    ]:
        other = H.config(kind)
        if kind == "llama":
            other.intermediate_size += 2
        other.architectures = [H.model_class(kind).__name__]
        other.save_pretrained(tmp_path / f"other_{kind}")
        with pytest.raises(ValueError, match=why):
            export_hf(
                checkpoint, tmp_path / "wrong", config=tmp_path / f"other_{kind}" / "config.json"
            )
        assert not (tmp_path / "wrong").exists()
    # With a config of its own, the same checkpoint exports.
    good = Path(out) / "config.json"
    export_hf(checkpoint, tmp_path / "given", config=good)
    assert (tmp_path / "given" / "model.safetensors").is_file()
    # Exported again into the sharded folder, whole: no shard or index of before is left
    # (transformers read the new file and our reader the old index).
    export_hf(checkpoint, out, config=good)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
