"""Codecs against their mathematical definitions, and inside our DDP."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.comm.compressed_collectives import make_codec
from shardwise.comm.compression import Int8Codec, pack_signs, unpack_signs
from shardwise.nn.models import MLP
from shardwise.ps.compressed import ps_codec
from spawn import run


def test_int8_quantisation_is_unbiased():
    codec, x = Int8Codec(seed=1), torch.randn(500)
    draws = 2000
    mean = sum(codec.decode(codec.encode(x), x.numel()) for _ in range(draws)) / draws
    # Each draw errs by less than one level (scale/127); the mean of 2000 draws by ~1/45 of it.
    level = x.abs().max() / 127
    assert (mean - x).abs().max() < 0.15 * level
    single = codec.decode(codec.encode(x), x.numel())
    assert (single - x).abs().max() <= level * (1 + 1e-6)  # and never by more than a level


def test_sign_packs_32_signs_in_4_bytes():
    x = torch.randn(1000)
    words = pack_signs(x)
    assert words.dtype == torch.int32 and words.numel() == 32  # ceil(1000 / 32) words
    # The bytes as they are sent, read back bit by bit (numpy, little-endian: bit i of the
    # stream is bit i % 32 of word i // 32): 1000 signs in 1/32 of fp32's 4000 bytes, in order,
    # 1 for x >= 0, and zeros in the padding.
    sent = words.numpy().tobytes()
    bits = np.unpackbits(np.frombuffer(sent, dtype=np.uint8), bitorder="little")
    assert len(x.numpy().tobytes()) == 4000 and len(sent) == 128
    assert bits[:1000].tolist() == (x >= 0).int().tolist() and not bits[1000:].any()
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


def test_topk_warm_up_densities_fall_exponentially_and_resume():
    # DGC's warm-up: density 0.25 * (ratio / 0.25) ** (c / W) at the c-th reduction of a
    # buffer, then ratio.
    n, ratio, warmup = 1000, 0.01, 4
    codec = make_codec(f"topk:{ratio}:{warmup}")
    sent_counts = []
    for call in range(7):
        x = torch.randn(n, generator=torch.Generator().manual_seed(call))
        (parts,) = codec.encode_chunks(x, key=0)
        assert [p.numel() for p in parts] == [n_ for _, n_ in codec.layout(n)]
        sent_counts.append(parts[1].unique().numel())  # distinct coordinates sent
        if call == 2:
            saved = codec.state_dict()
    assert sent_counts == [250, 111, 50, 22, 10, 10, 10]  # 1000 * 0.25 * 0.04 ** (c / 4)
    resumed = make_codec(f"topk:{ratio}:{warmup}")
    resumed.load_state_dict(saved)
    for call in range(3, 7):
        x = torch.randn(n, generator=torch.Generator().manual_seed(call))
        (parts,) = resumed.encode_chunks(x, key=0)
        assert parts[1].unique().numel() == sent_counts[call]
    assert torch.equal(resumed.residuals[0], codec.residuals[0])
    with pytest.raises(ValueError, match="warm-up needs both ends"):
        ps_codec("topk:0.01:10")  # a server and an asynchronous worker count apart


def test_a_codec_refuses_another_codecs_state():
    """A checkpoint's codec state is its codec's: another's residuals, or PowerSGD factors of
    another rank (which crashed the next reduction), are refused in a line."""
    saved = make_codec("powersgd:2")
    saved.qs[0] = [torch.ones(5, 2)]
    state = saved.state_dict()
    same = make_codec("powersgd:2")
    same.load_state_dict(state)
    assert torch.equal(same.qs[0][0], saved.qs[0][0])
    for other in ("powersgd:4", "topk:0.1"):
        with pytest.raises(
            ValueError,
            match=rf"made by compression 'powersgd:2', and this job's "
            rf"is '{other}': resume with the compression it was saved with",
        ):
            make_codec(other).load_state_dict(state)


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


class _Bucket:
    """The part of `dist.GradBucket` that torch's PowerSGD hook reads."""

    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]]) -> None:
        self._buffer, self._shapes = buffer, shapes

    def buffer(self):
        return self._buffer

    def gradients(self):
        sizes = [torch.Size(s).numel() for s in self._shapes]
        return [v.view(s) for v, s in zip(self._buffer.split(sizes), self._shapes, strict=True)]

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return self.gradients()


