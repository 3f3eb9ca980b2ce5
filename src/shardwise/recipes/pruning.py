"""Global magnitude pruning (unstructured), exact under sharding: the weights of smallest
magnitude over the whole model, whichever rank holds which piece of them.

The threshold is the k-th smallest |w| over every prunable weight (matrices and larger: biases
and normalisation weights stay), found without gathering a single weight: a bisection over
float32 bit patterns (non-negative floats order as their bits do), each round counting |w| <= t
on every rank's pieces and summing the counts over the ranks that hold the rest of each
parameter (the strategy's `parameter_norms` layout, as LARS and LAMB use it). 31 rounds of one
small all-reduce give the exact k-th value, so the mask is the one a single process computes.

The mask keeps sparsity through training: a step pre-hook zeroes the pruned gradients, and a
post-hook, before the strategy gathers or sends anything, zeroes the pruned weights and their
optimizer state (momentum, Adam's moments). A gradual schedule (Zhu & Gupta, 2017) raises the
sparsity cubically from `start` to `end`, pruning every `every` steps: s_f (1 - (1 - p)^3).

N:M structured sparsity (`NMPruner`, 2:4 for NVIDIA's sparse tensor cores: Mishra et al.,
2021) keeps the n largest |w| of every m consecutive weights along each weight's last (input)
dimension, ties to the earlier. A group may straddle two ZeRO shards: each rank writes the
magnitudes of its pieces into one flat tensor of the prunable parameters, summed over the
shard group (the strategy's `join`), so every rank sees its parameters whole and draws the one
mask a single process draws. A tensor-parallel slice holds whole groups where its last
dimension is a multiple of m (each slice is then m-aligned).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.arguments import finite_number, whole_number
from shardwise.checkpoint.reshardable import check_paired
from shardwise.optim.layerwise import ParameterNorms, Piece
from shardwise.strategies.base import DistributedModel, DistributedOptimizer
from shardwise.strategies.mesh_parallel import MeshModel
from shardwise.strategies.pipeline import PipelineModel

_INF_BITS = 0x7F800000  # +inf's bit pattern: above every finite magnitude


class Pruner:
    """Masks on `model`'s prunable weights (what `sw.prepare` returned, or a plain module),
    drawn by `prune` on the steps the schedule says; hooks `optimizer` so that pruned weights
    stay zero. Call `step()` after each optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sparsity: float,
        start: int = 0,
        end: int = 0,
        every: int = 1,
    ) -> None:
        finite_number("pruning sparsity", sparsity)
        if not 0 <= sparsity < 1:
            raise ValueError(f"pruning sparsity must be in [0, 1), got {sparsity}")
        for name, value, least in (("start", start, 0), ("end", end, 0), ("every", every, 1)):
            whole_number(f"pruning {name}", value, least)  # (steps: 1.5 never comes)
        if start < 0 or end < start or every < 1:
            raise ValueError(
                f"pruning schedule: need 0 <= start <= end and every >= 1, got start={start}, "
                f"end={end}, every={every}"
            )
        self.sparsity, self.start, self.end, self.every = sparsity, start, end, every
        inner = optimizer.inner if isinstance(optimizer, DistributedOptimizer) else optimizer
        self.optimizer = inner
        stepped = [p for group in inner.param_groups for p in group["params"]]
        if isinstance(model, DistributedModel):
            check_paired(model, optimizer)
            stages = model.pipeline if isinstance(model, MeshModel) else model
            if isinstance(stages, PipelineModel):
                raise ValueError(
                    "global magnitude pruning ranks every weight of the model, and a pipeline "
                    "stage holds only its own: not with pipeline parallelism yet"
                )
            self.layout = model.parameter_norms()
        else:
            if not {id(p) for p in stepped} <= {id(p) for p in model.parameters()}:
                raise ValueError("pruning: the optimizer steps tensors that are not the model's")
            self.layout = ParameterNorms.whole(stepped)
        self.stepped = stepped
        self.masks: dict[int, torch.Tensor] = {}  # by stepped tensor's id: True where kept
        self.steps = 0
        inner.register_step_pre_hook(lambda *_: self._mask_gradients())
        inner.register_step_post_hook(lambda *_: self._mask_weights())

    @torch.no_grad()
    def resume(self, steps: int) -> None:
        """Go on after `steps` optimizer steps of a run restored from a checkpoint: the masks
        are the pruned weights, which are exactly 0 (a kept weight of exactly 0.0 would stay
        0: a measure-zero event)."""
        self.steps = steps
        # (a run resumed before its first step has pruned nothing yet: its first step prunes,
        # as a fresh run's does; a mask made here would keep every weight for good)
        if steps == 0 or steps < self.start or self.target(steps) == 0:
            return
        # (zeroing what the masks prune again changes nothing: it is 0 in the checkpoint)
        self._keep(lambda index, magnitudes, piece: magnitudes != 0)

    def target(self, step: int) -> float:
        """The sparsity the schedule asks for after `step` optimizer steps."""
        if step >= self.end:
            return self.sparsity
        if step < self.start:
            return 0.0
        progress = (step - self.start) / (self.end - self.start)
        return self.sparsity * (1 - (1 - progress) ** 3)

    def step(self) -> None:
        """After an optimizer step: prune again where the schedule says."""
        self.steps += 1
        due = self.steps >= self.start and (self.steps - self.start) % self.every == 0
        if (due and self.steps <= max(self.end, self.start)) or not self.masks:
            self.prune(self.target(self.steps))

    def prune(self, sparsity: float) -> None:
        """Mask `sparsity` of the prunable weights (what a subclass ranks them by)."""
        raise NotImplementedError

    def _keep(self, kept: Callable[[int, torch.Tensor, Piece], torch.Tensor]) -> None:
        """New masks, a prunable piece's from `kept(index, |piece|, piece)`; zero them now."""
        prunable = [n >= 2 for n in self.layout.ndims]
        for p in self.stepped:
            keep = torch.ones(p.numel(), dtype=torch.bool, device=p.device)
            flat = p.detach().reshape(-1)
            for piece in self.layout.pieces[id(p)]:
                if prunable[piece.index]:
                    part = flat[piece.start : piece.stop].abs()
                    keep[piece.start : piece.stop] = kept(piece.index, part, piece)
            self.masks[id(p)] = keep.view_as(p)
        self._mask_weights()

    @torch.no_grad()
    def _mask_gradients(self) -> None:
        for p in self.stepped:
            if id(p) in self.masks and p.grad is not None:
                p.grad.mul_(self.masks[id(p)].to(p.grad.dtype))

    @torch.no_grad()
    def _mask_weights(self) -> None:
        for p in self.stepped:
            mask = self.masks.get(id(p))
            if mask is None:
                continue
            p.mul_(mask.to(p.dtype))
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    value.mul_(mask.to(value.dtype))  # momentum, Adam's moments


