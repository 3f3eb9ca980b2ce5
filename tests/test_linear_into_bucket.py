"""Linear layers that write their weight gradient into DDP's bucket (`linear_into_bucket`).

Evidence comes from autograd's own state: the memory a weight's `.grad` occupies once autograd
has accumulated it (read by a hook registered before DDP's), and the values of the gradients and
weights, against autograd's own linear and against one process on the global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.strategies import linear_into_bucket
from shardwise.strategies.linear_into_bucket import LinearIntoSlot
from spawn import run


class OneSlot:
    """Hands out one slot, once: a view into a larger buffer, as a bucket's."""

    def __init__(self, weight: nn.Parameter) -> None:
        self.buffer = torch.full((weight.numel() + 6,), float("nan"))
        self.slot = self.buffer[3 : 3 + weight.numel()].view_as(weight)
        self.claims = 0

    def claim_slot(self, weight, grad):
        self.claims += 1
        return self.slot if self.claims == 1 else None


@pytest.mark.parametrize("shape", [(64, 37), (4, 9, 37), (2, 3, 5, 37)])
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_are_autograds_own_bits_and_the_slot_becomes_grad(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(37, 23, bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    grad_out = torch.randn(*shape[:-1], 23)
    expected = torch.autograd.grad(
        F.linear(x, layer.weight, layer.bias), [x, layer.weight, *([layer.bias] * bias)], grad_out
    )
    slots = OneSlot(layer.weight)
    LinearIntoSlot.apply(x, layer.bias, layer.weight, slots).backward(grad_out)
    assert torch.equal(x.grad, expected[0])
    assert torch.equal(layer.weight.grad, expected[1])
    assert not bias or torch.equal(layer.bias.grad, expected[2])
    # autograd took the slot itself as .grad: the gradient was never made anywhere else
    assert layer.weight.grad.data_ptr() == slots.slot.data_ptr()
    assert slots.buffer[:3].isnan().all() and slots.buffer[-3:].isnan().all()


def test_a_gradient_of_several_row_blocks_is_autograds_within_rounding():
    """A weight of 2.4 MB, written a MiB of rows at a time (three GEMMs), over a 40-row batch."""
    torch.manual_seed(0)
    layer = nn.Linear(300, 2000)
    assert layer.weight.nbytes > 2 * linear_into_bucket.ROWS_BYTES
    x = torch.randn(4, 10, 300)
    grad_out = torch.randn(4, 10, 2000)
    (expected,) = torch.autograd.grad(
        F.linear(x, layer.weight, layer.bias), [layer.weight], grad_out
    )
    slots = OneSlot(layer.weight)
    LinearIntoSlot.apply(x, layer.bias, layer.weight, slots).backward(grad_out)
    assert layer.weight.grad.data_ptr() == slots.slot.data_ptr()
    assert torch.allclose(layer.weight.grad, expected, rtol=1e-6, atol=1e-6)
    assert slots.buffer[:3].isnan().all() and slots.buffer[-3:].isnan().all()


def test_a_second_use_in_one_backward_is_summed_by_autograd():
    """The layer used twice: the first claim writes into the slot, the second is refused and
    made fresh; autograd's sum is a tensor of its own, equal to its own linear's sum."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 5)
    x = torch.randn(3, 5)
    (expected,) = torch.autograd.grad(
        F.linear(F.linear(x, layer.weight, layer.bias), layer.weight, layer.bias).sum(),
        [layer.weight],
    )
    slots = OneSlot(layer.weight)
    hidden = LinearIntoSlot.apply(x, layer.bias, layer.weight, slots)
    LinearIntoSlot.apply(hidden, layer.bias, layer.weight, slots).sum().backward()
    assert slots.claims == 2
    assert torch.allclose(layer.weight.grad, expected, rtol=0, atol=1e-6)
    assert layer.weight.grad.data_ptr() != slots.slot.data_ptr()


class Awkward(nn.Module):
    """Every way a Linear's weight can get its gradient: once through its module (`proj`,
    without bias, on 3-d input), twice (`shared`), through its module and functionally
    (`side`), tied to an embedding (`head`), and not at all (`frozen`)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.shared = nn.Linear(6, 6)
        self.side = nn.Linear(6, 6)
        self.proj = nn.Linear(6, 7, bias=False)
        self.frozen = nn.Linear(7, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        h = h + 0.5 * F.linear(h, self.side.weight) + self.side(h)
        h = h + self.frozen(torch.relu(self.proj(h)))
        return self.head(h)


def _model() -> Awkward:
    torch.manual_seed(0)
    return Awkward()


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (3 * world, 4), generator=g), torch.randint(
        0, 11, (3 * world, 4), generator=g
    )


def _loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def awkward_training(in_buckets: bool):
    """Four steps of DDP on `Awkward`, the third accumulated over two micro-batches under
    no_sync() and the fourth on uneven shares; and where autograd left each weight's gradient
    in the second backward (a hook registered before DDP's sees `.grad` as autograd set it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    linear_into_bucket.MIN_BYTES = 0  # (this model's weights are tiny)
    module, step = _model(), 0
    made_at: dict[str, int] = {}  # (in the second backward: the first adds into the zeroed
    # buckets that wrapping made each `.grad`, as after zero_grad(set_to_none=False))

    def where_made(name: str):
        def hook(p: nn.Parameter) -> None:
            if step == 1:
                made_at.setdefault(name, p.grad.data_ptr())

        return hook

    for name in ("proj", "shared", "side", "head"):
        getattr(module, name).weight.register_post_accumulate_grad_hook(where_made(name))
    model, opt = sw.prepare(
        module, sw.DDP(linear_grads_in_buckets=in_buckets), optimizer=torch.optim.AdamW, lr=1e-2
    )
    buckets = [
        (b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.nbytes) for b in model.reducer.buckets
    ]
    for step in range(4):
        tokens, targets = _batch(step, world)
        local = slice(3 * rank, 3 * rank + 3)
        if step == 2:
            with model.no_sync():
                _loss(model, tokens[local][:1], targets[local][:1]).backward()
            model.declare_batch(2, 2 * world)
            _loss(model, tokens[local][1:], targets[local][1:]).backward()
        elif step == 3:  # rank 0 takes 1 sample of 3, rank 1 the other 2 (world 2)
            share = slice(0, 1) if rank == 0 else slice(1, 3)
            model.declare_batch(share.stop - share.start, 3)
            _loss(model, tokens[:3][share], targets[:3][share]).backward()
        else:
            _loss(model, tokens[local], targets[local]).backward()
        opt.step()
        opt.zero_grad()
    in_bucket = {n: any(lo <= ptr < hi for lo, hi in buckets) for n, ptr in made_at.items()}
    frozen_kept = "forward" not in vars(module.frozen)
    model.close()
    restored = not any("forward" in vars(m) for m in module.modules())
    return sw.full_state_dict(model), in_bucket, frozen_kept, restored


def reference_training() -> dict[str, torch.Tensor]:
    """The same four steps in one process, on each step's global batch."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        tokens, targets = _batch(step, 2)
        if step == 2:  # each rank's two micro-batch means summed, then averaged over ranks
            for lo, hi in [(0, 1), (1, 3), (3, 4), (4, 6)]:
                (_loss(model, tokens[lo:hi], targets[lo:hi]) / 2).backward()
        elif step == 3:
            _loss(model, tokens[:3], targets[:3]).backward()
        else:
            _loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_ddp_trains_exactly_whichever_way_a_weight_gets_its_gradient():
    fused = run(awkward_training, 2, True)
    copied = run(awkward_training, 2, False)
    reference = reference_training()
    for (state, in_bucket, frozen_kept, restored), (plain, plain_in_bucket, _, _) in zip(
        fused, copied, strict=True
    ):
        # only the weight with one use through its module had its gradient made in the bucket
        assert in_bucket == {"proj": True, "shared": False, "side": False, "head": False}
        assert not any(plain_in_bucket.values())
        assert frozen_kept and restored
        # the same bits as copying the gradients in (world 2: a/2 + b/2 is (a + b)/2)
        assert all(torch.equal(state[k], plain[k]) for k in state)
        worst = max((state[k] - v).abs().max().item() for k, v in reference.items())
        assert worst <= 1e-6


def test_only_weights_of_min_bytes_or_more_write_into_their_slot():
    small, large = nn.Linear(8, 1024), nn.Linear(1024, 600)  # 32 KB and 2.4 MB of fp32 weight
    model = nn.Sequential(small, large)
    assert large.weight.nbytes >= linear_into_bucket.MIN_BYTES > small.weight.nbytes
    linears = linear_into_bucket.WritesIntoSlots(
        model, OneSlot(large.weight), {small.weight, large.weight}
    )
    assert "forward" in vars(large) and "forward" not in vars(small)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), large(small(x)))
    linears.remove()
    assert "forward" not in vars(large)


