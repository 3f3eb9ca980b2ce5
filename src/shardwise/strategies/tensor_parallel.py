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
patterns (`TinyGPT.TP_PLAN`), as in torchtitan's `parallelize_module`; `tp_plan.py` checks it,
and finds a model's own (a Hugging Face model's is the one transformers ships: `hf_tp_plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from shardwise import comm
from shardwise.comm.parallel_ops import (
    IGNORE_INDEX,
    Split,
    copy_to_parallel,
    gather_from_parallel,
    gather_split,
    reduce_from_parallel,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from shardwise.distributed.runtime import Runtime
from shardwise.nn.meta_init import (
    ParameterSource,
    load_buffers_from,
    read_slice,
    read_whole,
    swap_parameters,
)
from shardwise.optim.layerwise import ParameterNorms
from shardwise.strategies.base import (
    DistributedModel,
    Strategy,
    UnsplitCheckpointsOnly,
    square_sum,
)
from shardwise.strategies.ddp import broadcast_module_state
from shardwise.strategies.plain_loss import check_plain_cross_entropy
from shardwise.strategies.section import StrategySection, check_options
from shardwise.strategies.tp_plan import model_plan, parse_style, resolve


# ---- the parallel layers -----------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T + b_local: this rank's slice of the output features.

    The input must be the same on every rank; its gradient is the sum over ranks of what each
    slice contributes, hence f (`copy_to_parallel`) in front. With `gather`, every rank's slices
    are concatenated into the full output (for a consumer that needs it whole, e.g. a loss
    computed inside the model); backward keeps this rank's slice of the gradient.
    """

    def __init__(
        self, linear: nn.Linear, rank: int, parts: int, group, chunks: int = 1, gather=False
    ) -> None:
        super().__init__()
        assert not (gather and chunks > 1), "a gathered output is one block"
        self.group, self.rank, self.gather = group, rank, gather
        self.split = Split(0, linear.out_features, parts, chunks)
        self.weight = _sliced(linear.weight, self.split.take(linear.weight.detach(), rank))
        self.bias = None
        if linear.bias is not None:
            self.bias = _sliced(linear.bias, self.split.take(linear.bias.detach(), rank))
        self.splits = {"weight": self.split, "bias": self.split}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(copy_to_parallel(x, self.group), self.weight, self.bias)
        if not self.gather:
            return local
        last = Split(local.dim() - 1, self.split.size, self.split.parts)
        return gather_from_parallel(local, last, self.rank, self.group)


def _sliced(whole: nn.Parameter, part: torch.Tensor) -> nn.Parameter:
    """This rank's `part` of `whole` as a parameter of its own, frozen where `whole` was."""
    return nn.Parameter(part.clone(), requires_grad=whole.requires_grad)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_local @ W_local^T + b: the input arrives split by features (the output of a
    column-parallel layer); g (`reduce_from_parallel`) sums the partial products. With
    `split_input` the input arrives whole (the same on every rank) and each rank takes its
    slice; f in front sums the slices' gradients back into the whole input's."""

    def __init__(self, linear: nn.Linear, rank: int, parts: int, group, split_input=False):
        super().__init__()
        self.group, self.split_input = group, split_input
        split = Split(1, linear.in_features, parts)
        self.start, self.end = split.bounds[rank]
        self.weight = _sliced(linear.weight, split.take(linear.weight.detach(), rank))
        # The bias is added once, after the sum: replicated on every rank.
        self.bias = None if linear.bias is None else _sliced(linear.bias, linear.bias.detach())
        self.splits = {"weight": split}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = copy_to_parallel(x, self.group)[..., self.start : self.end]
        y = reduce_from_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table. A token outside this range looks up nothing
    here (zeros); the all-reduce adds the one rank that holds it. The padding row, if this
    rank holds it, gets no gradient, as in the whole table."""

    def __init__(self, embedding: nn.Embedding, rank: int, parts: int, group) -> None:
        super().__init__()
        dropped = [
            f"{option}={getattr(embedding, option)}"
            for option in ("max_norm", "scale_grad_by_freq", "sparse")
            if getattr(embedding, option) not in (None, False)
        ]
        if dropped:  # (the renorm and the counts would be over this rank's rows only)
            raise ValueError(
                f"tensor parallel splits an embedding's rows, and this one has {', '.join(dropped)}"
                ": not supported (set them off, or leave the embedding out of the plan)"
            )
        self.group = group
        split = Split(0, embedding.num_embeddings, parts)
        self.start, self.end = split.bounds[rank]
        pad = embedding.padding_idx
        self.padding_idx = (
            pad - self.start if pad is not None and self.start <= pad < self.end else None
        )
        self.weight = _sliced(embedding.weight, split.take(embedding.weight.detach(), rank))
        self.splits = {"weight": split}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)
        return reduce_from_parallel(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class VocabParallelHead(ColumnParallelLinear):
    """The LM head, column-parallel over the vocabulary, with the embedding's row ranges. Its
    output is this rank's slice of the logits, for `vocab_parallel_cross_entropy`; with
    `gather` the full logits, for any loss."""

    def __init__(self, linear: nn.Linear, rank: int, parts: int, group, gather: bool) -> None:
        super().__init__(linear, rank, parts, group, gather=gather)
        self.start, self.end = self.split.bounds[rank]


# ---- the strategy ------------------------------------------------------------------------------
def vocab_parallel_loss(loss_fn, vocab_start: int | None, group, vocab_size: int | None = None):
    """The loss from vocabulary slices of the logits, this rank's starting at `vocab_start`
    (`loss_fn` where the logits are whole: None). It stands in for `loss_fn`, which must be
    mean cross-entropy, checked on the whole `vocab_size` (`plain_loss.py`; None: not checked,
    the cost model's shapes): any other loss would be replaced without a word."""
    if vocab_start is None:
        return loss_fn

    def sliced(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if vocab_size is not None:
            check_plain_cross_entropy(loss_fn, target, vocab_size)
            # A target outside the vocabulary lies in no rank's slice: the loss would count it
            # as log(sum) where F.cross_entropy refuses it. Checked on the device, no wait.
            inside = ((target >= 0) & (target < vocab_size)) | (target == IGNORE_INDEX)
            torch._assert_async(
                inside.all(), f"a target outside the vocabulary [0, {vocab_size}) (nor -100)"
            )
        return vocab_parallel_cross_entropy(logits, target, vocab_start, group)

    return sliced


def split_parameters(module: nn.Module) -> dict[str, Split]:
    """State-dict key -> how it is split, for every parameter of `module` (the whole model or
    a pipeline stage of it) that a parallel layer holds a slice of; the rest are replicated."""
    out = {}
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for pname, split in getattr(sub, "splits", {}).items():
            if getattr(sub, pname, None) is not None:
                out[f"{module_name}.{pname}" if module_name else pname] = split
    return out


class TensorParallelModel(UnsplitCheckpointsOnly, DistributedModel):
    """This rank's slices of the split layers, and the replicated rest. `vocab_start`: where
    this rank's slice of the vocabulary starts, when the loss is computed from the slices."""

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        vocab_start: int | None,
        vocab_size: int | None = None,
    ):
        super().__init__(module, runtime)
        self.group, self.vocab_start, self.vocab_size = runtime.group, vocab_start, vocab_size

    def sharded_parameters(self) -> dict[str, Split]:
        """Name -> how it is split, for every parameter that is not replicated."""
        return split_parameters(self.module)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        splits = self.sharded_parameters()
        return {
            key: gather_split(value, splits[key], self.group) if key in splits else value.clone()
            for key, value in self.module.state_dict().items()
        }

    def grad_square_sum(self) -> torch.Tensor:
        splits = self.sharded_parameters()
        named = [(n, p) for n, p in self.module.named_parameters() if p.grad is not None]
        device = self.runtime.device
        sharded = square_sum([p.grad for n, p in named if n in splits], device)
        comm.all_reduce(sharded, group=self.group)  # disjoint slices: sum over ranks
        return sharded + square_sum([p.grad for n, p in named if n not in splits], device)

    def parameter_norms(self) -> ParameterNorms:
        """Whole local tensors; a split parameter's squares summed over the group, a
        replicated one's counted at the group's first rank only."""
        splits, named = self.sharded_parameters(), list(self.module.named_parameters())
        counted = [name in splits or self.runtime.rank == 0 for name, _ in named]
        norms = ParameterNorms.whole([p for _, p in named])
        norms.device = self.runtime.device
        return count_once(norms, counted, self.group)

    def adapt_loss(self, loss_fn):
        return vocab_parallel_loss(loss_fn, self.vocab_start, self.group, self.vocab_size)

    def predict(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_start is None:
            return logits.argmax(-1)
        return vocab_parallel_argmax(logits, self.vocab_start, self.group)

    def data_shard(self) -> tuple[int, int]:
        return 1, 0  # every rank of the group sees the same batch


@dataclass(frozen=True)
class TensorParallel(Strategy):
    """Options for tensor parallel.

    size: ranks the layers are split over (the world, or the mesh's tp axis).
    plan: module-name pattern -> style (`tp_plan.STYLES`: 'colwise[:CHUNKS]', 'colwise_gather',
        'rowwise', 'rowwise_split_input', 'vocab_embedding', 'vocab_head', 'heads' to divide an
        attention module's n_head); default: the model's own, its TP_PLAN attribute or, for a
        Hugging Face model, the plan transformers ships with it (`hf_tp_plan`).
    loss_parallel: keep a 'vocab_head's logits split over the vocabulary and compute the loss
        from the slices (`sw.parallel_loss`); False gathers the full logits (any loss function
        works). A Hugging Face plan's head gathers them anyway: the model computes its loss.
    """

    size: int | None = None
    plan: dict[str, str] | None = None
    loss_parallel: bool = True

    def __post_init__(self) -> None:
        check_options(self, TPConfig)
        for style in (self.plan or {}).values():
            parse_style(style)

    def wrap(self, model: nn.Module, runtime: Runtime) -> TensorParallelModel:
        plan = self.checked_plan(model, runtime)  # refused here, before any collective
        broadcast_module_state(model, group=runtime.group)  # slice the same full weights
        return TensorParallelModel(model, runtime, *self._vocab(model, plan, runtime))

    def wrap_from(
        self, model: nn.Module, runtime: Runtime, source: ParameterSource
    ) -> TensorParallelModel:
        """A meta-device model: the parallel layers are made from the meta ones (shapes
        only), then each rank reads its slices of the split weights and the replicated rest
        whole from `source`; no rank ever holds a split weight whole. Every rank reads the
        same values, so nothing is broadcast."""
        plan = self.checked_plan(model, runtime)
        vocab = self._vocab(model, plan, runtime)
        read_own_slices(model, source, runtime.rank, runtime.device)
        load_buffers_from(model, source)
        return TensorParallelModel(model, runtime, *vocab)

    def _vocab(self, model: nn.Module, plan: dict[str, str], rt) -> tuple[int | None, int | None]:
        """Apply the plan; where this rank's vocabulary slice starts, and the vocabulary's
        size, if the loss is computed from the slices (a 'vocab_head' and loss_parallel)."""
        head = self.apply_plan(model, plan, rt)
        if head is None or not self.loss_parallel:
            return None, None
        return head.start, head.split.size

    def checked_plan(self, model: nn.Module, runtime: Runtime) -> dict[str, str]:
        if self.size is not None and self.size != runtime.world_size:
            raise ValueError(
                f"TensorParallel(size={self.size}) needs {self.size} ranks, got "
                f"{runtime.world_size} (use a device mesh to combine it with data parallel)"
            )
        plan = self.plan or model_plan(model)
        resolve(model, plan, runtime.world_size)
        return plan

    def apply_plan(self, model: nn.Module, plan: dict[str, str], rt) -> VocabParallelHead | None:
        """Replace the plan's modules of `model` by rank `rt.rank`'s parallel layers (`rt`: a
        runtime, or anything with world_size, rank and group); the vocabulary head, if any."""
        vocab_head = None
        modules = dict(model.named_modules())
        tied: dict[int, nn.Parameter] = {}  # a shared full weight -> the one slice of it
        for name, (style, chunks) in resolve(model, plan, rt.world_size).items():
            old = modules[name]
            new = self._parallelize(old, style, chunks, rt)
            if new is None:
                continue
            # `resolve` checked that every module sharing a weight splits its rows alike.
            new.weight = tied.setdefault(id(old.weight), new.weight)
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, new)
            if isinstance(new, VocabParallelHead):
                vocab_head = new
        return vocab_head

    def _parallelize(self, module, style: str, chunks: int, rt) -> nn.Module | None:
        """The parallel layer replacing `module` (checked by `resolve`), or None where it is
        changed in place."""
        parts, rank, group = rt.world_size, rt.rank, rt.group
        if style == "heads":
            module.n_head //= parts
            return None
        if style in ("colwise", "colwise_gather"):
            gather = style == "colwise_gather"
            return ColumnParallelLinear(module, rank, parts, group, chunks, gather)
        if style in ("rowwise", "rowwise_split_input"):
            split_input = style == "rowwise_split_input"
            return RowParallelLinear(module, rank, parts, group, split_input)
        if style == "vocab_embedding":
            return VocabParallelEmbedding(module, rank, parts, group)
        return VocabParallelHead(module, rank, parts, group, gather=not self.loss_parallel)


@torch.no_grad()
def read_own_slices(model: nn.Module, source: ParameterSource, rank: int, device) -> None:
    """Every meta parameter of `model` (its plan applied) read from `source`: rank `rank`'s
    slice of each split one (by its layer's `splits`), the others whole."""
    splits: dict[nn.Parameter, tuple[str, Split]] = {}
    for module_name, module in model.named_modules():
        for pname, split in getattr(module, "splits", {}).items():
            p = getattr(module, pname, None)
            if p is not None:  # (a tied weight: the name of its first holder, as below)
                splits.setdefault(p, (f"{module_name}.{pname}".lstrip("."), split))

    def read(name: str, p: nn.Parameter) -> nn.Parameter:
        if not p.is_meta or p not in splits:
            return read_whole(p, name, source, device)
        name, split = splits[p]
        whole = (*p.shape[: split.dim], split.size, *p.shape[split.dim + 1 :])
        start, stop = split.bounds[rank]
        blocks = [  # rank r's slice of each block (q, k, v of a fused projection)
            read_slice(
                source, name, whole, split.dim, c * split.block + start, c * split.block + stop
            )
            for c in range(split.chunks)
        ]
        value = torch.cat(blocks, dim=split.dim).to(device, p.dtype)
        return nn.Parameter(value, requires_grad=p.requires_grad)

    swap_parameters(model, read)


class TPConfig(StrategySection):
    name: Literal["tp"] = Field("tp", description="the parallelism strategy")
    size: int | None = Field(None, ge=1, description="ranks per model (default: the world)")
    loss_parallel: bool = Field(
        True, description="loss from vocabulary-sharded logits (never gathered)"
    )

    def build(self, world_size: int, run_dir: Path) -> TensorParallel:
        return TensorParallel(**self.options())

    def ranks_needed(self) -> int | None:
        return self.size

    def data_parallel_ranks(self, world_size: int) -> int:
        return 1  # (every rank holds a slice of the one model, on the same batch)

    def describe(self) -> str:
        return "tensor parallel"


def count_once(norms: ParameterNorms, counted: list[bool], group) -> ParameterNorms:
    """`norms` whose sums, after its own reduction, are summed over `group` too, each
    parameter's only from the ranks where `counted` (the slices of a split one, one copy of a
    replicated one)."""
    mask = torch.tensor(counted, dtype=torch.float32)
    inner = norms.reduce

    def reduce(sums: torch.Tensor) -> None:
        if inner is not None:
            inner(sums)
        sums.mul_(mask.to(sums.device))
        comm.all_reduce(sums, group=group)

    return ParameterNorms(norms.pieces, norms.params, reduce, norms.device, norms.join)
