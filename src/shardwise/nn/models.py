"""The small models shardwise's jobs, tests and benchmarks train.

MLP (digits, the 784-2048-2048-10 benchmark), a CNN with BatchNorm (digits as 8x8 images) and a
tiny character-level GPT in the style of nanoGPT (pre-norm blocks, causal self-attention).
"""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Sequential):
    """Linear layers with ReLU between them: sizes [in, hidden..., out]."""

    def __init__(self, sizes: list[int]) -> None:
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class ConvNet(nn.Module):
    """Two conv-BN-ReLU blocks and a linear head, for 1x8x8 images (sklearn's digits)."""

    def __init__(self, channels: tuple[int, int] = (16, 32), num_classes: int = 10) -> None:
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(c2 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # flat 64-pixel rows
            x = x.view(-1, 1, 8, 8)
        return self.head(self.features(x).flatten(1))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention, or where `mask` (bool, True = may attend) allows it."""
        b, t, _ = x.shape
        # Widths come from qkv's output, not from x: under tensor parallel this rank computes
        # only its n_head heads (the plan divides n_head), and x still has the full width.
        q, k, v = self.qkv(x).chunk(3, dim=2)
        width = q.shape[-1]
        q, k, v = (
            z.view(b, t, self.n_head, width // self.n_head).transpose(1, 2) for z in (q, k, v)
        )
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


def document_mask(idx: torch.Tensor, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions that restart at 0 at each `bos` token (batch, seq), and the attention mask
    (batch, 1, seq, seq) that lets a token see only the earlier tokens of its own document."""
    t = idx.shape[1]
    starts = idx == bos
    index = torch.arange(t, device=idx.device).expand_as(idx)
    # Each token's document start: the last BOS at or before it (0 before the first BOS).
    start = torch.where(starts, index, 0).cummax(dim=1).values
    document = starts.cumsum(dim=1)
    same = document.unsqueeze(2) == document.unsqueeze(1)
    causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
    return index - start, (same & causal).unsqueeze(1)


class TinyGPT(nn.Module):
    """A decoder-only transformer over characters; returns logits (batch, seq, vocab).

    With `bos_token`, a row may hold several documents, each starting with that token
    (packed sequences): positions restart and attention stays inside each document, so every
    document gets the logits it would get alone in its own row.
    """

    # How `shardwise.TensorParallel` splits it (Megatron-style; see strategies/tensor_parallel):
    # q/k/v by heads and fc1 by output features (column), attention's and the MLP's output
    # projections by input features (row), the embedding and the head by vocabulary.
    TP_PLAN: ClassVar[dict[str, str]] = {
        "tok_emb": "vocab_embedding",
        "blocks.*.attn": "heads",
        "blocks.*.attn.qkv": "colwise:3",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
        "head": "vocab_head",
    }

    # What `activation_checkpointing: true` recomputes (shardwise.nn.recompute).
    CHECKPOINT_UNITS: ClassVar[tuple[str, ...]] = ("blocks.*",)

    def __init__(
        self,
        vocab_size: int,
        seq_len: int = 128,
        d_model: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        bos_token: int | None = None,
    ) -> None:
        super().__init__()
        self.seq_len, self.bos_token = seq_len, bos_token
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.seq_len}")
        if self.bos_token is None:
            pos, mask = torch.arange(t, device=idx.device), None
        else:
            pos, mask = document_mask(idx, self.bos_token)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a sequence of layers, each feeding the next (what a pipeline splits)."""
        if self.bos_token is not None:  # the mask would have to travel between the stages
            raise ValueError("a TinyGPT with bos_token (document masking) cannot be pipelined")
        return [
            GPTEmbedding(self.tok_emb, self.pos_emb),
            *self.blocks,
            GPTHead(self.ln_f, self.head),
        ]


class GPTEmbedding(nn.Module):
    """TinyGPT's first pipeline layer: token plus position embeddings."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


class GPTHead(nn.Module):
    """TinyGPT's last pipeline layer: final norm and the vocabulary projection."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position whose target is not -100 (padding:
    F.cross_entropy's default ignore_index)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
