"""The two small models the cost-model tests train for real and trace on the meta device: an
MLP (64 inputs, 10 classes) and a tiny GPT (11 tokens, 16 positions), with their losses and
batches of n random samples."""

from __future__ import annotations

import torch

from shardwise.nn.models import MLP, TinyGPT, lm_loss


def build(name: str) -> torch.nn.Module:
    """The model `name` ("mlp" or "gpt"), seeded: every rank builds the same one."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP([64, 128, 128, 10])
    return TinyGPT(vocab_size=11, seq_len=16, d_model=32, n_layer=2, n_head=4)


def loss_fn(name: str):
    return lm_loss if name == "gpt" else torch.nn.functional.cross_entropy


def fake_batch(name: str):
    """n -> (inputs, targets) of n random samples of the model's kind (what the cost model
    traces, and a batch to train on where their values do not matter)."""
    if name == "mlp":
        return lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,)))
    return lambda n: (torch.randint(0, 11, (n, 16)), torch.randint(0, 11, (n, 16)))
