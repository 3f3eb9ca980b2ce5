"""A Hugging Face model as pipeline layers: its embeddings, each block, the final norm, the head.

A transformers model's forward is one function over its whole depth; a pipeline needs layers in
order. Each layer here is a `Piece`: the HF submodules it owns (and trains) and a function of
(hidden state, micro-batch), the micro-batch being the dict of the model's forward arguments
(input_ids, attention_mask, labels, pixel_values ...). Every stage holds the batch (the ranks of
a pipeline share it), so only the hidden state travels between stages, and what the model's
forward computes once for all its blocks (the causal or bidirectional attention mask, the
positions, Llama's rotary cos/sin) each block computes again from the micro-batch: the same
small tensors.

Which models:
- a causal LM whose config carries `base_model_pp_plan` (Llama and the models built like it):
  the plan names the base model's children in order (embed_tokens, layers, norm), the class's
  `_pp_plan` its head (lm_head);
- by adapters here: GPT2LMHeadModel (wte + wpe), BertForSequenceClassification (token types
  default to zeros in HF's embeddings; pooler + classifier), ViTForImageClassification (CLS
  token; final layernorm, classifier on token 0), ResNetForImageClassification (embedder,
  stages, pooler, classifier).
A causal LM whose layers attend through a sliding window is refused (each block here gets the
plain causal mask), and so is any other model, in one line naming it. Each split is checked
when it is made: the pieces in a row must give the model's own logits on a small sample, or the
model is refused (one built like Llama that scales its embeddings in its forward, say, would
otherwise train wrong without a word). A model whose parameters are on the meta device cannot
run: its split is checked by structure alone (that check is the user's, on a real build).

The last piece returns the model's own output class with HF's own loss (`model.loss_function`:
ForCausalLMLoss, which shifts the labels; classification cross-entropy), so a user trains on
`output.loss` as on `model(**batch).loss`. A micro-batch's loss is weighted by its share of the
items that loss averages over (tokens with a label after the shift, labelled samples), so the
step's loss is the whole batch's however the -100 labels fall. Every rank passes the batch:
`sw.train_step(model, batch, None, lambda out, _: out.loss)`; `model(**batch)` evaluates.

A weight two pieces share (GPT-2's tied wte and lm_head) stays one Parameter; when the pieces
land on different stages, the pipeline sums its gradient between them (pipeline_tied.py).
BatchNorm (ResNet) normalises each micro-batch by its own statistics, as in GPipe (Huang et al.,
2019): training equals one process accumulating gradients over the same micro-batches, and
equals one forward of the whole batch only with microbatches=1.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from shardwise.nn.meta_init import has_meta_parameters
from shardwise.strategies.batch_share import batch_samples
from shardwise.strategies.pipeline_stages import Microbatch

IGNORE = -100  # HF's label for "not scored"


def is_hf_model(model: nn.Module) -> bool:
    """Whether `model` is a transformers PreTrainedModel (without importing transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(model).__mro__
    )


class Piece(nn.Module):
    """Part of an HF model as a pipeline layer: `run(parts, hidden, batch)`, `parts` being the
    HF submodules it owns (the first piece gets hidden=None and reads the batch)."""

    def __init__(self, run: Callable, **parts: nn.Module) -> None:
        super().__init__()
        self.run = run
        self.parts = nn.ModuleDict(parts)

    def forward(self, hidden: torch.Tensor | None, batch: Mapping[str, Any]) -> Any:
        return self.run(self.parts, hidden, batch)


class Head(Piece):
    """The last piece: logits, returned as the model's own output class (`output_cls`, found
    by running the model once), with HF's own loss where the micro-batch has labels."""

    def __init__(self, run: Callable, loss: Callable, **parts: nn.Module) -> None:
        super().__init__(run, **parts)
        self.loss, self.output_cls = loss, None

    def forward(self, hidden: torch.Tensor, batch: Mapping[str, Any]) -> Any:
        logits = self.run(self.parts, hidden, batch)
        labels = batch.get("labels")
        loss = None if labels is None else self.loss(logits, labels)
        return self.output_cls(loss=loss, logits=logits)


# ---- what each piece runs ------------------------------------------------------------------------
def _apply(parts, hidden, batch):  # a final norm, a ResNet stage
    return parts.module(hidden)


