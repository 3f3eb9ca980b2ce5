"""Our DDP against single-process training, against torch's DDP, and its accounting."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.nn.models import MLP, ConvNet
from spawn import run

STEPS = 20
BATCH = 4  # per rank


def _global_batch(step: int, world_size: int, dtype: torch.dtype, image: bool = False):
    g = torch.Generator().manual_seed(1000 + step)
    shape = (world_size * BATCH, 1, 8, 8) if image else (world_size * BATCH, 13)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    y = torch.randint(0, 5, (world_size * BATCH,), generator=g)
    return x, y


def _local(t: torch.Tensor) -> torch.Tensor:
    r = dist.get_rank()
    return t[r * BATCH : (r + 1) * BATCH]


def _make_model(kind: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = MLP([13, 17, 9, 5]) if kind == "mlp" else ConvNet(channels=(4, 6), num_classes=5)
    return model.to(dtype)


def _max_diff(a: nn.Module | dict, b: nn.Module | dict) -> float:
    sa = a if isinstance(a, dict) else a.state_dict()
    sb = b if isinstance(b, dict) else b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def train_vs_reference(kind, dtype, ddp_kwargs, opt_cls=torch.optim.AdamW):
    """Train our DDP and a single-process reference on the same global batches."""
    world = dist.get_world_size()
    image = kind == "cnn"
    reference = _make_model(kind, dtype)
    ref_opt = opt_cls(reference.parameters(), lr=1e-2)
    model, opt = sw.prepare(
        _make_model(kind, dtype), sw.DDP(**ddp_kwargs), optimizer=opt_cls, lr=1e-2
    )
    for step in range(STEPS):
        _step_both(reference, ref_opt, model, opt, *_global_batch(step, world, dtype, image))
    return _max_diff(sw.full_state_dict(model), reference)


def _step_both(reference, ref_opt, model, opt, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of the single-process reference on the global batch, and of ours on this
    rank's share of it."""
    F.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    F.cross_entropy(model(_local(x)), _local(y)).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_equals_single_process_float32(world_size):
    # Many small buckets so the overlap/ordering logic is exercised. 1e-5: the sums over ranks
    # run in another order than the single-process batch mean (float32 rounding, ~1e-7/step).
    diffs = run(train_vs_reference, world_size, "mlp", torch.float32, {"bucket_mb": 0.0005})
    assert max(diffs) <= 1e-5


def test_ddp_equals_single_process_float64():
    # float64 leaves only rounding in the 16th digit: "exact" for all practical purposes.
    diffs = run(train_vs_reference, 2, "mlp", torch.float64, {"bucket_mb": 0.0005})
    assert max(diffs) <= 1e-12


@pytest.mark.parametrize(
    ("world_size", "algorithm"), [(2, "ring"), (4, "ring"), (4, "hierarchical")]
)
def test_ddp_our_all_reduce_algorithms_train_exactly(world_size, algorithm):
    kwargs = {"bucket_mb": 0.0005, "algorithm": algorithm, "group_size": 2}
    diffs = run(train_vs_reference, world_size, "mlp", torch.float32, kwargs)
    assert max(diffs) <= 1e-5


def test_batchnorm_model_matches_single_process_global_batch():
    # SyncBatchNorm: statistics over the global batch, running stats included in the state dict.
    diffs = run(train_vs_reference, 4, "cnn", torch.float32, {}, torch.optim.SGD)
    assert max(diffs) <= 1e-5


def algorithms_agree():
    """Our all-reduce algorithms against the native one on awkward sizes, each in buffers it
    places itself (shared memory's)."""
    from shardwise.comm.algorithms import make_all_reduce

    rank, worst = dist.get_rank(), 0.0
    algos = {
        name: make_all_reduce(name, group_size=2)
        for name in ("native", "shared_memory", "ring", "hierarchical")
    }
    for numel in (1, 3, 7, 1000, 4097):
        base = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 100 + numel))
        results = {}
        for name, algo in algos.items():
            t = algo.new_buffer(numel, base.dtype, base.device)
            t.copy_(base)
            algo.start(t).wait()
            results[name] = t
        for name in ("shared_memory", "ring", "hierarchical"):
            worst = max(worst, (results[name] - results["native"]).abs().max().item())
    for algo in algos.values():
        algo.close()
    return worst


def test_our_all_reduce_algorithms_equal_native_all_reduce():
    assert max(run(algorithms_agree, 4)) <= 1e-5


def ours_vs_torch_ddp():
    world = dist.get_world_size()
    ours, opt = sw.prepare(_make_model("mlp", torch.float32), sw.DDP(), lr=1e-2)
    theirs = nn.parallel.DistributedDataParallel(_make_model("mlp", torch.float32))
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = _global_batch(step, world, torch.float32)
        for m, o in ((ours, opt), (theirs, their_opt)):
            F.cross_entropy(m(_local(x)), _local(y)).backward()
            o.step()
            o.zero_grad()
    return _max_diff(sw.full_state_dict(ours), theirs.module)


def test_ddp_equals_torch_ddp():
    # Both divide by the world size before summing with the same backend: identical arithmetic.
    assert max(run(ours_vs_torch_ddp, 2)) <= 1e-6


