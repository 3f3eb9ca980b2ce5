"""Activation checkpointing (recompute): a region keeps only its inputs from forward to backward
and runs its forward again when its gradient is needed, trading compute for activation memory.

Regions are modules picked by name pattern (fnmatch on each dotted part of a `named_modules`
name, so `blocks.*` names the blocks themselves),
or, for `true`, the model's `CHECKPOINT_UNITS` (TinyGPT: each transformer block), a Hugging Face
model's blocks, every layer of a top-level `nn.Sequential` / `nn.ModuleList`, or else of its
longest `nn.ModuleList` (`default_regions`; none found is a one-line error). Each region's
`forward` is replaced by one that runs under `torch.utils.checkpoint` (non-reentrant: hooks, keyword
arguments and strategies that gather weights in hooks keep working), so parameter names, state
dicts, TP plans and pipeline splits are untouched, and every strategy can use it.

torch's checkpoint saves a region's inputs as ordinary saved tensors, so the `ActivationMeter`
counts them until the region's backward; the region's recomputed activations, alive during its
own backward only, are kept by checkpoint itself and not counted (torch's MemTracker sees them).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Spec = bool | list[str]


def default_regions(model: nn.Module) -> list[str]:
    """The regions `activation_checkpointing: true` means for this model: its
    `CHECKPOINT_UNITS`; a Hugging Face model's blocks (the classes its `_no_split_modules`
    names, the outermost of them); every layer of a top-level `nn.Sequential` or
    `nn.ModuleList`; else the layers of its longest `nn.ModuleList` (a stack of blocks kept
    deeper: `encoder.layers`)."""
    units = getattr(model, "CHECKPOINT_UNITS", None)
    if units is not None:
        return list(units)
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [n for n, m in model.named_modules() if n and type(m).__name__ in block_classes]
    blocks = [n for n in blocks if not any(n.startswith(b + ".") for b in blocks)]
    if blocks:
        return blocks
    top = [
        layer
        for name, module in model.named_modules()
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and name.count(".") == 0
        for layer in _layers(name, module)
    ]
    if top:
        return top
    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not stacks:
        return []
    return _layers(*max(stacks, key=lambda s: len(s[1])))  # (the first, shallowest, of ties)


def _layers(name: str, container: nn.Module) -> list[str]:
    """The names of `container`'s children (`container` being `name` in the model)."""
    return [f"{name}.{child}" if name else child for child, _ in container.named_children()]


def checkpoint_activations(model: nn.Module, spec: Spec = True) -> list[str]:
    """Make the modules `spec` names recompute their activations in backward; returns their
    names. `spec`: True (the model's default regions), False (none) or name patterns. A
    pattern matching no module, or regions nested in one another, are one-line errors."""
    if spec is False:
        return []
    patterns = default_regions(model) if spec is True else list(spec)
    if not patterns:  # (true, and nothing found: it would have done nothing without a word)
        raise ValueError(
            f"activation_checkpointing: true finds no blocks in {type(model).__name__}: "
            "name the modules to recompute (a list of name patterns, e.g. ['layers.*'])"
        )
    names = [name for name, _ in model.named_modules() if name]
    chosen: list[str] = []
    for pattern in patterns:
        matched = [n for n in names if _matches(n, pattern)]
        if not matched:
            raise ValueError(
                f"activation_checkpointing: pattern {pattern!r} matches no module of "
                f"{type(model).__name__}"
            )
        chosen += [n for n in matched if n not in chosen]
    for outer in chosen:
        inner = next((n for n in chosen if n.startswith(outer + ".")), None)
        if inner is not None:
            raise ValueError(
                f"activation_checkpointing: regions {outer!r} and {inner!r} are nested; "
                "name one of them"
            )
    modules = dict(model.named_modules())
    for name in chosen:
        module = modules[name]
        module.forward = _recomputing(module.forward)
    return chosen


# (transformers' names of a block's key/value cache argument, version by version)
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")


def _cache_taking(forward: Callable[..., Any]) -> inspect.Signature | None:
    """`forward`'s signature where it takes a key/value cache (a Hugging Face block's)."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):  # (a callable with no signature to read)
        return None
    return signature if set(signature.parameters) & {*_CACHES, "use_cache"} else None


def _without_cache(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple:
    """The call's arguments with no key/value cache: a block's cache, filled by its forward,
    would hold one more entry when the block runs again (a size mismatch in backward). None
    while training, as transformers' own gradient checkpointing does (the model's config
    untouched: what it exports)."""
    bound = signature.bind_partial(*args, **kwargs)
    cache_class = getattr(sys.modules.get("transformers.cache_utils"), "Cache", ())
    for name, value in bound.arguments.items():
        if (name in _CACHES and value is not None) or isinstance(value, cache_class):
            bound.arguments[name] = None
    if bound.arguments.get("use_cache"):
        bound.arguments["use_cache"] = False
    return bound.args, bound.kwargs


def _matches(name: str, pattern: str) -> bool:
    """fnmatch per dotted part: `blocks.*` names the blocks, not the modules inside them."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(map(fnmatch.fnmatchcase, parts, wanted))


def _recomputing(forward: Callable[..., Any]) -> Callable[..., Any]:
    signature = _cache_taking(forward)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved anyway
            return forward(*args, **kwargs)
        if signature is not None:
            args, kwargs = _without_cache(signature, args, kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.recomputes = True  # type: ignore[attr-defined]  # (ZeRO-3 checks its units against it)
    return run


def recomputed(model: nn.Module) -> list[str]:
    """The names of the model's checkpointed regions."""
    return [n for n, m in model.named_modules() if getattr(m.forward, "recomputes", False)]


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose checkpointed regions are the copy's own: `copy.deepcopy`
    would keep each patched forward pointing at the original module."""
    regions = recomputed(model)
    twin = copy.deepcopy(model)
    modules = dict(twin.named_modules())
    for name in regions:
        del modules[name].forward  # the instance's patch: the class's forward again
    if regions:
        checkpoint_activations(twin, regions)
    return twin
