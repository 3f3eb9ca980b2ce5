"""Hugging Face models nobody here wrote, built offline from tiny configs (nothing downloaded),
with a batch of each kind and the loss the HF idiom gives (`model(**batch).loss`).

    model = build("gpt2")                   # seeded: every rank builds the same one
    batch = make_batch("gpt2", n, step)     # a dict of tensors, n samples, seeded by step
    loss = hf_loss(model(**batch))          # ModelOutput.loss

`KINDS` are the acceptance's five models plus an untied GPT-2. Tests that need them skip where
`transformers` (the optional extra `shardwise[hf]`) is not installed.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # tiny configs draw advice meant for real ones

VOCAB, SEQ, CLASSES, IMAGE = 37, 8, 3, 16
KINDS = ("gpt2", "gpt2_untied", "llama", "bert", "resnet", "vit")


def config(kind: str):
    """The tiny config of `kind` (fp32, eager attention, no dropout: exact comparisons)."""
    T = transformers
    common = {"attn_implementation": "eager"}
    if kind in ("gpt2", "gpt2_untied"):
        c = T.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=kind == "gpt2", **common,
        )  # fmt: skip
    elif kind == "llama":  # grouped-query attention: 4 query heads share 2 key/value heads
        c = T.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            tie_word_embeddings=False, **common,
        )  # fmt: skip
    elif kind == "bert":
        c = T.BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=24, max_position_embeddings=SEQ, num_labels=CLASSES,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common,
        )  # fmt: skip
    elif kind == "resnet":  # BatchNorm throughout
        c = T.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 12], depths=[1, 1],
            layer_type="basic", num_labels=CLASSES,
        )  # fmt: skip
    elif kind == "vit":
        c = T.ViTConfig(
            image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=24, num_labels=CLASSES,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return c


def model_class(kind: str):
    T = transformers
    return {
        "gpt2": T.GPT2LMHeadModel,
        "gpt2_untied": T.GPT2LMHeadModel,
        "llama": T.LlamaForCausalLM,
        "bert": T.BertForSequenceClassification,
        "resnet": T.ResNetForImageClassification,
        "vit": T.ViTForImageClassification,
    }[kind]


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """`kind` built from its tiny config with `seed`: the same model on every rank."""
    torch.manual_seed(seed)
    return model_class(kind)(config(kind))


def make_batch(kind: str, n: int, step: int) -> dict[str, torch.Tensor]:
    """n samples of `kind`'s input as HF takes them, labels included."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind in ("gpt2", "gpt2_untied", "llama"):
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    if kind == "bert":
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return {"input_ids": ids, "labels": torch.randint(0, CLASSES, (n,), generator=g)}
    pixels = torch.randn(n, 3, IMAGE, IMAGE, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, CLASSES, (n,), generator=g)}


def rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Samples start..stop of every tensor in the batch (a rank's share)."""
    return {k: v[start:stop] for k, v in batch.items()}


def hf_loss(output) -> torch.Tensor:
    """The loss the HF idiom trains on: the output's own `.loss`."""
    return output.loss
