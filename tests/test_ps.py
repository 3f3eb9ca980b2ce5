"""Parameter server: sync is exact, SSP's bound holds, async converges, failures are survived."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.models import MLP
from shardwise.ps.sharding import describe_mismatch, plan_shards, signature
from spawn import run

BATCH = 4  # per worker
STEPS = 20
EPOCHS = 4  # passes over the digits training set in the work-queue tests


def _mlp(sizes=(13, 16, 9, 5)) -> MLP:
    torch.manual_seed(0)
    return MLP(list(sizes))


def _global_batch(step: int, workers: int):
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(workers * BATCH, 13, generator=g)
    return x, torch.randint(0, 5, (workers * BATCH,), generator=g)


def _reference(workers: int, steps: int = STEPS) -> dict:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _global_batch(step, workers)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _sync_run(
    servers: int,
    steps: int = STEPS,
    kill_server_at: int | None = None,
    snap=None,
    relays: int = 0,
    lr: float = 1e-2,
):
    """Sync PS; worker w trains on slice w of global batch `clock` (so a resumed job picks up
    exactly where the snapshot left it)."""
    strategy = sw.ParameterServer(
        servers=servers,
        mode="sync",
        snapshot_every=5 if snap else 0,
        snapshot_dir=snap or "ps-snapshots",
        relays=relays,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    workers = world - servers - relays
    if strategy.is_relay():
        report = sw.ps.relay(_mlp(), strategy)
        return {"received": report.pushes_received, "forwarded": report.pushes_forwarded}
    if strategy.is_server():
        if kill_server_at is not None and rank == 0:
            original = sw.ps.server.Server.apply

            def dying_apply(self, flat, staleness):
                original(self, flat, staleness)
                if self.version == kill_server_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            sw.ps.server.Server.apply = dying_apply
        report = sw.ps.serve(_mlp(), strategy, torch.optim.AdamW, lr=lr)
        return {
            "resumed_from": report.resumed_from,
            "updates": report.updates,
            "pushes": report.pushes_received,
        }
    model, opt = sw.prepare(_mlp(), strategy, optimizer=torch.optim.AdamW, lr=lr)
    client, index = model.client, rank - servers - relays
    try:
        while client.clock < steps:
            x, y = _global_batch(client.clock, workers)
            part = slice(index * BATCH, (index + 1) * BATCH)
            F.cross_entropy(model(x[part]), y[part]).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # the server died: this run ends here
        return {"error": type(e).__name__}
    state = sw.full_state_dict(model)
    strategy.close(model)
    return state


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_equals_single_process(servers):
    expected = _reference(workers=2)
    results = run(_sync_run, servers + 2, servers)
    for state in results[servers:]:
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5
    assert all(r["updates"] == STEPS for r in results[:servers])


def test_two_level_sync_equals_single_process():
    """2 servers, 2 relays over 3 workers (groups of 2 and 1: the servers must weight each
    relay's sum by its count to get the mean over all workers)."""
    expected = _reference(workers=3)
    results = run(_sync_run, 7, 2, STEPS, None, None, 2)
    for state in results[4:]:
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5
    assert [r["updates"] for r in results[:2]] == [STEPS, STEPS]
    # The servers heard one push per relay and clock, not one per worker.
    assert [r["pushes"] for r in results[:2]] == [2 * STEPS, 2 * STEPS]
    assert [(r["received"], r["forwarded"]) for r in results[2:4]] == [
        (2 * STEPS, STEPS),
        (STEPS, STEPS),
    ]


def test_shards_are_balanced_by_bytes_and_signatures_compared():
    model = MLP([64, 512, 512, 10])  # one 512x512 matrix holds 80% of the bytes
    plan = plan_shards(model, 3)
    sizes = [b - a for a, b in plan.bounds]
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    assert max(sizes) - min(sizes) <= 1  # equal bytes, whatever the tensors' sizes
    other = MLP([64, 256, 512, 10])
    assert describe_mismatch(signature(model), signature(other)) == (
        "parameter '0.weight' has shape [256, 64], the servers hold [512, 64]"
    )
    assert describe_mismatch(signature(model), signature(model)) is None


def _ssp_run(staleness: int):
    """Workers log, on the machine's monotonic clock, when each push left and when the pull
    after it returned: the evidence the SSP bound is checked on."""
    strategy = sw.ParameterServer(servers=1, mode="ssp", staleness=staleness)
    rank = dist.get_rank()
    if strategy.is_server():
        sw.ps.serve(_mlp(), strategy, torch.optim.SGD, lr=1e-2)
        return None
    model, opt = sw.prepare(_mlp(), strategy, optimizer=torch.optim.SGD, lr=1e-2)
    pushed, returned = [], []  # seconds at which push k (1-based) left; pull k came back
    for step in range(15):
        if rank == 1:
            time.sleep(0.03)  # the straggler
        x, y = _global_batch(step, 1)
        F.cross_entropy(model(x), y).backward()
        pushed.append(time.monotonic())
        opt.step()  # push this step's gradient, then pull (SSP may hold the pull)
        returned.append(time.monotonic())
        opt.zero_grad()
    strategy.close(model)
    return pushed, returned


def test_ssp_never_lets_a_worker_run_more_than_s_clocks_ahead():
    staleness = 2
    logs = [log for log in run(_ssp_run, 4, staleness) if log is not None]
    lead = 0  # the largest lead the logs prove a worker had when its pull returned
    for w, (_, returned) in enumerate(logs):
        for clock, t in enumerate(returned, start=1):
            for v, (pushed, _) in enumerate(logs):
                if v == w:
                    continue
                # Worker w may start clock `clock` only once every other worker pushed
                # `clock - s` times: that push must have left before w's pull returned.
                if clock - staleness >= 1:
                    assert pushed[clock - staleness - 1] < t, (w, clock, v)
                # v cannot have pushed more than it had sent by then: a lower bound on w's lead.
                lead = max(lead, clock - sum(p < t for p in pushed))
    assert lead == staleness  # the fast workers did run ahead as far as allowed


def _mismatch_run():
    strategy = sw.ParameterServer(servers=1, mode="async")
    rank = dist.get_rank()
    if strategy.is_server():
        report = sw.ps.serve(_mlp(), strategy, torch.optim.SGD, lr=1e-2)
        return report.rejected
    sizes = (13, 16, 9, 5) if rank == 1 else (13, 17, 9, 5)
    try:
        model, opt = sw.prepare(_mlp(sizes), strategy, optimizer=torch.optim.SGD, lr=1e-2)
    except sw.ps.PSError as e:
        return str(e)
    for step in range(5):
        x, y = _global_batch(step, 1)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    strategy.close(model)
    return "trained"


def test_a_worker_with_another_model_is_refused_and_the_others_go_on():
    rejected, good, bad = run(_mismatch_run, 3)
    assert good == "trained"
    assert bad == (
        "parameter server 0 refused this worker: parameter '0.weight' has shape "
        "[17, 13], the servers hold [16, 13]"
    )
    assert list(rejected) == [2]


def _digits_run(
    mode: str, die_at: int | None, relays: int = 0, servers: int = 1, hang: bool = False
):
    """Workers take batches from server 0's work queue (EPOCHS passes over the digits training set);
    one may SIGKILL itself mid-run, or (`hang`) stop training while its process lives on."""
    from shardwise.datasets import digits

    splits = digits()
    strategy = sw.ParameterServer(
        servers=servers,
        mode=mode,
        staleness=2,
        timeout_s=2.0,
        relays=relays,
        progress_timeout_s=3.0,
    )
    rank = dist.get_rank()
    size = len(splits.train)
    if strategy.is_relay():
        return {"dead": sw.ps.relay(_mlp((64, 128, 10)), strategy).dead_workers}
    if strategy.is_server():
        work = sw.ps.WorkQueue(size, 32, epochs=EPOCHS, seed=0)
        report = sw.ps.serve(_mlp((64, 128, 10)), strategy, torch.optim.AdamW, work=work, lr=3e-3)
        return {
            "consumed": sorted(report.consumed),
            "dead": report.dead_workers,
            "size": size,
            "updates": report.updates,
            "rounds": report.rounds,
        }
    model, opt = sw.prepare(_mlp((64, 128, 10)), strategy, optimizer=torch.optim.AdamW, lr=3e-3)
    steps = 0
    while (indices := model.client.next_batch()) is not None:
        if rank == die_at and steps == 5:
            if hang:  # its heartbeats go on: only its progress says it is stuck
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = splits.train[indices]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    state = sw.full_state_dict(model)
    strategy.close(model)
    with torch.no_grad():
        reference = _mlp((64, 128, 10))
        reference.load_state_dict(state)
        x, y = splits.test[:]
        accuracy = (reference(x).argmax(-1) == y).float().mean().item()
    return {"accuracy": accuracy, "steps": steps}


def test_async_reaches_90_percent_on_digits():
    server, *workers = run(_digits_run, 3, "async", None, timeout_s=180)
    assert all(w["accuracy"] >= 0.90 for w in workers), workers
    assert len(server["consumed"]) == EPOCHS * (server["size"] // 32) * 32  # every batch


def test_a_killed_worker_is_declared_dead_and_its_data_is_consumed_by_the_others():
    server, _, alive = run(_digits_run, 3, "ssp", 1, timeout_s=180, dies=(1,))
    assert list(server["dead"]) == [1] and server["dead"][1] <= 2.0 + 1.0  # timeout + a check
    batches = server["size"] // 32
    assert len(server["consumed"]) == EPOCHS * batches * 32  # nothing lost with the dead worker
    assert alive["accuracy"] >= 0.85


def test_a_worker_whose_training_hangs_is_declared_stuck_and_its_batch_trained_by_another():
    server, _, alive = run(_digits_run, 3, "ssp", 1, 0, 1, True, timeout_s=180, dies=(1,))
    assert list(server["dead"]) == [1] and 3.0 < server["dead"][1] <= 3.0 + 2.0
    batches = server["size"] // 32
    assert len(server["consumed"]) == EPOCHS * batches * 32  # its batch was trained again
    assert alive["accuracy"] >= 0.85


def test_a_killed_server_resumes_from_its_snapshot(tmp_path):
    expected = _reference(workers=2)
    snap = str(tmp_path / "snapshots")
    first = run(_sync_run, 3, 1, STEPS, 12, snap, timeout_s=120, dies=(0,))
    assert all("error" in r for r in first[1:])  # the workers saw their server go
    second = run(_sync_run, 3, 1, STEPS, None, snap)
    assert second[0]["resumed_from"] == 10  # snapshots every 5 updates; killed after 12
    assert second[0]["updates"] == STEPS - 10
    for state in second[1:]:
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5
    # The servers' state (shard and optimizer) is the job's training state: resumed from it,
    # training continued exactly as an uninterrupted parameter-server run does.
    straight = run(_sync_run, 3, 1, STEPS)
    for state, resumed in zip(straight[1:], second[1:], strict=True):
        assert all(torch.equal(state[k], resumed[k]) for k in state)


def test_a_snapshot_of_another_job_is_refused(tmp_path):
    """The same snapshot directory, another learning rate: the server refuses to resume (it
    used to resume silently, do no update and report the old job's figures)."""
    snap = str(tmp_path / "snapshots")
    run(_sync_run, 3, 1, 10, None, snap)
    with pytest.raises(Exception, match="a snapshot of another job"):
        run(_sync_run, 3, 1, 10, None, snap, 0, 2e-2, timeout_s=60)


@pytest.mark.parametrize("mode, hang", [("async", False), ("sync", True)], ids=["kill", "hang"])
def test_two_level_survives_a_killed_or_stuck_worker_behind_a_relay(mode, hang):
    """1 server, relays 1 and 2 over workers 3, 4 and 5; worker 3 dies (async), or its training
    hangs while it keeps beating (sync): its relay declares it dead (silent) or stuck (its clock
    still while worker 4's moves on), server 0 deals its batch again, and the others finish
    every batch of every epoch (in sync mode through the end of the queue, where workers wait
    for the lost one's batch)."""
    args = (mode, 3, 2, 1, hang)
    server, relay_a, relay_b, _, *alive = run(_digits_run, 6, *args, timeout_s=180, dies=(3,))
    silence = relay_a["dead"][3]
    assert list(relay_a["dead"]) == [3]
    assert 3.0 < silence <= 3.0 + 2.0 if hang else silence <= 2.0 + 1.0
    assert not relay_b["dead"] and not server["dead"]
    assert len(server["consumed"]) == EPOCHS * (server["size"] // 32) * 32
    assert all(w["accuracy"] >= 0.85 for w in alive), alive


def test_sync_servers_apply_the_same_rounds_when_a_worker_dies():
    """2 servers, 3 workers, sync; worker 2 dies, and at the end of the queue the others wait
    for its batch. Server 0 decides each round's members and server 1 follows: both apply the
    same number of updates, and every batch is consumed."""
    server0, server1, _, *alive = run(_digits_run, 5, "sync", 2, 0, 2, timeout_s=180, dies=(2,))
    assert list(server0["dead"]) == [2] and list(server1["dead"]) == [2]
    assert server0["updates"] == server1["updates"]
    assert server0["rounds"] == server1["rounds"]  # the same members, round by round
    assert {2, 3, 4} in [set(r) for r in server0["rounds"]]  # lock-step before the death
    assert [3, 4] in server0["rounds"]  # and without the dead worker after it
    assert len(server0["consumed"]) == EPOCHS * (server0["size"] // 32) * 32
    assert all(w["accuracy"] >= 0.85 for w in alive), alive


def test_the_work_queue_holds_exactly_the_batches_asked_for():
    """4000 batches of 32 from 1437 samples: an epoch holds 44 full batches (its last partial
    one dropped), so 91 epochs are needed, not ceil(4000 * 32 / 1437) = 90 (a job of 4000 steps
    used to do 3960)."""
    work = sw.ps.WorkQueue.for_batches(4000, size=1437, batch=32, seed=0)
    batches = list(work.queue)
    assert len(batches) == 4000 and all(len(indices) == 32 for _, indices in batches)
    for epoch in {e for e, _ in batches}:
        seen = [i for e, indices in batches if e == epoch for i in indices]
        assert len(seen) == len(set(seen)) and all(0 <= i < 1437 for i in seen)
    with pytest.raises(ValueError, match="holds no batch"):
        sw.ps.WorkQueue.for_batches(10, size=20, batch=32, seed=0)
