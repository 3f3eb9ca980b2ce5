"""Hugging Face models nobody here wrote, under our data-parallel strategies, equal single-process
training; tied weights stay one parameter; frozen parameters cost no communication or optimizer
state; a parameter read while ZeRO-3 has it freed is a one-line error naming it.

Each model is trained 10 AdamW steps the HF way (`model(**batch).loss.backward()`), each rank on
its half of the global batch, and compared with one process training on the whole batch. The
bound is 1e-5, or what torch's own DDP reaches on the same model and batches where fp32 reduction
order alone moves AdamW further (measured in the same run, never looser).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hf_models as H
import shardwise as sw
from shardwise.comm import shared_memory
from shardwise.comm.accounting import native_volume
from shardwise.observe.memory import memory_report
from spawn import run

STEPS, BATCH, LR = 10, 2, 1e-3  # BATCH samples per rank
STRATEGIES = {
    "ddp": lambda: sw.DDP(),
    "zero1": lambda: sw.ZeRO(stage=1, bucket_mb=0.01),
    "zero2": lambda: sw.ZeRO(stage=2, bucket_mb=0.01),
    "zero3": lambda: sw.ZeRO(stage=3),
}
TIED = {"gpt2": ("lm_head.weight", "transformer.wte.weight")}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _train(model, opt, kind: str, world: int, rank: int, share: int = BATCH) -> None:
    """STEPS steps on the global batches (world * BATCH samples), this rank on `share` of them."""
    for step in range(STEPS):
        batch = H.make_batch(kind, world * BATCH, step)
        model(**H.rows(batch, rank * share, (rank + 1) * share)).loss.backward()
        opt.step()
        opt.zero_grad()


def _single_process(kind: str, world: int) -> dict:
    model = H.build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, kind, world, 0, share=world * BATCH)  # the whole global batch
    return model.state_dict()


def _torch_ddp(kind: str, world: int, rank: int) -> dict:
    model = H.build(kind)
    if kind == "resnet":  # torch's SyncBatchNorm runs on GPUs only: compare where it applies
        return {}
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    _train(ddp, opt, kind, world, rank)
    return model.state_dict()


def equal_to_one_process(kind: str) -> dict:
    """Max abs difference from single-process training, per strategy and for torch's DDP."""
    world, rank = dist.get_world_size(), dist.get_rank()
    H.transformers.logging.set_verbosity_error()
    reference = _single_process(kind, world)
    out = {}
    for name, strategy in STRATEGIES.items():
        model, opt = sw.prepare(H.build(kind), strategy(), lr=LR)
        _train(model, opt, kind, world, rank)
        full = model.full_state_dict()
        out[name] = _max_diff(full, reference)
        if kind in TIED:  # still one parameter in the model, one value under both names
            head, embedding = TIED[kind]
            inner = model.module
            out[f"{name}_tied"] = inner.get_parameter(head) is inner.get_parameter(embedding)
            out[f"{name}_tied_equal"] = torch.equal(full[head], full[embedding])
        model.close()
    torch_ddp = _torch_ddp(kind, world, rank)
    out["torch_ddp"] = _max_diff(torch_ddp, reference) if torch_ddp else 0.0
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "resnet", "vit"])
def test_hf_models_under_data_parallel_equal_one_process(kind):
    for result in run(equal_to_one_process, 2, kind, timeout_s=240):
        assert result["torch_ddp"] < 1e-4, result  # torch's DDP does equal one process
        bound = max(1e-5, result["torch_ddp"])
        for name in STRATEGIES:
            assert result[name] <= bound, (kind, name, result)
            if kind in TIED:
                assert result[f"{name}_tied"] and result[f"{name}_tied_equal"], (name, result)


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def frozen_costs() -> dict:
    """One step of GPT-2 with its embeddings frozen (transfer learning): bytes on the wire and
    optimizer-state bytes, per strategy, beside the trainable and total parameter counts."""
    world = dist.get_world_size()
    out = {}
    for name, strategy in STRATEGIES.items():
        model = H.build("gpt2_untied")
        for p in model.transformer.wte.parameters():
            p.requires_grad_(False)
        for p in model.transformer.wpe.parameters():
            p.requires_grad_(False)
        for p in model.transformer.h[0].parameters():  # and the lower block, as in fine-tuning
            p.requires_grad_(False)
        trainable = _numel(p for p in model.parameters() if p.requires_grad)
        frozen_before = {k: v.clone() for k, v in model.state_dict().items() if "wte" in k}
        wrapped, opt = sw.prepare(model, strategy(), lr=LR)
        sw.comm.stats.end_step()
        batch = H.make_batch("gpt2_untied", world * BATCH, 0)
        rank = dist.get_rank()
        wrapped(**H.rows(batch, rank * BATCH, (rank + 1) * BATCH)).loss.backward()
        by_op = sw.comm.stats.end_step().by_op
        opt.step()
        report = memory_report(wrapped, opt)
        full = wrapped.full_state_dict()
        out[name] = {
            "trainable": trainable,
            "total": _numel(model.parameters()),
            "bytes": {op: t.bytes for op, t in by_op.items()},
            "optimizer": report["optimizer"],
            "frozen_unchanged": all(torch.equal(full[k], v) for k, v in frozen_before.items()),
        }
        wrapped.close()
    return out


