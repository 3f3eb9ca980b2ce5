"""Gradient compression codecs: send fewer bytes per gradient bucket.

Each codec turns a flat (already world-size-divided) gradient buffer into the sum over ranks,
approximately, while sending less. Two shapes of exchange exist:

- cast codecs (`fp16`, `bf16`) all-reduce a lower-precision copy: sums stay meaningful;
- quantising and sparsifying codecs (`int8`, `topk`, `randomk`, `sign`) cannot be summed on the
  wire (int8 overflows, sparse indices differ by rank), so each rank's encoding is all-gathered
  and every rank decodes and sums all of them.

Biased codecs (top-k, random-k, sign) keep **error feedback** (Seide et al. 2014; Karimireddy
et al. 2019): what a step did not send is added to the next step's gradient, so nothing is
lost, only delayed. State is kept per buffer, keyed by the buffer's index (the order in which
the strategy describes its buffers), and `state_dict` saves all of it, random generators
included, so a resumed run continues bit-identically.
The bytes counted by the accounting layer are those of the tensors really exchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.comm.algorithms import ThreadedAllReduce
from shardwise.comm.collectives import (
    ProcessGroup,
    all_gather_into_tensor,
    all_reduce,
    group_size,
)
from shardwise.comm.flat import flatten, unflatten


class Codec(ABC):
    """Compress-exchange-decompress for one flat buffer, in place."""

    name = "codec"

    def __init__(self) -> None:
        self.residuals: dict[int, torch.Tensor] = {}
        self.generator: torch.Generator | None = None  # codecs that draw random numbers

    @abstractmethod
    def reduce(self, buffer: torch.Tensor, group: ProcessGroup | None, key: int) -> None:
        """Replace `buffer` (this rank's contribution) by the decoded sum over the group."""

    def describe(self, key: int, shapes: list[torch.Size]) -> None:  # noqa: B027 - optional
        """Buffer `key` holds tensors of `shapes` (PowerSGD compresses each matrix)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the next reduction depends on: residuals and the random generator."""
        state = {f"residual.{k}": v for k, v in self.residuals.items()}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {
            int(k.split(".")[1]): v.clone() for k, v in state.items() if k.startswith("residual.")
        }
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])

    def with_feedback(self, buffer: torch.Tensor, key: int) -> torch.Tensor:
        """The buffer plus what earlier steps left unsent (error feedback)."""
        residual = self.residuals.get(key)
        # (a residual restored from a checkpoint arrives on the CPU)
        return buffer if residual is None else buffer + residual.to(buffer.device)

    def keep_residual(self, key: int, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Remember exactly what was not sent: `corrected - sent`."""
        self.residuals[key] = corrected - sent


class CastCodec(Codec):
    """All-reduce in fp16 or bf16: half the bytes, rounding error only."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def reduce(self, buffer, group, key) -> None:
        low = buffer.to(self.dtype)
        all_reduce(low, group=group)
        buffer.copy_(low)


def _gather(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All ranks' equal-sized tensors stacked along a new first dimension."""
    n = group_size(group)
    out = torch.empty((n, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    all_gather_into_tensor(out.view(-1), tensor.contiguous().view(-1), group=group)
    return out


class Int8Codec(Codec):
    """QSGD-style stochastic quantisation to int8 with one fp32 scale per buffer: unbiased,
    E[decode(encode(x))] = x, and about a quarter of fp32's bytes (Alistarh et al. 2017)."""

    name = "int8"
    levels = 127

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = x.abs().max().clamp_min(torch.finfo(x.dtype).tiny).reshape(1)
        scaled = x / scale * self.levels
        noise = torch.rand(x.shape, generator=self.generator, dtype=x.dtype).to(x.device)
        # floor(v + u), u ~ U[0, 1): rounds up with probability frac(v), so the mean is v.
        return torch.floor(scaled + noise).to(torch.int8), scale.to(torch.float32)

    def decode(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return q.to(torch.float32) * (scale / self.levels)

    def reduce(self, buffer, group, key) -> None:
        q, scale = self.encode(buffer)
        qs, scales = _gather(q, group), _gather(scale, group)
        total = sum(self.decode(qs[r], scales[r]) for r in range(qs.shape[0]))
        buffer.copy_(total)


class SparseCodec(Codec):
    """Send `ratio` of the coordinates (values and int32 indices), with error feedback."""

    def __init__(self, ratio: float, seed: int = 0) -> None:
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"sparsification ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.generator = torch.Generator().manual_seed(seed)

    @abstractmethod
    def select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k coordinates to send."""

    def reduce(self, buffer, group, key) -> None:
        corrected = self.with_feedback(buffer, key)
        k = max(1, int(corrected.numel() * self.ratio))
        indices = self.select(corrected, k)
        values = corrected[indices]
        sent = torch.zeros_like(corrected)
        sent[indices] = values
        self.keep_residual(key, corrected, sent)
        all_values = _gather(values, group)
        all_indices = _gather(indices.to(torch.int32), group).long()
        buffer.zero_()
        buffer.index_add_(0, all_indices.view(-1), all_values.view(-1))


class TopK(SparseCodec):
    """The k largest-magnitude coordinates (Aji & Heafield 2017; Lin et al., DGC, 2018)."""

    name = "topk"

    def select(self, x, k):
        return x.abs().topk(k, sorted=False).indices


class RandomK(SparseCodec):
    """k coordinates chosen uniformly at random (Stich et al. 2018)."""

    name = "randomk"

    def select(self, x, k):
        return torch.randperm(x.numel(), generator=self.generator)[:k].to(x.device)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per coordinate (1 for x >= 0), 32 to an int32 word: 1/32 of fp32's bytes."""
    bits = (x >= 0).to(torch.int64)
    padded = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 32)).view(-1, 32)
    weights = 2 ** torch.arange(32, dtype=torch.int64, device=x.device)
    return (padded * weights).sum(dim=1).to(torch.int32)  # wraps into int32's range exactly


def unpack_signs(words: torch.Tensor, numel: int) -> torch.Tensor:
    """+1/-1 per coordinate from `pack_signs`' words."""
    shifts = torch.arange(32, dtype=torch.int64, device=words.device)
    bits = (words.to(torch.int64).unsqueeze(1) >> shifts) & 1
    return (bits.view(-1)[:numel] * 2 - 1).to(torch.float32)


class SignCodec(Codec):
    """1-bit compression: signs times one scale (mean |x|), with error feedback (Bernstein et
    al., signSGD, 2018; Seide et al., 1-bit SGD, 2014)."""

    name = "sign"

    def reduce(self, buffer, group, key) -> None:
        corrected = self.with_feedback(buffer, key)
        scale = corrected.abs().mean().reshape(1)
        words = pack_signs(corrected)
        sent = unpack_signs(words, corrected.numel()).to(corrected.dtype) * scale
        self.keep_residual(key, corrected, sent)
        all_words, scales = _gather(words, group), _gather(scale, group)
        total = sum(
            unpack_signs(all_words[r], buffer.numel()).to(buffer.dtype) * scales[r]
            for r in range(all_words.shape[0])
        )
        buffer.copy_(total)


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
    gradient minus its share (1/n) of the aggregated approximation.
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
        self.calls: dict[int, int] = {}
        self.generator = torch.Generator().manual_seed(seed)
        self.shapes: dict[int, list[torch.Size]] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}

    def describe(self, key: int, shapes: list[torch.Size]) -> None:
        """The shapes of the tensors that make up buffer `key`, in order."""
        self.shapes[key] = [torch.Size(s) for s in shapes]

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state.update({f"calls.{k}": torch.tensor(n) for k, n in self.calls.items()})
        for k, qs in self.qs.items():
            state.update({f"q.{k}.{i}": q for i, q in enumerate(qs)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.calls = {
            int(k.split(".")[1]): int(v) for k, v in state.items() if k.startswith("calls.")
        }
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

    def reduce(self, buffer, group, key) -> None:
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.calls[key] <= self.start_iter:
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


def make_codec(spec: str) -> Codec:
    """`fp16`, `bf16`, `int8`, `topk:0.01`, `randomk:0.01`, `sign`, `powersgd:4[:START]`."""
    name, _, arg = spec.partition(":")
    if name == "fp16":
        return CastCodec(torch.float16)
    if name == "bf16":
        return CastCodec(torch.bfloat16)
    if name == "int8":
        return Int8Codec()
    if name in ("topk", "randomk"):
        ratio = float(arg) if arg else 0.01
        return TopK(ratio) if name == "topk" else RandomK(ratio)
    if name == "sign":
        return SignCodec()
    if name == "powersgd":  # powersgd:RANK or powersgd:RANK:START_ITER
        rank, _, start = arg.partition(":")
        return PowerSGD(int(rank) if rank else 4, start_iter=int(start) if start else 0)
    raise ValueError(
        "compression must be fp16, bf16, int8, topk:RATIO, randomk:RATIO, sign or "
        f"powersgd:RANK, got {spec!r}"
    )


class CompressedAllReduce(ThreadedAllReduce):
    """A DDP all-reduce algorithm that runs a codec on the communication thread."""

    def __init__(self, codec: Codec, timeout: timedelta | None) -> None:
        super().__init__()
        self.codec = codec
        self.op = f"compressed_{codec.name}"
        self.group = dist.new_group(timeout=timeout)  # collective: all ranks create it together
        self.index: dict[int, int] = {}  # a buffer's address -> its index (the codec's key)

    def describe(self, buffer: torch.Tensor, shapes: list[torch.Size]) -> None:
        # A bucket's buffer lives as long as the model: its address finds its index.
        key = self.index.setdefault(buffer.data_ptr(), len(self.index))
        self.codec.describe(key, shapes)

    def _run(self, buffer: torch.Tensor) -> None:
        key = self.index.setdefault(buffer.data_ptr(), len(self.index))
        self.codec.reduce(buffer, self.group, key=key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.codec.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.codec.load_state_dict(state)
