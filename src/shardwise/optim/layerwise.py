"""What a layer-wise adaptive optimizer needs from the strategy: each parameter's norm.

LARS and LAMB scale each parameter's update by a trust ratio, ||w|| / ||update||, of the
*parameter*: the model's weight matrix, not whatever tensor the optimizer happens to step. Under
ZeRO the optimizer steps flat shards that cut across parameters; under tensor parallelism it
steps slices of a parameter; a trust ratio of those pieces is another optimizer (DeepSpeed#490:
"LAMB and LARS implementations that are not aware of ZeRO will not work correctly with ZeRO").

`ParameterNorms` maps each stepped tensor to the pieces of parameters it holds (`Piece`: which
parameter, which elements of the stepped tensor) and sums the pieces' squares over the ranks
holding the rest of each parameter (`reduce`, in place on a [k, parameters] tensor of partial
sums), as the strategy's global-norm clipping does. Without a strategy every stepped tensor is
one whole parameter and nothing is reduced: the optimizer is the single-process one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of a stepped tensor (flattened) are elements [offset, offset +
    stop - start) of parameter `index` (flattened)."""

    index: int
    start: int
    stop: int
    offset: int = 0


class ParameterNorms:
    """Per-parameter squared norms of tensors laid out like the stepped ones."""

    def __init__(
        self,
        pieces: dict[int, list[Piece]],
        params: Sequence[torch.Tensor],
        reduce: Callable[[torch.Tensor], None] | None = None,
        device: torch.device | None = None,
        join: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """`pieces`: by the stepped tensor's id, the pieces it holds (padding is in none);
        `params`: the parameters, by index (this rank's tensors of them: a slice's dimensions
        are its parameter's); `reduce`: sums a [k, len(params)] tensor of this rank's partial
        sums over the ranks, on `device` (the backend's: offloaded shards are on the CPU, and
        NCCL reduces GPU tensors only; None: the stepped tensors'); `join`: sums, in place, a
        flat tensor of the parameters' elements one after the other over the ranks holding
        the other pieces of each (ZeRO's shard group; None: each rank holds its parameters
        whole), which makes each parameter whole where each rank wrote its own pieces."""
        self.pieces, self.params, self.reduce = pieces, list(params), reduce
        self.device, self.join = device, join
        self.ndims = [p.dim() for p in self.params]  # (1-D ones may be left unadapted)

    @classmethod
    def whole(cls, params: Sequence[torch.Tensor]) -> ParameterNorms:
        """Each stepped tensor a whole parameter, on one rank (or the same on every rank)."""
        pieces = {id(p): [Piece(i, 0, p.numel())] for i, p in enumerate(params)}
        return cls(pieces, params)

    def square_sums(self, rows: Sequence[dict[int, torch.Tensor]]) -> torch.Tensor:
        """Σ x² per parameter of each row (a row: by stepped tensor's id, a tensor shaped
        like it), summed over the ranks: a [len(rows), parameters] fp32 tensor."""
        device = self.device
        if device is None:
            device = next(iter(rows[0].values())).device if rows and rows[0] else None
        sums = torch.zeros(len(rows), len(self.ndims), dtype=torch.float32, device=device)
        for k, row in enumerate(rows):
            for key, tensor in row.items():
                flat = tensor.detach().reshape(-1)
                # (a slice and a dot per piece: a few pieces per parameter, one per ZeRO unit
                # it spans, against an index tensor as large as the parameters)
                for piece in self.pieces[key]:
                    part = flat[piece.start : piece.stop].float()
                    sums[k, piece.index] += part.dot(part).to(device)
        if self.reduce is not None:
            self.reduce(sums)
        return sums

    def expand(self, key: int, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like the stepped tensor `like` (id `key`) holding, on each element,
        `values` (one per parameter) of the parameter it belongs to; 0 on padding."""
        out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        values = values.to(like.device, like.dtype)
        for piece in self.pieces[key]:
            out[piece.start : piece.stop] = values[piece.index]
        return out.view_as(like)


class LayerwiseOptimizer(torch.optim.Optimizer):
    """An optimizer whose update needs each parameter's norm: single-process by default,
    exact under a strategy once `sw.prepare` has set `norms` to the strategy's layout."""

    norms: ParameterNorms | None = None  # set by `sw.prepare`; None: whole parameters, here
    _whole: ParameterNorms | None = None  # (made from the param groups, remade when they grow)

    def _norms(self) -> ParameterNorms:
        if self.norms is not None:
            return self.norms
        if self._whole is None:
            self._whole = ParameterNorms.whole(
                [p for group in self.param_groups for p in group["params"]]
            )
        return self._whole

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.update(stepped, self._norms())
        return loss

    def update(self, stepped: list[torch.Tensor], norms: ParameterNorms) -> None:
        """One step of the tensors with gradients, `norms` saying whose pieces they are."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._whole = None  # (progressive unfreezing: the new parameters need pieces too)
