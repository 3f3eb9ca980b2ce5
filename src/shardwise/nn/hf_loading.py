"""Hugging Face models from local files (`model.hf_config`, `model.hf_pretrained`), nothing
downloaded. transformers is the optional extra `shardwise[hf]`, imported only here and only
when such a model is asked for.

The class is the one the config's `architectures` names (GPT2LMHeadModel, LlamaForCausalLM,
BertForSequenceClassification, ...), as transformers' Auto classes pick it for a checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from shardwise.nn.hf_weights import HFWeights
from shardwise.nn.meta_init import empty_parameters


def transformers_module() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "Hugging Face models need transformers: pip install shardwise[hf]"
        ) from None
    transformers.logging.set_verbosity_error()  # (advice meant for a hub download, per rank)
    transformers.utils.logging.disable_progress_bar()
    return transformers


def hf_config(path: Path | str):
    """The config in `path` (a config.json, or a folder holding one)."""
    transformers = transformers_module()
    path = Path(path)
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # (transformers' own kinds too: a field of the wrong type is one)
        reason = " ".join(str(e).split())[:300]
        raise ValueError(f"{path}: not a Hugging Face config: {reason}") from None


def model_class(config, where: Path | str) -> type[nn.Module]:
    """The transformers class the config's `architectures` names."""
    transformers = transformers_module()
    names = getattr(config, "architectures", None) or []
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: architectures must be a list of class names, got {names!r}")
    if not names:
        raise ValueError(
            f"{where}: the config names no architectures: add e.g. "
            '"architectures": ["GPT2LMHeadModel"] (the class to build)'
        )
    cls = getattr(transformers, names[0], None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(
            f"{where}: architecture {names[0]!r} is not a model class of transformers "
            f"{transformers.__version__}"
        )
    return cls


def from_config(path: Path | str) -> nn.Module:
    """A freshly initialised model of the config in `path` (seeded by the caller), in fp32."""
    config = hf_config(path)
    return model_class(config, path)._from_config(config, dtype=torch.float32)


def load_pretrained(folder: Path | str) -> tuple[nn.Module, HFWeights]:
    """The model saved in `folder` (config.json and safetensors weights, one file or sharded
    with model.safetensors.index.json), built on the meta device (no weights in memory), and
    its weights as a source: each rank's strategy reads only what the rank keeps (`sw.prepare`
    with `source=`), in the model's dtype (fp32)."""
    config = hf_config(folder)
    cls = model_class(config, folder)
    with empty_parameters():
        model = cls._from_config(config, dtype=torch.float32)
    return model, HFWeights(folder, getattr(model, "base_model_prefix", ""))
