"""ZeRO stages 1-3 against single-process training and our DDP; bytes and memory by formula."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.bench.floor import bare_collectives, calls_of
from shardwise.comm import shared_memory
from shardwise.nn.models import MLP, TinyGPT, lm_loss
from shardwise.observe.memory import model_state_bytes
from spawn import run
from state_diff import max_abs_diff

STEPS = 20
BATCH = 4  # per rank


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":  # 427 parameters: not divisible by 2 or 4, nor are two of its units
        return MLP([13, 16, 9, 5])
    return TinyGPT(vocab_size=11, seq_len=8, d_model=16, n_layer=2, n_head=2)


def _batch(kind: str, step: int, world: int):
    g = torch.Generator().manual_seed(500 + step)
    if kind == "mlp":
        return torch.randn(world * BATCH, 13, generator=g), torch.randint(
            0, 5, (world * BATCH,), generator=g
        )
    tokens = torch.randint(0, 11, (world * BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _local(t: torch.Tensor) -> torch.Tensor:
    r = dist.get_rank()
    return t[r * BATCH : (r + 1) * BATCH]


def _loss(kind: str):
    return F.cross_entropy if kind == "mlp" else lm_loss


class _Abort(Exception):
    """Raised by a hook inside backward."""


def _abort_midway(model: nn.Module, aborting: list) -> nn.Module:
    """`model`, its backward raising (while `aborting`) once the gradients past its first
    hidden layer or block are made: some reductions launched, the others not."""
    middle = model.blocks[0] if hasattr(model, "blocks") else model[1]

    def hook(module, inputs, output):
        if aborting:
            output.register_hook(lambda grad: (_ for _ in ()).throw(_Abort()))

    middle.register_forward_hook(hook)
    return model


def train_three_ways(kind: str, stage: int, clip: float | None, keep_mb: float = 0.0):
    """ZeRO, our DDP and a single-process reference on the same global batches; twice a
    backward of ZeRO's and DDP's raises half way on every rank, and is taken back (zero_grad)
    before the step's own."""
    world, loss_fn = dist.get_world_size(), _loss(kind)
    aborting: list[bool] = []
    # Adam divides by sqrt(v): near-zero gradients amplify rounding, so the transformer gets the
    # smaller learning rate it would train with anyway.
    lr = 1e-2 if kind == "mlp" else 1e-3
    reference = _model(kind)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    zero, zero_opt = sw.prepare(
        _abort_midway(_model(kind), aborting),
        sw.ZeRO(stage=stage, bucket_mb=0.0005, keep_gathered_mb=keep_mb),
        lr=lr,
    )
    ddp, ddp_opt = sw.prepare(_abort_midway(_model(kind), aborting), sw.DDP(), lr=lr)
    for step in range(STEPS):
        x, y = _batch(kind, step, world)
        loss_fn(reference(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        for model, opt in ((zero, zero_opt), (ddp, ddp_opt)):
            if step in (3, 8):  # (on other data: what it made must not count)
                aborting.append(True)
                with contextlib.suppress(_Abort):
                    loss_fn(model(_local(x).flip(0)), _local(y)).backward()
                aborting.clear()
                opt.zero_grad()
            if step == 8:  # the step's batch in two halves, the first's gradients kept local
                half = BATCH // 2
                with model.no_sync():
                    (loss_fn(model(_local(x)[:half]), _local(y)[:half]) / 2).backward()
                (loss_fn(model(_local(x)[half:]), _local(y)[half:]) / 2).backward()
            else:
                loss_fn(model(_local(x)), _local(y)).backward()
            if keep_mb and model is zero:  # a forward whose backward never comes (a metric):
                model(_local(x))  # the units it leaves gathered must not outlive the step
            if clip:
                sw.clip_grad_norm_(model, clip)
            opt.step()
            opt.zero_grad()
    ours = sw.full_state_dict(zero)
    return max_abs_diff(ours, reference.state_dict()), max_abs_diff(ours, sw.full_state_dict(ddp))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_equals_single_process_and_ddp(world_size, stage):
    # 1e-5 in float32: only the order of the sums over ranks differs from the reference.
    for vs_reference, vs_ddp in run(train_three_ways, world_size, "mlp", stage, None):
        assert vs_reference <= 1e-5
        assert vs_ddp <= 1e-5


# 0.02 MiB keeps the last block, the final norm and the head gathered, not the first block.
@pytest.mark.parametrize("stage, keep_mb", [(2, 0.0), (3, 0.0), (3, 0.02)])
def test_zero_on_a_transformer_with_clipping(stage, keep_mb):
    # Units are blocks, embeddings and head; clipping needs the norm over all ranks' shards.
    for vs_reference, vs_ddp in run(train_three_ways, 2, "gpt", stage, 0.05, keep_mb):
        assert vs_reference <= 1e-5
        assert vs_ddp <= 1e-5


def clipping_is_active():
    model, _ = sw.prepare(_model("mlp"), sw.ZeRO(stage=3), lr=1e-2)
    x, y = _batch("mlp", 0, dist.get_world_size())
    F.cross_entropy(model(_local(x)), _local(y)).backward()
    before = sw.clip_grad_norm_(model, 1e-3).item()
    after = sw.clip_grad_norm_(model, 1e3).item()  # returns the (already clipped) norm
    return before, after


def test_clip_returns_the_global_norm_and_clips_to_it():
    for before, after in run(clipping_is_active, 2):
        assert before > 1e-3
        assert after == pytest.approx(1e-3, rel=1e-3)


KEPT_MB = 0.02  # the last block (13 KB), not the one before it too (see below)


def bytes_per_step():
    """One step's counted bytes for each stage (one process group serves all), and stage 3
    keeping some units gathered from forward to backward: none, the budget's, the default's."""
    world, out = dist.get_world_size(), {}
    for stage, keep_mb in ((1, 0.0), (2, 0.0), (3, 0.0), (3, KEPT_MB), (3, None)):
        strategy = sw.ZeRO(stage=stage, bucket_mb=0.001, keep_gathered_mb=keep_mb)
        model, opt = sw.prepare(_model("gpt"), strategy, lr=1e-2)
        padded = [u.full.numel() for u in model.units]
        # Stage 3's root unit: the parameters no block holds (the embeddings, final norm and
        # head: modules too small for units of their own), gathered once for the whole step.
        root = stage == 3 and {id(p) for p in model.units[0].params} == {
            id(p) for n, p in model.module.named_parameters() if not n.startswith("blocks.")
        }
        x, y = _batch("gpt", 0, world)
        sw.comm.stats.end_step()

        def step(model=model, opt=opt, x=x, y=y):
            lm_loss(model(_local(x)), _local(y)).backward()
            opt.step()
            opt.zero_grad()

        calls = calls_of(step)
        sent = {call.op for call in calls}  # (how each went: the recorder's names)
        out[stage, keep_mb] = (sw.comm.stats.end_step().by_op, padded, root, sent)
        bare_collectives(calls)()  # (what a bench's floor replays: every call it recorded)
        model.close()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_bytes_equal_the_zero_formulas(world_size):
    n = world_size
    for per_stage in run(bytes_per_step, world_size):
        for (stage, keep_mb), (by_op, padded, root, sent) in per_stage.items():
            # Each unit's gradients reduce-scattered once, (n-1)/n of its bytes per rank; with
            # gloo's ranks on one host, summed where they lie in shared memory (stages 2/3 in
            # `StagedGradients`, stage 1 in the full buffers it keeps), else exchanged (an
            # all-to-all of the slices, faster there than gloo's reduce-scatter) ...
            scatter = "reduce_scatter" if shared_memory.supported() else "all_to_all"
            # (stage 3 on one host: its ranks meet once a forward before reading each other's
            # shards where they lie, a barrier of no bytes)
            met = stage == 3 and shared_memory.supported()
            assert set(by_op) == {scatter, "all_gather"} | ({"barrier"} if met else set())
            if met:
                assert (by_op["barrier"].calls, by_op["barrier"].bytes) == (1, 0)
            assert by_op[scatter].bytes == sum(4 * (n - 1) * p // n for p in padded)
            assert by_op[scatter].calls == len(padded)
            # ... and all-gathers of its parameters: once after the step (stages 1/2), or
            # before forward and before backward (stage 3): 1.5x DDP's volume in all ...
            gathers = [2 if stage == 3 else 1] * len(padded)
            if stage == 3:  # ... but once for the root unit, gathered for the whole step ...
                assert root and len(padded) == 3  # (the root and two blocks)
                gathers[0] = 1
            if keep_mb is None and stage == 3:  # ... and by default for every unit that
                gathers = [1] * len(padded)  # fits 1 GiB (`DEFAULT_KEEP_BYTES`): all here ...
            if keep_mb:  # ... or for the units that fit the budget, counted from the last
                kept = 0
                for i in reversed(range(len(padded))):
                    if kept + 4 * padded[i] > keep_mb * 2**20:
                        break
                    kept += 4 * padded[i]
                    gathers[i] = 1
                assert 1 < gathers.count(1) < len(padded)  # (some kept, not all)
            volume = sum(g * 4 * (n - 1) * p // n for g, p in zip(gathers, padded, strict=True))
            assert by_op["all_gather"].bytes == volume
            assert by_op["all_gather"].calls == sum(gathers)
            # (on one host, gathered through shared memory: no gather through gloo's sockets)
            if met:  # (stage 3's shards live there: read where each rank's lies)
                assert sent == {"reduce_scatter_shared", "all_gather_resident", "barrier_shared"}
            elif shared_memory.supported():
                assert sent == {"reduce_scatter_shared", "all_gather_shared"}, sent


def test_the_default_keeps_the_last_unit_then_those_before_it_that_fit_the_default_budget():
    from shardwise.strategies.zero.stage3 import DEFAULT_KEEP_BYTES as GIB
    from shardwise.strategies.zero.stage3 import kept_units

    assert kept_units([GIB // 2] * 3, None) == {1, 2}  # (a third would pass the budget)
    assert kept_units([GIB // 2] * 3, None, first=1) == {2, 3}  # (after a root unit)
    assert kept_units([1, GIB, 2 * GIB], None) == {2}  # the last, whatever its size
    assert kept_units([1, GIB, 2 * GIB], 0) == set()  # 0: none
    assert kept_units([], None) == set()


FORMULAS = {  # model-state bytes per rank, ZeRO paper (fp32 Adam: K = 12)
    "ddp": lambda p, n: 16 * p,
    "zero1": lambda p, n: 4 * p + 4 * p + 8 * p / n,
    "zero2": lambda p, n: 4 * p + (4 * p + 8 * p) / n,
    "zero3": lambda p, n: 16 * p / n,
}


def state_bytes():
    out = {}
    for name in FORMULAS:
        torch.manual_seed(0)
        model = MLP([64, 512, 512, 10])  # ~300k parameters: Adam's step counters are noise
        strategy = sw.DDP() if name == "ddp" else sw.ZeRO(stage=int(name[-1]))
        model, opt = sw.prepare(model, strategy, lr=1e-3)
        x = torch.randn(8, 64)
        y = torch.randint(0, 10, (8,))
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # measured with gradients: the fullest state
        params = sum(p.numel() for p in sw.full_state_dict(model).values())
        out[name] = (model_state_bytes(model, opt)["total"], params)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_state_memory_matches_the_zero_paper(world_size):
    for per_strategy in run(state_bytes, world_size):
        for name, (measured, params) in per_strategy.items():
            expected = FORMULAS[name](params, world_size)
            assert abs(measured - expected) / expected <= 0.02, (name, measured, expected)


def test_bad_stage_is_a_value_error():
    with pytest.raises(ValueError, match=r"ZeRO\(stage=4\): Input should be 1, 2 or 3"):
        sw.ZeRO(stage=4)


def test_keeping_gathered_units_is_stage_3_only():
    with pytest.raises(ValueError, match=r"keep_gathered_mb=1\.0 applies to stage 3"):
        sw.ZeRO(stage=2, keep_gathered_mb=1.0)
    with pytest.raises(ValueError, match=r"keep_gathered_mb=-1\.0\): Input should be greater"):
        sw.ZeRO(stage=3, keep_gathered_mb=-1.0)


def pairwise_gathers() -> dict:
    """ZeRO's all-gather by direct messages on one host (`comm.all_gather_pairwise`): three of
    different sizes in flight at once on each half of the world, a gloo all-to-all on the same
    group between their issue and their wait; then one on the whole world, replayed bare as a
    bench floor replays a step's collectives."""
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank makes both)
    group = halves[rank // 2]
    shards = [torch.arange(n, dtype=torch.float32) + 1000.0 * rank for n in (3, 70_001, 5)]
    outs = [torch.full((2 * s.numel(),), -1.0) for s in shards]
    handles = [
        sw.comm.all_gather_pairwise(out, shard, group, async_op=True)
        for out, shard in zip(outs, shards, strict=True)
    ]
    sent, received = torch.full((6,), float(rank)), torch.empty(6)
    sw.comm.all_to_all_single(received, sent, group=group)
    for h in handles:
        h.wait()
    gloo = [torch.empty_like(out) for out in outs]
    for want, shard in zip(gloo, shards, strict=True):
        dist.all_gather_into_tensor(want, shard, group=group)
    whole = torch.empty(4 * 7)
    calls = calls_of(lambda: sw.comm.all_gather_pairwise(whole, torch.full((7,), float(rank))))
    bare_collectives(calls)()  # (the same messages again, on buffers of their own)
    return {
        "equal": [torch.equal(o, w) for o, w in zip(outs, gloo, strict=True)],
        "exchanged": received.tolist(),
        "whole": whole.view(4, 7)[:, 0].tolist(),
        "recorded": [c.op for c in calls],
    }


def test_pairwise_gathers_in_flight_together_equal_gloos_all_gather():
    for rank, out in enumerate(run(pairwise_gathers, 4)):
        assert out["equal"] == [True, True, True]
        pair = 2 * (rank // 2)
        assert out["exchanged"] == [float(pair)] * 3 + [float(pair + 1)] * 3
        assert out["whole"] == [0.0, 1.0, 2.0, 3.0]
        assert out["recorded"] == ["all_gather_pairwise"]


def test_pairwise_gather_refuses_mismatched_buffers_and_its_tag():
    from shardwise.comm.collectives import PAIRWISE_TAG, TraceGroup

    pair = TraceGroup(size=2, rank=0)  # (checked before anything is sent)
    with pytest.raises(ValueError, match="does not hold 2 shards"):
        sw.comm.all_gather_pairwise(torch.empty(8, dtype=torch.bfloat16), torch.empty(4), pair)
    with pytest.raises(ValueError, match="does not hold 2 shards"):
        sw.comm.all_gather_pairwise(torch.empty(6), torch.empty(4), pair)
    with pytest.raises(ValueError, match="reserved for all_gather_pairwise"):
        sw.comm.send(torch.empty(1), 0, tag=PAIRWISE_TAG)


def test_run_names_tell_zero3s_keep_policies_apart():
    from shardwise.strategies.zero import ZeROConfig

    names = [
        ZeROConfig(stage=stage, keep_gathered_mb=keep).describe()
        for stage, keep in ((3, None), (3, 0), (3, 2.5), (1, 0))
    ]
    assert names == ["zero-3", "zero-3 (regather)", "zero-3 (keep 2.5 MiB)", "zero-1"]


def _forward_after_loading(keep_gathered_mb: float) -> float:
    """A forward with autograd on and no backward (a loss only logged), then the weights of
    another model loaded: the next forward's worst difference from that model's."""

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    strategy = sw.ZeRO(stage=3, keep_gathered_mb=keep_gathered_mb)
    ours, _ = sw.prepare(model(0), strategy, optimizer=torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    ours(x)
    ours.load_state_dict(model(1).state_dict())
    with torch.no_grad():
        return (ours(x) - model(1)(x)).abs().max().item()


@pytest.mark.parametrize("keep_gathered_mb", [1024.0, 0.0], ids=["kept", "regathered"])
def test_zero3_computes_with_weights_loaded_over_units_kept_gathered(keep_gathered_mb):
    """Before, a unit kept gathered from a forward whose backward never came went on computing
    with the old weights (0.26 off) while the shards held the loaded ones."""
    assert run(_forward_after_loading, 2, keep_gathered_mb) == [0.0, 0.0]


class _SwappedOnRankOne(nn.Module):
    """Two blocks of one shape, applied in the other order on rank 1: control flow that
    differs between ranks, which ZeRO-3 cannot shard (each unit's collectives follow it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.blocks if dist.get_rank() == 0 else reversed(self.blocks)
        return second(torch.tanh(first(x)))


def _units_in_another_order(stage: int, precision: str | None) -> tuple[str, bool, float]:
    torch.manual_seed(0)
    model, opt = sw.prepare(
        # (units of one block each: 16.6 KB apiece)
        _SwappedOnRankOne(),
        sw.ZeRO(stage=stage, bucket_mb=0.02, mixed_precision=precision),
        optimizer=torch.optim.SGD,
        lr=0.1,
    )
    before = sw.full_state_dict(model)
    said, start = "", time.monotonic()
    try:
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    except RuntimeError as e:
        said = str(e)
    took_s = time.monotonic() - start
    model.zero_grad()  # (the backward that raised, taken back)
    untouched = all(torch.equal(v, before[k]) for k, v in sw.full_state_dict(model).items())
    return said, untouched, took_s


@pytest.mark.skipif(not shared_memory.supported(), reason="stages gradients in /dev/shm")
@pytest.mark.parametrize(("stage", "precision"), [(2, None), (3, None), (3, "bf16")])
def test_zero_refuses_ranks_that_run_its_units_in_another_order(stage, precision):
    # Before: ZeRO-3's staged reduce-scatters summed one rank's unit with another's (1.5e-3
    # off after one SGD step, said nowhere), and ZeRO-2's too. (ZeRO-1 launches its units in
    # their order, whatever order their gradients come in: each is its own buffer's. In bf16,
    # ZeRO-3 gathers its units from fp32 masters, not where they lie.)
    for said, untouched, took_s in run(_units_in_another_order, 2, stage, precision):
        assert "ranks arrived for different calls" in said, said
        assert "in the same order" in said and "\n" not in said
        assert untouched and took_s < 20


def _refusals() -> list[str]:
    """What ZeRO says of a model it cannot train: each a one-line `ValueError`/`RuntimeError`."""
    said = []
    frozen = nn.Linear(5, 3).requires_grad_(False)
    two_dtypes = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3).to(torch.bfloat16))
    for model, strategy in (
        (frozen, sw.ZeRO(stage=3)),
        (two_dtypes, sw.ZeRO(stage=3)),
        (two_dtypes, sw.ZeRO(stage=2, offload="cpu")),
        (nn.Linear(5, 3).to(torch.bfloat16), sw.ZeRO(stage=1, offload="cpu")),
    ):
        with pytest.raises(ValueError) as refused:
            sw.prepare(model, strategy, optimizer=torch.optim.SGD, lr=0.1)
        said.append(str(refused.value))

    class HalfUsed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(5, 3), nn.Linear(5, 3)

        def forward(self, x):
            return self.used(x)

    model, _ = sw.prepare(HalfUsed(), sw.ZeRO(stage=2), optimizer=torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError) as refused:
        model(torch.randn(2, 5)).sum().backward()
    said.append(str(refused.value))
    return said


def test_zero_refuses_what_it_cannot_train_in_one_line_each():
    """A frozen model crashed inside ZeRO (max() of no unit); a bf16 layer in an fp32 model was
    cast to fp32 and failed in its forward; a parameter with no gradient was told to pass an
    option ZeRO does not take; bad codec specs and a NaN bucket were taken."""
    frozen, dtypes, offloaded_dtypes, offloaded_bf16, unused = run(_refusals, 2)[0]
    assert frozen.startswith("ZeRO: the model has no trainable parameter")
    for said in (dtypes, offloaded_dtypes):
        assert "several dtypes (float32 (0.weight), bfloat16 (1.weight))" in said
    assert "for a bfloat16 model, pass mixed_precision='bf16'" in offloaded_bf16
    assert "2 parameter(s) received no gradient" in unused and "freeze them" in unused
    for made in (
        lambda: sw.ZeRO(compression="sign:3"),
        lambda: sw.DDP(compression="int8:0.5"),
        lambda: sw.ZeRO(compression="fp16:x"),
        lambda: sw.DDP(compression=3),
        lambda: sw.DDP(bucket_mb=float("nan")),
        lambda: sw.ZeRO(bucket_mb=float("inf")),
        lambda: sw.DDP(compression="topk:"),
        lambda: sw.DDP(compression="powersgd:2:"),
        lambda: sw.ZeRO(compression="fp16:"),
    ):
        with pytest.raises(
            ValueError, match=r"^(compression must be|(DDP|ZeRO)\((compression|bucket_mb)=)"
        ):
            made()
    assert sw.ZeRO(compression="topk:0.5:3").compression == "topk:0.5:3"  # (still taken)