def test_frozen_parameters_cost_no_communication_or_optimizer_state():
    n = 2
    for per_strategy in run(frozen_costs, n):
        for name, r in per_strategy.items():
            assert r["frozen_unchanged"], name
            grads = 4 * r["trainable"]  # fp32 bytes of the trainable parameters' gradients
            assert r["trainable"] < 0.7 * r["total"]  # the frozen part is not negligible
            if name == "ddp":
                sent = r["bytes"]["all_reduce"]
                assert sent == pytest.approx(native_volume("all_reduce", grads, n), rel=0.01)
            else:  # reduce-scattered, padded to a multiple of n per unit (gloo's ranks sharing
                # a host: summed where they lie in shared memory)
                op = "reduce_scatter" if shared_memory.supported() else "all_to_all"
                sent = r["bytes"][op]
                assert sent == pytest.approx(native_volume(op, grads, n), rel=0.01)
            # AdamW: two fp32 moments per trainable parameter (sharded over n under ZeRO), and a
            # step counter per tensor.
            moments = 8 * r["trainable"] / (1 if name == "ddp" else n)
            assert r["optimizer"] == pytest.approx(moments, rel=0.01), (name, r)


def read_while_freed() -> str:
    model, _ = sw.prepare(H.build("gpt2"), sw.ZeRO(stage=3), lr=LR)
    block = model.module.transformer.h[0]
    try:
        block.mlp.c_fc(torch.randn(1, 16))  # a submodule run outside its block's forward
    except RuntimeError as error:
        return str(error)
    finally:
        model.close()
    return "no error"


def test_a_parameter_read_while_freed_is_a_one_line_error_naming_it():
    for message in run(read_while_freed, 2):
        assert "\n" not in message
        assert "transformer.h.0.mlp.c_fc" in message and "'transformer.h.0'" in message, message


def frozen_survive_resume(run_dir: str) -> dict:
    """Fine-tune GPT-2 with frozen (and non-default) embeddings 3 steps, checkpoint, go on 2
    steps; then a model built with another seed resumes from the checkpoint and goes the same 2
    steps. Bitwise equal, per strategy, frozen parameters included."""
    world, rank, out = dist.get_world_size(), dist.get_rank(), {}

    def fine_tune(seed: int):
        model = H.build("gpt2_untied", seed=seed)
        model.transformer.wte.weight.requires_grad_(False)
        with torch.no_grad():  # "pretrained" embeddings: not what any seed gives
            model.transformer.wte.weight.copy_(
                torch.linspace(-1, 1, model.transformer.wte.weight.numel()).view_as(
                    model.transformer.wte.weight
                )
            )
        return model

    for name in ("zero1", "zero3"):
        directory = f"{run_dir}/{name}"

        def steps(model, opt, first, last):
            for step in range(first, last):
                batch = H.make_batch("gpt2_untied", world * BATCH, step)
                model(**H.rows(batch, rank * BATCH, (rank + 1) * BATCH)).loss.backward()
                opt.step()
                opt.zero_grad()

        model, opt = sw.prepare(fine_tune(0), STRATEGIES[name](), lr=LR)
        checkpointer = sw.Checkpointer(directory, model, opt, asynchronous=False)
        steps(model, opt, 0, 3)
        checkpointer.save(3)
        steps(model, opt, 3, 5)
        straight = model.full_state_dict()
        model.close()
        model, opt = sw.prepare(fine_tune(1), STRATEGIES[name](), lr=LR)
        with torch.no_grad():
            model.module.transformer.wte.weight.zero_()  # lost unless the checkpoint has it
        start, _ = sw.Checkpointer(directory, model, opt, asynchronous=False).resume()
        steps(model, opt, start, 5)
        resumed = model.full_state_dict()
        model.close()
        out[name] = (start, all(torch.equal(straight[k], resumed[k]) for k in straight))
    return out