def accumulation_vs_big_batch(k: int):
    """k micro-batches under no_sync (last one synced) against one k-times larger batch."""
    world = dist.get_world_size()
    acc, acc_opt = sw.prepare(_make_model("mlp", torch.float32), sw.DDP(bucket_mb=0.0005), lr=1e-2)
    big, big_opt = sw.prepare(_make_model("mlp", torch.float32), sw.DDP(), lr=1e-2)
    for step in range(5):
        micro = [_global_batch(step * k + i, world, torch.float32) for i in range(k)]
        for i, (x, y) in enumerate(micro):
            ctx = acc.no_sync() if i < k - 1 else torch.enable_grad()
            with ctx:
                (F.cross_entropy(acc(_local(x)), _local(y)) / k).backward()
        acc_opt.step()
        acc_opt.zero_grad()
        x = torch.cat([_local(x) for x, _ in micro])
        y = torch.cat([_local(y) for _, y in micro])
        F.cross_entropy(big(x), y).backward()
        big_opt.step()
        big_opt.zero_grad()
    return _max_diff(sw.full_state_dict(acc), sw.full_state_dict(big))


def test_no_sync_accumulation_equals_larger_batch():
    assert max(run(accumulation_vs_big_batch, 2, 3)) <= 1e-5


def bytes_of_one_step(algorithm: str):
    model, opt = sw.prepare(
        _make_model("mlp", torch.float32), sw.DDP(bucket_mb=0.0005, algorithm=algorithm), lr=1e-2
    )
    x, y = _global_batch(0, dist.get_world_size(), torch.float32)
    F.cross_entropy(model(_local(x)), _local(y)).backward()  # (the first step agrees on the
    opt.step()  # buckets' order: one broadcast, once)
    opt.zero_grad()
    bucket_bytes = [b.buffer.numel() * 4 for b in model.reducer.buckets]
    sw.comm.stats.end_step()
    F.cross_entropy(model(_local(x)), _local(y)).backward()
    opt.step()
    snap = sw.comm.stats.end_step()
    sent_per_bucket = []
    n = dist.get_world_size()
    for size in bucket_bytes:  # what a ring must send: all chunks but the one it keeps, twice
        chunks = torch.empty(size // 4).tensor_split(n)
        rank = dist.get_rank()
        keep_rs, keep_ag = (rank + 1) % n, (rank + 2) % n
        sent_per_bucket.append(
            4 * (size // 4 - chunks[keep_rs].numel() + size // 4 - chunks[keep_ag].numel())
        )
    return snap.bytes, bucket_bytes, sent_per_bucket, len(bucket_bytes), snap.calls


@pytest.mark.parametrize("world_size", [2, 4])
def test_accounting_bytes_equal_what_the_ring_must_send(world_size):
    for rank, (sent, buckets, expected, num_buckets, calls) in enumerate(
        run(bytes_of_one_step, world_size, "ring")
    ):
        assert num_buckets > 1
        assert sent == sum(expected), (rank, sent, expected)
        # 2(n-1) messages per bucket, each counted once.
        assert calls == num_buckets * 2 * (world_size - 1)
        if all(b // 4 % world_size == 0 for b in buckets):
            assert sent == sum(2 * (world_size - 1) * b // world_size for b in buckets)


def test_accounting_bytes_native_all_reduce_formula():
    for sent, buckets, _, num_buckets, calls in run(bytes_of_one_step, 2, "native"):
        assert calls == num_buckets
        assert sent == sum(2 * (2 - 1) * b // 2 for b in buckets)


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def unused_parameters(allow: bool):
    torch.manual_seed(0)
    model, opt = sw.prepare(WithUnused(), sw.DDP(find_unused_parameters=allow), lr=0.1)
    x = torch.randn(3, 4)
    try:
        model(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    opt.step()
    return "ok"


def test_unused_parameter_is_a_clear_error_or_allowed():
    messages = run(unused_parameters, 2, False)
    assert all("unused.weight" in m and "find_unused_parameters=True" in m for m in messages)
    assert run(unused_parameters, 2, True) == ["ok", "ok"]


def grads_are_bucket_views():
    model, opt = sw.prepare(_make_model("mlp", torch.float32), sw.DDP(bucket_mb=0.0005), lr=1e-2)
    x, y = _global_batch(0, 2, torch.float32)
    in_buckets = []
    for zero_to_none in (True, False, True):  # after either kind of zero_grad
        F.cross_entropy(model(_local(x)), _local(y)).backward()
        # (the buckets of now: the first backward may cut them again, in the order it made them)
        storages = {b.buffer.untyped_storage().data_ptr() for b in model.reducer.buckets}
        in_buckets.append(
            all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())
        )
        opt.step()
        opt.zero_grad(set_to_none=zero_to_none)
    return all(in_buckets)


def test_gradients_live_in_the_buckets():
    assert run(grads_are_bucket_views, 2) == [True, True]


class RegisteredBackwards(nn.Module):
    """Layers registered in the reverse of the order the forward uses them: buckets cut in
    reverse registration order would complete last-first."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(9, 3)
        self.middle = nn.Linear(11, 9)
        self.first = nn.Linear(7, 11)

    def forward(self, x):
        return self.out(torch.relu(self.middle(torch.relu(self.first(x)))))


def buckets_follow_backward():
    torch.manual_seed(0)
    reference = RegisteredBackwards()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(0)
    model, opt = sw.prepare(
        RegisteredBackwards(), sw.DDP(bucket_mb=0.0002), optimizer=torch.optim.SGD, lr=0.1
    )
    arrived = []  # what backward made first, seen by hooks of our own
    for p in model.module.parameters():
        p.register_post_accumulate_grad_hook(arrived.append)
    names = {p: n for n, p in model.module.named_parameters()}
    before = [[names[p] for p in b.params] for b in model.reducer.buckets]
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, y = torch.randn(8, 7, generator=g), torch.randint(0, 3, (8,), generator=g)
        _step_both(reference, ref_opt, model, opt, x, y)
    first_backward = [names[p] for p in arrived[:6]]
    after = [names[p] for b in model.reducer.buckets for p in b.params]
    return before, first_backward, after, len(model.reducer.buckets), _max_diff(model, reference)


def test_buckets_follow_the_order_backward_makes_gradients():
    for before, first_backward, after, buckets, diff in run(buckets_follow_backward, 2):
        assert before[0][0].startswith("first.")  # reverse registration: the last to come
        assert first_backward[0].startswith("out.")
        assert after == first_backward and buckets > 1  # cut again, in backward's order
        assert diff <= 1e-6  # the gradients moved with them: still one process's training


def test_world_of_one_runs_same_code_path():
    # sw.init() outside a launcher: a real size-1 group; DDP equals plain training.
    diffs = run(train_vs_reference, 1, "mlp", torch.float32, {})
    assert diffs[0] <= 1e-6


def test_bad_strategy_options_are_value_errors():
    with pytest.raises(ValueError, match="bucket_mb"):
        sw.DDP(bucket_mb=0)
    with pytest.raises(ValueError, match="algorithm"):
        sw.DDP(algorithm="tree")
    with pytest.raises(TypeError, match="strategy"):
        sw.prepare(nn.Linear(2, 2), "ddp")


def test_sync_batchnorm_keeps_a_frozen_norm_frozen_and_its_dtype():
    # As torch's own conversion does (before, a frozen norm was trained, a float64 one fp32).
    from shardwise.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

    def make() -> nn.Sequential:
        model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm2d(4).double())
        model[1].requires_grad_(False)
        return model

    ours, torchs = convert_sync_batchnorm(make()), nn.SyncBatchNorm.convert_sync_batchnorm(make())
    assert isinstance(ours[1], SyncBatchNorm) and isinstance(ours[2], SyncBatchNorm)
    described = [[(p.requires_grad, p.dtype) for p in m.parameters()] for m in (ours, torchs)]
    assert described[0] == described[1]
    assert [p.requires_grad for p in ours[1].parameters()] == [False, False]
    assert ours[2].running_var.dtype == torch.float64


def _half_batchnorm_vs_fp32(dtype: torch.dtype) -> list[float]:
    """Rank r's 16-bit SyncBatchNorm on its part of a global batch of 2 x 200 x 200 positions a
    channel (an fp16 count of 80,000 is inf), against torch's float32 BatchNorm2d on the whole:
    the output, the input's gradient and the running statistics, worst differences."""
    from shardwise.nn.sync_batchnorm import SyncBatchNorm

    rank = dist.get_rank()
    x = torch.randn(2, 3, 200, 200, generator=torch.Generator().manual_seed(5)) * 3 + 1
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(3)
    nn.init.uniform_(reference.weight, 0.5, 1.5)
    ours = SyncBatchNorm(3).to(dtype)
    ours.load_state_dict(reference.state_dict())
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    whole = x.clone().requires_grad_()
    (reference(whole) * probe).sum().backward()
    part = x[rank : rank + 1].to(dtype).requires_grad_()
    out = ours(part)
    (out.float() * probe[rank : rank + 1]).sum().backward()  # (the ranks' parts add up)
    expected = reference(x)  # (a second forward: the running statistics move again)
    ours(part)
    return [
        (out.float() - expected[rank : rank + 1].detach()).abs().max().item(),
        ((part.grad.float() - whole.grad[rank : rank + 1]).abs() / whole.grad.abs().max())
        .max()
        .item(),
        (ours.running_mean.float() - reference.running_mean).abs().max().item(),
        (ours.running_var.float() / reference.running_var - 1).abs().max().item(),
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sync_batchnorm_in_16_bits_keeps_its_statistics_in_float32(dtype):
    """Before, the per-channel count and sums were all-reduced in the input's dtype: in fp16 the
    output was 160x too large and the running variance NaN."""
    tolerance = 0.02 if dtype == torch.float16 else 0.1  # (the output's own rounding)
    for out, grad, mean, var in run(_half_batchnorm_vs_fp32, 2, dtype):
        assert out <= tolerance and grad <= tolerance / 4, (out, grad)
        assert mean <= 0.01 and var <= 0.01, (mean, var)
