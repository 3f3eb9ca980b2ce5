"""LARS (You, Gitman & Ginsburg, 2017): SGD with momentum whose step for each layer is scaled
by a trust ratio, eta ||w|| / (||g|| + weight_decay ||w||), so that large batches (with the
linear scaling rule and warm-up, Goyal et al. 2017) train without a layer's update outgrowing
its weights."""

from __future__ import annotations

import torch

from shardwise.optim.layerwise import LayerwiseOptimizer, ParameterNorms


class LARS(LayerwiseOptimizer):
    """For each parameter w with gradient g (of the whole parameter, under any strategy):

        ratio = eta ||w|| / (||g|| + weight_decay ||w|| + eps)   (1 where ||w|| or ||g|| is 0)
        buf = momentum buf + ratio (g + weight_decay w);   w -= lr buf

    `exclude_1d`: biases and normalisation weights (one dimension or none) get neither weight
    decay nor a trust ratio (as in SimCLR's recipe): they then step at the plain `lr`, which
    LARS's rates (10-40 on the digits MLP at a batch of 1024) make diverge where no BatchNorm
    tames them, hence off by default."""

    def __init__(
        self,
        params,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        eps: float = 1e-8,
        exclude_1d: bool = False,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if value < 0:
                raise ValueError(f"LARS: {name} must be >= 0, got {value}")
        if eta <= 0:
            raise ValueError(f"LARS: eta must be > 0, got {eta}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            eta=eta,
            eps=eps,
            exclude_1d=exclude_1d,
        )
        super().__init__(params, defaults)

    def update(self, stepped: list[torch.Tensor], norms: ParameterNorms) -> None:
        squares = norms.square_sums([{id(p): p for p in stepped}, {id(p): p.grad for p in stepped}])
        w_norm, g_norm = squares.sqrt()
        one_dim = torch.tensor(norms.ndims, device=w_norm.device) <= 1
        for group in self.param_groups:
            adapted = ~one_dim if group["exclude_1d"] else torch.ones_like(one_dim)
            decay = torch.where(adapted, group["weight_decay"], 0.0)
            ratio = group["eta"] * w_norm / (g_norm + decay * w_norm + group["eps"])
            ratio = torch.where(adapted & (w_norm > 0) & (g_norm > 0), ratio, 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad + norms.expand(id(p), decay, p) * p
                d.mul_(norms.expand(id(p), ratio, p))
                state = self.state[p]
                if group["momentum"]:
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d.clone()
                    else:
                        buf.mul_(group["momentum"]).add_(d)
                    d = buf
                p.add_(d, alpha=-group["lr"])
