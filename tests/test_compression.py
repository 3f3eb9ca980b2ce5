"""Codecs against their mathematical definitions, and inside our DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.compression import Int8Codec, make_codec, pack_signs, unpack_signs
from shardwise.models import MLP
from spawn import run


def test_int8_quantisation_is_unbiased():
    codec, x = Int8Codec(seed=1), torch.randn(500)
    draws = 2000
    mean = sum(codec.decode(*codec.encode(x)) for _ in range(draws)) / draws
    # Each draw errs by less than one level (scale/127); the mean of 2000 draws by ~1/45 of it.
    level = x.abs().max() / 127
    assert (mean - x).abs().max() < 0.15 * level
    single = codec.decode(*codec.encode(x))
    assert (single - x).abs().max() <= level * (1 + 1e-6)  # and never by more than a level


def test_sign_packs_32_signs_in_4_bytes():
    x = torch.randn(1000)
    words = pack_signs(x)
    assert words.dtype == torch.int32 and words.numel() == 32  # ceil(1000 / 32) words
    assert words.numel() * 4 == 128  # bytes: 1000 signs in 1/32 of fp32's 4000 (+ padding)
    assert torch.equal(unpack_signs(words, 1000), torch.where(x >= 0, 1.0, -1.0))


def codec_round(spec: str, steps: int):
    """Each rank reduces its own vector `steps` times; returns what the math says to check."""
    rank, world = dist.get_rank(), dist.get_world_size()
    codec = make_codec(spec)
    group = dist.group.WORLD
    checks = []
    for step in range(steps):
        x = torch.randn(257, generator=torch.Generator().manual_seed(10 * step + rank))
        before = codec.residuals.get("k")
        corrected = x if before is None else x + before
        buffer = x.clone()
        sw.comm.stats.end_step()
        codec.reduce(buffer, group, key="k")
        sent_bytes = sw.comm.stats.end_step().bytes
        # What this rank sent = corrected - new residual; the result is the sum of all sends.
        sent = corrected - codec.residuals["k"] if "k" in codec.residuals else x
        all_sent = torch.empty(world, 257)
        dist.all_gather_into_tensor(all_sent.view(-1), sent.contiguous())
        if spec.startswith(("topk", "randomk")):  # the residual is exactly what stayed home
            residual, k = codec.residuals["k"], int(257 * 0.1)
            assert int((sent != 0).sum()) <= k
            assert torch.equal(residual[sent != 0], torch.zeros_like(residual[sent != 0]))
            assert torch.equal(residual[sent == 0], corrected[sent == 0])
        if spec.startswith("topk"):  # and what left is the k largest in magnitude
            assert sent.abs().max() >= codec.residuals["k"].abs().max()
        checks.append(((buffer - all_sent.sum(0)).abs().max().item(), sent_bytes))
    return checks


@pytest.mark.parametrize("spec", ["topk:0.1", "randomk:0.1", "sign"])
def test_error_feedback_keeps_exactly_the_residual(spec):
    # residual_t = (x_t + residual_{t-1}) - sent_t by construction; here we check the other
    # half: the decoded result is exactly the sum of what the ranks sent.
    for checks in run(codec_round, 2, spec, 3):
        for err, _ in checks:
            assert err <= 1e-5


def test_bytes_counted_are_the_bytes_exchanged():
    (topk_rank0, *_), (sign_rank0, *_) = (
        run(codec_round, 2, "topk:0.1", 1)[0],
        run(codec_round, 2, "sign", 1)[0],
    )
    k = int(257 * 0.1)
    # all-gather at world 2 sends this rank's part once: k fp32 values + k int32 indices
    assert topk_rank0[1] == k * 4 + k * 4
    # 257 signs -> 9 int32 words, plus one fp32 scale
    assert sign_rank0[1] == 9 * 4 + 4


def ddp_with(compression: str | None):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model, opt = sw.prepare(MLP([13, 32, 5]), sw.DDP(compression=compression), lr=1e-2)
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(4 * world, 13, generator=g),
            torch.randint(0, 5, (4 * world,), generator=g),
        )
        mine = slice(4 * dist.get_rank(), 4 * (dist.get_rank() + 1))
        sw.comm.stats.end_step()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        step_bytes = sw.comm.stats.end_step().bytes
    params = sum(p.numel() for p in model.parameters())
    return sw.full_state_dict(model), step_bytes, params


def test_fp16_compressed_ddp_halves_the_bytes_and_tracks_fp32():
    (plain, plain_bytes, params), _ = run(ddp_with, 2, None)
    (half, half_bytes, _), _ = run(ddp_with, 2, "fp16")
    assert plain_bytes == params * 4 and half_bytes == params * 2  # 2(n-1)/n = 1 at n = 2
    assert max((plain[k] - half[k]).abs().max().item() for k in plain) < 5e-3


def test_bad_codec_names_are_value_errors():
    with pytest.raises(ValueError, match="compression must be"):
        sw.DDP(compression="zip")
    with pytest.raises(ValueError, match="ratio"):
        make_codec("topk:2")
