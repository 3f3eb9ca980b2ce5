"""Local SGD, gossip and adaptive synchronisation against their definitions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.nn.models import MLP
from shardwise.strategies.relaxed import flat_params, neighbours
from spawn import run

BATCH = 4


def _model():
    torch.manual_seed(0)
    return MLP([13, 16, 5])


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * BATCH, 13, generator=g)
    y = torch.randint(0, 5, (world * BATCH,), generator=g)
    mine = slice(dist.get_rank() * BATCH, (dist.get_rank() + 1) * BATCH)
    return x, y, mine


def local_sgd_period_one():
    world = dist.get_world_size()
    kw = {"optimizer": torch.optim.SGD, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}
    local, local_opt = sw.prepare(_model(), sw.LocalSGD(period=1), **kw)
    ddp, ddp_opt = sw.prepare(_model(), sw.DDP(), **kw)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for step in range(15):
        x, y, mine = _batch(step, world)
        for model, opt in ((local, local_opt), (ddp, ddp_opt)):
            F.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    a = dict(local.module.state_dict())  # this rank's replica, not an average
    return (
        max((a[k] - ddp.module.state_dict()[k]).abs().max().item() for k in a),
        max((a[k] - reference.state_dict()[k]).abs().max().item() for k in a),
    )


def test_local_sgd_period_1_with_momentum_equals_ddp_and_single_process():
    # SGD with momentum and weight decay is linear in the gradient: averaging parameters after
    # each step equals averaging gradients before it (up to float rounding).
    for vs_ddp, vs_reference in run(local_sgd_period_one, 4):
        assert vs_ddp <= 1e-5 and vs_reference <= 1e-5


def _identical_after_each_step(model, opt, steps: int) -> list[bool]:
    """Train `steps` steps; after each, whether every rank holds exactly the same parameters."""
    world, identical = dist.get_world_size(), []
    for step in range(steps):
        x, y, mine = _batch(step, world)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        flat = _all(flat_params(model.module), world)
        identical.append(bool((flat == flat[0]).all()))
    return identical


def local_sgd_period(period: int, warmup: int):
    model, opt = sw.prepare(_model(), sw.LocalSGD(period=period, warmup_steps=warmup), lr=1e-2)
    identical_after = _identical_after_each_step(model, opt, 12)
    return model.sync_steps, identical_after


def test_local_sgd_replicas_identical_right_after_each_average():
    for sync_steps, identical in run(local_sgd_period, 2, 3, 2):
        assert sync_steps == [5, 8, 11]  # warm-up steps 1-2 synchronous, then every 3 steps
        expected = [s <= 2 or s in (5, 8, 11) for s in range(1, 13)]
        assert identical == expected


def gossip_steps(topology: str, lr: float):
    world = dist.get_world_size()
    model, opt = sw.prepare(
        _model(), sw.Gossip(topology=topology), optimizer=torch.optim.SGD, lr=lr
    )
    torch.manual_seed(dist.get_rank())  # replicas start apart, to watch them contract
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    start = _all(flat_params(model.module), world)
    mean_errors, distances = [], [(start - start.mean(0)).norm().item()]
    for step in range(10):
        x, y, mine = _batch(step, world)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        before = flat_params(model.module)  # (parameters before the local step)
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        after = flat_params(model.module)
        # Averaging-SGD predicts: mean_r x_r(t+1) = mean_r x_r(t) - lr * mean_r g_r
        stack = lambda t: _all(t, world)  # noqa: E731
        predicted = stack(before).mean(0) - lr * stack(grads).mean(0)
        mean_errors.append((stack(after).mean(0) - predicted).abs().max().item())
        distances.append((stack(after) - stack(after).mean(0)).norm().item())
    return mean_errors, distances


def _all(t: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(world, t.numel())
    dist.all_gather_into_tensor(out.view(-1), t.contiguous())
    return out


@pytest.mark.parametrize("topology", ["ring", "torus", "exponential"])
def test_gossip_keeps_the_mean_and_drives_consensus_distance_down(topology):
    for mean_errors, distances in run(gossip_steps, 4, topology, 0.05):
        assert max(mean_errors) <= 1e-5  # doubly stochastic mixing preserves the average
        assert distances[-1] < 0.2 * distances[0]  # from randomly perturbed starting replicas


def test_topologies_are_symmetric_and_regular():
    for topology in ("ring", "torus", "exponential"):
        for world in (2, 4, 6, 8):
            peers = {r: neighbours(topology, r, world) for r in range(world)}
            assert all(r in peers[q] for r in peers for q in peers[r])
            assert len({len(p) for p in peers.values()}) == 1


def adaptive(threshold: float, lr: float):
    """Every rank's parameters before each step, its gradients, and its parameters after."""
    world = dist.get_world_size()
    strategy = sw.AdaptiveSync(threshold=threshold)
    model, opt = sw.prepare(_model(), strategy, optimizer=torch.optim.SGD, lr=lr)
    seen = []
    for step in range(20):
        x, y, mine = _batch(step, world)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        before = _all(flat_params(model.module), world)
        grads = _all(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), world)
        opt.step()
        opt.zero_grad()
        seen.append((before, grads, _all(flat_params(model.module), world)))
    return seen


