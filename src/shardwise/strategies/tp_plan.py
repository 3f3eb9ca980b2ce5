"""A tensor-parallel plan: which module of a model gets which split, checked before any is made.

A plan maps module-name patterns (fnmatch: `blocks.*.mlp.0`) to styles:

    colwise[:CHUNKS]     an nn.Linear split by output features (CHUNKS equal blocks, e.g. 3 for
                         a fused q/k/v projection, each split on its own); the output stays split
    colwise_gather       the same, its output gathered whole on every rank
    rowwise              an nn.Linear split by input features; its input arrives split (from a
                         colwise layer), the partial products are summed
    rowwise_split_input  the same, its input arrives whole and each rank takes its slice
    vocab_embedding      an nn.Embedding split by vocabulary rows
    vocab_head           the LM head split by vocabulary, for the vocabulary-parallel loss
    heads                an attention module whose `n_head` counts this rank's heads

A model brings its own plan: shardwise's models a `TP_PLAN` attribute, Hugging Face models the
plan transformers ships with them (`hf_tp_plan`). `resolve` matches the patterns and refuses,
in one line naming the module, what cannot be split: a wrong layer type, attention heads that
do not divide over the ranks, or a tied weight split differently from its twin.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from shardwise.strategies.hf_tp_plan import hf_plan

STYLES = (
    "colwise",
    "colwise_gather",
    "rowwise",
    "rowwise_split_input",
    "vocab_embedding",
    "vocab_head",
    "heads",
)
# Styles that split a weight by its rows (dim 0) in one block, the same rows for an embedding
# (vocab, dim) and a head (vocab, dim): the two halves of a tied weight can share one slice.
ROW_SPLIT = ("colwise", "colwise_gather", "vocab_embedding", "vocab_head")
_EXPECTED = {"vocab_embedding": nn.Embedding, "heads": nn.Module}


def parse_style(style: str) -> tuple[str, int]:
    """(style, chunks) from 'colwise:3' and the like."""
    name, _, chunks = style.partition(":")
    if name not in STYLES:
        raise ValueError(f"tensor-parallel style must be one of {STYLES}, got {style!r}")
    if chunks and name != "colwise":
        raise ValueError(f"tensor-parallel style {name!r} takes no ':CHUNKS', got {style!r}")
    return name, int(chunks or 1)


def model_plan(model: nn.Module) -> dict[str, str]:
    """The plan `model` brings: its TP_PLAN, or the one transformers ships for it."""
    plan = getattr(model, "TP_PLAN", None) or hf_plan(model)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (no TP_PLAN attribute, no "
            "Hugging Face config.base_model_tp_plan): pass TensorParallel(plan={pattern: style})"
        )
    return plan


def resolve(model: nn.Module, plan: dict[str, str], parts: int) -> dict[str, tuple[str, int]]:
    """Module name -> (style, chunks) for every module the plan splits over `parts` ranks,
    checked (a later pattern overrides an earlier one for the same module)."""
    modules = dict(model.named_modules())
    targets: dict[str, tuple[str, int]] = {}
    for pattern, style in plan.items():
        matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(f"tensor-parallel plan: no module matches {pattern!r}")
        targets.update((name, parse_style(style)) for name in matched)
    for name, (style, chunks) in targets.items():
        module, parent = modules[name], modules[name.rpartition(".")[0]]
        expected = _EXPECTED.get(style, nn.Linear)
        if not isinstance(module, expected):
            raise ValueError(f"{name}: style {style!r} needs an {expected.__name__}")
        if style == "heads" and not isinstance(getattr(module, "n_head", None), int):
            raise ValueError(f"{name}: style 'heads' needs a module with an n_head count")
        if style == "heads" and module.n_head % parts:
            raise ValueError(f"{name}: {module.n_head} heads do not split over {parts} ranks")
        _check_heads(name, module, style, chunks, parent, parts)
    _check_ties(model, targets)
    return targets


def _check_heads(name: str, module, style: str, chunks: int, parent, parts: int) -> None:
    """A projection into or out of attention heads must split on head boundaries.

    Hugging Face attention (Llama and its kin) views q/k/v's output as (-1, head_dim) heads and
    reads nothing else that counts them, so a slice of whole heads makes it attend over this
    rank's heads alone; grouped-query attention keeps its ratio (num_key_value_groups) when the
    query and the key/value heads both divide. A projection is recognised by its parent's
    `head_dim` and a width that is a multiple of it.
    """
    head_dim = getattr(parent, "head_dim", None)
    if style not in ("colwise", "rowwise") or not isinstance(head_dim, int):
        return
    width = module.out_features if style == "colwise" else module.in_features
    heads, rest = divmod(width // chunks, head_dim)
    if rest == 0 and heads % parts:
        raise ValueError(
            f"{name}: {heads} attention heads do not split over {parts} tensor-parallel ranks"
        )


def _check_ties(model: nn.Module, targets: dict[str, tuple[str, int]]) -> None:
    """A weight shared by several modules (an LM head tied to the embedding) must be split the
    same way in all of them, or in none: otherwise each would train its own copy."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for names in owners.values():
        splits = [targets.get(name.rpartition(".")[0]) for name in names]
        if len(names) < 2 or all(split is None or split[0] == "heads" for split in splits):
            continue
        rows = all(
            split is not None and split[0] in ROW_SPLIT and split[1] == 1 for split in splits
        )
        if not (rows and all(name.endswith(".weight") for name in names)):
            raise ValueError(
                f"tensor-parallel plan: {' and '.join(names)} are one tied parameter; split "
                f"all of its modules by rows ({', '.join(ROW_SPLIT)}) or none"
            )
