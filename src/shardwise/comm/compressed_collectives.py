"""Codecs by name (`make_codec`, the `compression:` option of DDP, ZeRO and the parameter
server) and the asynchronous collectives that run them: DDP's bucket all-reduce
(`CompressedAllReduce`) and ZeRO's unit reduce-scatter (`CompressedReduceScatter`), each on a
communication thread and a process group of its own, as our other threaded algorithms.
"""

from __future__ import annotations

import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.comm.accounting import stats
from shardwise.comm.all_reduce_base import CommThread, ThreadedAllReduce
from shardwise.comm.collectives import Handle
from shardwise.comm.compression import (
    CastCodec,
    Codec,
    Int8Codec,
    RandomK,
    SignCodec,
    TopK,
)
from shardwise.comm.powersgd import PowerSGD

CODEC_SPEC = (
    "fp16, bf16, int8, topk:RATIO[:WARMUP], randomk:RATIO[:WARMUP], sign or powersgd:RANK[:WARMUP]"
)
# (RATIO in (0, 1]: what the configs' fields accept; the Python API says why a number is off)
CODEC_PATTERN = (
    r"^(fp16|bf16|int8|sign|(topk|randomk)(:(0?\.\d+|1(\.0*)?)(:\d+)?)?|powersgd(:\d+(:\d+)?)?)$"
)


def make_codec(spec: str) -> Codec:
    """`fp16`, `bf16`, `int8`, `topk:0.01[:WARMUP]`, `randomk:0.01[:WARMUP]`, `sign`,
    `powersgd:4[:START]`."""
    codec = _codec(spec)
    codec.spec = spec
    return codec


def _codec(spec: str) -> Codec:
    if not isinstance(spec, str) or not _well_formed(spec):
        raise ValueError(f"compression must be {CODEC_SPEC}, got {spec!r}")
    name, _, arg = spec.partition(":")
    try:
        if name == "fp16":
            return CastCodec(torch.float16)
        if name == "bf16":
            return CastCodec(torch.bfloat16)
        if name == "int8":
            return Int8Codec()
        if name in ("topk", "randomk"):  # topk:RATIO or topk:RATIO:WARMUP_REDUCTIONS
            ratio, _, warmup = arg.partition(":")
            codec = TopK if name == "topk" else RandomK
            return codec(float(ratio) if ratio else 0.01, warmup=int(warmup) if warmup else 0)
        if name == "sign":
            return SignCodec()
        if name == "powersgd":  # powersgd:RANK or powersgd:RANK:START_ITER
            rank, _, start = arg.partition(":")
            return PowerSGD(int(rank) if rank else 4, start_iter=int(start) if start else 0)
    except ValueError as e:
        if "must be" in str(e):
            raise
    raise ValueError(f"compression must be {CODEC_SPEC}, got {spec!r}")


def _well_formed(spec: str) -> bool:
    """A codec's name, with arguments only where it takes them, none of them empty (whether
    each is a number in range, the codec says)."""
    name, *args = spec.split(":")
    takes = {"topk": 2, "randomk": 2, "powersgd": 2}.get(name, 0)
    return len(args) <= takes and all(args)


def codec_fingerprint(spec: str | None) -> int:
    """A number that two ends of a connection compare to agree on a codec (0: none)."""
    return 0 if spec is None else zlib.crc32(spec.encode()) or 1


class CompressedAllReduce(ThreadedAllReduce):
    """A DDP all-reduce algorithm that runs a codec on the communication thread."""

    def __init__(self, codec: Codec, timeout: timedelta | None) -> None:
        super().__init__()
        self.codec = codec
        self.op = f"compressed_{codec.name}"
        self.group = dist.new_group(timeout=timeout)  # collective: all ranks create it together
        self.index: dict[int, int] = {}  # a buffer's address -> its index (the codec's key)
        codec.commit()

    def describe(self, buffer: torch.Tensor, shapes: list[torch.Size]) -> None:
        # A bucket's buffer lives as long as the model: its address finds its index.
        key = self.index.setdefault(buffer.data_ptr(), len(self.index))
        self.codec.describe(key, shapes)

    def _run(self, buffer: torch.Tensor) -> None:
        key = self.index.setdefault(buffer.data_ptr(), len(self.index))
        self.codec.reduce(buffer, self.group, key=key)

    def commit(self) -> None:
        self.codec.commit()

    def forget_written(self, buffers: list[torch.Tensor]) -> None:
        self.codec.roll_back()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.codec.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.codec.load_state_dict(state)
        self.codec.commit()


class CompressedReduceScatter:
    """ZeRO's reduce-scatter of flat units through a codec, asynchronously: on a thread and a
    process group of its own (as `CompressedAllReduce`), so backward runs on meanwhile and the
    codec's messages never interleave with the training thread's collectives."""

    def __init__(self, codec: Codec, timeout: timedelta | None) -> None:
        self.codec = codec
        self.op = f"compressed_{codec.name}"
        self.group = dist.new_group(timeout=timeout)  # collective: all ranks create it together
        self._thread = CommThread("shardwise-codec")
        codec.commit()

    def describe(self, key: int, shapes: list[torch.Size]) -> None:
        self.codec.describe(key, shapes)

    def commit(self) -> None:
        """The reductions started so far are kept: every one has been waited for, and the
        backward that started them ended."""
        self.codec.commit()

    def roll_back(self) -> None:
        """Back to the last `commit`: a backward that raised started the reductions since (each
        waited for already), and its gradients are discarded."""
        self.codec.roll_back()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.codec.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.codec.load_state_dict(state)
        self.codec.commit()

    def start(self, full: torch.Tensor, shard: torch.Tensor, key: int) -> Handle:
        """Begin writing into `shard` this rank's slice of the sum of every rank's `full`."""
        return Handle(self.op, self._thread.submit(self._run, full, shard, key), None)

    def _run(self, full: torch.Tensor, shard: torch.Tensor, key: int) -> None:
        with stats.background():
            self.codec.reduce_scatter(full, shard, self.group, key)

    def close(self) -> None:
        self._thread.shutdown()
