"""The tensor-parallel plan transformers ships with a Hugging Face model, in shardwise's styles.

transformers keeps a model's plan in two places: the config's `base_model_tp_plan` (patterns
relative to the base model, which sits under `model.base_model_prefix`, e.g. `model` in
LlamaForCausalLM) and the model class's `_tp_plan` for what lies outside it (the LM head). It
also splits the base model's `embed_tokens` by vocabulary when its plan says nothing of it.
`shipped_plan` composes the same plan over the full model's module names (what transformers'
own `model.tp_plan` holds) and `hf_plan` translates it; nothing here imports transformers.

The head keeps transformers' gathered output ('colwise_gather_output'): an HF model computes its
loss from the logits inside its forward (`model(input_ids=x, labels=y).loss`), so they must be
whole there. shardwise's vocabulary-parallel loss needs the loss outside the model: pass a plan
with 'vocab_head' and apply `sw.parallel_loss` to the model's logits for that.
"""

from __future__ import annotations

import fnmatch

from torch import nn

# transformers' style -> shardwise's (None: the module stays whole on every rank). Each pair
# of transformers names on one line is registered with the same layouts there
# (transformers/distributed/tensor_parallel.py).
HF_STYLES: dict[str, str | None] = {
    "colwise": "colwise",  # input whole, output split by features
    "rowwise": "rowwise",  # input split by features, output summed
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "vocab_embedding",
    "replicate": None,
}


def shipped_plan(model: nn.Module) -> dict[str, str]:
    """transformers' plan for `model` over its full module names, in transformers' styles
    ({} for a model it ships none for, or one that is no Hugging Face model)."""
    config, prefix = getattr(model, "config", None), getattr(model, "base_model_prefix", None)
    if config is None or prefix is None:
        return {}
    base = getattr(model, prefix, None)
    under = f"{prefix}." if isinstance(base, nn.Module) else ""
    base = base if under else model
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if base is not model:
        base_plan.update(getattr(type(base), "_tp_plan", None) or {})
    if base_plan and isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        base_plan.setdefault("embed_tokens", "embedding_rowwise")
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    plan.update({under + pattern: style for pattern, style in base_plan.items()})
    return plan


def hf_plan(model: nn.Module) -> dict[str, str]:
    """The plan transformers ships for `model`, in shardwise's styles ({} where it ships none).

    A rule that names nothing in this model (a layer kind it lacks) is dropped, as transformers
    drops it; a style shardwise cannot honour, or a rule on a parameter rather than a module,
    is refused in one line naming the module and the style.
    """
    modules = [name for name, _ in model.named_modules()]
    params = [name for name, _ in model.named_parameters()]
    plan = {}
    for pattern, style in shipped_plan(model).items():
        hits = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        params_hit = [name for name in params if fnmatch.fnmatchcase(name, pattern)]
        if style == "replicate" or not (hits or params_hit):
            continue
        if style not in HF_STYLES or not hits:
            raise ValueError(
                f"{type(model).__name__}: {(hits or params_hit)[0]} has the style {style!r} in "
                "the plan transformers ships, which shardwise's tensor parallel cannot honour: "
                "pass TensorParallel(plan={pattern: style})"
            )
        plan[pattern] = HF_STYLES[style]
    return plan
