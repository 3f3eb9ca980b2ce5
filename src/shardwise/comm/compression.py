"""Gradient compression codecs: send fewer bytes per gradient bucket, unit or message.

One codec serves every collective that moves gradients: DDP's all-reduce of a bucket
(`reduce`), ZeRO's reduce-scatter of a flat unit (`reduce_scatter`) and, for codecs whose
message is one rank's encoding of a flat tensor (`WireCodec`: `encode`/`decode`, a fixed
layout per length), the parameter server's pushes and pulls (`ps/compressed.py`).
The exchange follows from what can be summed on the wire:

- cast codecs (`fp16`, `bf16`) all-reduce or reduce-scatter a lower-precision copy;
- quantising and sparsifying codecs (`int8`, `topk`, `randomk`, `sign`) cannot be summed on the
  wire (int8 overflows, sparse indices differ by rank): for an all-reduce each rank's encoding
  is all-gathered and every rank decodes and sums all of them; for a reduce-scatter each rank
  encodes each destination's chunk, an all-to-all hands every rank the encodings of its own
  chunk, and it decodes and sums only those;
- PowerSGD all-reduces low-rank factors (sums of factors are meaningful); a reduce-scatter
  all-reduces the factors of the whole unit and keeps the owned slice.

Biased codecs (top-k, random-k, sign, PowerSGD) keep **error feedback** (Seide et al. 2014;
Karimireddy et al. 2019): what a step did not send is added to the next step's gradient, so
nothing is lost, only delayed. State is kept per buffer, keyed by the buffer's index (DDP's
bucket, ZeRO's unit, the PS's server), and `state_dict` saves all of it, random generators
included, so a resumed run continues bit-identically.
The bytes counted by the accounting layer are those of the tensors really exchanged.
PowerSGD lives in `powersgd.py`; codecs by name and the asynchronous collectives that run them
(DDP's, ZeRO's) in `compressed_collectives.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from shardwise.comm.collectives import (
    ProcessGroup,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    group_size,
    reduce_scatter_tensor,
)

Layout = list[tuple[torch.dtype, int]]  # an encoding's tensors: dtype and length of each


class Codec(ABC):
    """Compress-exchange-decompress of one flat buffer: the sum over the group, or this rank's
    slice of it, approximately, in fewer bytes."""

    name = "codec"
    spec = "codec"  # the string `make_codec` was given

    def __init__(self) -> None:
        self.residuals: dict[int, torch.Tensor] = {}
        self.generator: torch.Generator | None = None  # codecs that draw random numbers
        self.calls: dict[int, int] = {}  # reductions of each buffer so far (`count_call`)
        # The state `roll_back` returns to: whoever runs the codec commits it once made, and
        # after each backward whose reductions it keeps.
        self._committed: dict[str, torch.Tensor] | None = None

    @abstractmethod
    def reduce(self, buffer: torch.Tensor, group: ProcessGroup | None, key: int) -> None:
        """Replace `buffer` (this rank's contribution) by the decoded sum over the group."""

    @abstractmethod
    def reduce_scatter(
        self, full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, key: int
    ) -> None:
        """Write into `shard` this rank's slice (group-rank order) of the decoded sum of every
        rank's `full` (whose length the group size divides). `full` is left as it was."""

    def describe(self, key: int, shapes: list[torch.Size]) -> None:  # noqa: B027 - optional
        """Buffer `key` holds tensors of `shapes` (PowerSGD compresses each matrix)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the next reduction depends on: residuals and the random generator; and
        the codec's spec, which `load_state_dict` checks (another codec's state, a PowerSGD of
        another rank's factors, is not this one's)."""
        state = {"spec": torch.tensor(list(self.spec.encode()), dtype=torch.uint8)}
        state.update({f"residual.{k}": v for k, v in self.residuals.items()})
        state.update({f"calls.{k}": torch.tensor(n) for k, n in self.calls.items()})
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "spec" in state:  # (checkpoints before it was recorded: taken as they are)
            saved = bytes(state["spec"].tolist()).decode("utf-8", errors="replace")
            if saved != self.spec:
                raise ValueError(
                    f"the checkpoint's codec state was made by compression {saved!r}, and this "
                    f"job's is {self.spec!r}: resume with the compression it was saved with"
                )
        self.residuals = {
            int(k.split(".")[1]): v.clone() for k, v in state.items() if k.startswith("residual.")
        }
        self.calls = {
            int(k.split(".")[1]): int(v) for k, v in state.items() if k.startswith("calls.")
        }
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])

    def commit(self) -> None:
        """The reductions so far are kept (their backward ended): `roll_back` returns here.
        References, no copies: a reduction replaces a buffer's state, never changes it."""
        self._committed = self.state_dict()

    def roll_back(self) -> None:
        """Back to the state of the last `commit`: the reductions a backward that raised sent
        are discarded with its gradients, and what they left unsent must not be sent later
        (error feedback), nor their draws or counts shape the next ones."""
        if self._committed is None:
            raise RuntimeError(f"{self.name} codec rolled back with no commit before")
        self.load_state_dict(self._committed)

    def count_call(self, key: int) -> int:
        """Count a reduction of buffer `key`; the reductions of it before this one."""
        done = self.calls.get(key, 0)
        self.calls[key] = done + 1
        return done

    def with_feedback(self, buffer: torch.Tensor, key: int) -> torch.Tensor:
        """The buffer plus what earlier steps left unsent (error feedback)."""
        residual = self.residuals.get(key)
        if residual is not None and residual.shape != buffer.shape:  # (restored: other buckets)
            raise ValueError(
                f"the checkpoint's error-feedback residual of bucket {key} holds "
                f"{residual.numel()} values, the bucket {buffer.numel()}: resume with the "
                "bucket_mb the run was saved with (DDP's default changed: 25 before)"
            )
        # (a residual restored from a checkpoint arrives on the CPU)
        return buffer if residual is None else buffer + residual.to(buffer.device)

    def keep_residual(self, key: int, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Remember exactly what was not sent: `corrected - sent`."""
        self.residuals[key] = corrected - sent


class WireCodec(Codec):
    """A codec whose message is one rank's encoding of a flat tensor: a few tensors of a fixed
    layout for a given length (`layout`), sent as one uint8 message (`to_bytes`) and checked
    when read from outside (`problem`). Error feedback, where `feedback` is set, keeps what
    `decode(encode(x))` lost of `x`."""

    feedback = False

    @abstractmethod
    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The tensors that stand for the flat tensor `x`, laid out as `layout(x.numel())`."""

    @abstractmethod
    def decode(self, parts: list[torch.Tensor], numel: int) -> torch.Tensor:
        """The flat float32 tensor of `numel` values that `parts` stand for."""

    @abstractmethod
    def layout(self, numel: int) -> Layout:
        """(dtype, length) of each tensor that `encode` makes of `numel` values."""

    def problem(self, parts: list[torch.Tensor], numel: int) -> str | None:
        """What is wrong with an encoding read from outside (None: it decodes safely)."""
        floats = [p for p in parts if p.is_floating_point()]
        if any(not bool(p.isfinite().all()) for p in floats):
            return f"{self.name} encoding holds non-finite values"
        return None

    def encode_chunks(self, x: torch.Tensor, key: int, chunks: int = 1) -> list[list[torch.Tensor]]:
        """The encodings of `chunks` equal slices of `x` (plus, with error feedback, what
        earlier calls for `key` left unsent; what this one leaves is kept)."""
        corrected = self.with_feedback(x, key) if self.feedback else x
        encoded = [self.encode(c) for c in corrected.view(chunks, -1)]
        if self.feedback:
            m = corrected.numel() // chunks
            sent = torch.cat([self.decode(e, m).to(corrected) for e in encoded])
            self.keep_residual(key, corrected, sent)
        return encoded

    def reduce(self, buffer, group, key) -> None:
        (parts,) = self.encode_chunks(buffer, key)
        mine = to_bytes(parts)
        n = group_size(group)
        everyone = torch.empty(n, mine.numel(), dtype=torch.uint8, device=mine.device)
        all_gather_into_tensor(everyone.view(-1), mine, group=group)
        buffer.copy_(self._decode_sum(everyone, buffer.numel()))

    def reduce_scatter(self, full, shard, group, key) -> None:
        n = group_size(group)
        outgoing = torch.stack([to_bytes(e) for e in self.encode_chunks(full, key, n)])
        incoming = torch.empty_like(outgoing)  # row r: rank r's encoding of this rank's chunk
        all_to_all_single(incoming.view(-1), outgoing.view(-1), group=group)
        shard.copy_(self._decode_sum(incoming, shard.numel()))

    def _decode_sum(self, rows: torch.Tensor, numel: int) -> torch.Tensor:
        """The sum of the decoded encodings, one per row of uint8 `rows`."""
        layout = self.layout(numel)
        return sum(self.decode(from_bytes(row, layout), numel) for row in rows)


def to_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """An encoding's tensors end to end as one uint8 message (the bytes on the wire)."""
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def wire_nbytes(layout: Layout) -> int:
    return sum(n * torch.empty(0, dtype=d).element_size() for d, n in layout)


def from_bytes(message: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors of `layout` read back from a `to_bytes` message (of exactly that size)."""
    assert message.numel() == wire_nbytes(layout), "check the length before reading"
    parts, offset = [], 0
    for dtype, n in layout:
        size = n * torch.empty(0, dtype=dtype).element_size()
        # (a copy: a slice at an odd offset cannot be viewed as a wider dtype)
        parts.append(message[offset : offset + size].clone().view(dtype))
        offset += size
    return parts


class CastCodec(WireCodec):
    """All-reduce (or reduce-scatter) in fp16 or bf16: half the bytes, rounding error only."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def encode(self, x):
        return [x.to(self.dtype)]

    def decode(self, parts, numel):
        return parts[0].to(torch.float32)

    def layout(self, numel):
        return [(self.dtype, numel)]

    def reduce(self, buffer, group, key) -> None:
        low = buffer.to(self.dtype)
        all_reduce(low, group=group)
        buffer.copy_(low)

    def reduce_scatter(self, full, shard, group, key) -> None:
        low = torch.empty(shard.numel(), dtype=self.dtype, device=shard.device)
        reduce_scatter_tensor(low, full.to(self.dtype), group=group)
        shard.copy_(low)


class Int8Codec(WireCodec):
    """QSGD-style stochastic quantisation to int8 with one fp32 scale per buffer: unbiased,
    E[decode(encode(x))] = x, and about a quarter of fp32's bytes (Alistarh et al. 2017)."""

    name = "int8"
    levels = 127

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def encode(self, x):
        x = x.to(torch.float32)
        scale = x.abs().max().clamp_min(torch.finfo(x.dtype).tiny).reshape(1)
        scaled = x / scale * self.levels
        noise = torch.rand(x.shape, generator=self.generator, dtype=x.dtype).to(x.device)
        # floor(v + u), u ~ U[0, 1): rounds up with probability frac(v), so the mean is v.
        return [torch.floor(scaled + noise).to(torch.int8), scale]

    def decode(self, parts, numel):
        q, scale = parts
        return q.to(torch.float32) * (scale / self.levels)

    def layout(self, numel):
        return [(torch.int8, numel), (torch.float32, 1)]


WARMUP_DENSITY = 0.25  # a sparse codec's density at the start of its warm-up


class SparseCodec(WireCodec):
    """Send `ratio` of the coordinates (values and int32 indices), with error feedback.

    With `warmup` W > 0 the density starts at 1/4 and falls exponentially to `ratio` over the
    first W reductions of each buffer (DGC's sparsity warm-up, Lin et al. 2018, from 75 %
    sparsity): early gradients change fastest and are the worst to delay, and at 1/4 the
    values and indices are still half of fp32's bytes. Every rank of a collective counts the
    same reductions, so they agree on the layout; a parameter server's two ends do not, which
    is why it refuses a warm-up."""

    feedback = True

    def __init__(self, ratio: float, seed: int = 0, warmup: int = 0) -> None:
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"sparsification ratio must be in (0, 1], got {ratio}")
        if warmup < 0:
            raise ValueError(f"sparsification warm-up must be >= 0 reductions, got {warmup}")
        self.ratio, self.warmup = ratio, warmup
        self.density = ratio  # of the reduction under way
        self.generator = torch.Generator().manual_seed(seed)

    @abstractmethod
    def select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k coordinates to send."""

    def k(self, numel: int) -> int:
        return max(1, int(numel * self.density)) if numel else 0

    def encode_chunks(self, x, key, chunks=1):
        call = self.count_call(key)
        self.density = self.ratio
        if call < self.warmup and self.ratio < WARMUP_DENSITY:
            self.density = WARMUP_DENSITY * (self.ratio / WARMUP_DENSITY) ** (call / self.warmup)
        return super().encode_chunks(x, key, chunks)

    def encode(self, x):
        indices = self.select(x, self.k(x.numel()))
        return [x[indices].to(torch.float32), indices.to(torch.int32)]

    def decode(self, parts, numel):
        values, indices = parts
        out = torch.zeros(numel, dtype=torch.float32, device=values.device)
        return out.index_add_(0, indices.long(), values)

    def layout(self, numel):
        return [(torch.float32, self.k(numel)), (torch.int32, self.k(numel))]

    def problem(self, parts, numel):
        indices = parts[1]
        if indices.numel() and not (int(indices.min()) >= 0 and int(indices.max()) < numel):
            return f"{self.name} indices out of [0, {numel})"
        return super().problem(parts, numel)


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


class SignCodec(WireCodec):
    """1-bit compression: signs times one scale (mean |x|), with error feedback (Bernstein et
    al., signSGD, 2018; Seide et al., 1-bit SGD, 2014)."""

    name = "sign"
    feedback = True

    def encode(self, x):
        return [pack_signs(x), x.abs().mean().reshape(1).to(torch.float32)]

    def decode(self, parts, numel):
        words, scale = parts
        return unpack_signs(words, numel) * scale

    def layout(self, numel):
        return [(torch.int32, -(-numel // 32)), (torch.float32, 1)]
