"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r gradient compression by one power-iteration
step per matrix, warm-started from the previous step's Q, with error feedback.

Sums of the low-rank factors are meaningful, so they travel by all-reduce (two rounds: the Ps
with the tensors left uncompressed, then the Qs); no one-message encoding exists, which is why
it is a `Codec` and not a `WireCodec` (`compression.py`). For a reduce-scatter (ZeRO) the whole
unit's factors are all-reduced and the owned slice kept.
"""

from __future__ import annotations

import torch

from shardwise.comm.collectives import all_reduce, group_rank, group_size
from shardwise.comm.compression import Codec
from shardwise.comm.flat import flatten, unflatten


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`'s (reduced QR; column signs do not matter here,
    since P's and Q's signs cancel in P Q^T)."""
    return torch.linalg.qr(matrix).Q


class PowerSGD(Codec):
    """Rank-r PowerSGD (Vogels et al., NeurIPS 2019): one power-iteration step per matrix.

    For each gradient matrix M (n x m, with error feedback added): P = M Q, all-reduced and
    orthogonalised; Q = M^T P, all-reduced; the result is P Q^T. Q is kept for the next step
    (warm start). Tensors that would not shrink at least `min_compression_rate` times (biases,
    small matrices) are all-reduced uncompressed. Each rank keeps as its error its corrected
    gradient minus its share (1/n) of the aggregated approximation. Its two rounds of
    all-reduce have no one-message encoding, so it is no `WireCodec` (the PS cannot use it).
    """

    name = "powersgd"

    def __init__(
        self, rank: int = 4, min_compression_rate: float = 2.0, seed: int = 0, start_iter: int = 0
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.min_compression_rate = rank, min_compression_rate
        # Plain all-reduce for the first `start_iter` reductions of each buffer: the start of
        # training is the most sensitive to approximate gradients (torch's start_powerSGD_iter).
        self.start_iter = start_iter
        self.generator = torch.Generator().manual_seed(seed)
        self.shapes: dict[int, list[torch.Size]] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}

    def describe(self, key: int, shapes: list[torch.Size]) -> None:
        """The shapes of the tensors that make up buffer `key`, in order."""
        self.shapes[key] = [torch.Size(s) for s in shapes]

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        for k, qs in self.qs.items():
            state.update({f"q.{k}.{i}": q for i, q in enumerate(qs)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        qs: dict[int, dict[int, torch.Tensor]] = {}
        for name, q in state.items():
            if name.startswith("q."):
                _, key, i = name.split(".")
                qs.setdefault(int(key), {})[int(i)] = q.clone()
        self.qs = {k: [by_index[i] for i in sorted(by_index)] for k, by_index in qs.items()}

    def _matrix_rank(self, shape: torch.Size) -> int | None:
        """The rank to compress a tensor of `shape` with, or None to send it as it is."""
        if len(shape) < 2:
            return None
        n, m = shape[0], shape[1:].numel()
        r = min(n, m, self.rank)
        return r if (n + m) * r * self.min_compression_rate < n * m else None

    def reduce_scatter(self, full, shard, group, key) -> None:
        # The sum of low-rank approximations is not the approximation of each slice: reduce
        # the whole unit's factors (what they cost is what is sent), keep this rank's slice.
        total = full.clone()
        self.reduce(total, group, key)
        shard.copy_(total.view(group_size(group), -1)[group_rank(group)])

    def reduce(self, buffer, group, key) -> None:
        if self.count_call(key) < self.start_iter:
            all_reduce(buffer, group=group)
            return
        shapes = self.shapes.get(key, [buffer.shape])
        corrected = self.with_feedback(buffer, key)
        views = list(corrected.split([s.numel() for s in shapes]))
        ranks = [self._matrix_rank(s) for s in shapes]
        matrices = [v.view(s[0], -1) for v, s, r in zip(views, shapes, ranks, strict=True) if r]
        plain = [v for v, r in zip(views, ranks, strict=True) if r is None]
        if key not in self.qs:  # the same seed on every rank: the same random start
            self.qs[key] = [
                torch.randn(m.shape[1], r, generator=self.generator).to(m)
                for m, r in zip(matrices, filter(None, ranks), strict=True)
            ]
        qs = [orthogonalize(q.to(m)) for q, m in zip(self.qs[key], matrices, strict=True)]
        flat_plain = torch.cat(plain) if plain else corrected.new_empty(0)
        ps = [m @ q for m, q in zip(matrices, qs, strict=True)]
        # Two rounds of messages: the uncompressed tensors with the Ps, then the Qs.
        self._all_reduce_together([flat_plain, *ps], group)
        ps = [orthogonalize(p) for p in ps]
        qs = [m.t() @ p for m, p in zip(matrices, ps, strict=True)]
        self._all_reduce_together(qs, group)
        self.qs[key] = qs
        approx = [p @ q.t() for p, q in zip(ps, qs, strict=True)]
        out, offset_plain, matrix_iter = [], 0, iter(approx)
        for v, r in zip(views, ranks, strict=True):
            if r is None:
                out.append(flat_plain[offset_plain : offset_plain + v.numel()])
                offset_plain += v.numel()
            else:
                out.append(next(matrix_iter).reshape(-1))
        total = torch.cat(out)
        n = group_size(group)
        self.residuals[key] = corrected - total / n  # this rank's share of what was lost
        buffer.copy_(total)

    @staticmethod
    def _all_reduce_together(tensors: list[torch.Tensor], group) -> None:
        """One message for many tensors: flatten, all-reduce, copy back."""
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return
        flat = flatten(tensors)
        all_reduce(flat, group=group)
        for t, piece in zip(tensors, unflatten(flat, tensors), strict=True):
            t.copy_(piece)
