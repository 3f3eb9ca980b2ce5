"""Global magnitude pruning under sharding: the mask under ZeRO-3 (world 1, 2, 4), ZeRO-1 (4) and
tensor parallel (world 2, 4) is bit for bit the one a single process draws, the k smallest |w| of
the whole model computed here with `kthvalue`; a gradual schedule over 100 steps under ZeRO-3
ends at exactly its sparsity, the pruned weights and their Adam moments still zero; a ZeRO-3
checkpoint of 4 ranks resumed on 2 keeps the mask its files hold; the 2:4 mask under ZeRO-3
(world 2, 4) and tensor parallel (world 4) is the single process's, groups straddling shards
included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.checkpoint.reshardable import read_full_state
from shardwise.checkpoint.run_checkpoint import SHARDED, complete
from shardwise.nn.models import TinyGPT
from spawn import run

SPARSITY = 0.6


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 11), nn.LayerNorm(11), nn.Tanh(), nn.Linear(11, 5))


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=11, seq_len=8, d_model=16, n_layer=2, n_head=4)


def _expected_kept(model: nn.Module, sparsity: float) -> dict[str, torch.Tensor]:
    """One process, by definition: the k smallest magnitudes over every weight of 2+ dims."""
    weights = {k: v for k, v in model.state_dict().items() if v.dim() >= 2}
    magnitudes = torch.cat([v.abs().reshape(-1) for v in weights.values()])
    k = int(sparsity * magnitudes.numel())
    threshold = magnitudes.kthvalue(k).values
    return {name: w.abs() > threshold for name, w in weights.items()}


def _kept_after_prune(make, strategy: sw.Strategy) -> dict[str, bool]:
    """Whether each prunable weight's mask, read from the weights the strategy holds after
    one prune (pruned ones are 0), is the single process's."""
    model, opt = sw.prepare(make(), strategy, lr=1e-2)
    sw.GlobalMagnitudePruner(model, opt, SPARSITY).prune(SPARSITY)
    state = sw.full_state_dict(model)
    expected = _expected_kept(make(), SPARSITY)
    model.close()
    return {name: torch.equal(state[name] != 0, kept) for name, kept in expected.items()}


def _train(model, opt, pruner, steps: int, world_batch: int = 12) -> None:
    replicas, index = sw.data_shard(model)
    share = world_batch // replicas
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(world_batch, 7, generator=g),
            torch.randint(0, 5, (world_batch,), generator=g),
        )
        sw.train_step(
            model, x[index * share :][:share], y[index * share :][:share], F.cross_entropy
        )
        opt.step()
        opt.zero_grad()
        pruner.step()


def _gradual() -> dict[str, float]:
    """ZeRO-3, cubic from step 10 to 60 every 10 steps, 100 AdamW steps: the final sparsity
    of the prunable weights, and the largest Adam moment left on a pruned weight."""
    model, opt = sw.prepare(_mlp(), sw.ZeRO(stage=3), lr=1e-2)
    pruner = sw.GlobalMagnitudePruner(model, opt, SPARSITY, start=10, end=60, every=10)
    _train(model, opt, pruner, 100)
    state = sw.full_state_dict(model)
    weights = [v for v in state.values() if v.dim() >= 2]
    zeros = sum(int((w == 0).sum()) for w in weights)
    moments = max(
        float((s[key] * ~pruner.masks[id(p)]).abs().max())
        for p, s in opt.state.items()
        for key in ("exp_avg", "exp_avg_sq")
    )
    model.close()
    return {"zeros": zeros, "prunable": sum(w.numel() for w in weights), "moments": moments}


def _pruned_on_4(root: str) -> None:
    """ZeRO-3 at 4 ranks: pruned at the first step, trained 3, checkpointed."""
    model, opt = sw.prepare(_mlp(), sw.ZeRO(stage=3), lr=1e-2)
    _train(model, opt, sw.GlobalMagnitudePruner(model, opt, SPARSITY), 3)
    saver = sw.Checkpointer(root, model, opt, asynchronous=False)
    saver.save(3)
    saver.close()
    model.close()


def _resumed_on_2(root: str) -> dict[str, torch.Tensor]:
    """The 4 ranks' checkpoint resumed at 2 (resharded): the masks the pruner takes from it,
    then the weights' zeros after 5 more steps."""
    model, opt = sw.prepare(_mlp(), sw.ZeRO(stage=3), lr=1e-2)
    step, _ = sw.Checkpointer(root, model, opt).resume()
    pruner = sw.GlobalMagnitudePruner(model, opt, SPARSITY)
    pruner.resume(step)
    masks = {(k, "resumed"): v != 0 for k, v in sw.full_state_dict(model).items() if v.dim() >= 2}
    _train(model, opt, pruner, 5)
    trained = sw.full_state_dict(model)
    model.close()
    return {**masks, **{(k, "trained"): trained[k] != 0 for k, _ in masks}}


def _mlp8() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 5))


