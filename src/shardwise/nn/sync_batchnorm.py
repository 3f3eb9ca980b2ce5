"""Synchronised batch normalisation: batch statistics over the global batch of all ranks.

With plain data parallel, each rank normalises by its own micro-batch's statistics, so training
differs from one process seeing the global batch. Here the per-channel sums are all-reduced in
the forward pass (two passes: mean, then centred squares, for float accuracy), and the two sums
the input gradient needs are all-reduced in the backward pass (Ioffe & Szegedy 2015, eq. for
dL/dx; the synchronised form follows Peng et al., MegDet 2018). Works on CPU (gloo) and CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import comm
from shardwise.nn.meta_init import buffers_to

ALONE = "alone"  # the group of a process with no process group: statistics its own, as torch's


def _sum_over(group, t: torch.Tensor) -> None:
    if group is not ALONE:
        comm.all_reduce(t, group=group)


def _channel_sum(t: torch.Tensor) -> torch.Tensor:
    dims = [d for d in range(t.dim()) if d != 1]
    return t.sum(dim=dims)


def _broadcastable(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Statistics, sums and the normalisation in float32 for 16-bit inputs, as torch's kernels
    accumulate them (an fp16 count past 65,504 elements a channel is inf); the output and the
    gradients in the input's and the parameters' own dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group, share):
        ctx.dtypes = x.dtype, None if weight is None else weight.dtype
        x = x.to(_statistics_dtype(x.dtype))
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        sums = torch.cat([_channel_sum(x), count])
        _sum_over(group, sums)
        total = sums[-1]
        mean = sums[:-1] / total
        xmu = x - _broadcastable(mean, x)
        sq = _channel_sum(xmu * xmu)
        _sum_over(group, sq)
        var = sq / total
        invstd = torch.rsqrt(var + eps)
        xhat = xmu * _broadcastable(invstd, x)
        if weight is not None:
            weight, bias = weight.to(x.dtype), bias.to(x.dtype)
        ctx.save_for_backward(xhat, invstd, weight, total)
        ctx.group, ctx.share = group, share
        ctx.mark_non_differentiable(mean, var, total)
        y = xhat
        if weight is not None:
            y = y * _broadcastable(weight, x) + _broadcastable(bias, x)
        return y.to(ctx.dtypes[0]), mean, var, total

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dtotal):
        xhat, invstd, weight, total = ctx.saved_tensors
        dy = dy.to(xhat.dtype)
        # Sums over the *global* batch of dy and dy * xhat: the only coupling between ranks.
        sums = torch.cat([_channel_sum(dy), _channel_sum(dy * xhat)])
        local = sums.clone()
        # Each rank's dy is of its own batch's mean loss. With uneven batches those are on
        # different scales: weigh each by its share of the global batch (the global mean's
        # dy), sum, and return to this rank's scale, as the gradient weighting expects.
        share = ctx.share.uneven_weight() if ctx.share is not None else None
        if share is not None:
            sums.mul_(share)
        _sum_over(ctx.group, sums)
        if share is not None:
            sums.div_(share)
        sum_dy, sum_dy_xhat = sums.chunk(2)
        scale = invstd if weight is None else invstd * weight
        dx = (
            dy - _broadcastable(sum_dy / total, dy) - xhat * _broadcastable(sum_dy_xhat / total, dy)
        )
        dx = (dx * _broadcastable(scale, dy)).to(ctx.dtypes[0])
        # Parameter gradients stay local; data parallel averages them like every other gradient.
        local_dy, local_dy_xhat = local.to(ctx.dtypes[1] or local.dtype).chunk(2)
        dweight = local_dy_xhat if weight is not None else None
        dbias = local_dy if weight is not None else None
        return dx, dweight, dbias, None, None, None


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Drop-in replacement for BatchNorm1d/2d/3d; statistics span every rank of `group`."""

    def __init__(self, *args, group=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        # data parallel's BatchShare, set by the strategy: weighs uneven batches' gradients
        self.batch_share = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        # (no process group, as in a plain script: this process's batch alone, as torch's; a
        # model compiled then keeps that choice, dynamo taking is_initialized as a constant)
        alone = self.group is None and not torch.distributed.is_initialized()
        y, mean, var, total = _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, self.eps, ALONE if alone else self.group, self.batch_share
        )
        count = total.item()  # (the same on every rank: all refuse together)
        if count == 1:  # a variance of 0: every output would be the bias, as nn.BatchNorm refuses
            raise ValueError(
                "SyncBatchNorm: expected more than 1 value per channel over all ranks, got "
                f"{count:.0f} (input size {tuple(x.shape)} on this rank)"
            )
        if self.track_running_stats and count:  # (an empty batch has no statistics: 0/0)
            self._update_running_stats(mean.detach(), var.detach(), count)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        self.num_batches_tracked.add_(1)
        # momentum=None means a cumulative moving average, as in nn.BatchNorm.
        cumulative = 1.0 / float(self.num_batches_tracked)
        factor = cumulative if self.momentum is None else self.momentum
        unbiased = var * (count / max(count - 1.0, 1.0))
        # Same formula (and rounding) as the native kernel: (1 - m) * running + m * batch.
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def convert_sync_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace every BatchNorm layer under `module` with a `SyncBatchNorm` (same state)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, SyncBatchNorm
    ):
        sync = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            group=group,
        )
        # Parameters on the meta device (read later from a source) stay so: assigned, not copied.
        meta = module.weight is not None and module.weight.is_meta
        sync.load_state_dict(module.state_dict(), assign=meta)
        sync.train(module.training)
        for name, p in module.named_parameters(recurse=False):  # (a frozen norm stays so)
            getattr(sync, name).requires_grad_(p.requires_grad)
        device = next(module.buffers(), torch.empty(0)).device
        if meta:
            buffers_to(sync, device)
            return sync
        if module.weight is not None:  # (in the norm's own dtype, not the default fp32)
            return sync.to(device=device, dtype=module.weight.dtype)
        return sync.to(device)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, group))
    return module