def _odd_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 601), nn.Tanh(), nn.Linear(601, 3))


def _odd_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 1024, generator=g), torch.randint(0, 3, (4 * world,), generator=g)


def odd_sizes_training():
    """DDP on a model whose 2.46 MB weight follows gradients of 3, 1803 and 601 floats in its
    bucket: where each gradient lies after backward, and the weights after three steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, opt = sw.prepare(_odd_model(), sw.DDP(), optimizer=torch.optim.SGD, lr=0.1, momentum=0.9)
    first, _, last = model.module
    for step in range(3):
        x, y = _odd_batch(step, world)
        F.cross_entropy(model(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4]).backward()
        at = {
            "large": first.weight.grad.data_ptr(),
            "small": [last.bias.grad.data_ptr(), last.weight.grad.data_ptr()],
        }
        opt.step()
        opt.zero_grad()
    return sw.full_state_dict(model), at


def test_a_large_gradient_starts_on_a_cache_line_and_small_ones_stay_packed():
    reference = _odd_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _odd_batch(step, 2)
        F.cross_entropy(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
    for state, at in run(odd_sizes_training, 2):
        bias, weight = at["small"]  # (the bucket starts with the last layer's bias)
        # 2,407 floats before it: packed, it would start 9,628 bytes in (28 past a line)
        assert at["large"] - bias == 2416 * 4 and at["large"] % 64 == 0
        assert weight == bias + 3 * 4  # the bias's 3 floats, then the weight: no gap
        worst = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        assert worst <= 1e-6