def _positions(batch, like: torch.Tensor) -> torch.Tensor:
    given = batch.get("position_ids")
    return given if given is not None else torch.arange(like.shape[1], device=like.device)[None]


def _token_embed(parts, hidden, batch):
    return parts.module(batch["input_ids"])


def _gpt2_embed(parts, hidden, batch):  # GPT2Model.forward's order of additions
    ids = batch["input_ids"]
    hidden = parts.wte(ids) + parts.wpe(_positions(batch, ids))
    if batch.get("token_type_ids") is not None:
        hidden = hidden + parts.wte(batch["token_type_ids"])
    return parts.drop(hidden)


def _decoder_block(parts, hidden, batch, *, config, causal_mask):
    # The model's forward builds this mask once for all blocks; without an attention_mask in
    # the batch it is plain causal (or None, where the attention kernel is causal by itself).
    positions = _positions(batch, hidden)
    mask = causal_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=batch.get("attention_mask"),
        cache=None,
        position_ids=positions,
    )
    extra = {"position_embeddings": parts.rotary(hidden, positions)} if "rotary" in parts else {}
    return parts.block(hidden, attention_mask=mask, position_ids=positions, **extra)


def _encoder_block(parts, hidden, batch, *, config, bidirectional_mask):
    mask = bidirectional_mask(
        config=config, inputs_embeds=hidden, attention_mask=batch.get("attention_mask")
    )
    return parts.block(hidden, mask)


def _bert_embed(parts, hidden, batch):
    return parts.embeddings(
        input_ids=batch["input_ids"],
        token_type_ids=batch.get("token_type_ids"),
        position_ids=batch.get("position_ids"),
    )


def _vit_embed(parts, hidden, batch):
    embeddings = parts.embeddings
    pixels = batch["pixel_values"].to(embeddings.patch_embeddings.projection.weight.dtype)
    return embeddings(pixels, interpolate_pos_encoding=batch.get("interpolate_pos_encoding"))


def _image_embed(parts, hidden, batch):
    return parts.embedder(batch["pixel_values"])


def _lm_logits(parts, hidden, batch):
    return parts.head(hidden)


def _bert_logits(parts, hidden, batch):  # the pooler reads token 0
    return parts.classifier(parts.dropout(parts.pooler(hidden)))


def _pooled_logits(parts, hidden, batch):  # ResNet: average pool, then flatten + linear
    return parts.classifier(parts.pooler(hidden))


def _first_token_logits(parts, hidden, batch):  # ViT: the CLS token
    return parts.classifier(hidden[:, 0, :])


def _causal_loss(model) -> Callable:
    function, vocab_size = model.loss_function, model.config.vocab_size
    return lambda logits, labels: function(logits, labels, vocab_size=vocab_size)


def _classifier_loss(model) -> Callable:
    function, config = model.loss_function, model.config
    return lambda logits, labels: function(labels, logits, config)


# ---- the models ----------------------------------------------------------------------------------
def _masks():
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    return create_causal_mask, create_bidirectional_mask


def _planned_causal_lm(model) -> list[nn.Module]:
    """The base model's children in the order of `config.base_model_pp_plan`: the first embeds
    input_ids, a ModuleList holds the decoder blocks, the rest map hidden -> hidden."""
    base, prefix, config = model.base_model, model.base_model_prefix + ".", model.config
    heads = [name for name in getattr(model, "_pp_plan", None) or {} if not name.startswith(prefix)]
    if len(heads) != 1:
        raise _cannot(model, f"its class's _pp_plan names {len(heads)} heads, not one")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or (
        not hasattr(config, "layer_types") and getattr(config, "sliding_window", None)
    ):  # each block here gets the plain causal mask
        raise _cannot(model, "some of its layers attend through a sliding window")
    block = partial(_decoder_block, config=base.config, causal_mask=_masks()[0])
    rotary = {"rotary": base.rotary_emb} if hasattr(base, "rotary_emb") else {}
    pieces: list[nn.Module] = []
    for name in config.base_model_pp_plan:
        module = getattr(base, name)
        if isinstance(module, nn.ModuleList):
            pieces += [Piece(block, block=b, **rotary) for b in module]
        else:
            pieces.append(Piece(_apply if pieces else _token_embed, module=module))
    head = Head(_lm_logits, _causal_loss(model), head=getattr(model, heads[0]))
    return [*pieces, head]


