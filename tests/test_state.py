"""The training-state protocol: for every strategy, `state_dict()` of the model and of its
optimizer after k steps, loaded into a fresh prepare of the same strategy, then m more steps,
is bit-identical to k + m uninterrupted steps.

Each case trains three models on the same batches: one straight through, one for k steps whose
state is copied (as a checkpoint would) and which is then closed, and a fresh one that loads
that copy and trains the last m steps. The evidence is the gathered parameters of the first and
the third, compared exactly (`torch.equal`). Each strategy's state is exercised where it
matters: error-feedback residuals and random generators of the codecs, PowerSGD's Q matrices
and its start counter (k is past `start_iter`), the fp16 loss scale (halved by an overflow
before the copy), local SGD's step counter (the next average falls after the copy), adaptive
sync's reference point.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.nn.models import MLP, TinyGPT, lm_loss
from spawn import run

K, M = 3, 3  # steps before the copy, steps after it
BATCH = 4

DATA_PARALLEL = {
    "ddp": lambda: sw.DDP(bucket_mb=0.0005),
    "ddp_ring": lambda: sw.DDP(algorithm="ring"),
    "ddp_hierarchical": lambda: sw.DDP(algorithm="hierarchical", group_size=1),
    **{
        f"ddp_{codec}": (lambda codec=codec: sw.DDP(compression=codec, bucket_mb=0.0005))
        for codec in ("fp16", "bf16", "int8", "topk:0.3", "randomk:0.3", "sign", "powersgd:1:2")
    },
    "zero1": lambda: sw.ZeRO(stage=1, bucket_mb=0.0005),
    "zero2": lambda: sw.ZeRO(stage=2),
    "zero3": lambda: sw.ZeRO(stage=3),
    "zero2_fp16": lambda: sw.ZeRO(stage=2, mixed_precision="fp16"),
    "zero3_bf16": lambda: sw.ZeRO(stage=3, mixed_precision="bf16"),
    "zero1_cpu_offload": lambda: sw.ZeRO(stage=1, offload="cpu"),
    # ZeRO's codec state: int8's generator, top-k's residuals per unit, PowerSGD's Qs and count
    "zero1_int8": lambda: sw.ZeRO(stage=1, bucket_mb=0.0005, compression="int8"),
    "zero2_topk": lambda: sw.ZeRO(stage=2, bucket_mb=0.0005, compression="topk:0.3"),
    "zero3_powersgd": lambda: sw.ZeRO(stage=3, compression="powersgd:1:2"),
    "local_sgd": lambda: sw.LocalSGD(period=2, warmup_steps=1),
    "gossip": lambda: sw.Gossip(),
    "hybrid": lambda: sw.Hybrid(global_every=2),
    "adaptive": lambda: sw.AdaptiveSync(threshold=1e-3),
}
MODEL_PARALLEL = {  # world size 2
    "tp": lambda: sw.TensorParallel(),
    "pp_1f1b": lambda: sw.Pipeline(stages=2, schedule="1f1b", microbatches=2),
    "pp_gpipe": lambda: sw.Pipeline(stages=2, schedule="gpipe", microbatches=2),
}
MESHES = {  # world size 4
    "hsdp_zero3": lambda: sw.ZeRO(stage=3, shard_group=2),
    "mesh_dp2_tp2_ddp": lambda: sw.MeshParallel(dp=2, tp=2, data=sw.DDP()),
    "mesh_dp2_pp2_zero1": lambda: sw.MeshParallel(
        dp=2, pp=2, data=sw.ZeRO(stage=1), pipeline=sw.Pipeline(microbatches=2)
    ),
}


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP([13, 16, 5])


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=11, seq_len=8, d_model=16, n_layer=2, n_head=4)


def _mlp_batch(step: int, model: sw.strategies.base.DistributedModel, poison: bool):
    replicas, index = model.data_shard()
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(replicas * BATCH, 13, generator=g)
    y = torch.randint(0, 5, (replicas * BATCH,), generator=g)
    mine = slice(index * BATCH, (index + 1) * BATCH)
    x, y = x[mine], y[mine]
    if poison and step == 1 and dist.get_rank() == 1:
        x = x * 1e6  # beyond fp16's range: every rank skips this step, the scale halves
    return x, y, torch.nn.functional.cross_entropy


def _gpt_batch(step: int, model, poison: bool):
    replicas, index = model.data_shard()
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 11, (replicas * BATCH, 9), generator=g)
    mine = tokens[index * BATCH : (index + 1) * BATCH]
    return mine[:, :-1], mine[:, 1:], lm_loss


def _train(model, opt, steps: range, batch_fn, poison: bool) -> None:
    for step in steps:
        x, y, loss_fn = batch_fn(step, model, poison)
        sw.train_step(model, x, y, loss_fn)
        opt.step()
        opt.zero_grad()


def _prepare(factory, build_model):
    return sw.prepare(build_model(), factory(), optimizer=torch.optim.AdamW, lr=1e-2)


def roundtrips(
    table_name: str, gpt: bool, table: dict | None = None, checkpoint_dir: str | None = None
) -> dict[str, bool]:
    table = table or globals()[table_name]  # (strategies are built in the ranks: lambdas)
    build_model, batch_fn = (_gpt, _gpt_batch) if gpt else (_mlp, _mlp_batch)
    identical = {}
    for name in table:
        factory, poison = table[name], name == "zero2_fp16"  # (its loss scale)
        straight, straight_opt = _prepare(factory, build_model)
        _train(straight, straight_opt, range(K + M), batch_fn, poison)
        expected = sw.full_state_dict(straight)
        expected_state = copy.deepcopy((straight.state_dict(), straight_opt.state_dict()))
        expected_scale = _loss_scale(straight)
        straight.close()

        first, first_opt = _prepare(factory, build_model)
        _train(first, first_opt, range(K), batch_fn, poison)
        if checkpoint_dir:  # through files: the reshardable checkpoint and the strategy state
            sw.save_checkpoint(first, first_opt, f"{checkpoint_dir}/{name}", step=K)
        saved = copy.deepcopy((first.state_dict(), first_opt.state_dict()))
        first.close()

        resumed, resumed_opt = _prepare(factory, build_model)
        if checkpoint_dir:
            sw.load_checkpoint(resumed, resumed_opt, f"{checkpoint_dir}/{name}")
        else:
            resumed.load_state_dict(saved[0])
            resumed_opt.load_state_dict(saved[1])
        _train(resumed, resumed_opt, range(K, K + M), batch_fn, poison)
        got = sw.full_state_dict(resumed)
        got_state = (resumed.state_dict(), resumed_opt.state_dict())
        got_scale = _loss_scale(resumed)
        resumed.close()
        # The gathered parameters, and every tensor of the training state (loss scale, codec
        # residuals, counters, optimizer moments), end the same.
        identical[name] = (
            _same(got, expected)
            and _same(got_state, expected_state)
            and got_scale == expected_scale
        )
    return identical


def _loss_scale(model) -> float | None:
    """fp16's loss scale: it changes no weight until the next overflow, so look at it."""
    scaler = getattr(getattr(model, "masters", None), "scaler", None)
    return None if scaler is None else scaler.scale


