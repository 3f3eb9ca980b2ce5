"""LAMB (You et al., 2019): Adam's update, with decoupled weight decay, scaled for each layer by
a trust ratio ||w|| / ||update||: BERT pre-training at a batch of 32k without losing accuracy."""

from __future__ import annotations

import torch

from shardwise.optim.layerwise import LayerwiseOptimizer, ParameterNorms


class LAMB(LayerwiseOptimizer):
    """For each parameter w with gradient g (of the whole parameter, under any strategy), at
    step t:

        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay w
        ratio = ||w|| / ||r||   (1 where either is 0; at most `max_trust` if given)
        w -= lr ratio r

    `exclude_1d`: biases and normalisation weights get neither weight decay nor a trust ratio
    (ratio 1: Adam's step), as BERT's recipe leaves them out of weight decay."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_trust: float | None = None,
        exclude_1d: bool = False,
    ) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"LAMB: lr and weight_decay must be >= 0, got {lr}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"LAMB: betas must be in [0, 1), got {betas}")
        if max_trust is not None and max_trust <= 0:
            raise ValueError(f"LAMB: max_trust must be > 0, got {max_trust}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_trust=max_trust,
            exclude_1d=exclude_1d,
        )
        super().__init__(params, defaults)

    def update(self, stepped: list[torch.Tensor], norms: ParameterNorms) -> None:
        ndims = torch.tensor(norms.ndims)
        updates = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            adapted = ndims > 1 if group["exclude_1d"] else torch.ones_like(ndims, dtype=bool)
            decay = torch.where(adapted, group["weight_decay"], 0.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # (tensors only: a checkpoint holds no Python objects)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                # (bias corrections as tensors: the planner steps it on fake tensors)
                r = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
                updates[id(p)] = r.add_(norms.expand(id(p), decay.to(p.device), p) * p)
        squares = norms.square_sums([{id(p): p for p in stepped}, updates])
        w_norm, r_norm = squares.sqrt()
        for group in self.param_groups:
            adapted = ndims.to(w_norm.device) > 1
            adapted |= not group["exclude_1d"]
            ratio = w_norm / r_norm.clamp(min=torch.finfo(torch.float32).tiny)
            if group["max_trust"] is not None:
                ratio = ratio.clamp(max=group["max_trust"])
            ratio = torch.where(adapted & (w_norm > 0) & (r_norm > 0), ratio, 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                r = updates[id(p)] * norms.expand(id(p), ratio, p)
                p.add_(r, alpha=-group["lr"])
