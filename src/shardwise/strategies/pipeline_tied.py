"""Weights that two pipeline stages hold: one parameter of the unsplit model, used twice.

GPT-2 ties its LM head to its token embedding (`lm_head.weight is wte.weight`): the first stage
embeds with it and the last one scores with it. In one process it is one parameter whose
gradient is the sum of both uses. Here each holder keeps its own copy (equal at the start, the
model being broadcast); after a step's backward, each sends the others the gradient of its own
use and adds theirs in stage order, so every copy gets the same sum, bit for bit, and the same
optimizer update (Megatron-LM's embedding group, done point-to-point between the holders).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise import comm


def shared_parameters(
    layers: list[nn.Module], bounds: list[int], stage: int
) -> list[tuple[nn.Parameter, list[int]]]:
    """Stage `stage`'s trainable parameters that other stages hold too, each with the stages
    that hold it; in the order of the layers, which every stage agrees on (their messages pair
    up). A frozen one has no gradient to sum (given zeros, a decaying optimizer moved it)."""
    holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s] : bounds[s + 1]]:
            for p in layer.parameters():
                if p.requires_grad:
                    holders.setdefault(id(p), (p, set()))[1].add(s)
    return [(p, sorted(h)) for p, h in holders.values() if stage in h and len(h) > 1]


class TiedWeights:
    """This stage's share of the tied weights, and the summing of their gradients."""

    def __init__(self, tied: list[tuple[nn.Parameter, list[int]]], stage: int, group) -> None:
        self.params, self.stage, self.group = tied, stage, group
        # The norm of the whole gradient counts a tied one once: at its first holder.
        self.elsewhere = {id(p) for p, holders in tied if holders[0] != stage}
        self.earlier: list[torch.Tensor | None] = []

    def __bool__(self) -> bool:
        return bool(self.params)

    def counted_here(self, p: nn.Parameter) -> bool:
        return id(p) not in self.elsewhere

    def begin_step(self) -> None:
        """Remember gradients accumulated by earlier steps: they were summed already."""
        self.earlier = [None if p.grad is None else p.grad.clone() for p, _ in self.params]

    def sum_grads(self) -> None:
        """After the step's last backward: every holder's gradient becomes the sum of all."""
        for (p, holders), before in zip(
            self.params, self.earlier or [None] * len(self.params), strict=True
        ):
            fresh = torch.zeros_like(p) if p.grad is None else p.grad.detach()
            parts = {self.stage: (fresh if before is None else fresh - before).contiguous()}
            sends = [
                comm.send(parts[self.stage], peer, self.group)
                for peer in holders
                if peer != self.stage
            ]
            for peer in holders:
                if peer != self.stage:
                    parts[peer] = torch.empty_like(parts[self.stage])
                    comm.recv(parts[peer], peer, self.group)
            total = sum((parts[h] for h in holders[1:]), parts[holders[0]].clone())
            for handle in sends:  # (what was sent may be the gradient itself)
                handle.wait()
            total = total if before is None else before + total
            if p.grad is None:
                p.grad = total
            else:
                p.grad.copy_(total)
        self.earlier = []