def _expected_nm(model: nn.Module, n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """One process, by definition: the n largest |w| of each m along the last dimension."""
    kept = {}
    for name, w in model.state_dict().items():
        if w.dim() >= 2:
            groups = w.abs().reshape(-1, m)
            keep = torch.zeros_like(groups, dtype=torch.bool)
            keep.scatter_(1, groups.topk(n, dim=1).indices, True)
            kept[name] = keep.view_as(w)
    return kept


def _nm_kept(make, strategy: sw.Strategy) -> dict[str, bool]:
    """Whether each weight's 2:4 mask under the strategy is the single process's, after the
    prune and after 3 more AdamW steps on random batches."""
    model, opt = sw.prepare(make(), strategy, lr=1e-2)
    pruner = sw.NMPruner(model, opt, 2, 4)
    pruner.step()  # (start 0: prunes on the first call)
    expected = _expected_nm(make())
    pruned = sw.full_state_dict(model)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        if make is _gpt:
            idx = torch.randint(0, 11, (4, 9), generator=g)
            x, y = idx[:, :-1], idx[:, 1:]
            loss = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731
        else:
            x, y, loss = (
                torch.randn(4, 8, generator=g),
                torch.randint(0, 5, (4,), generator=g),
                F.cross_entropy,
            )
        sw.train_step(model, x, y, loss)
        opt.step()
        opt.zero_grad()
        pruner.step()
    trained = sw.full_state_dict(model)
    model.close()
    return {
        f"{name} {when}": torch.equal(state[name] != 0, kept)
        for name, kept in expected.items()
        for when, state in (("pruned", pruned), ("trained", trained))
    }


def _ranks(root: str) -> dict:
    out = {"zero3 mlp": _kept_after_prune(_mlp, sw.ZeRO(stage=3))}
    out["2:4 zero3 mlp"] = _nm_kept(_mlp8, sw.ZeRO(stage=3))
    out["zero3 gpt"] = _kept_after_prune(_gpt, sw.ZeRO(stage=3))
    if torch.distributed.get_world_size() == 4:
        out["zero1 mlp"] = _kept_after_prune(_mlp, sw.ZeRO(stage=1, bucket_mb=0.0003))
        out["tp4 gpt"] = _kept_after_prune(_gpt, sw.TensorParallel())
        out["2:4 tp4 gpt"] = _nm_kept(_gpt, sw.TensorParallel())
        _pruned_on_4(root)
    else:
        out["tp2 gpt"] = _kept_after_prune(_gpt, sw.TensorParallel())
        out["gradual"] = _gradual()
        out["resharded"] = _resumed_on_2(root)
    return out


def test_the_mask_is_one_process_s_sparsity_holds_and_survives_a_4_to_2_reshard(tmp_path):
    # World 4 prunes and checkpoints under ZeRO-3; world 2 resumes it (resharded).
    for world in (4, 2):
        for result in run(_ranks, world, str(tmp_path), timeout_s=300):
            if world == 2:
                gradual = result.pop("gradual")
                assert gradual["zeros"] == int(SPARSITY * gradual["prunable"]), gradual
                assert gradual["moments"] == 0.0
                resharded = result.pop("resharded")
            for name, kept in result.items():
                assert kept and all(kept.values()), (name, kept)
    # The mask as the 4 ranks saved it (the checkpoint files' zeros) is the 2 ranks' mask,
    # and still theirs after 5 more steps.
    saved, _, _ = read_full_state(complete(tmp_path / "checkpoints")[-1] / SHARDED)
    weights = {k: v for k, v in saved.items() if v.dim() >= 2}
    pruned = sum(int((w == 0).sum()) for w in weights.values())
    assert pruned == int(SPARSITY * sum(w.numel() for w in weights.values()))
    for name, w in weights.items():
        assert torch.equal(resharded[(name, "resumed")], w != 0), name
        assert torch.equal(resharded[(name, "trained")], w != 0), name


def test_one_process_and_bad_options():
    sw.init()  # a world of one
    assert all(_kept_after_prune(_mlp, sw.ZeRO(stage=3)).values())
    plain = _mlp()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    sw.GlobalMagnitudePruner(plain, opt, 0.5).prune(0.5)
    expected = _expected_kept(_mlp(), 0.5)
    assert all(torch.equal(plain.state_dict()[k] != 0, v) for k, v in expected.items())
    # Resumed before any step (`--resume` that found no checkpoint yet): the first step
    # prunes as a fresh run's does (before, the resume's masks kept every weight for good).
    for make_pruner in (lambda m, o: sw.GlobalMagnitudePruner(m, o, 0.5), sw.NMPruner):
        model = _mlp8()
        frozen = torch.optim.SGD(model.parameters(), lr=0.0)
        pruner = make_pruner(model, frozen)
        pruner.resume(0)
        frozen.step()
        pruner.step()
        weights = [p for p in model.parameters() if p.dim() >= 2]
        zeros = sum(int((p == 0).sum()) for p in weights)
        assert zeros == sum(p.numel() for p in weights) // 2, make_pruner
    with pytest.raises(ValueError, match=r"shape \(11, 7\) \(on this rank\) has 7"):
        sw.NMPruner(plain, opt, 2, 4)  # groups of 4 along 7 inputs
    with pytest.raises(ValueError, match="0 < N < M"):
        sw.NMPruner(_mlp8(), opt, 4, 4)
    for options, words in [
        (dict(sparsity=1.0), r"sparsity must be in \[0, 1\)"),
        (dict(sparsity=0.5, start=5, end=2), "start <= end"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            sw.GlobalMagnitudePruner(plain, opt, **options)
        assert "\n" not in str(err.value)