class GlobalMagnitudePruner(Pruner):
    """Prunes to `sparsity` of the prunable weights, the smallest |w| over the whole model,
    gradually from step `start` to `end`, every `every` steps."""

    @torch.no_grad()
    def prune(self, sparsity: float) -> None:
        """Mask the `sparsity` share of the prunable weights with the smallest magnitudes
        (with those already pruned, which are 0), and zero them now."""
        prunable = [n >= 2 for n in self.layout.ndims]
        total = int(self._count(lambda x: torch.ones_like(x, dtype=torch.bool), prunable))
        k = int(sparsity * total)
        threshold = self._kth_magnitude(k, prunable) if k else -1.0
        self._keep(lambda index, magnitudes, piece: magnitudes > threshold)

    def _count(self, hit, prunable: list[bool]) -> float:
        """Σ over the prunable weights' elements of `hit(|x|)`, over all ranks (fp64: exact)."""
        counts = torch.zeros(1, len(prunable), dtype=torch.float64, device=self.layout.device)
        for p in self.stepped:
            flat = p.detach().reshape(-1)
            for piece in self.layout.pieces[id(p)]:
                if prunable[piece.index]:
                    part = flat[piece.start : piece.stop].abs()
                    counts[0, piece.index] += hit(part).sum().to(counts.device, torch.float64)
        if self.layout.reduce is not None:
            self.layout.reduce(counts)
        return counts.sum().item()

    def _kth_magnitude(self, k: int, prunable: list[bool]) -> float:
        """The k-th smallest |w| over the prunable weights: the smallest t with k of them at
        or below it, bisected over float32 bit patterns."""
        low, high = 0, _INF_BITS  # count(<= low's value) may be < k; count(<= high) >= k
        while low < high:
            middle = (low + high) // 2
            t = torch.tensor(middle, dtype=torch.int32).view(torch.float32).item()
            if self._count(lambda x, t=t: x <= t, prunable) >= k:
                high = middle
            else:
                low = middle + 1
        return torch.tensor(low, dtype=torch.int32).view(torch.float32).item()


class NMPruner(Pruner):
    """Keeps `n` of every `m` consecutive weights (the largest |w|) along each prunable
    weight's last dimension, from step `start` on (sparsity 1 - n/m at once)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, n: int = 2, m: int = 4, start=0
    ) -> None:
        whole_number("N:M sparsity's N", n)
        whole_number("N:M sparsity's M", m)
        if not 0 < n < m:
            raise ValueError(f"N:M sparsity needs 0 < N < M, got {n}:{m}")
        super().__init__(model, optimizer, 1 - n / m, start=start, end=start)
        self.n, self.m = n, m
        for p, dims in zip(self.layout.params, self.layout.ndims, strict=True):
            if dims >= 2 and p.shape[-1] % m:
                raise ValueError(
                    f"N:M sparsity groups {m} weights along the last dimension, and a weight "
                    f"of shape {tuple(p.shape)} (on this rank) has {p.shape[-1]}"
                )

    @torch.no_grad()
    def prune(self, sparsity: float) -> None:
        """Mask all but the n largest |w| of each group of m (nothing where `sparsity` is 0:
        before `start`)."""
        if sparsity == 0:
            self._keep(lambda index, magnitudes, piece: torch.ones_like(magnitudes, dtype=bool))
            return
        prunable = [d >= 2 for d in self.layout.ndims]
        sizes = [
            p.numel() if keep else 0 for p, keep in zip(self.layout.params, prunable, strict=True)
        ]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        device = self.layout.device or (self.stepped[0].device if self.stepped else None)
        whole = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        for p in self.stepped:  # this rank's pieces, at their places in their parameters
            flat = p.detach().reshape(-1)
            for piece in self.layout.pieces[id(p)]:
                if prunable[piece.index]:
                    at = starts[piece.index] + piece.offset
                    whole[at : at + piece.stop - piece.start] = flat[piece.start : piece.stop].abs()
        if self.layout.join is not None:  # (others' pieces added to zeros: exact)
            self.layout.join(whole)
        ranked = whole.view(-1, self.m).sort(dim=1, descending=True, stable=True).indices
        kept = torch.zeros_like(whole, dtype=torch.bool).view(-1, self.m)
        kept.scatter_(1, ranked[:, : self.n], True)
        kept = kept.view(-1)

        def piece_kept(index: int, magnitudes: torch.Tensor, piece: Piece) -> torch.Tensor:
            at = starts[index] + piece.offset
            return kept[at : at + magnitudes.numel()].to(magnitudes.device)

        self._keep(piece_kept)