def test_frozen_parameters_survive_save_and_resume_bitwise(tmp_path):
    for result in run(frozen_survive_resume, 2, str(tmp_path)):
        assert result == {"zero1": (3, True), "zero3": (3, True)}


MESH = {  # model -> its 2 x 2 meshes: tensor parallel from its own plan, or its automatic split
    "llama": {
        "dp2_tp2_ddp": lambda: sw.MeshParallel(dp=2, tp=2, data=sw.DDP()),
        "dp2_tp2_zero1": lambda: sw.MeshParallel(dp=2, tp=2, data=sw.ZeRO(stage=1)),
        "dp2_pp2_zero1": lambda: sw.MeshParallel(
            dp=2, pp=2, data=sw.ZeRO(stage=1), pipeline=sw.Pipeline(microbatches=2)
        ),
    },
    "gpt2": {
        "dp2_pp2_ddp": lambda: sw.MeshParallel(
            dp=2, pp=2, data=sw.DDP(), pipeline=sw.Pipeline(microbatches=2)
        )
    },
    "bert": {
        "dp2_pp2_ddp": lambda: sw.MeshParallel(
            dp=2, pp=2, data=sw.DDP(), pipeline=sw.Pipeline(microbatches=2)
        )
    },
}


def on_a_mesh() -> dict:
    """Each model and mesh of MESH against one process on the global batch (2 replicas x
    BATCH samples): max abs difference of the full state dicts after STEPS AdamW steps."""
    H.transformers.logging.set_verbosity_error()
    out = {}
    for kind, meshes in MESH.items():
        reference = _single_process(kind, 2)
        for name, strategy in meshes.items():
            model, opt = sw.prepare(H.build(kind), strategy(), lr=LR)
            replicas, index = sw.data_shard(model)
            assert replicas == 2
            for step in range(STEPS):
                mine = H.rows(
                    H.make_batch(kind, 2 * BATCH, step), index * BATCH, (index + 1) * BATCH
                )
                if "pp" in name:  # a pipeline runs its schedule: the HF loss on the last stage
                    sw.train_step(model, mine, None, lambda out, _: out.loss)
                else:
                    model(**mine).loss.backward()
                opt.step()
                opt.zero_grad()
            out[f"{kind}/{name}"] = _max_diff(model.full_state_dict(), reference)
    return out


def test_hf_models_on_a_2x2_mesh_equal_one_process():
    for result in run(on_a_mesh, 4, timeout_s=300):
        assert result and all(diff <= 1e-5 for diff in result.values()), result


def replicas_after_construction() -> dict:
    """Each rank builds GPT-2 with a seed of its own (as a script that seeds by rank would);
    data-parallel wrapping makes every replica rank 0's model, for DDP and each ZeRO stage."""
    rank, out = dist.get_rank(), {}
    rank0 = H.build("gpt2", seed=0).state_dict()
    for name, strategy in STRATEGIES.items():
        model, _ = sw.prepare(H.build("gpt2", seed=rank), strategy(), lr=LR)
        full = model.full_state_dict()
        out[name] = all(torch.equal(full[k], v) for k, v in rank0.items())
        model.close()
    return out


def test_data_parallel_replicas_are_rank_0s_model_after_construction():
    for result in run(replicas_after_construction, 2):
        assert result == dict.fromkeys(STRATEGIES, True), result
