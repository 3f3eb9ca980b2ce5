"""Ring all-reduce over point-to-point messages: a reduce-scatter, then an all-gather.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations" (2009),
popularised for deep learning by Baidu (2017) and Horovod. The tensor is cut into n chunks; in
each of n-1 steps every rank sends one chunk to its right neighbour and adds the chunk it receives
from its left one. After that each rank owns one fully reduced chunk, and n-1 more steps pass the
finished chunks around. Each rank sends 2(n-1)/n of the tensor, whatever n is.
"""

from __future__ import annotations

import torch

from shardwise.comm.collectives import ProcessGroup, exchange, group_rank, group_size


def ring_all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None) -> None:
    """Sum `tensor` (contiguous) in place over the ranks of `group`."""
    assert tensor.is_contiguous(), "ring all-reduce works on a contiguous (flat) buffer"
    n, rank = group_size(group), group_rank(group)
    if n == 1:
        return
    chunks = list(tensor.view(-1).tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=tensor.dtype, device=tensor.device)

    # Reduce-scatter: at step s rank r passes on chunk r-s, which already holds s+1 contributions.
    for step in range(n - 1):
        send_chunk = chunks[(rank - step) % n]
        recv_chunk = chunks[(rank - step - 1) % n]
        incoming = scratch[: recv_chunk.numel()]
        exchange([(send_chunk, right)], [(incoming, left)], group, op="ring_all_reduce")
        recv_chunk.add_(incoming)

    # All-gather: rank r now owns the finished chunk r+1; pass finished chunks around the ring.
    for step in range(n - 1):
        send_chunk = chunks[(rank + 1 - step) % n]
        recv_chunk = chunks[(rank - step) % n]
        exchange([(send_chunk, right)], [(recv_chunk, left)], group, op="ring_all_reduce")
