"""Tensor parallel, Megatron-style: each big weight matrix split over the ranks of a group.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019). In a transformer block's MLP, fc1 is split by output features
(column-parallel: every rank computes a slice of the hidden units from the whole input), GELU
acts elementwise on the slice, and fc2 is split by input features (row-parallel: every rank
multiplies its slice, and one all-reduce sums the partial outputs). Attention is split the same
way, by heads: q, k and v column-parallel, the output projection row-parallel. Two functions put
the communication into autograd:

    f = copy_to_parallel      identity forward, all-reduce of the input gradient backward
    g = reduce_from_parallel  all-reduce forward, identity backward

so each sub-block (attention, MLP) costs one all-reduce of the activations forward and one
backward. The embedding and the LM head are split by vocabulary rows, and the loss is computed
from vocabulary-sharded logits (`vocab_parallel_cross_entropy`: a max, a sum of exponentials and
the target logit are all-reduced, a few floats per token) so the full logits never exist.

Layers that are not split (layer norms, position embeddings, row-parallel biases) are replicated;
their gradients come out identical on every rank because everything upstream of them was
all-reduced. The plan that says which layer gets which treatment is a dict of module-name
patterns (`TinyGPT.TP_PLAN`), as in torchtitan's `parallelize_module`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise import comm
from shardwise.runtime import Runtime
from shardwise.strategies.base import Strategy, UnsplitCheckpointsOnly, WrappedModel, square_sum
from shardwise.strategies.ddp import broadcast_module_state

ProcessGroup = dist.ProcessGroup


# ---- the two communication functions -----------------------------------------------------------
class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Autograd may hand the same gradient tensor to several consumers (residual branches):
        # reduce a copy, never it.
        grad = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_parallel(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, group)


# ---- how a dimension is split ------------------------------------------------------------------
def split_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's slice; the first `size % parts` ranks get one more."""
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class Split:
    """Dimension `dim` of a full tensor, made of `chunks` equal blocks (q, k, v for a fused
    projection), each block cut into `parts` slices; rank r holds slice r of every block."""

    dim: int
    size: int
    parts: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.size % self.chunks:
            raise ValueError(f"size {self.size} is not {self.chunks} equal blocks")
        self.block = self.size // self.chunks
        self.bounds = split_bounds(self.block, self.parts)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        start, end = self.bounds[rank]
        blocks = full.split(self.block, dim=self.dim)
        return torch.cat([b.narrow(self.dim, start, end - start) for b in blocks], dim=self.dim)

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `take` over all ranks' pieces."""
        per_rank = [p.split(p.shape[self.dim] // self.chunks, dim=self.dim) for p in pieces]
        blocks = [torch.cat([r[c] for r in per_rank], dim=self.dim) for c in range(self.chunks)]
        return torch.cat(blocks, dim=self.dim)


def gather_split(local: torch.Tensor, split: Split, group: ProcessGroup | None) -> torch.Tensor:
    """All ranks' slices (possibly of unequal sizes) reassembled into the full tensor."""
    moved = local.detach().movedim(split.dim, 0).contiguous()
    longest = max(e - s for s, e in split.bounds) * split.chunks
    padded = torch.zeros((longest, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    padded[: moved.shape[0]] = moved
    out = torch.empty((split.parts * longest, *moved.shape[1:]), dtype=moved.dtype,
                      device=moved.device)  # fmt: skip
    comm.all_gather_into_tensor(out.view(-1), padded.view(-1), group=group)
    pieces = [
        out[r * longest : r * longest + (e - s) * split.chunks].movedim(0, split.dim)
        for r, (s, e) in enumerate(split.bounds)
    ]
    return split.assemble(pieces)


# ---- the parallel layers -----------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T + b_local: this rank's slice of the output features.

    The input must be the same on every rank; its gradient is the sum over ranks of what each
    slice contributes, hence f (`copy_to_parallel`) in front.
    """

    def __init__(self, linear: nn.Linear, rank: int, parts: int, group, chunks: int = 1) -> None:
        super().__init__()
        self.group = group
        self.split = Split(0, linear.out_features, parts, chunks)
        self.weight = nn.Parameter(self.split.take(linear.weight.detach(), rank).clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(self.split.take(linear.bias.detach(), rank).clone())
        self.splits = {"weight": self.split, "bias": self.split}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_local @ W_local^T + b: the input arrives split by features (the output of a
    column-parallel layer); g (`reduce_from_parallel`) sums the partial products."""

    def __init__(self, linear: nn.Linear, rank: int, parts: int, group) -> None:
        super().__init__()
        self.group = group
        split = Split(1, linear.in_features, parts)
        self.weight = nn.Parameter(split.take(linear.weight.detach(), rank).clone())
        # The bias is added once, after the sum: replicated on every rank.
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.splits = {"weight": split}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table. A token outside this range looks up nothing
    here (zeros); the all-reduce adds the one rank that holds it."""

    def __init__(self, embedding: nn.Embedding, rank: int, parts: int, group) -> None:
        super().__init__()
        self.group = group
        split = Split(0, embedding.num_embeddings, parts)
        self.start, self.end = split.bounds[rank]
        self.weight = nn.Parameter(split.take(embedding.weight.detach(), rank).clone())
        self.splits = {"weight": split}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel(out, self.group)


class _GatherFromParallel(torch.autograd.Function):
    """All ranks' slices of the last dimension, concatenated; backward keeps this rank's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: Split, rank: int, group) -> torch.Tensor:
        ctx.bounds = split.bounds[rank]
        return gather_split(x, split, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        start, end = ctx.bounds
        return grad[..., start:end], None, None, None


class VocabParallelHead(ColumnParallelLinear):
    """The LM head, column-parallel over the vocabulary, with the embedding's row ranges. Its
    output is this rank's slice of the logits, for `vocab_parallel_cross_entropy`; with
    `gather` the full logits, for any loss."""

    def __init__(self, linear: nn.Linear, rank: int, parts: int, group, gather: bool) -> None:
        super().__init__(linear, rank, parts, group)
        self.rank, self.gather = rank, gather
        self.start, self.end = self.split.bounds[rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        if not self.gather:
            return local
        last = Split(local.dim() - 1, self.split.size, self.split.parts)
        return _GatherFromParallel.apply(local, last, self.rank, self.group)


# ---- loss and prediction from vocabulary-sharded logits ----------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, group):
        logits = logits.float()
        top = logits.max(dim=-1).values
        comm.all_reduce(top, group=group, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)  # softmax is shift-invariant; this keeps exp finite
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total, group=group)
        inside = (target >= start) & (target < start + logits.shape[-1])
        local = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        comm.all_reduce(picked, group=group)  # exactly one rank contributes each target logit
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        softmax, local, inside = ctx.saved_tensors
        # d(-log softmax_target)/d logits = softmax - onehot(target); the onehot lives on one rank.
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -inside.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, start: int, group: ProcessGroup | None
) -> torch.Tensor:
    """Mean cross-entropy from this rank's vocabulary slice [start, start + V_local) of the
    logits (any leading shape); equals `F.cross_entropy` on the gathered logits."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), start, group).mean()


def vocab_parallel_argmax(logits: torch.Tensor, start: int, group) -> torch.Tensor:
    """argmax over the whole vocabulary from sharded logits (ties: the lowest index)."""
    values, index = logits.max(dim=-1)
    size = comm.group_size(group)
    both = torch.stack([values.float(), (index + start).float()]).contiguous()
    out = torch.empty((size, *both.shape), dtype=both.dtype, device=both.device)
    comm.all_gather_into_tensor(out.view(-1), both.view(-1), group=group)
    best = out[:, 0].argmax(dim=0, keepdim=True)  # first maximum = lowest rank = lowest index
    return out[:, 1].gather(0, best).squeeze(0).long()


# ---- the strategy ------------------------------------------------------------------------------
STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "heads")


def _parse_style(style: str) -> tuple[str, int]:
    name, _, chunks = style.partition(":")
    if name not in STYLES:
        raise ValueError(f"tensor-parallel style must be one of {STYLES}, got {style!r}")
    return name, int(chunks or 1)


class TensorParallelModel(WrappedModel):
    def __init__(self, module: nn.Module, group, parts: int, vocab: VocabParallelHead | None):
        super().__init__(module)
        self.group, self.parts, self.vocab_head = group, parts, vocab


@dataclass
class TensorParallel(UnsplitCheckpointsOnly, Strategy):
    """Options for tensor parallel.

    size: ranks the layers are split over (the world, or the mesh's tp dimension).
    plan: module-name pattern -> style ('colwise[:CHUNKS]', 'rowwise', 'vocab_embedding',
        'vocab_head', 'heads' to divide an attention module's n_head); default: the model's
        TP_PLAN attribute.
    loss_parallel: keep the logits split over the vocabulary and compute the loss from the
        slices (`sw.parallel_loss`); False gathers the full logits (any loss function works).
    """

    size: int | None = None
    plan: dict[str, str] | None = None
    loss_parallel: bool = True

    def __post_init__(self) -> None:
        if self.size is not None and self.size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {self.size}")
        for style in (self.plan or {}).values():
            _parse_style(style)

    def wrap(self, model: nn.Module, runtime: Runtime) -> TensorParallelModel:
        if self.size is not None and self.size != runtime.world_size:
            raise ValueError(
                f"TensorParallel(size={self.size}) needs {self.size} ranks, got "
                f"{runtime.world_size} (use a device mesh to combine it with data parallel)"
            )
        plan = self.plan if self.plan is not None else getattr(model, "TP_PLAN", None)
        if not plan:
            raise ValueError(
                f"{type(model).__name__} has no TP_PLAN: pass TensorParallel(plan={{...}})"
            )
        broadcast_module_state(model, group=runtime.group)  # slice the same full weights
        parts, rank, group = runtime.world_size, runtime.rank, runtime.group
        vocab_head = None
        names = dict(model.named_modules())
        for pattern, style in plan.items():
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise ValueError(f"tensor-parallel plan: no module matches {pattern!r}")
            name, chunks = _parse_style(style)
            for module_name in matched:
                module = names[module_name]
                if name == "heads":
                    if module.n_head % parts:
                        raise ValueError(
                            f"{module_name}: {module.n_head} heads do not split over {parts} ranks"
                        )
                    module.n_head //= parts
                    continue
                new = self._parallel_layer(name, module, module_name, rank, parts, group, chunks)
                parent, _, child = module_name.rpartition(".")
                setattr(names[parent] if parent else model, child, new)
                if name == "vocab_head":
                    vocab_head = new
        return TensorParallelModel(model, group, parts, vocab_head if self.loss_parallel else None)

    def _parallel_layer(self, style, module, name, rank, parts, group, chunks) -> nn.Module:
        expected = nn.Embedding if style == "vocab_embedding" else nn.Linear
        if not isinstance(module, expected):
            raise ValueError(f"{name}: style {style!r} needs an {expected.__name__}")
        if style == "colwise":
            return ColumnParallelLinear(module, rank, parts, group, chunks)
        if style == "rowwise":
            return RowParallelLinear(module, rank, parts, group)
        if style == "vocab_embedding":
            return VocabParallelEmbedding(module, rank, parts, group)
        return VocabParallelHead(module, rank, parts, group, gather=not self.loss_parallel)

    def make_optimizer(
        self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> torch.optim.Optimizer:
        return optimizer_cls(model.module.parameters(), **kwargs)

    def sharded_parameters(self, model: nn.Module) -> dict[str, Split]:
        """Name -> how it is split, for every parameter that is not replicated."""
        out = {}
        for module_name, module in model.module.named_modules():
            for pname, split in getattr(module, "splits", {}).items():
                if getattr(module, pname, None) is not None:
                    out[f"{module_name}.{pname}" if module_name else pname] = split
        return out

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        splits = self.sharded_parameters(model)
        return {
            key: gather_split(value, splits[key], model.group) if key in splits else value.clone()
            for key, value in model.module.state_dict().items()
        }

    def grad_square_sum(self, model: nn.Module) -> torch.Tensor:
        splits = self.sharded_parameters(model)
        named = [(n, p) for n, p in model.module.named_parameters() if p.grad is not None]
        sharded = square_sum([p.grad for n, p in named if n in splits])
        comm.all_reduce(sharded, group=model.group)  # disjoint slices: sum over ranks
        return sharded + square_sum([p.grad for n, p in named if n not in splits])

    def adapt_loss(self, model: nn.Module, loss_fn):
        head = model.vocab_head
        if head is None:
            return loss_fn
        return lambda logits, target: vocab_parallel_cross_entropy(
            logits, target, head.start, model.group
        )

    def predict(self, model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        head = model.vocab_head
        if head is None:
            return logits.argmax(-1)
        return vocab_parallel_argmax(logits, head.start, model.group)

    def data_shard(self, model: nn.Module) -> tuple[int, int]:
        return 1, 0  # every rank of the group sees the same batch
