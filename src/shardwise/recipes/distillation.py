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
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from shardwise import comm
from shardwise.arguments import finite_number, whole_number
from shardwise.comm.parallel_ops import IGNORE_INDEX  # (F.cross_entropy's padding label)
from shardwise.distributed import runtime
from shardwise.distributed.runtime import Runtime
from shardwise.observe.run_output import check_writable_file
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
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"top-k: logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() == 0:
        raise ValueError("top-k: logits must have at least 1 dimension, got a scalar")
    whole_number("top-k k", k, least=1)
    if k > logits.shape[-1]:
        raise ValueError(f"top-k: k={k} must be in [1, {logits.shape[-1]}] (the vocabulary)")
    values, indices = logits.topk(k, dim=-1)
    return values, indices


def distill_loss(
    temperature: float = 2.0,
    alpha: float = 0.5,
    hard_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """The loss of a student's logits against targets `(labels, teacher_logits)`: a mean over
    the rows (samples, or tokens), so it weighs like any per-sample mean loss. A row whose
    label is -100 (padding, as `F.cross_entropy` ignores it) is left out of both terms."""
    finite_number("distillation temperature", temperature, above=0)  # (NaN, inf: a NaN loss)
    if not 0 <= alpha <= 1:
        raise ValueError(f"distillation alpha must be in [0, 1], got {alpha}")

    def loss(student: torch.Tensor, targets: tuple[torch.Tensor, TeacherLogits]) -> torch.Tensor:
        labels, teacher = targets
        vocab = student.shape[-1]
        rows, labels = student.reshape(-1, vocab), labels.reshape(-1)
        scored = labels != IGNORE_INDEX  # (padding: no row of the soft term either)
        soft = soft_loss(rows, _dense(teacher, vocab, rows), temperature, scored)
        hard = hard_loss(rows, labels) if alpha < 1 else rows.new_zeros(())
        return alpha * temperature**2 * soft + (1 - alpha) * hard

    return loss


def soft_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    temperature: float,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over rows (those `scored`, if given) of KL(softmax(teacher / T) ||
    softmax(student / T)); a teacher logit of -inf (outside a top-K) has probability 0 and
    adds nothing."""
    log_q = F.log_softmax(student / temperature, dim=-1)
    log_p = F.log_softmax(teacher.detach() / temperature, dim=-1)
    p = log_p.exp()
    per_row = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(dim=-1)
    if scored is None:
        return per_row.sum() / student.shape[0]
    # (masked, not indexed: no wait for the device to say how many rows are left)
    return torch.where(scored, per_row, 0.0).sum() / scored.sum()


def _dense(teacher: TeacherLogits, vocab: int, like: torch.Tensor) -> torch.Tensor:
    """The teacher's logits as rows of the vocabulary: top-K values scattered into -inf."""
    if isinstance(teacher, torch.Tensor):
        if teacher.shape[-1:] != (vocab,) or teacher.numel() != like.numel():
            raise ValueError(  # (reshaped, a [4, 6] teacher was read as a [6, 4] student's)
                f"teacher logits of shape {list(teacher.shape)} for student logits of "
                f"{like.shape[0]} rows of {vocab} classes: they must have the student's shape"
            )
        return teacher.reshape(-1, vocab)
    values, indices = teacher
    k = values.shape[-1]
    rows = torch.full_like(like, float("-inf"), dtype=values.dtype)
    return rows.scatter(1, indices.reshape(-1, k), values.reshape(-1, k))


def _check_rank0_writes(path: Path, rt: Runtime) -> None:
    """Before the teacher's forward over the whole dataset: rank 0, which writes, can write
    `path`; its answer is every rank's (one refusing alone would leave the others in the
    forward's collectives)."""
    problem = ""
    if rt.is_main:
        try:
            check_writable_file(path)
        except ValueError as e:
            problem = str(e)
    refused = torch.tensor([bool(problem)], dtype=torch.int64, device=rt.device)
    comm.all_reduce(refused)
    if refused.item():
        raise ValueError(problem or f"rank 0 cannot write the teacher cache {path}")


class TeacherCache:
    """A teacher's top-K logits for every sample of a dataset, read from a safetensors file
    (`values` [samples, K] fp32, `indices` [samples, K] int32; `build` writes one): the offline
    teacher, which costs the student's run no forward at all. Every field is checked on
    reading: shapes, dtypes, finite values, indices in [0, classes)."""

    def __init__(self, path: str | Path, samples: int, student_classes: int | None = None) -> None:
        """`student_classes`: what the cache's classes must be (None: not checked)."""
        self.path = Path(path)
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                values, indices = f.get_tensor("values"), f.get_tensor("indices")
            classes = int(meta["classes"])
        except Exception as e:  # (not safetensors, a tensor or a field missing)
            raise ValueError(
                f"{self.path}: not a teacher cache ({type(e).__name__}: {e})"
            ) from None
        problem = _cache_problem(values, indices, samples, classes)
        if problem is None and student_classes is not None and classes != student_classes:
            problem = f"logits over {classes} classes, and the student has {student_classes}"
        if problem:
            raise ValueError(f"{self.path}: {problem}: build it again (delete the file)")
        self.values, self.indices, self.classes = values, indices.long(), classes

    def lookup(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (values, indices) of these dataset samples."""
        held = len(self.values)
        if samples.numel() and not 0 <= int(samples.min()) <= int(samples.max()) < held:
            raise IndexError(  # (-1 read the last sample's logits)
                f"samples {int(samples.min())}..{int(samples.max())}: the cache holds 0..{held - 1}"
            )
        return self.values[samples], self.indices[samples]

    @staticmethod
    @torch.no_grad()
    def build(
        teacher: nn.Module, dataset, path: str | Path, k: int | None, batch_size: int = 256
    ) -> Path:
        """Run `teacher` over `dataset`'s (input, label) samples and write each one's top `k`
        logits (None: all of them) to `path`. Every rank calls it (a sharded teacher's forward
        is collective); rank 0 writes."""
        from torch.utils.data import DataLoader

        rt = runtime.init()
        path = Path(path)
        if k is not None:
            whole_number("top-k k", k, least=1)  # (0 meant every class)
        _check_rank0_writes(path, rt)
        rows = []
        for inputs, _ in DataLoader(dataset, batch_size=batch_size):
            rows.append(teacher(inputs.to(rt.device)).float().cpu())
        if not rows:  # (every rank reads the same dataset: all refuse)
            raise ValueError(f"teacher cache {path}: the dataset has no samples")
        logits = torch.cat(rows)
        values, indices = top_k_logits(logits, logits.shape[-1] if k is None else k)
        if rt.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tensors = {"values": values.contiguous(), "indices": indices.int().contiguous()}
            save_file(tensors, str(tmp), metadata={"classes": str(logits.shape[-1])})
            tmp.replace(path)  # (whole or absent: a killed build leaves no half cache)
        comm.barrier()  # (nobody reads it before it is in place)
        return path


def _cache_problem(values, indices, samples: int, classes: int) -> str | None:
    if values.dtype != torch.float32 or indices.dtype != torch.int32:
        return f"values must be float32 and indices int32, got {values.dtype}, {indices.dtype}"
    if values.dim() != 2 or values.shape != indices.shape or values.shape[0] != samples:
        return f"holds {tuple(values.shape)} logits, the training data {samples} samples"
    if not 1 <= values.shape[1] <= classes:
        return f"K = {values.shape[1]} is not in [1, {classes}]"
    if not bool(values.isfinite().all()):
        return "holds non-finite logits"
    if indices.numel() and not (int(indices.min()) >= 0 and int(indices.max()) < classes):
        return f"indices out of [0, {classes})"
    if bool((indices.sort(dim=1).values.diff(dim=1) == 0).any()):  # (one class's logit, twice)
        return "a class repeated within a sample's top-K indices"
    return None
