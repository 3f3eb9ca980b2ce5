"""Parameter-server messages through a gradient codec (`comm/compression.py`, `compression:`).

Pushes carry gradients: the worker encodes each server's slice with the codec, keeping the
codec's error feedback (one residual per server) on the worker, and the server decodes.

Pulls carry parameters, which a codec must not round or drop outright (top-k of the weights
would zero 99% of them). A pull therefore sends the *difference* between the server's
parameters and the worker's copy of them, which the server mirrors exactly, since it knows
what it sent: the mirror moves by the decoded difference, so whatever a pull did not send stays
in the next difference. That is error feedback kept by the sender, needing no residual of its
own (and the codec's residual must not be added on top: it would send the same error twice).
A client's first pull is plain fp32 and sets the mirror. Cost: one shard-sized mirror per
client on each server.

On the wire a compressed payload is one uint8 message laid out as the codec's `layout` for
the slice's length; the header carries the codec's fingerprint (`codec_fingerprint`, also in
the HELLO, so a worker with another codec is refused before it pushes anything). The receiver
checks fingerprint, dtype and exact length, then the encoding itself (indices in range, finite
scales and values) before decoding: a malformed message is refused in one line.
"""

from __future__ import annotations

import torch

from shardwise.comm.compressed_collectives import codec_fingerprint, make_codec
from shardwise.comm.compression import WireCodec, from_bytes, to_bytes, wire_nbytes

PS_CODECS = "fp16, bf16, int8, topk:RATIO, randomk:RATIO or sign"


def ps_codec(spec: str | None) -> WireCodec | None:
    """The codec for `compression: spec` (None: none); a ValueError for one the PS cannot use."""
    if spec is None:
        return None
    codec = make_codec(spec)
    if not isinstance(codec, WireCodec):
        raise ValueError(
            f"ps compression must be {PS_CODECS}, got {spec!r} (PowerSGD needs whole "
            "matrices and two rounds of all-reduce; a server's shard is a flat range)"
        )
    if getattr(codec, "warmup", 0):
        raise ValueError(
            f"ps compression {spec!r}: a sparsity warm-up needs both ends to count the same "
            "reductions, which asynchronous workers and servers do not; drop the :WARMUP"
        )
    return codec


def wire_size(codec: WireCodec, numel: int) -> int:
    """Bytes of a compressed payload for `numel` values."""
    return wire_nbytes(codec.layout(numel))


def read(
    codec: WireCodec, fingerprint: int, payload: torch.Tensor, numel: int
) -> tuple[torch.Tensor | None, str | None]:
    """(the decoded float32 values, None), or (None, what is wrong with the message)."""
    if fingerprint != codec_fingerprint(codec.spec):
        return None, f"is not compressed with this server's codec ({codec.spec})"
    if payload.dtype != torch.uint8:
        return None, f"has a {payload.dtype} payload, expected the uint8 bytes of {codec.spec}"
    if payload.numel() != (size := wire_size(codec, numel)):
        return None, f"has {payload.numel()} bytes, expected {size} ({codec.spec} of {numel})"
    parts = from_bytes(payload, codec.layout(numel))
    if problem := codec.problem(parts, numel):
        return None, problem
    return codec.decode(parts, numel), None


class PushEncoder:
    """A worker's pushes: each server's slice of the gradient encoded, with error feedback."""

    def __init__(self, codec: WireCodec) -> None:
        self.codec, self.fingerprint = codec, codec_fingerprint(codec.spec)

    def encode(self, piece: torch.Tensor, server_index: int) -> torch.Tensor:
        (parts,) = self.codec.encode_chunks(piece.to(torch.float32), key=server_index)
        return to_bytes(parts)


class PullMirrors:
    """A server's copy of what each client holds of its shard; pulls send the difference."""

    def __init__(self, codec: WireCodec) -> None:
        self.codec, self.fingerprint = codec, codec_fingerprint(codec.spec)
        self.mirrors: dict[int, torch.Tensor] = {}

    def answer(self, client: int, values: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(fingerprint, payload) of a pull of `values` by `client`: 0 and the values
        themselves the first time, then the codec's encoding of what the client lacks."""
        mirror = self.mirrors.get(client)
        if mirror is None or not values.numel():  # (an empty shard has nothing to encode)
            self.mirrors[client] = values.clone()
            return 0, values
        parts = self.codec.encode(values - mirror)  # (no codec residual: the mirror is it)
        mirror += self.codec.decode(parts, mirror.numel())
        return self.fingerprint, to_bytes(parts)

    def forget(self, client: int) -> None:
        self.mirrors.pop(client, None)


class PullReplicas:
    """A worker's copy of each server's shard, moved by each compressed pull's difference."""

    def __init__(self, codec: WireCodec) -> None:
        self.codec, self.fingerprint = codec, codec_fingerprint(codec.spec)
        self.replicas: dict[int, torch.Tensor] = {}

    def dtype(self, server: int) -> torch.dtype:
        """What the next pull answer from `server` carries: fp32 values first, then bytes."""
        return torch.uint8 if server in self.replicas else torch.float32

    def take(
        self, server: int, fingerprint: int, payload: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor | None, str | None]:
        """(the server's values as this worker now holds them, None) or (None, problem)."""
        if not numel:
            return torch.zeros(0), None
        if server not in self.replicas:
            if fingerprint != 0 or payload.numel() != numel:
                return None, f"a first pull of {payload.numel()} values, expected {numel} plain"
            self.replicas[server] = payload.clone()
            return payload, None
        delta, problem = read(self.codec, fingerprint, payload, numel)
        if problem:
            return None, problem
        self.replicas[server] += delta
        return self.replicas[server], None
