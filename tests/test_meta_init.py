"""Models built with their parameters on the meta device take their values from a source: each
ZeRO-3 rank reads only its own slice of each unit, replicated strategies read whole tensors;
either way the model equals the one built whole, and trains as one process does from the same
weights. Bad sources are one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_models as H
import shardwise as sw
from spawn import run

STEPS, BATCH, LR = 10, 2, 1e-3


class DictSource:
    """A source over a state dict in memory (independent of any file reader), counting reads."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.elements_read = state, 0

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def read(self, name: str) -> torch.Tensor:
        self.elements_read += self.state[name].numel()
        return self.state[name].clone()

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        self.elements_read += stop - start
        return self.state[name].reshape(-1)[start:stop].clone()


def _train(model, opt, kind: str, world: int, rank: int, share: int) -> None:
    for step in range(STEPS):
        batch = H.make_batch(kind, world * BATCH, step)
        model(**H.rows(batch, rank * share, (rank + 1) * share)).loss.backward()
        opt.step()
        opt.zero_grad()


def from_pretrained_weights(kind: str) -> dict:
    """ "Pretrained" weights (another seed) into a meta-device model: the loaded model, and 10
    AdamW steps from it, against one process training from the same weights."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pretrained = H.build(kind, seed=7).state_dict()
    reference = H.build(kind)
    reference.load_state_dict(pretrained)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    _train(reference, ref_opt, kind, world, 0, world * BATCH)
    out = {}
    for name, strategy in (("zero3", sw.ZeRO(stage=3)), ("ddp", sw.DDP())):
        with sw.empty_parameters():
            model = H.build(kind)
        meta = all(p.is_meta for p in model.parameters())
        source = DictSource(pretrained)
        wrapped, opt = sw.prepare(model, strategy, lr=LR, source=source)
        loaded = wrapped.full_state_dict()
        out[name] = {
            "meta": meta,
            "loaded_exactly": all(torch.equal(loaded[k], v) for k, v in pretrained.items()),
            "read": source.elements_read,
        }
        _train(wrapped, opt, kind, world, rank, BATCH)
        trained = wrapped.full_state_dict()
        out[name]["diff"] = max(
            (trained[k] - v).abs().max().item() for k, v in reference.state_dict().items()
        )
        wrapped.close()
    # (a tied weight is one tensor under two names)
    out["numel"] = sum({v.data_ptr(): v.numel() for v in pretrained.values()}.values())
    return out


@pytest.mark.parametrize("kind", ["gpt2", "resnet"])
def test_meta_model_loads_its_own_shards_and_trains_as_one_process(kind):
    for r in run(from_pretrained_weights, 2, kind):
        for name in ("zero3", "ddp"):
            assert r[name]["meta"] and r[name]["loaded_exactly"], (name, r)
            assert r[name]["diff"] <= 1e-5, (name, r)
        # ZeRO-3 reads about half of the weights per rank (frozen and buffers whole); DDP all.
        assert r["ddp"]["read"] >= r["numel"] * 0.99
        assert r["zero3"]["read"] < 0.6 * r["numel"], r


def bad_sources() -> list[str]:
    errors = []
    good = H.build("gpt2").state_dict()
    for source in (None, DictSource({}), DictSource({k: v[:1] for k, v in good.items()})):
        with sw.empty_parameters():
            model = H.build("gpt2")
        try:
            sw.prepare(model, sw.ZeRO(stage=1), lr=LR, source=source)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_a_missing_source_or_tensor_or_a_wrong_shape_is_one_line():
    no_source, missing, shape = run(bad_sources, 1)[0]
    assert "meta device" in no_source and "source=" in no_source
    assert "has no tensor 'transformer.wte.weight'" in missing
    assert "shape (1, 16)" in shape and "(37, 16)" in shape
    assert all("\n" not in e for e in (no_source, missing, shape))