def test_adaptive_sync_synchronises_exactly_when_drift_passes_the_threshold():
    """Drift recomputed from the gathered replicas: a step ends in an average exactly when
    some replica's local step took it further than `threshold` (relative) from the last
    average, and then every replica holds the mean of the locally stepped ones."""
    threshold, lr = 0.02, 0.05
    seen = run(adaptive, 2, threshold, lr)[0]
    anchor, syncs = seen[0][0][0], []
    assert torch.equal(seen[0][0][0], seen[0][0][1])  # the replicas start equal
    for step, (before, grads, after) in enumerate(seen, start=1):
        local = torch.add(before, grads, alpha=-lr)  # plain SGD's local step, as torch does it
        drift = ((local - anchor).norm(dim=1) / anchor.norm()).max().item()
        assert abs(drift - threshold) > 1e-6 * threshold  # no case too close to call
        if drift > threshold:
            syncs.append(step)
            assert torch.allclose(after, local.mean(0).expand_as(after), atol=1e-7)
            assert torch.equal(after[0], after[1])
            anchor = after[0]
        else:
            assert torch.equal(after, local)  # no message changed a parameter
    assert 0 < len(syncs) < 20


def hybrid_gossip():
    model, opt = sw.prepare(_model(), sw.Hybrid(global_every=3), optimizer=torch.optim.SGD, lr=0.1)
    return model.sync_steps, _identical_after_each_step(model, opt, 7)


def test_hybrid_gossip_averages_globally_every_k_steps():
    # Ring gossip at world 4 mixes only neighbours: replicas agree exactly only after the
    # global average (steps 3 and 6).
    for sync_steps, identical in run(hybrid_gossip, 4):
        assert sync_steps == [3, 6]
        assert identical == [s in (3, 6) for s in range(1, 8)]


