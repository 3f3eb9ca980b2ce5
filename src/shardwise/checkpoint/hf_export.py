"""Our checkpoints out as Hugging Face folders (`shardwise export CKPT DIR --hf`).

A run of a Hugging Face model records the model's config once, as `hf_config.json` in its run
directory (`record_hf_config`, called by the checkpointer: plain JSON, the class name in
`architectures`). Export consolidates the checkpoint's full weights (`export_checkpoint`'s
reading, any strategy and world size) and writes what `save_pretrained` writes: `config.json`,
and `model.safetensors` or shards `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`, so `AutoModel...from_pretrained(DIR)` (or
`model.hf_pretrained: DIR`) loads it. A tied weight is written once, under its first name, as
transformers writes it; loading ties it again.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from shardwise.checkpoint.reshardable import _atomic, full_weights
from shardwise.nn.hf_loading import from_config
from shardwise.observe.run_output import os_reason

CONFIG = "hf_config.json"
MAX_SHARD_BYTES = 5 << 30  # transformers' default max_shard_size (5 GB)


def hf_config_of(model: nn.Module) -> dict[str, Any] | None:
    """The config of the Hugging Face model inside `model` (a strategy's model, or the plain
    one, or a pipeline's stage of one), with its class in `architectures`; None for any other
    model."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "to_json_string") and hasattr(module, "base_model_prefix"):
            return _as_saved(config, type(module).__name__)
        cut_from = getattr(module, "cut_from_hf", None)  # (`PipelineModel`'s)
        if cut_from is not None:
            return _as_saved(*cut_from)
    return None


def _as_saved(config: Any, class_name: str) -> dict[str, Any]:
    as_saved = json.loads(config.to_json_string(use_diff=False))  # (dtypes as names)
    return {**as_saved, "architectures": [class_name]}


def record_hf_config(model: nn.Module, run_dir: Path) -> None:
    """Write the model's HF config beside its checkpoints (nothing for other models)."""
    config = hf_config_of(model)
    if config is not None:
        text = json.dumps(config, indent=2, sort_keys=True)
        _atomic(run_dir / CONFIG, lambda p: p.write_text(text))


def find_hf_config(checkpoint: Path) -> Path | None:
    """The config a checkpoint's run recorded: in the checkpoint's folder or a parent's (a
    run's `checkpoints/step-N` and `checkpoint` folders are two levels down at most)."""
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / CONFIG).is_file():
            return folder / CONFIG
    return None


def read_hf_config(path: Path) -> dict[str, Any]:
    """A config.json, checked to be one: an object naming its model type and class."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}: not a readable JSON config: {' '.join(str(e).split())}"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{path}: not a Hugging Face config (no model_type)")
    names = config.get("architectures")
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{path}: names no architectures (the model class to load)")
    return config


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    config: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write checkpoint `checkpoint` as a Hugging Face folder `out`; `config`: a config.json
    to use where the run recorded none."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"cannot write a Hugging Face folder to {out}: it is a file")
    where = Path(config) if config is not None else find_hf_config(checkpoint)
    if where is None:
        raise ValueError(
            f"{checkpoint}: no {CONFIG} recorded with it (not a Hugging Face model's run?): "
            "pass --hf-config PATH/config.json"
        )
    hf_config = read_hf_config(where)
    shapes = _model_tensors(where)  # (before the checkpoint, which may be large, is read)
    weights = {
        k: v.float() if v.is_floating_point() else v for k, v in full_weights(checkpoint).items()
    }
    if shapes is not None:
        _check_fits(weights, shapes, where, checkpoint)
    try:
        save_hf(weights, hf_config, out, max_shard_bytes)
    except OSError as e:
        raise ValueError(f"cannot write {out}: {os_reason(e)}") from None
    return out


def _model_tensors(where: Path) -> tuple[str, dict[str, tuple]] | None:
    """The class name and tensor shapes of the model the config at `where` builds, made on the
    meta device (its non-persistent buffers too: a checkpoint saves them); None where it cannot
    be built here (no transformers; a class of the user's own, or of remote code: not checked)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    try:
        with torch.device("meta"):
            model = from_config(where)
    except ValueError:
        return None
    tensors = [*model.named_parameters(remove_duplicate=False)]
    tensors += model.named_buffers(remove_duplicate=False)
    return type(model).__name__, {name: tuple(t.shape) for name, t in tensors}


def _check_fits(
    weights: dict[str, torch.Tensor], model: tuple[str, dict[str, tuple]], where: Path, checkpoint
) -> None:
    """Every tensor of the checkpoint is one of the config's model, of its shape: with another
    architecture's config the folder was written, and transformers loaded it as a fresh model,
    every weight unused, without a word. (Its tensors the checkpoint leaves out, tied ones,
    load as its own.)"""
    name_of_class, shapes = model
    for name, tensor in weights.items():
        if name not in shapes:
            raise ValueError(
                f"{checkpoint} holds {name!r}, which the {name_of_class} of {where} has not: "
                "a config of another model"
            )
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"{checkpoint}'s {name} is {tuple(tensor.shape)}, the {name_of_class} of "
                f"{where} has {shapes[name]}: a config of another size"
            )


def save_hf(
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    out: Path,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """`state` and `config` as `save_pretrained` lays them out (sharded above max_shard_bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    # An earlier export's weights go first: transformers reads model.safetensors before an
    # index, our reader the index first, so one of them would read the old weights.
    for stale in [out / "model.safetensors", out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    for stale in out.glob("model-*-of-*.safetensors"):
        stale.unlink()
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {
                name: f for f, shard in zip(files, shards, strict=True) for name in shard
            },
        }
        _atomic(
            out / "model.safetensors.index.json",
            lambda p: p.write_text(json.dumps(index, indent=2)),
        )
    for file, shard in zip(files, shards, strict=True):
        _atomic(
            out / file, lambda p, shard=shard: save_file(shard, str(p), metadata={"format": "pt"})
        )
    _atomic(
        out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True))
    )
