"""A mesh's training state as one process would hold it, and back.

On a `dp x tp x pp` mesh a parameter is cut up to three times: tensor parallel gives each tp
rank a slice of it (`Split`), the pipeline gives it to the stage that runs it, and ZeRO lays the
stage's parameters end to end in flat units of which each dp rank keeps one slice. Making it
whole undoes the cuts in reverse: along the data axis first (the data strategy's own layout:
`checkpoint_shard`'s units, all-gathered), then the tensor-parallel slices (`gather_split`), then
the stages (under the unsplit model's names). Loading a whole state cuts it forward: the stage's
names, this rank's slice, and the data strategy takes its share (`load_full_state`).

The checkpoint path gathers onto the plane dp = 0 only and ends on global rank 0, which holds
the whole model and its optimizer state for the moment it takes to write them (the same as
DDP's checkpoint); the other ranks drop what they gathered as soon as they have passed it on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from shardwise import comm
from shardwise.comm.named_tensors import all_gather_named
from shardwise.comm.parallel_ops import Split, gather_split
from shardwise.strategies.base import DistributedModel
from shardwise.strategies.zero import ZeroStage1

# name -> tensor; name -> {optimizer-state key -> tensor}; the names that are parameters
TrainingState = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[str]]


def data_axis_state(data: DistributedModel, optimizer) -> TrainingState | None:
    """What `data` (DDP or ZeRO along the data axis) holds, whole along that axis and keyed by
    its module's names: parameters and buffers, each parameter's optimizer state, and which
    names are parameters. On data-axis rank 0; None on the others (collective for ZeRO)."""
    layout, tensors = data.checkpoint_shard(optimizer)
    rt = data.runtime
    if layout["num_shards"] > 1:  # ZeRO: every rank holds one equal slice of every unit
        units = sorted(k for k in tensors if k.startswith("unit"))  # (the same on every rank)
        for key in units:
            if tensors[key].dim():
                tensors[key] = _all_gather_flat(tensors[key], rt.group, layout["num_shards"])
    if rt.rank != 0:
        return None
    params = {k.removeprefix("buffer/"): v for k, v in tensors.items() if k.startswith("buffer/")}
    states: dict[str, dict[str, torch.Tensor]] = {}
    names: list[str] = []
    for i, unit in enumerate(layout["units"]):
        flats = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(f"unit{i}/")}
        offset = 0
        for name, shape in unit["params"]:
            n = math.prod(shape)
            names.append(name)
            for key, flat in flats.items():
                value = flat if flat.dim() == 0 else flat[offset : offset + n].view(shape)
                if key == "param":
                    params[name] = value
                else:
                    states.setdefault(name, {})[key] = value
            offset += n
    return params, states, names


def _all_gather_flat(piece: torch.Tensor, group, parts: int) -> torch.Tensor:
    out = piece.new_empty(parts * piece.numel())
    comm.all_gather_into_tensor(out, piece.contiguous(), group=group)
    return out


def gather_tensor_axis(state: TrainingState, splits: dict[str, Split], group) -> None:
    """Make every tensor-parallel slice in `state` whole, in place (collective over the tp
    group; every rank walks the names in the same, sorted order)."""
    params, states, _ = state
    for name in sorted(params):
        if name in splits:
            params[name] = gather_split(params[name], splits[name], group)
    for name in sorted(states):
        for key in sorted(states[name]):
            value = states[name][key]
            if name in splits and value.dim():
                states[name][key] = gather_split(value, splits[name], group)


def gather_stage_states(state: TrainingState, names: dict[str, list[str]], group) -> TrainingState:
    """Every stage's `state` under the unsplit model's names (`names`: stage key -> the model's
    keys; a tied weight is taken under its first), on every rank of the pipeline group."""
    params, states, param_names = state
    device = next(iter(params.values())).device if params else torch.device("cpu")
    # Sent as named tensors (no pickle): ("p", name) a parameter, ("s", name, key) one of its
    # optimizer state's tensors, ("n", name) an empty marker keeping the parameters' order.
    local = [(("p", names[k][0]), v) for k, v in params.items()]
    local += [(("s", names[k][0], key), v) for k, s in states.items() for key, v in s.items()]
    local += [(("n", names[k][0]), torch.empty(0)) for k in param_names]
    merged: TrainingState = ({}, {}, [])
    for part in all_gather_named(local, group, device):
        for key, value in part:
            if key[0] == "p" and len(key) == 2:
                merged[0][key[1]] = value
            elif key[0] == "s" and len(key) == 3:
                merged[1].setdefault(key[1], {})[key[2]] = value
            elif key[0] == "n" and len(key) == 2 and key[1] not in merged[2]:
                merged[2].append(key[1])  # (a tied weight: held by two stages, named once)
    return merged


def cut_state(
    params: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    keys: list[str],
    full_name: dict[str, str],
    splits: dict[str, Split],
    tp_rank: int,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """This rank's part of a whole state (single-process names): for each of its module's
    `keys`, the tensor of the model's `full_name[key]`, sliced where `splits` says."""

    def cut(key: str, value: torch.Tensor) -> torch.Tensor:
        split = splits.get(key)
        return split.take(value, tp_rank) if split is not None and value.dim() else value

    local_params, local_states = {}, {}
    for key in keys:
        name = full_name[key]
        if name in params:
            local_params[key] = cut(key, params[name])
        if name in states:
            local_states[key] = {k: cut(key, v) for k, v in states[name].items()}
    return local_params, local_states


def grad_pieces(data: DistributedModel) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """Each gradient this rank holds along the data axis, with the parameter it belongs to:
    ZeRO's shard gradients cut at the parameters' boundaries, or DDP's whole gradients."""
    if not isinstance(data, ZeroStage1):
        yield from ((p, p.grad) for p in data.module.parameters() if p.grad is not None)
        return
    for unit, shard in zip(data.units, data.shards, strict=True):
        if shard.grad is None:
            continue
        low = unit.rank * unit.shard_numel  # this rank's slice of the unit's flat buffer
        for p in unit.params:
            start = max(unit.offset_of[p], low)
            stop = min(unit.offset_of[p] + p.numel(), low + unit.shard_numel)
            if start < stop:
                yield p, shard.grad[start - low : stop - low]
