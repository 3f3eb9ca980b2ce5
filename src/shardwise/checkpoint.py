"""Final checkpoints: the full model state as safetensors, written atomically by rank 0."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def _atomic(path: Path, write) -> None:
    """Write to a temporary sibling, fsync, then rename: a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_model(directory: Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Save `state` (a full state dict) and `meta` under `directory`; returns the weights path."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    weights = directory / "model.safetensors"
    _atomic(weights, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _atomic(directory / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=2)))
    return weights


def load_model(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))