def _gpt2(model) -> list[nn.Module]:
    base = model.transformer
    block = partial(_decoder_block, config=base.config, causal_mask=_masks()[0])
    return [
        Piece(_gpt2_embed, wte=base.wte, wpe=base.wpe, drop=base.drop),
        *(Piece(block, block=b) for b in base.h),
        Piece(_apply, module=base.ln_f),
        Head(_lm_logits, _causal_loss(model), head=model.lm_head),
    ]


def _bert(model) -> list[nn.Module]:
    base = model.bert
    block = partial(_encoder_block, config=base.config, bidirectional_mask=_masks()[1])
    head = Head(
        _bert_logits, _classifier_loss(model),
        pooler=base.pooler, dropout=model.dropout, classifier=model.classifier,
    )  # fmt: skip
    return [
        Piece(_bert_embed, embeddings=base.embeddings),
        *(Piece(block, block=b) for b in base.encoder.layer),
        head,
    ]


def _vit(model) -> list[nn.Module]:
    base = model.vit
    block = partial(_encoder_block, config=base.config, bidirectional_mask=_masks()[1])
    return [
        Piece(_vit_embed, embeddings=base.embeddings),
        *(Piece(block, block=b) for b in base.layers),
        Piece(_apply, module=base.layernorm),
        Head(_first_token_logits, _classifier_loss(model), classifier=model.classifier),
    ]


def _resnet(model) -> list[nn.Module]:
    base = model.resnet
    loss = _classifier_loss(model)
    return [
        Piece(_image_embed, embedder=base.embedder),
        *(Piece(_apply, module=stage) for stage in base.encoder.stages),
        Head(_pooled_logits, loss, pooler=base.pooler, classifier=model.classifier),
    ]


# ---- choosing, checking, feeding -----------------------------------------------------------------
def _text_sample(model, device, dtype) -> dict[str, torch.Tensor]:
    length = min(4, getattr(model.config, "max_position_embeddings", 4))
    ids = torch.arange(2 * length, device=device) % model.config.vocab_size
    return {"input_ids": ids.reshape(2, length)}


def _image_sample(model, device, dtype, size: int | None = None) -> dict[str, torch.Tensor]:
    c = model.config
    size = size or c.image_size
    shape = (2, c.num_channels, size, size)
    pixels = torch.linspace(-1, 1, 2 * c.num_channels * size * size, device=device, dtype=dtype)
    return {"pixel_values": pixels.reshape(shape)}


def _labelled_tokens(batch) -> int:
    """Tokens ForCausalLMLoss scores: token t against label t+1, -100 skipped."""
    labels = batch.get("labels")
    return batch_samples(batch) if labels is None else int((labels[..., 1:] != IGNORE).sum())


def _labelled_samples(batch) -> int:
    labels = batch.get("labels")
    if labels is None or labels.is_floating_point():  # regression, multi-label: every sample
        return batch_samples(batch)
    return int((labels != IGNORE).sum())


# class name -> (pieces, sample input, what its loss averages over)
ADAPTERS = {
    "GPT2LMHeadModel": (_gpt2, _text_sample, _labelled_tokens),
    "BertForSequenceClassification": (_bert, _text_sample, _labelled_samples),
    "ViTForImageClassification": (_vit, _image_sample, _labelled_samples),
    "ResNetForImageClassification": (_resnet, partial(_image_sample, size=64), _labelled_samples),
}


def _cannot(model, why: str | None = None) -> ValueError:
    why = why or (
        f"it is neither a causal LM with config.base_model_pp_plan nor one of {', '.join(ADAPTERS)}"
    )
    return ValueError(
        f"Pipeline cannot split {type(model).__name__} into stages: {why}; pass an "
        "nn.Sequential or a module with pipeline_layers() (its layers in order)"
    )


def _adapter(model) -> tuple:
    for cls in type(model).__mro__:
        if cls.__name__ in ADAPTERS:
            return ADAPTERS[cls.__name__]
    causal_lm = any(cls.__name__.endswith("ForCausalLM") for cls in type(model).__mro__)
    if causal_lm and getattr(model.config, "base_model_pp_plan", None):
        return _planned_causal_lm, _text_sample, _labelled_tokens
    raise _cannot(model)