def powersgd_vs_torch_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from shardwise.comm.powersgd import PowerSGD

    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = [(32, 16), (16,), (20, 6, 4), (3, 3)]  # two compressed, a bias and a small matrix
    r = 2
    theirs = torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2
    )
    theirs.iter = theirs.start_powerSGD_iter  # compress from the first call
    ours = PowerSGD(rank=r)
    ours.describe("k", shapes)
    # The same starting Q for both: torch warm-starts from its memory when it is filled.
    q0 = [torch.randn(16, r, generator=torch.Generator().manual_seed(7)), torch.randn(24, r)]
    dist.broadcast(q0[1], 0)
    theirs.p_memory_dict[0] = torch.empty(32 * r + 20 * r)
    theirs.q_memory_dict[0] = torch.cat([q.reshape(-1) for q in q0])
    ours.qs["k"] = [q.clone() for q in q0]
    worst = []
    for step in range(3):  # warm start and error feedback carried across steps
        numel = sum(torch.Size(s).numel() for s in shapes)
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))
        their_out = torch_powersgd.powerSGD_hook(theirs, _Bucket(grad.clone(), shapes)).wait()
        our_out = grad / world  # our DDP hands codecs the pre-divided gradient, wants the sum
        ours.reduce(our_out, dist.group.WORLD, key="k")
        worst.append(
            (
                (our_out - their_out).abs().max().item(),
                (world * ours.residuals["k"] - theirs.error_dict[0]).abs().max().item(),
            )
        )
    return worst


def test_powersgd_equals_torch_powersgd_hook_from_the_same_q():
    for per_step in run(powersgd_vs_torch_hook, 2):
        for output_diff, error_diff in per_step:
            assert output_diff <= 1e-5
            assert error_diff <= 1e-5  # torch keeps n times our (pre-divided) residual


def powersgd_bytes():
    world = dist.get_world_size()
    model, opt = sw.prepare(MLP([64, 128, 128, 10]), sw.DDP(compression="powersgd:4"), lr=1e-3)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    sw.comm.stats.end_step()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return sw.comm.stats.end_step().bytes, world


def test_powersgd_sends_the_low_rank_factors_only():
    for sent, n in run(powersgd_bytes, 2):
        matrices = [(128, 64), (128, 128), (10, 128)]
        # (n+m)r values per compressible matrix (10x128 at rank 4: 552 < 1280/2, compressed),
        # biases (128+128+10) uncompressed; all-reduce sends 2(n-1)/n of each, fp32.
        values = sum((a + b) * 4 for a, b in matrices) + 128 + 128 + 10
        assert sent == 4 * values * 2 * (n - 1) // n


def test_ideal_powersgd_reduction_of_the_benchmark_models():
    from shardwise.bench.comm_bench import ideal_powersgd_ratio
    from shardwise.nn.models import TinyGPT

    # About 39x for the tiny GPT (the figure) at rank 4.
    assert 38 < ideal_powersgd_ratio(TinyGPT(65)) < 40
    # MLP by hand: (2048+784)4 + (2048+2048)4 + (10+2048)4 values for the weights (the 10x2048
    # head still shrinks more than 2x, so it is compressed too) plus 4,106 bias values.
    sent = (2048 + 784) * 4 + (2048 + 2048) * 4 + (10 + 2048) * 4 + 2048 + 2048 + 10
    assert ideal_powersgd_ratio(MLP([784, 2048, 2048, 10])) == pytest.approx(5_824_522 / sent)


class _Abort(Exception):
    """Raised by a hook inside backward."""


def trains_as_if_the_raised_backwards_never_ran(strategies: list):
    """Each strategy trains the same model twice on the same batches: once as is, once with a
    backward that raises on every rank after the last layer's gradients were reduced through
    the codec (residuals kept, random numbers drawn, reductions counted), then `zero_grad`.
    Both must end the same, bit for bit, the codec's state too."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def trained(strategy, abort_at: tuple[int, ...]):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(13, 31), nn.Tanh(), nn.Linear(31, 5))
        aborting: list = []

        def raise_in_backward(module, inputs, output):  # (once the last layer's grads are made)
            if aborting:
                output.register_hook(lambda grad: (_ for _ in ()).throw(_Abort()))

        module[1].register_forward_hook(raise_in_backward)
        model, opt = sw.prepare(module, strategy, lr=1e-2)
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4 * world, 13, generator=g)[rank * 4 : (rank + 1) * 4]
            y = torch.randint(0, 5, (4 * world,), generator=g)[rank * 4 : (rank + 1) * 4]
            if step in abort_at:  # (on other data: nothing of it may remain)
                aborting.append(True)
                with contextlib.suppress(_Abort):
                    F.cross_entropy(model(3 * x.flip(0)), y).backward()
                aborting.clear()
                opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        state = {**sw.full_state_dict(model), **model.extra_state()}
        model.close()
        return state

    diffs = []
    for strategy in strategies:
        plain, taken_back = trained(strategy, ()), trained(strategy, (1, 3))
        assert plain.keys() == taken_back.keys()
        diffs.append(max((plain[k] - taken_back[k]).abs().max().item() for k in plain))
    return diffs


def test_a_backward_that_raised_leaves_nothing_in_the_codec():
    strategies = [  # (buckets and units of a parameter or so: some reduced before the raise)
        sw.DDP(bucket_mb=0.0005, compression="randomk:0.3"),
        sw.DDP(bucket_mb=0.0005, compression="powersgd:2"),
        sw.ZeRO(stage=2, bucket_mb=0.0005, compression="topk:0.3:2"),
    ]
    for diffs in run(trains_as_if_the_raised_backwards_never_ran, 2, strategies):
        assert diffs == [0.0, 0.0, 0.0]
