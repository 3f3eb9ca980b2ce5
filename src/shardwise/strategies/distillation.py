"""Knowledge distillation (Hinton et al., 2015): a student trained on a frozen teacher's
softened outputs as well as the labels, under any strategy.

The teacher (`prepare_teacher`) runs forward only, in eval mode, inside `torch.no_grad`: no
gradient, no gradient bucket, no optimizer state, nothing sent in backward. It is whole on
every rank, or sharded like ZeRO-3's parameters (`shard=True`): each rank keeps 1/N of every
block and the block is gathered for its forward and freed after it (forward-only gathers),
so a rank holds about teacher/N between steps.

The teacher's outputs travel with the targets, `(labels, teacher_logits)`, so the student's
step is the strategy's own (`sw.train_step`, accumulation, a user's loop): `distill_loss`
weighs `alpha * T^2 * KL(softmax(t / T) || softmax(s / T))` (per row: a sample, or a token of a
language model) against `(1 - alpha) * hard_loss(s, labels)`. The teacher's logits may be its
top K per row, `(values, indices)` from `top_k_logits`, cached offline: the rest of the
vocabulary gets no probability; with K the whole vocabulary it is the online loss, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.distributed import runtime
from shardwise.strategies.ddp import broadcast_module_state
from shardwise.strategies.zero import ZeRO

TeacherLogits = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # dense, or (values, indices)


def prepare_teacher(module: nn.Module, shard: bool = False) -> nn.Module:
    """`module` frozen, in eval mode, on this rank's device, the same on every rank (rank 0's
    values); with `shard`, its parameters sharded over the ranks as ZeRO-3's are and gathered
    block by block for each forward. Call it on every rank (collective); call the teacher
    under `torch.no_grad()` on every rank together."""
    rt = runtime.init()
    module = module.to(rt.device).eval()
    if shard:
        for p in module.parameters():  # (ZeRO-3 makes its units of trainable parameters)
            p.requires_grad_(True)
        module = ZeRO(stage=3, sync_batchnorm=False).wrap(module, rt).eval()
    elif rt.world_size > 1:
        broadcast_module_state(module)
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def top_k_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest logits of each row (last dimension) and their indices: what an offline
    cache of the teacher keeps."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top-k: k={k} must be in [1, {logits.shape[-1]}] (the vocabulary)")
    values, indices = logits.topk(k, dim=-1)
    return values, indices


def distill_loss(
    temperature: float = 2.0,
    alpha: float = 0.5,
    hard_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """The loss of a student's logits against targets `(labels, teacher_logits)`: a mean over
    the rows (samples, or tokens), so it weighs like any per-sample mean loss."""
    if temperature <= 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"distillation alpha must be in [0, 1], got {alpha}")

    def loss(student: torch.Tensor, targets: tuple[torch.Tensor, TeacherLogits]) -> torch.Tensor:
        labels, teacher = targets
        vocab = student.shape[-1]
        rows = student.reshape(-1, vocab)
        soft = soft_loss(rows, _dense(teacher, vocab, rows), temperature)
        hard = hard_loss(rows, labels.reshape(-1)) if alpha < 1 else rows.new_zeros(())
        return alpha * temperature**2 * soft + (1 - alpha) * hard

    return loss


def soft_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over rows of KL(softmax(teacher / T) || softmax(student / T)); a teacher logit of
    -inf (outside a top-K) has probability 0 and adds nothing."""
    log_q = F.log_softmax(student / temperature, dim=-1)
    log_p = F.log_softmax(teacher.detach() / temperature, dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum() / student.shape[0]


def _dense(teacher: TeacherLogits, vocab: int, like: torch.Tensor) -> torch.Tensor:
    """The teacher's logits as rows of the vocabulary: top-K values scattered into -inf."""
    if isinstance(teacher, torch.Tensor):
        return teacher.reshape(-1, vocab)
    values, indices = teacher
    k = values.shape[-1]
    rows = torch.full_like(like, float("-inf"), dtype=values.dtype)
    return rows.scatter(1, indices.reshape(-1, k), values.reshape(-1, k))
