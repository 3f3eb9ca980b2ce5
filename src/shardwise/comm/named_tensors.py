"""Gather named tensors from every rank without pickle.

`torch.distributed.all_gather_object` pickles what each rank sends and unpickles what it
receives: a peer (or anything that can speak on its connection) could run code in every rank.
Here a rank sends a JSON header (each tensor's key, dtype and shape) and the tensors' raw bytes;
the receiver checks every field before it sizes or reads anything, so a malformed message is a
one-line error, never code. Two all-gathers of sizes first (every rank's header and payload
lengths), then of the padded header and payload bytes.
"""

from __future__ import annotations

import json

import torch

from shardwise.comm.collectives import ProcessGroup, all_gather_into_tensor, group_size

# The dtypes a gathered tensor may have, by name (a header names nothing else).
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

Key = tuple[str, ...]


def all_gather_named(
    items: list[tuple[Key, torch.Tensor]],
    group: ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[list[tuple[Key, torch.Tensor]]]:
    """Every rank's `items` ((key, tensor) pairs, keys tuples of strings), in group-rank order;
    the received tensors are on the CPU, in the order each rank gave them."""
    head = json.dumps(
        [[list(key), str(t.dtype).removeprefix("torch."), list(t.shape)] for key, t in items]
    ).encode()
    payload = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for _, t in items]
    body = torch.cat(payload) if payload else torch.empty(0, dtype=torch.uint8)
    n = group_size(group)
    lengths = torch.tensor([len(head), body.numel()], dtype=torch.int64, device=device)
    every = torch.empty(n * 2, dtype=torch.int64, device=device)
    all_gather_into_tensor(every, lengths, group)
    sizes = every.view(n, 2).cpu().tolist()
    heads = all_gather_bytes(torch.frombuffer(bytearray(head), dtype=torch.uint8), n, group, device)
    bodies = all_gather_bytes(body, n, group, device)
    return [
        _read(heads[r][:head_len], bodies[r][:body_len], r)
        for r, (head_len, body_len) in enumerate(sizes)
    ]


def all_gather_bytes(data: torch.Tensor, n: int, group, device) -> list[torch.Tensor]:
    """Every rank's bytes, each padded to the longest (whose length is all-gathered first)."""
    longest = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    all_gather_into_tensor(lengths, longest, group)
    width = int(lengths.max())
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    out = torch.empty(n * width, dtype=torch.uint8, device=device)
    all_gather_into_tensor(out, padded, group)
    return list(out.cpu().view(n, width)) if width else [out.cpu()] * n


def _read(head: torch.Tensor, body: torch.Tensor, rank: int) -> list[tuple[Key, torch.Tensor]]:
    """Rank `rank`'s (key, tensor) pairs, every field checked before use."""
    try:
        entries = json.loads(bytes(head.numpy()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"rank {rank} sent a malformed tensor header: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(f"rank {rank} sent a malformed tensor header: not a list")
    out, offset = [], 0
    for entry in entries:
        key, dtype, shape = _fields(entry, rank)
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        if offset + nbytes > body.numel():
            raise ValueError(f"rank {rank} sent {body.numel()} bytes, fewer than its header says")
        tensor = body[offset : offset + nbytes].clone().view(dtype).reshape(shape)
        out.append((key, tensor))
        offset += nbytes
    if offset != body.numel():
        raise ValueError(f"rank {rank} sent {body.numel()} bytes, more than its header says")
    return out


def _fields(entry, rank: int) -> tuple[Key, torch.dtype, list[int]]:
    ok = isinstance(entry, list) and len(entry) == 3
    key, dtype, shape = entry if ok else (None, None, None)
    ok = ok and isinstance(key, list) and all(isinstance(k, str) for k in key)
    ok = ok and dtype in DTYPES and isinstance(shape, list)
    ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    if not ok:
        raise ValueError(f"rank {rank} sent a malformed tensor header entry: {str(entry)[:200]}")
    return tuple(key), DTYPES[dtype], shape
