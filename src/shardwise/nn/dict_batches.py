"""Batches that are dicts of tensors, as Hugging Face models take them: `model(**batch)`, and the
loss the model computes itself from the batch's labels (`output.loss`).

Every strategy calls its model with one argument, the batch (`model(inputs)`). `call_with_keywords`
makes a model take a dict there as its keyword arguments, by a forward pre-hook on the model
itself rather than a wrapper module: parameter names, state dicts, the model's class and
config (which tensor parallel reads an HF model's plan from) all stay the user's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

LABELS = "labels"  # a dict sample's targets (Hugging Face's name)


def _spread(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        return (), dict(args[0])
    return None  # called otherwise: as it was


def call_with_keywords(model: nn.Module) -> nn.Module:
    """`model(batch)` with a dict `batch` becomes `model(**batch)` (other calls are left as
    they are); it runs before the model's other pre-hooks, so that those (mixed precision's
    casts, ZeRO-3's gathers, timing) see the keywords. Returns the model."""
    model.register_forward_pre_hook(_spread, with_kwargs=True, prepend=True)
    return model


def output_loss(output: Any, _target: Any = None) -> torch.Tensor:
    """The loss a model computed itself: `output.loss` (a ModelOutput) or `output["loss"]`."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"the model's output ({type(output).__name__}) has no loss: give its samples a "
            "'labels' entry, or name a loss function (model.loss)"
        )
    return loss


def _logits(output: Any) -> Any:
    return output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)


def logits_of(output: Any) -> torch.Tensor:
    """The output itself where it is a tensor, else its `.logits` (or `["logits"]`)."""
    logits = output if isinstance(output, torch.Tensor) else _logits(output)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"the model's output ({type(output).__name__}) is neither a tensor nor has logits: "
            "name a loss function (model.loss)"
        )
    return logits


def class_logits(output: Any, targets: torch.Tensor) -> torch.Tensor | None:
    """The logits to score accuracy on, where a model's output object (not a tensor) is a
    classification's: `.logits` (or `["logits"]`) of one row of classes per target. None for
    anything else (a language model's per-token logits are not classes of its labels, which it
    shifts itself)."""
    logits = _logits(output)
    if isinstance(logits, torch.Tensor) and logits.dim() == 2 and targets.dim() == 1:
        return logits
    return None
