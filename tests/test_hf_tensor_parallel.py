"""Tensor parallel of a Hugging Face model from the plan transformers ships with it (no user
plan), trained with the HF idiom `model(**batch).loss`, against single-process training; the
refusals (no plan, heads that do not divide, a style or a tie we cannot honour) in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from hf_models import build, config, make_batch, model_class
from shardwise.strategies.hf_tp_plan import hf_plan, shipped_plan
from shardwise.strategies.tp_plan import resolve
from spawn import run
from state_diff import max_abs_diff

STEPS = 10
BATCH = 4
# fp32 throughout. Split matmuls sum their partial products in another order than the whole
# ones (and the all-reduce adds the ranks' halves), a few ulps per step; AdamW's m/sqrt(v)
# keeps each update below lr, so after 10 steps the weights differ by ~1e-7 (measured below).
TOL = 1e-5


def _llama(**changes) -> nn.Module:
    """The tiny GQA Llama (4 query heads, 2 key/value heads) with `changes` to its config."""
    torch.manual_seed(0)
    c = config("llama")
    for key, value in changes.items():
        setattr(c, key, value)
    return model_class("llama")(c)


def _hf_idiom(model, opt, steps: int) -> list[float]:
    """The loop an HF user writes; every rank of a tensor-parallel group sees the full batch."""
    losses = []
    for step in range(steps):
        loss = model(**make_batch("llama", BATCH, step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(model: nn.Module, steps: int) -> tuple[dict, list[float]]:
    losses = _hf_idiom(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps)
    return model.state_dict(), losses


def _plain_model() -> nn.Sequential:
    """A padded embedding, a gathered column split and a row split of a whole input: the
    styles Llama's plan does not use (and the padding row, which gets no gradient)."""
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Embedding(11, 6, padding_idx=3), nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 5)
    )


PLAIN_PLAN = {"0": "vocab_embedding", "1": "colwise_gather", "3": "rowwise_split_input"}


def _plain_batch(step: int) -> torch.Tensor:
    ids = torch.randint(0, 11, (BATCH, 7), generator=torch.Generator().manual_seed(step))
    return ids.index_fill(1, torch.tensor([0]), 3)  # the padding token in every row


def _train_plain(model, opt, steps: int = 3) -> None:
    for step in range(steps):
        model(_plain_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _refusal(model: nn.Module) -> str:
    with pytest.raises(ValueError) as refused:
        sw.prepare(model, sw.TensorParallel())
    return str(refused.value)


def _ranks():
    """One launch: the acceptance run, a tied Llama, the plain styles and the refusals."""
    model, opt = sw.prepare(build("llama"), sw.TensorParallel(), lr=1e-3)
    split = {
        "q_proj": model.module.model.layers[0].self_attn.q_proj.weight.shape[0],
        "lm_head": type(model.module.lm_head).__name__,
        "embed": type(model.module.model.embed_tokens).__name__,
    }
    losses = _hf_idiom(model, opt, STEPS)
    llama = (sw.full_state_dict(model), losses, split)

    tied, opt = sw.prepare(_llama(tie_word_embeddings=True), sw.TensorParallel(), lr=1e-3)
    inner = tied.module
    shared = inner.lm_head.weight is inner.model.embed_tokens.weight
    _hf_idiom(tied, opt, 3)

    plain, opt = sw.prepare(_plain_model(), sw.TensorParallel(plan=PLAIN_PLAN), lr=1e-3)
    _train_plain(plain, opt)

    refusals = [
        _refusal(build("bert")),
        _refusal(nn.Sequential(nn.Linear(4, 4))),
        _refusal(_llama(num_key_value_heads=1)),  # 4 query heads split, 1 kv head does not
    ]
    return llama, (sw.full_state_dict(tied), shared), sw.full_state_dict(plain), refusals


def test_hf_llama_trains_under_its_own_plan_as_in_one_process():
    results = run(_ranks, 2)
    expected, ref_losses = _reference(build("llama"), STEPS)
    tied_expected, _ = _reference(_llama(tie_word_embeddings=True), 3)
    plain_expected = _plain_model()
    _train_plain(plain_expected, torch.optim.AdamW(plain_expected.parameters(), lr=1e-3))
    for (state, losses, split), (tied, shared), plain, refusals in results:
        # Split as the plan says: half of q's 4 heads of 4 features, a gathered head.
        assert split == {
            "q_proj": 8,
            "lm_head": "ColumnParallelLinear",
            "embed": "VocabParallelEmbedding",
        }
        diffs = {
            "llama": max_abs_diff(state, expected),
            "llama_loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "tied": max_abs_diff(tied, tied_expected),
            "plain": max_abs_diff(plain, plain_expected.state_dict()),
        }
        print("max |shardwise - one process|:", {k: f"{v:.2e}" for k, v in diffs.items()})
        assert shared and all(diff <= TOL for diff in diffs.values()), diffs
        assert all("\n" not in message for message in refusals)
        assert refusals[0].startswith("BertForSequenceClassification has no tensor-parallel plan")
        assert refusals[1].startswith("Sequential has no tensor-parallel plan")
        assert "pass TensorParallel(plan=" in refusals[0]
        assert refusals[2] == (
            "model.layers.0.self_attn.k_proj: 1 attention heads do not split over 2 "
            "tensor-parallel ranks"
        )


# ---- the plan, without processes ---------------------------------------------------------------
def test_the_plan_is_the_one_transformers_resolves():
    model = build("llama")
    assert shipped_plan(model) == model.tp_plan  # transformers' own composition of it
    assert hf_plan(model)["lm_head"] == "colwise_gather"  # the HF loss needs whole logits
    assert hf_plan(model)["model.embed_tokens"] == "vocab_embedding"


def test_a_style_or_a_tie_we_cannot_honour_is_refused_in_one_line():
    model = build("llama")
    model.config.base_model_tp_plan = {"layers.*.mlp.down_proj": "sequence_parallel"}
    with pytest.raises(
        ValueError,
        match=r"^LlamaForCausalLM: model.layers.0.mlp.down_proj has the style 'sequence_parallel'",
    ):
        hf_plan(model)
    model.config.base_model_tp_plan = {"layers.*.input_layernorm.weight": "colwise"}
    with pytest.raises(ValueError, match=r"input_layernorm.weight has the style 'colwise'"):
        hf_plan(model)
    tied = _llama(tie_word_embeddings=True)
    with pytest.raises(
        ValueError,
        match=r"^tensor-parallel plan: model.embed_tokens.weight and lm_head.weight are one tied",
    ):
        resolve(tied, {"lm_head": "rowwise", "model.embed_tokens": "vocab_embedding"}, 2)