class _Branches(torch.nn.Module):
    """A head used by the samples of class 0 only: on a rank whose batch holds none, it makes
    no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.rare = MLP([13, 16, 5]), torch.nn.Linear(13, 5)

    def forward(self, x, y):
        out = self.body(x)
        rare = y == 0
        return out if not rare.any() else out + self.rare(x) * rare[:, None]


def warmup_steps_vs_one_process() -> float:
    """Post-local SGD's warm-up steps under clipping and with a branch only one rank's batch
    takes, against one process on the global batch (clipped by the global gradient's norm)."""
    world = dist.get_world_size()
    model, opt = sw.prepare(_Branches(), sw.LocalSGD(warmup_steps=10), optimizer=torch.optim.SGD)
    reference = _Branches()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for group in opt.param_groups:
        group["lr"] = 0.05
    for step in range(4):
        x, y, mine = _batch(step, world)
        y = torch.where(torch.arange(len(y)) < BATCH, y.clamp_min(1), y)  # (rank 0: no class 0)
        y[BATCH] = 0  # (rank 1: one)
        F.cross_entropy(model(x[mine], y[mine]), y[mine]).backward()
        sw.clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()
        F.cross_entropy(reference(x, y), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    ours = model.module.state_dict()
    return max((ours[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def test_local_sgd_warm_up_steps_are_synchronous_under_clipping_and_unused_branches():
    """Before, each rank clipped its own gradient by its own norm (the average came after, in
    the step: 3e-3 off), and a gradient one rank lacked left the ranks all-reducing buffers of
    different sizes (gloo aborted, the other rank hung)."""
    assert max(run(warmup_steps_vs_one_process, 2)) <= 1e-6


def a_round_that_trained_nothing() -> bool:
    model, _ = sw.prepare(_model(), sw.LocalSGD(period=2), optimizer=torch.optim.SGD, lr=0.1)
    model.pace_by_rounds()
    before = flat_params(model.module).clone()
    model.end_round(0)  # (every chunk of the round skipped on every rank)
    return torch.equal(flat_params(model.module), before)


def test_a_work_queue_round_that_trained_nothing_leaves_the_replicas_as_they_are():
    assert run(a_round_that_trained_nothing, 2) == [True, True]  # (was 0/0: NaN everywhere)


@pytest.mark.parametrize(
    "made",
    [
        lambda: sw.LocalSGD(period=2.5),
        lambda: sw.LocalSGD(period="4"),
        lambda: sw.LocalSGD(warmup_steps=-3),
        lambda: sw.Gossip(global_every=2.5),
        lambda: sw.AdaptiveSync(threshold=float("nan")),
        lambda: sw.AdaptiveSync(threshold="0.1"),
    ],
)
def test_relaxed_options_are_checked_in_one_line(made):
    with pytest.raises(
        ValueError, match=r"^(LocalSGD|Gossip|AdaptiveSync)\(\w+=.+\): Input should be"
    ):
        made()


def uneven_batches_vs_one_process(strategy) -> float:
    """Rank batches of 6 and 2 through `sw.train_step` (which declares them), plain SGD:
    against one process on the global batch of 8."""
    sizes = [6, 2]
    model, opt = sw.prepare(_model(), strategy, optimizer=torch.optim.SGD, lr=0.1)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 13, generator=g), torch.randint(0, 5, (8,), generator=g)
        start = sum(sizes[: dist.get_rank()])
        mine = slice(start, start + sizes[dist.get_rank()])
        sw.train_step(model, x[mine], y[mine], F.cross_entropy)
        opt.step()
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ours = model.module.state_dict()
    return max((ours[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize(
    "strategy", [sw.LocalSGD(period=1), sw.LocalSGD(warmup_steps=10)], ids=["period-1", "warm-up"]
)
def test_local_sgd_weighs_uneven_batches_by_their_samples(strategy):
    """The replicas meet weighed by the samples each trained on since they last met (in the
    same all-reduce): with plain SGD, period 1 and the warm-up's synchronous steps are the
    global batch's steps. Before, they averaged the ranks alike: 9.5e-2 off."""
    assert max(run(uneven_batches_vs_one_process, 2, strategy)) <= 1e-6


def saved_between_averages(directory: str) -> tuple[float, float, float]:
    """Local SGD two steps into a period of 4 (the replicas apart), rank batches of 6 and 2,
    saved: the checkpoint's weights against this rank's own replica, against the replicas'
    average as their meeting then makes it, and against `full_state_dict`."""
    from shardwise.checkpoint.reshardable import full_weights

    sizes = [6, 2]
    model, opt = sw.prepare(_model(), sw.LocalSGD(period=4), optimizer=torch.optim.SGD, lr=0.5)
    for step in range(2):
        x, y, _ = _batch(step, dist.get_world_size())
        start = sum(sizes[: dist.get_rank()])
        mine = slice(start, start + sizes[dist.get_rank()])
        sw.train_step(model, x[mine], y[mine], F.cross_entropy)
        opt.step()
        opt.zero_grad()
    own = {k: v.clone() for k, v in model.module.state_dict().items()}
    full = sw.full_state_dict(model)
    sw.save_checkpoint(model, opt, directory)
    saved = full_weights(directory)
    model.average()  # (the meeting the period would end with)
    met = model.module.state_dict()

    def diff(state):
        return max((saved[k] - v).abs().max().item() for k, v in state.items())

    return diff(own), diff(met), diff(full)


def test_a_checkpoint_between_averages_holds_the_replicas_average(tmp_path):
    """What an export or a resume on other ranks reads is the model the replicas' next meeting
    makes, weighed by their samples (before, rank 0's replica: 0.2 off)."""
    for vs_own, vs_met, vs_full in run(saved_between_averages, 2, str(tmp_path / "ckpt")):
        assert vs_own > 1e-3 and vs_met == 0.0 and vs_full == 0.0


def a_dropped_warm_up_step() -> bool:
    """A warm-up step whose gradients were read (clipped) and then dropped, as a non-finite
    step is: the next step is still synchronous (before, it stepped each rank's own gradients:
    the replicas 0.07 apart)."""
    world = dist.get_world_size()
    model, opt = sw.prepare(_model(), sw.LocalSGD(warmup_steps=5), optimizer=torch.optim.SGD)
    for step, dropped in ((0, True), (1, False)):
        x, y, mine = _batch(step, world)
        sw.train_step(model, x[mine], y[mine], F.cross_entropy)
        sw.clip_grad_norm_(model, 1.0)
        if not dropped:
            opt.step()
        opt.zero_grad()
    flat = _all(flat_params(model.module), world)
    return bool((flat == flat[0]).all())


def test_a_dropped_warm_up_step_leaves_the_next_one_synchronous():
    assert run(a_dropped_warm_up_step, 2) == [True, True]


def a_16_bit_average_of_many_samples() -> float:
    """fp16 replicas, each weighed by 70,000 samples (tokens, say): their average, against the
    plain mean (before, every weight came out 0: 70,000 is past fp16's range)."""
    torch.manual_seed(dist.get_rank())
    local = torch.nn.Linear(13, 5).half()
    model, _ = sw.prepare(local, sw.LocalSGD(period=1), optimizer=torch.optim.SGD, lr=0.1)
    mine = flat_params(model.module).float()
    model.declare_batch(70_000)
    model.after_step()  # (a step trained on them: the replicas meet)
    expected = _all(mine, dist.get_world_size()).mean(dim=0).half()
    return (flat_params(model.module).float() - expected.float()).abs().max().item()


def test_replicas_of_16_bits_average_in_float32():
    assert max(run(a_16_bit_average_of_many_samples, 2)) <= 1e-3