def _same(a, b) -> bool:
    """Exact equality of nested dicts, lists and tensors (NaN never equals)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _assert_all_identical(results: list[dict[str, bool]]) -> None:
    for rank, identical in enumerate(results):
        assert all(identical.values()), f"rank {rank}: not bit-identical: " + ", ".join(
            name for name, same in identical.items() if not same
        )


def test_data_parallel_state_roundtrip_is_bit_identical():
    _assert_all_identical(run(roundtrips, 2, "DATA_PARALLEL", False))


def test_model_parallel_state_roundtrip_is_bit_identical():
    _assert_all_identical(run(roundtrips, 2, "MODEL_PARALLEL", True))


def test_mesh_state_roundtrip_is_bit_identical():
    _assert_all_identical(run(roundtrips, 4, "MESHES", True))


def disk_offload_roundtrip(directory: str) -> dict[str, bool]:
    table = {"zero2_disk": lambda: sw.ZeRO(stage=2, offload="disk", offload_dir=directory)}
    return roundtrips("", False, table)


def test_disk_offload_state_roundtrip_is_bit_identical(tmp_path):
    _assert_all_identical(run(disk_offload_roundtrip, 2, str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # each closed model removed its files


def checkpoint_roundtrips(directory: str) -> dict[str, bool]:
    table = {
        "ddp_powersgd:1:2": DATA_PARALLEL["ddp_powersgd:1:2"],
        "zero2_fp16": DATA_PARALLEL["zero2_fp16"],
        "zero3": DATA_PARALLEL["zero3"],
    }
    return roundtrips("", False, table, checkpoint_dir=directory)


def test_checkpoint_roundtrip_is_bit_identical(tmp_path):
    """save_checkpoint / load_checkpoint on the same ranks: the strategy state travels too
    (PowerSGD's factors and counter, the fp16 loss scale halved before the save)."""
    _assert_all_identical(run(checkpoint_roundtrips, 2, str(tmp_path)))


def plain_weights_load() -> list[bool]:
    """A single-process state dict loads into a prepared model of any strategy."""
    target = {k: v + 0.5 for k, v in _mlp().state_dict().items()}
    loaded = []
    for factory in (sw.DDP, sw.LocalSGD, sw.AdaptiveSync, lambda: sw.ZeRO(stage=3)):
        model, _ = sw.prepare(_mlp(), factory())
        model.load_state_dict(target)
        loaded.append(_same(sw.full_state_dict(model), target))
        model.close()
    return loaded


def test_plain_weights_load_into_every_prepared_model():
    assert all(all(loaded) for loaded in run(plain_weights_load, 2))


def state_is_not_shared_between_prepares() -> tuple[int, int]:
    """One strategy object prepares two models: options are frozen, state lives on models."""
    strategy = sw.AdaptiveSync(threshold=1e-3)
    a, a_opt = sw.prepare(_mlp(), strategy, optimizer=torch.optim.SGD, lr=0.1)
    b, _ = sw.prepare(_mlp(), strategy, optimizer=torch.optim.SGD, lr=0.1)
    _train(a, a_opt, range(2), _mlp_batch, False)
    return len(a.drift_history), len(b.drift_history)


def test_one_strategy_prepares_two_models():
    assert run(state_is_not_shared_between_prepares, 2) == [(2, 0), (2, 0)]
    with pytest.raises(AttributeError):  # frozen options
        sw.DDP().bucket_mb = 1.0
