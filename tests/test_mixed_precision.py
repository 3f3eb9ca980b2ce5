"""Mixed precision under ZeRO: fp32 masters, bf16/fp16 compute, fp16 loss scaling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.nn.models import MLP
from spawn import run

BATCH = 4


def _model():
    torch.manual_seed(0)
    return MLP([13, 16, 9, 5])


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * BATCH, 13, generator=g)
    y = torch.randint(0, 5, (world * BATCH,), generator=g)
    r = dist.get_rank()
    return x[r * BATCH : (r + 1) * BATCH], y[r * BATCH : (r + 1) * BATCH]


def fp16_with_injected_overflow(stage: int, poisoned: set[int]):
    model, opt = sw.prepare(_model(), sw.ZeRO(stage=stage, mixed_precision="fp16"), lr=1e-2)
    changed = []
    for step in range(8):
        x, y = _batch(step, dist.get_world_size())
        if step in poisoned and dist.get_rank() == 1:  # one rank overflows: all must skip
            x = x * 1e6  # beyond fp16's 65504
        before = torch.cat([s.detach().clone() for s in model.shards])
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        after = torch.cat([s.detach() for s in model.shards])
        changed.append(not torch.equal(before, after))
    scaler = model.masters.scaler
    return scaler.skipped_steps, scaler.scale, changed


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_skips_exactly_the_overflowing_steps(stage):
    for skipped, scale, changed in run(fp16_with_injected_overflow, 2, stage, {2, 5}):
        assert skipped == [2, 5]
        assert scale == 2.0**16 / 4  # halved once per overflow
        assert changed == [step not in (2, 5) for step in range(8)]


def bf16_training(stage: int):
    model, opt = sw.prepare(_model(), sw.ZeRO(stage=stage, mixed_precision="bf16"), lr=1e-2)
    assert next(model.parameters()).dtype == torch.bfloat16  # compute copy
    assert all(s.dtype == torch.float32 for s in model.shards)  # masters
    losses = []
    for step in range(30):
        x, y = _batch(step % 4, dist.get_world_size())
        loss = F.cross_entropy(model(x), y)
        assert loss.dtype == torch.float32  # outputs leave the model in fp32
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sw.full_state_dict(model), losses


def fp32_losses():
    model, opt = sw.prepare(_model(), sw.ZeRO(stage=1), lr=1e-2)
    losses = []
    for step in range(30):
        x, y = _batch(step % 4, dist.get_world_size())
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_stages_agree_learn_and_stay_near_fp32():
    results = {stage: run(bf16_training, 2, stage)[0] for stage in (1, 2, 3)}
    reference = run(fp32_losses, 2)[0]
    state1, losses = results[1]
    assert all(v.dtype == torch.float32 for v in state1.values())  # masters come back
    for stage in (2, 3):  # same arithmetic in every stage: identical masters
        state, _ = results[stage]
        assert all(torch.equal(state[k], state1[k]) for k in state1)
    assert sum(losses[-4:]) < 0.9 * sum(losses[:4])  # it learns (random labels: slowly)
    # bf16 keeps ~3 significant digits. Adam's sign-like updates let single weights drift by a
    # few learning rates, so compare what training achieves: the loss, within 5% of fp32's.
    assert sum(losses[-4:]) == pytest.approx(sum(reference[-4:]), rel=0.05)


def offloaded_vs_in_memory(stage: int, offload: str, directory: str):
    world = dist.get_world_size()
    strategy = sw.ZeRO(stage=stage, offload=offload, offload_dir=directory)
    offloaded, off_opt = sw.prepare(_model(), strategy, lr=1e-2)
    plain, plain_opt = sw.prepare(_model(), sw.ZeRO(stage=stage), lr=1e-2)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for opt in (off_opt, plain_opt)
    ]
    for step in range(10):
        x, y = _batch(step, world)
        for model, opt, sched in zip(
            (offloaded, plain), (off_opt, plain_opt), schedules, strict=True
        ):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    a, b = sw.full_state_dict(offloaded), sw.full_state_dict(plain)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    if offload != "disk":
        return diff, None, None, None
    shard = offloaded.shards[0]
    folder = offloaded.disk_step.store.directory
    assert folder.parent == Path(directory)  # a fresh directory of this rank's, where asked
    on_disk = [  # the files hold the current master weights and Adam moments
        torch.equal(torch.from_file(str(folder / f"unit0.{name}.bin"), size=t.numel()), t.detach())
        for name, t in (("master", shard), ("exp_avg", off_opt.state[shard]["exp_avg"]))
    ]
    files = sorted(p.name for p in folder.iterdir())
    return diff, files, all(on_disk), len(offloaded.units)


@pytest.mark.parametrize(("stage", "offload"), [(1, "disk"), (3, "disk"), (2, "cpu")])
def test_offload_trains_identically(tmp_path, stage, offload):
    results = run(offloaded_vs_in_memory, 2, stage, offload, str(tmp_path))
    for diff, files, on_disk, num_units in results:
        assert diff == 0.0  # the same arithmetic, only the memory is elsewhere
        if offload == "disk":
            keys = ("master", "exp_avg", "exp_avg_sq", "step")
            assert set(files) == {f"unit{i}.{k}.bin" for i in range(num_units) for k in keys}
            assert on_disk


def test_the_loss_scale_reaches_every_gradient_once_when_one_output_feeds_another():
    # A model that returns its loss and an auxiliary loss added into it (a Mixtral-like
    # router loss): backward from the loss reaches the auxiliary output too. Before, each
    # output had a hook scaling its gradient, and that path was scaled twice.
    from torch import nn

    from shardwise.nn.mixed_precision import LossScaler, install_casts

    class WithAuxiliary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            out = self.linear(x)
            aux = out.pow(2).mean()
            return {"loss": out.sum() + aux, "aux": aux}

    torch.manual_seed(0)
    model, x = WithAuxiliary(), torch.randn(5, 4)
    model(x)["loss"].backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    scaler = LossScaler(torch.device("cpu"), init_scale=1024.0)
    install_casts(model, torch.float32, scaler)
    outputs = model(x)
    outputs["aux"].mul_(1.0)  # (an output is the caller's to change in place, as without)
    outputs["loss"].backward()
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got.grad / 1024.0, want, rtol=1e-6, atol=0)


def _frozen_first_layer():
    """A frozen Linear, recomputed in backward (a checkpointed region runs its module again
    outside the model's forward), then two that train."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Recomputed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    torch.manual_seed(0)
    model = nn.Sequential(
        Recomputed(nn.Linear(13, 16)), nn.Tanh(), nn.Linear(16, 9), nn.Tanh(), nn.Linear(9, 5)
    )
    model[0].requires_grad_(False)
    return model


def frozen_under_mixed_precision(stage: int, precision: str):
    """Each step's forward, against the same weights cast to the compute dtype in one plain
    module (the frozen ones from the original, the others from the masters), and the frozen
    weights at the end against the original's."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    original = _frozen_first_layer().state_dict()
    strategy = sw.ZeRO(stage=stage, mixed_precision=precision)
    model, opt = sw.prepare(_frozen_first_layer(), strategy, lr=1e-2)
    worst = 0.0
    for step in range(4):
        x, y = _batch(step, dist.get_world_size())
        plain = _frozen_first_layer()
        plain.load_state_dict(sw.full_state_dict(model))
        expected = plain.to(dtype)(x.to(dtype)).float()
        out = model(x)
        worst = max(worst, (out - expected).abs().max().item())
        F.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    final = sw.full_state_dict(model)
    frozen = [k for k in original if k.startswith("0.")]
    kept = all(
        final[k].dtype == torch.float32 and torch.equal(final[k], original[k]) for k in frozen
    )
    moved = not torch.equal(final["4.weight"], original["4.weight"])
    return worst, kept, moved


@pytest.mark.parametrize(("stage", "precision"), [(1, "bf16"), (3, "fp16")])
def test_frozen_parameters_compute_in_the_compute_dtype_and_stay_as_they_were(stage, precision):
    """Before, a frozen parameter stayed fp32 while its input came in the compute dtype: the
    forward failed ("mat1 and mat2 must have the same dtype")."""
    for worst, kept, moved in run(frozen_under_mixed_precision, 2, stage, precision):
        assert worst == 0.0 and kept and moved, (worst, kept, moved)


def hf_gpt2_embeddings_frozen_in_bf16(stage: int) -> tuple[float, float, bool]:
    """A Hugging Face GPT-2 (tied embedding and head) with its embeddings frozen, under ZeRO in
    bf16: each step's loss against the same model cast to bf16 in one plain module, and whether
    the frozen (tied) weight comes back as it was, in fp32."""
    import hf_models as H

    original = H.build("gpt2").state_dict()
    model = H.build("gpt2")
    model.transformer.wte.requires_grad_(False)  # (the head's weight too: the same parameter)
    model.transformer.wpe.requires_grad_(False)
    ours, opt = sw.prepare(model, sw.ZeRO(stage=stage, mixed_precision="bf16"), lr=1e-3)
    worst = 0.0
    for step in range(3):
        batch = H.make_batch("gpt2", 2, step + 10 * dist.get_rank())
        plain = H.build("gpt2")
        plain.load_state_dict(sw.full_state_dict(ours))
        expected = H.hf_loss(plain.to(torch.bfloat16)(**batch)).float()
        loss = H.hf_loss(ours(**batch))
        worst = max(worst, (loss.detach().float() - expected).abs().item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    final = sw.full_state_dict(ours)
    key = "transformer.wte.weight"
    return worst, final[key].dtype == torch.float32, torch.equal(final[key], original[key])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hugging_face_model_with_frozen_tied_embeddings_trains_in_bf16(stage):
    pytest.importorskip("transformers")
    for worst, fp32, kept in run(hf_gpt2_embeddings_frozen_in_bf16, 2, stage):
        assert worst == 0.0 and fp32 and kept, (worst, fp32, kept)


def test_frozen_weights_stay_swapped_through_nested_calls_and_follow_a_new_tensor():
    """A module that calls itself keeps the compute-dtype copy until its outermost call ends
    (before, the inner call put the fp32 weight back under the outer one: a dtype error), and
    a parameter replaced by another gets a copy of the new one, not the old copy."""
    from torch import nn

    from shardwise.nn.mixed_precision import FrozenInComputeDtype

    class CallsItself(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4), requires_grad=False)

        def forward(self, x, depth: int = 1):
            if depth:
                x = self(x, depth - 1)
            return x @ self.w

    model = CallsItself()
    FrozenInComputeDtype(model, torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    w = model.w.detach().to(torch.bfloat16)
    assert torch.equal(model(x), (x @ w) @ w)
    assert model._parameters["w"] is model.w and model.w.dtype == torch.float32  # (back)
    model.w = nn.Parameter(torch.ones(4, 4), requires_grad=False)  # (its id may be reused)
    assert torch.equal(model(x, depth=0), x @ torch.ones(4, 4, dtype=torch.bfloat16))
