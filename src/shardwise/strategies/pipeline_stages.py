"""How a pipeline cuts a model: its layers in order, contiguous stages of them, and how a batch
enters them.

A model is a pipeline's if it is an `nn.Sequential` or has a `pipeline_layers()` method that
lists its layers in order (each one's output the next one's input); a Hugging Face model is cut
by `hf_stages.py`. Stages are cut where the heaviest stage is lightest, by parameter count or
by measured time per layer. A feed says how a step's batch becomes micro-batches: here, the
inputs chunked into the first stage and the targets into the last one's loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.nn.meta_init import load_buffers_from, read_whole, swap_parameters


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The model as layers in order, each one's output the next one's input."""
    if hasattr(model, "pipeline_layers"):
        return list(model.pipeline_layers())
    if isinstance(model, nn.Sequential):
        return list(model)
    raise ValueError(
        f"{type(model).__name__} is not an nn.Sequential and has no pipeline_layers() method: "
        "a pipeline needs the model as a sequence of layers"
    )


def balanced_split(weights: list[float], stages: int) -> list[int]:
    """Start index of each stage for contiguous stages minimising the heaviest stage's weight,
    none of them weightless where the weights allow (a stage of a lone activation has nothing
    to train: more cuts, as interleaved's, would otherwise make such stages on ties).

    Dynamic programming over (layers used, stages used); L and S are small.
    """
    n = len(weights)
    if stages > n:
        raise ValueError(f"cannot split {n} layers into {stages} pipeline stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    starts = _min_max_starts(prefix, stages, weighted=True)
    return starts if starts is not None else _min_max_starts(prefix, stages, weighted=False)


def _min_max_starts(prefix: list[float], stages: int, weighted: bool) -> list[int] | None:
    n, inf = len(prefix) - 1, float("inf")
    # best[k][i]: heaviest stage when the first i layers form k stages; cut[k][i]: last start.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if weighted and prefix[i] - prefix[j] <= 0:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    if best[stages][n] == inf:
        return None
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def measure_layer_times(
    layers: list[nn.Module], sample: torch.Tensor, reps: int = 3
) -> list[float]:
    """Seconds of forward plus backward per layer on `sample` (the median of `reps`). The
    model is left as it was: its buffers (BatchNorm's running statistics) and the random
    generators (dropout's draws) are put back, so training starts where it would have."""
    times = [[] for _ in layers]
    buffers = [(b, b.clone()) for layer in layers for b in layer.buffers()]
    devices = [sample.device] if sample.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for _ in range(reps):
            x = sample
            for i, layer in enumerate(layers):
                x = x.detach().requires_grad_(x.is_floating_point())
                start = time.perf_counter()
                y = layer(x)
                y.float().sum().backward()
                times[i].append(time.perf_counter() - start)
                x = y
            for layer in layers:
                layer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return [sorted(t)[len(t) // 2] for t in times]


class PipelineStage(nn.Module):
    """This rank's consecutive layers; each gets the micro-batch's `context` too, if any."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Any, *context: Any) -> Any:
        for layer in self.layers:
            x = layer(x, *context)
        return x


@torch.no_grad()
def read_stage(
    model: nn.Module, stage: PipelineStage, source, device: torch.device
) -> dict[nn.Parameter, nn.Parameter]:
    """The meta parameters of `stage` (part of `model`) read whole from `source` under the
    model's names, and its buffers; the other stages' parameters stay on the meta device.
    Returns each parameter replaced -> its replacement."""
    names: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
    replaced: dict[nn.Parameter, nn.Parameter] = {}

    def read(_stage_name: str, p: nn.Parameter) -> nn.Parameter:
        replaced[p] = read_whole(p, names[p], source, device)
        return replaced[p]

    swap_parameters(stage, read)
    load_buffers_from(model, source, within=stage)
    return replaced


@dataclass
class Microbatch:
    """One micro-batch as a stage sees it."""

    x: Any  # the first stage's input (None on the others)
    context: tuple  # further arguments of every layer: () for plain layers
    target: Any  # the last stage's loss compares the output with it
    parts: float  # the micro-batch's loss is divided by it: M for equal shares


class TensorFeed:
    """A plain pipeline's batch: the inputs, chunked, into the first stage; the targets,
    chunked, to the last stage's loss; every micro-batch an equal share of the batch."""

    def split(self, inputs: Any, targets: Any, m: int, first: bool, last: bool) -> list:
        # (checked on every stage that reads the batch: a last stage's targets cut into fewer
        # chunks left it waiting for a micro-batch that never came)
        for part in (inputs if first else None, targets if last else None):
            if part is not None and part.shape[0] % m:
                raise ValueError(f"batch of {part.shape[0]} does not split into {m} micro-batches")
        xs = inputs.chunk(m) if first else [None] * m
        ys = targets.chunk(m) if last else [None] * m
        return [Microbatch(x, (), y, m) for x, y in zip(xs, ys, strict=False)]

    def whole(self, inputs: Any) -> tuple[Any, tuple]:
        """The first stage's input and every layer's context, for a forward of the batch."""
        return inputs, ()

    def pack(self, output: Any) -> list[torch.Tensor]:
        """The last stage's output as the tensors it is broadcast as."""
        return [output]

    def count(self, context: tuple) -> int:
        """How many tensors `pack` gives for a batch with this context."""
        return 1

    def unpack(self, tensors: list[torch.Tensor]) -> Any:
        return tensors[0]
