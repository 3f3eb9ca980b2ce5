"""Point-to-point messages with a header: a fixed-size int64 tensor first, then the payload.

gloo and NCCL move tensors whose size the receiver must know in advance, so a message that is
not of a size both sides already agree on is preceded by a header of `HEADER` int64 values.
Two users: the pipeline's activations (`tensor_header` / `read_tensor_header`: the shape and
dtype), and the parameter server's protocol (a kind, a few integers and the payload's length).
Between one pair of ranks, messages arrive in the order they were sent, so a header is always
followed by its own payload. Every field read back is checked before it sizes anything.
"""

from __future__ import annotations

import torch

from shardwise.comm.collectives import Handle, ProcessGroup, recv, send

HEADER = 8
MAX_DIMS = HEADER - 2  # a tensor header: ndim, up to 6 sizes, dtype code
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


def header(*ints: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A header holding `ints` (at most HEADER of them), zero-padded."""
    if len(ints) > HEADER:
        raise ValueError(f"a header holds {HEADER} integers, got {len(ints)}")
    out = torch.zeros(HEADER, dtype=torch.int64, device=device)
    out[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
    return out


def send_header(head: torch.Tensor, dst: int, group: ProcessGroup | None) -> Handle:
    return send(head, dst, group)


def recv_header(src: int, group: ProcessGroup | None, device="cpu") -> torch.Tensor:
    head = torch.empty(HEADER, dtype=torch.int64, device=device)
    recv(head, src, group)
    return head


def tensor_header(tensor: torch.Tensor) -> torch.Tensor:
    """The header announcing `tensor`: its number of dimensions, sizes and dtype."""
    if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
        raise ValueError(f"cannot announce a {tensor.dim()}-d {tensor.dtype} tensor")
    head = header(tensor.dim(), *tensor.shape, device=tensor.device)
    head[-1] = DTYPES.index(tensor.dtype)
    return head


def read_tensor_header(head: torch.Tensor) -> tuple[list[int], torch.dtype]:
    """(shape, dtype) from a `tensor_header`, checked."""
    ndim, code = int(head[0]), int(head[-1])
    shape = [int(v) for v in head[1 : 1 + ndim]]
    if not 0 <= ndim <= MAX_DIMS or not 0 <= code < len(DTYPES) or min(shape, default=0) < 0:
        raise ValueError(f"malformed tensor header {head.tolist()}")
    return shape, DTYPES[code]