@torch.no_grad()
def _eval_run(model: nn.Module, run: Callable) -> Any:
    """`run()` with dropout off and BatchNorm's running statistics untouched."""
    training = model.training
    model.eval()
    try:
        return run()
    finally:
        model.train(training)


def hf_layers(model: nn.Module) -> tuple[list[nn.Module], HFFeed]:
    """`model`'s pieces in order and the feed of its batches; a ValueError naming the model if
    it cannot be split, or if its pieces do not reproduce its own forward. Nothing runs on
    meta-device parameters: a meta model's split is checked by its structure alone (the
    adapter found every piece), its output class is the one its forward declares."""
    pieces_of, sample_of, items = _adapter(model)
    pieces = pieces_of(model)
    if has_meta_parameters(model):
        output_cls = _declared_output(model)
    else:
        output_cls = _checked_output(model, pieces, sample_of)
    pieces[-1].output_cls = output_cls
    return pieces, HFFeed(items, output_cls)


def _checked_output(model: nn.Module, pieces: list[nn.Module], sample_of: Callable) -> type:
    """The model's output class, once its pieces in a row gave its own logits on a sample."""
    first = next(model.parameters())
    sample = sample_of(model, first.device, first.dtype)
    expected = _eval_run(model, lambda: model(**sample))
    pieces[-1].output_cls = type(expected)

    def through_pieces():
        hidden = None
        for piece in pieces:
            hidden = piece(hidden, sample)
        return hidden

    got = _eval_run(model, through_pieces).logits
    if got.shape != expected.logits.shape or not torch.allclose(got, expected.logits, 1e-3, 1e-3):
        raise _cannot(model, "its pieces do not reproduce its forward (it does more than its plan)")
    return type(expected)


def _declared_output(model: nn.Module) -> type:
    """The ModelOutput class in the return annotation of the model's forward."""
    try:
        declared = typing.get_type_hints(type(model).forward).get("return")
    except (NameError, TypeError):
        declared = None
    for cls in (declared, *typing.get_args(declared)):
        if isinstance(cls, type) and hasattr(cls, "logits"):
            return cls
    raise _cannot(model, "its forward declares no output class, which a meta model needs")


class HFFeed:
    """An HF model's batch: the dict of its forward's arguments, on every stage, cut into
    micro-batches (every tensor whose first dimension is the batch's); the first stage's
    pieces read it, the last's scores the labels."""

    def __init__(self, items: Callable, output_cls: type) -> None:
        self.items, self.output_cls = items, output_cls

    def _batch(self, inputs: Any, targets: Any) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise ValueError(
                "a pipeline of a Hugging Face model takes the batch as a dict of the model's "
                f"forward arguments (input_ids, labels ...) on every stage, not a "
                f"{type(inputs).__name__}"
            )
        return dict(inputs) if targets is None else {**inputs, "labels": targets}

    def split(self, inputs: Any, targets: Any, m: int, first: bool, last: bool) -> list:
        batch = self._batch(inputs, targets)
        n = batch_samples(batch)
        if n % m:
            raise ValueError(f"batch of {n} does not split into {m} micro-batches")
        chunks: list[dict[str, Any]] = [{} for _ in range(m)]
        for key, value in batch.items():
            cut = torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n
            for chunk, part in zip(chunks, value.chunk(m) if cut else [value] * m, strict=True):
                chunk[key] = part
        counts = [self.items(chunk) for chunk in chunks]
        if 0 in counts:  # HF's mean over nothing is NaN
            raise ValueError(
                f"micro-batch {counts.index(0)} of {m} has no labelled item (all labels -100): "
                "use fewer micro-batches or spread the labelled rows"
            )
        total = sum(counts)
        return [
            Microbatch(None, (c,), c.get("labels"), total / k)
            for c, k in zip(chunks, counts, strict=True)
        ]

    def whole(self, inputs: Any) -> tuple[Any, tuple]:
        return None, (self._batch(inputs, None),)

    def pack(self, output: Any) -> list[torch.Tensor]:
        loss = [] if output.loss is None else [output.loss.detach().reshape(1)]
        return [output.logits, *loss]

    def count(self, context: tuple) -> int:
        return 1 if context[0].get("labels") is None else 2

    def unpack(self, tensors: list[torch.Tensor]) -> Any:
        loss = tensors[1].reshape(()) if len(tensors) > 1 else None
        return self.output_cls(loss=loss, logits=tensors[0])
