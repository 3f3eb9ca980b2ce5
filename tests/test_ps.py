"""Parameter server: sync is exact, SSP's bound holds, async converges, failures are survived."""

from __future__ import annotations

import collections
import json
import os
import signal
import time
import tracemalloc
import types
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from harness import run_ps_job
from ps_batches import (
    BATCH,
    STEPS,
    global_batch,
    mlp,
    single_process_weights,
    train_on_slices,
)
from shardwise.nn.models import MLP
from shardwise.ps import protocol
from shardwise.ps.dealer import Dealer, NoDealing
from shardwise.ps.peers import check_hello
from shardwise.ps.protocol import Kind
from shardwise.ps.sharding import describe_mismatch, plan_shards, signature
from shardwise.ps.snapshots import EXIT_NO_SNAPSHOT, ShardSnapshots, SnapshotError
from shardwise.ps.worker import PSClient
from spawn import run

EPOCHS = 4  # passes over the digits training set in the work-queue tests


def _die_after_update(version: int) -> None:
    """This process's server SIGKILLs itself right after it makes `version`."""
    original = sw.ps.server.Server.apply

    def dying_apply(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.version == version:
            os.kill(os.getpid(), signal.SIGKILL)

    sw.ps.server.Server.apply = dying_apply


def _sync_run(
    servers: int,
    steps: int = STEPS,
    kill_server_at: int | None = None,
    snap=None,
    relays: int = 0,
    lr: float = 1e-2,
    skips: dict | None = None,
    schedule=None,
):
    """Sync PS; worker w trains on slice w of global batch `clock` (so a resumed job picks up
    exactly where the snapshot left it); `schedule`: the servers' rate multiplier by step."""
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
        report = sw.ps.relay(mlp(), strategy)
        return {"received": report.pushes_received, "forwarded": report.pushes_forwarded}
    if strategy.is_server():
        if kill_server_at is not None and rank == 0:
            _die_after_update(kill_server_at)
        report = sw.ps.serve(mlp(), strategy, torch.optim.AdamW, lr=lr, lr_schedule=schedule)
        return {
            "resumed_from": report.resumed_from,
            "updates": report.updates,
            "pushes": report.pushes_received,
        }
    model, opt = sw.prepare(mlp(), strategy, optimizer=torch.optim.AdamW, lr=lr)
    client, index = model.client, rank - servers - relays
    try:
        while client.clock < steps:
            x, y = global_batch(client.clock, workers)
            part = slice(index * BATCH, (index + 1) * BATCH)
            F.cross_entropy(model(x[part]), y[part]).backward()
            if client.clock in (skips or {}).get(index, ()):
                model.skip_step()  # (as `train.nonfinite: skip` does: nothing pushed)
            else:
                opt.step()
            opt.zero_grad()
    except Exception as e:  # the server died: this run ends here
        return {"error": type(e).__name__}
    state = sw.full_state_dict(model)
    strategy.close(model)
    return state


@pytest.mark.parametrize(
    "servers, schedule",
    [(1, None), (2, None), (1, sw.Schedule("cosine", total_steps=STEPS, warmup_steps=3))],
    ids=["1", "2", "1-cosine"],
)
def test_sync_equals_single_process(servers, schedule):
    """The servers' rate follows the schedule by training step, as one process's does."""
    expected = single_process_weights(workers=2, schedule=schedule)
    results = run(partial(_sync_run, schedule=schedule), servers + 2, servers)
    for state in results[servers:]:
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5
    assert all(r["updates"] == STEPS for r in results[:servers])


def test_two_level_sync_equals_single_process():
    """2 servers, 2 relays over 3 workers (groups of 2 and 1: the servers must weight each
    relay's sum by its count to get the mean over all workers)."""
    expected = single_process_weights(workers=3)
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


@pytest.mark.parametrize("relays", [0, 1], ids=["flat", "relay"])
def test_a_skipped_step_leaves_that_workers_slice_out_of_the_update(relays):
    """A worker that skips a clock (`train.nonfinite: skip`) pushes nothing: that update is the
    other worker's mean alone, and a clock both skip is no update at all."""
    skips = {0: {3, 11}, 1: {7, 11}}
    expected = single_process_weights(workers=2, skips=skips)
    results = run(_sync_run, 3 + relays, 1, STEPS, None, None, relays, 1e-2, skips)
    for state in results[1 + relays :]:
        assert max((state[k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5
    assert results[0]["updates"] == STEPS - 1  # the clock both skipped applied nothing


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
        sw.ps.serve(mlp(), strategy, torch.optim.SGD, lr=1e-2)
        return None
    hello_at = []  # (the straggler's: when its HELLO left)
    if rank == 1:  # the straggler says HELLO after the others pushed: it begins at clock 0
        send = PSClient._send  # all the same (before: at the server's version, far ahead)

        def late_hello(self, server, kind, *ints, payload=None):
            if kind == Kind.HELLO:
                time.sleep(0.3)
                hello_at.append(time.monotonic())
            return send(self, server, kind, *ints, payload=payload)

        PSClient._send = late_hello
    model, opt = sw.prepare(mlp(), strategy, optimizer=torch.optim.SGD, lr=1e-2)
    pushed, returned = [], []  # seconds at which push k (1-based) left; pull k came back
    for step in range(15):
        if rank == 1:
            time.sleep(0.03)  # the straggler
        x, y = global_batch(step, 1)
        F.cross_entropy(model(x), y).backward()
        pushed.append(time.monotonic())
        opt.step()  # push this step's gradient, then pull (SSP may hold the pull)
        returned.append(time.monotonic())
        opt.zero_grad()
    strategy.close(model)
    return pushed, returned, hello_at


def _late_joiner_run(mode: str):
    """Worker 2 trains throughout; worker 3 says HELLO to server 0, then, half a second of
    worker 2's pushes later, to server 1: the two servers' versions differ then (every async
    server counts its own updates), and both tell it the clock every worker began at."""
    strategy = sw.ParameterServer(servers=2, mode=mode, staleness=1000)
    rank = dist.get_rank()
    if strategy.is_server():
        return sw.ps.serve(mlp(), strategy, torch.optim.SGD, lr=1e-2).refused
    told = {}  # server -> the clock its HELLO's answer said
    if rank == 3:
        send, recv = PSClient._send, PSClient._recv

        def late_hello(self, server, kind, *ints, payload=None):
            if kind == Kind.HELLO and server == 1:
                time.sleep(0.5)
            return send(self, server, kind, *ints, payload=payload)

        def noting(self, server, dtype=None, most=1 << 31):
            h, payload = recv(self, server, dtype, most)
            told.setdefault(server, int(h[1]))
            return h, payload

        PSClient._send, PSClient._recv = late_hello, noting
    model, opt = sw.prepare(mlp(), strategy, optimizer=torch.optim.SGD, lr=1e-2)
    for step in range(400 if rank == 2 else 20):
        x, y = global_batch(step, 1)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    strategy.close(model)
    return told


@pytest.mark.alone  # (a 0.5 s sleep must outlast a push)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_worker_told_other_versions_by_its_servers_is_served(mode):
    refused_0, refused_1, _, told = run(_late_joiner_run, 4, mode)
    # (before: each told its version, server 1 a larger one, worker 2's pushes having
    # reached it between the HELLOs; a clock counts the worker's own pushes, not everyone's)
    assert told == {0: 0, 1: 0}
    assert refused_0 == refused_1 == 0  # no honest message refused as out of turn


def test_a_hello_that_is_not_a_model_signature_is_refused_in_words():
    """Whatever JSON a first HELLO carries, the server says why it refuses it, and lives."""
    ours = signature(mlp())
    deep = b"[" * 500_000 + b"]" * 500_000  # (deeper than Python's JSON parser recurses)
    for text in [deep, b'[["w", [Infinity]]]', b'[["w", [NaN]]]', b"{}", b"[1]", b"\xff"]:
        payload = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        problem = check_hello(ours, payload)  # (malformed, or another model's: no parameter)
        assert problem and ("malformed HELLO" in problem or "missing" in problem), problem
    assert check_hello(ours, protocol.pack([[n, list(s)] for n, s in ours])) is None


@pytest.mark.alone  # (a straggler's sleep must outlast the others' steps)
def test_ssp_never_lets_a_worker_run_more_than_s_clocks_ahead():
    staleness = 2
    logs = [log for log in run(_ssp_run, 4, staleness) if log is not None]
    (hello_at,) = logs[0][2]  # (worker rank 1's)
    assert any(pushed[0] < hello_at for pushed, _, _ in logs[1:])  # others pushed before it
    lead = 0  # the largest lead the logs prove a worker had when its pull returned
    for w, (_, returned, _) in enumerate(logs):
        for clock, t in enumerate(returned, start=1):
            for v, (pushed, _, _) in enumerate(logs):
                if v == w:
                    continue
                # Worker w may start clock `clock` only once every other worker pushed
                # `clock - s` times: that push must have left before w's pull returned.
                if clock - staleness >= 1:
                    assert pushed[clock - staleness - 1] < t, (w, clock, v)
                # v cannot have pushed more than it had sent by then: a lower bound on w's lead.
                lead = max(lead, clock - sum(p < t for p in pushed))
    assert lead == staleness  # the fast workers did run ahead as far as allowed


def _mismatch_run(mode: str):
    strategy = sw.ParameterServer(servers=1, mode=mode, progress_timeout_s=20)
    rank = dist.get_rank()
    if strategy.is_server():
        report = sw.ps.serve(mlp(), strategy, torch.optim.SGD, lr=1e-2)
        return report.rejected
    sizes = (13, 16, 9, 5) if rank == 1 else (13, 17, 9, 5)
    if rank == 2:  # (its HELLO after the other's first push: a sync round waits for it)
        send = sw.ps.protocol.send

        def late_hello(dst, kind, *args, **kwargs):
            if kind == sw.ps.protocol.Kind.HELLO:
                time.sleep(2.0)
            return send(dst, kind, *args, **kwargs)

        sw.ps.protocol.send = late_hello
    try:
        model, opt = sw.prepare(mlp(sizes), strategy, optimizer=torch.optim.SGD, lr=1e-2)
    except sw.ps.PSError as e:
        return str(e)
    for step in range(5):
        x, y = global_batch(step, 1)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    strategy.close(model)
    return "trained"


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_worker_with_another_model_is_refused_and_the_others_go_on(mode):
    rejected, good, bad = run(_mismatch_run, 3, mode)
    assert good == "trained"
    assert bad == (
        "parameter server 0 refused this worker: parameter '0.weight' has shape "
        "[17, 13], the servers hold [16, 13]"
    )
    assert list(rejected) == [2]


def _digits_run(
    log_dir: str,
    mode: str,
    die_at: int | None,
    relays: int = 0,
    servers: int = 1,
    hang: bool = False,
    after_push: bool | str = False,
):
    """Workers take batches from server 0's work queue (EPOCHS passes over the digits training set);
    one may SIGKILL itself mid-run (before its 6th batch, or with `after_push` after it: its
    update applied, or with "skip" skipped as a non-finite one is, its next batch not asked
    for), or (`hang`) stop training while its process lives on. Each worker logs the indices of
    every batch it trained to `log_dir` (flushed: a killed worker's log holds all it trained)."""
    from shardwise.data.datasets import digits

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
        return {"dead": sw.ps.relay(mlp((64, 128, 10)), strategy).dead_workers}
    if strategy.is_server():
        work = sw.ps.WorkQueue(size, 32, epochs=EPOCHS, seed=0)
        report = sw.ps.serve(mlp((64, 128, 10)), strategy, torch.optim.AdamW, work=work, lr=3e-3)
        return {
            "consumed": report.consumed_samples,
            "dead": report.dead_workers,
            "size": size,
            "updates": report.updates,
            "rounds": report.rounds,
        }
    model, opt = sw.prepare(mlp((64, 128, 10)), strategy, optimizer=torch.optim.AdamW, lr=3e-3)
    steps = 0
    log = open(Path(log_dir) / f"trained{rank}.jsonl", "a")  # noqa: SIM115 (SIGKILLed with it)
    while (indices := model.client.next_batch()) is not None:
        if rank == die_at and steps == 5 and not after_push:
            if hang:  # its heartbeats go on: only its progress says it is stuck
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = splits.train[indices]
        F.cross_entropy(model(x), y).backward()
        if rank == die_at and steps == 5 and after_push == "skip":
            model.skip_step()  # (as the trainer does with a non-finite gradient)
        else:
            opt.step()
        opt.zero_grad()
        log.write(json.dumps(indices) + "\n")
        log.flush()
        steps += 1
        if rank == die_at and steps == 6 and after_push:
            os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    state = sw.full_state_dict(model)
    strategy.close(model)
    with torch.no_grad():
        reference = mlp((64, 128, 10))
        reference.load_state_dict(state)
        x, y = splits.test[:]
        accuracy = (reference(x).argmax(-1) == y).float().mean().item()
    return {"accuracy": accuracy, "steps": steps}


def _each_batch_trained_once(server: dict, log_dir: Path) -> None:
    """The workers' own logs hold every batch of the EPOCHS seeded passes (each dropping its last
    partial batch) exactly once, and the server counted them all as consumed."""
    planned = collections.Counter()
    for epoch in range(EPOCHS):
        order = torch.randperm(server["size"], generator=torch.Generator().manual_seed(epoch))
        for start in range(0, server["size"] - 32 + 1, 32):
            planned[tuple(order[start : start + 32].tolist())] += 1
    logs = [path.read_text().splitlines() for path in log_dir.glob("trained*.jsonl")]
    trained = collections.Counter(tuple(json.loads(line)) for lines in logs for line in lines)
    assert trained == planned  # (the dead worker's batches before it died included)
    assert server["consumed"] == sum(planned.values()) * 32


@pytest.mark.alone  # (2 s and 3 s silence timeouts)
def test_async_reaches_90_percent_on_digits(tmp_path):
    server, *workers = run(_digits_run, 3, str(tmp_path), "async", None, timeout_s=180)
    assert all(w["accuracy"] >= 0.90 for w in workers), workers
    _each_batch_trained_once(server, tmp_path)


@pytest.mark.alone  # (a dead worker named within 3 s)
def test_a_killed_worker_is_declared_dead_and_its_data_is_consumed_by_the_others(tmp_path):
    server, _, alive = run(_digits_run, 3, str(tmp_path), "ssp", 1, timeout_s=180, dies=(1,))
    assert list(server["dead"]) == [1] and server["dead"][1] <= 2.0 + 1.0  # timeout + a check
    assert len((tmp_path / "trained1.jsonl").read_text().splitlines()) == 5  # then it died
    _each_batch_trained_once(server, tmp_path)  # nothing lost with the dead worker
    assert alive["accuracy"] >= 0.85


@pytest.mark.alone  # (a stuck worker named within 3-5 s)
def test_a_worker_whose_training_hangs_is_declared_stuck_and_its_batch_trained_by_another(
    tmp_path,
):
    args = (str(tmp_path), "ssp", 1, 0, 1, True)
    server, _, alive = run(_digits_run, 3, *args, timeout_s=180, dies=(1,))
    assert list(server["dead"]) == [1] and 3.0 < server["dead"][1] <= 3.0 + 2.0
    _each_batch_trained_once(server, tmp_path)  # its batch was trained again
    assert alive["accuracy"] >= 0.85


def test_a_killed_server_resumes_from_its_snapshot(tmp_path):
    expected = single_process_weights(workers=2)
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


def _sync_digits_run(log_dir: str, snap: str, kill_server_at=None, die_at=None):
    """Sync, 1 server and 3 workers dealt 40 batches of the digits from server 0's queue,
    snapshots every 5 updates; worker `die_at` SIGKILLs itself as its 4th batch begins (the
    rounds after it hold 2 pushes, not 3), the server as it makes version `kill_server_at`.
    Each worker logs every batch it trained with the version its update made (the one its
    pull answered: in sync, the round that holds its push)."""
    from shardwise.data.datasets import digits

    splits = digits()
    strategy = sw.ParameterServer(
        servers=1, mode="sync", timeout_s=4.0, snapshot_every=5, snapshot_dir=snap
    )
    rank = dist.get_rank()
    if strategy.is_server():
        if kill_server_at is not None:
            _die_after_update(kill_server_at)
        work = sw.ps.WorkQueue.for_batches(40, len(splits.train), 32, seed=0)
        report = sw.ps.serve(mlp((64, 128, 10)), strategy, torch.optim.SGD, work=work, lr=0.1)
        return {"resumed_from": report.resumed_from, "size": len(splits.train)}
    model, opt = sw.prepare(mlp((64, 128, 10)), strategy, optimizer=torch.optim.SGD, lr=0.1)
    log = open(Path(log_dir) / f"trained{rank}.jsonl", "a")  # noqa: SIM115 (SIGKILLed with it)
    try:
        steps = 0
        while (indices := model.client.next_batch()) is not None:
            if rank == die_at and steps == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = splits.train[indices]
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            log.write(json.dumps([indices, model.client.version]) + "\n")
            log.flush()
            steps += 1
    except Exception as e:  # the server died: this run ends here
        return {"error": type(e).__name__}
    finally:
        log.close()
    strategy.close(model)
    return {"steps": steps}


def test_a_server_resumed_after_rounds_short_of_a_worker_deals_exactly_the_batches_left(
    tmp_path,
):
    """A worker dies, so rounds hold fewer batches than workers; then the server dies and the
    job resumes from its snapshot. The batches whose updates the snapshot holds (by the
    workers' own logs: those of versions up to it) and those the resumed job trained are
    every batch of the plan, each once: none skipped (as when a resumed server took a version
    for `workers` batches), none trained twice."""
    snap, first, second = (tmp_path / d for d in ("snapshots", "first", "second"))
    first.mkdir(), second.mkdir()
    run(_sync_digits_run, 4, str(first), str(snap), 12, 3, timeout_s=120, dies=(0, 3))
    server, *_ = run(_sync_digits_run, 4, str(second), str(snap), timeout_s=120)
    assert server["resumed_from"] == 10  # snapshots every 5 updates; killed after 12

    def trained(log_dir: Path, up_to: float) -> collections.Counter:
        lines = [json.loads(line) for p in log_dir.glob("*.jsonl") for line in p.open()]
        return collections.Counter(tuple(batch) for batch, v in lines if v <= up_to)

    order = torch.randperm(server["size"], generator=torch.Generator().manual_seed(0))
    planned = collections.Counter(tuple(order[32 * b : 32 * b + 32].tolist()) for b in range(40))
    kept = trained(first, up_to=10)
    assert sum(kept.values()) == 3 * 3 + 7 * 2  # 3 rounds of 3 pushes, then 7 of 2
    assert kept + trained(second, up_to=float("inf")) == planned


IDENTITY = json.dumps({"job": "a"})


def _shard_state(version: int) -> dict:
    """What a server snapshots: its shard and its AdamW's state after a step."""
    torch.manual_seed(version)
    shard = torch.nn.Parameter(torch.randn(7))
    opt = torch.optim.AdamW([shard], lr=1e-2)
    shard.grad = torch.randn(7)
    opt.step()
    return {
        "version": version,
        "bounds": [0, 7],
        "params": [shard.detach().clone()],
        "optimizer": opt.state_dict(),
    }


def _snapshots(directory, store=None, identity=IDENTITY, servers=1) -> ShardSnapshots:
    return ShardSnapshots(directory, 0, servers, store or dist.HashStore(), identity, [7])


def test_snapshots_are_kept_two_and_a_damaged_or_foreign_one_is_passed_over(tmp_path, capsys):
    """Each way a snapshot goes bad costs one line naming the file and why, and the server
    falls back to the version before; no file is unpickled (a pickle is refused unread)."""
    snaps = _snapshots(tmp_path)
    for version in (5, 10, 15):
        snaps.save(_shard_state(version))
    assert snaps.versions() == [10, 15]  # the last two
    saved, loaded = _shard_state(15), snaps.load(15)
    assert torch.equal(loaded["params"][0], saved["params"][0])
    assert loaded["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]  # betas too
    for key, value in saved["optimizer"]["state"][0].items():
        assert torch.equal(loaded["optimizer"]["state"][0][key], value)
    newest = snaps._path(15)
    good = newest.read_bytes()
    torch.save(saved, newest.with_suffix(".pt"))
    damages = {
        "unreadable (Error while deserializing header: incomplete metadata": good[:-9],
        "damaged (its SHA-256 does not match its contents)": good[:-1] + bytes([good[-1] ^ 1]),
        "unreadable (Error while deserializing header: header too large)": newest.with_suffix(
            ".pt"
        ).read_bytes(),  # torch.save's pickle
        "a snapshot of another job": None,  # another job's, written under the same name
    }
    for why, data in damages.items():
        if data is None:
            _snapshots(tmp_path, identity=json.dumps({"job": "b"})).save(_shard_state(15))
        else:
            newest.write_bytes(data)
        path, state = _snapshots(tmp_path).newest_common()
        assert path == snaps._path(10) and state["version"] == 10
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"shardwise: ps server 0: {newest}: {why}"), line
    snaps._path(10).write_bytes(b"")  # both damaged: no version left to resume from
    with pytest.raises(SnapshotError, match=r"^no snapshot in .* is usable by every server"):
        _snapshots(tmp_path).newest_common()
    assert len(capsys.readouterr().err.splitlines()) == 2  # one line per damaged file
    snaps.save(_shard_state(5))  # resumed from scratch: the later versions are given up
    assert snaps.versions() == [5]


def test_servers_resume_from_the_newest_version_all_of_them_can_use(tmp_path):
    """Server 0 has two usable snapshots; what server 1 says it kept and can use decides."""
    snaps = _snapshots(tmp_path)
    for version in (5, 10):
        snaps.save(_shard_state(version))
    cases = [([5, 10], [5, 10], 10), ([5, 10], [5], 5), ([5, 10], [], "error"), ([], [], None)]
    for kept, usable, expected in cases:
        store = dist.HashStore()
        store.set("shardwise/ps/snapshots/server1", json.dumps({"kept": kept, "usable": usable}))
        if expected == "error":
            with pytest.raises(SnapshotError, match=r"versions \[5, 10\] .* server\(s\) \[1\]"):
                _snapshots(tmp_path, store, servers=2).newest_common()
            continue
        found = _snapshots(tmp_path, store, servers=2).newest_common()
        assert (found and found[1]["version"]) == expected


def _identities() -> list[str]:
    """The identities (what a snapshot must have been written by) of servers of five jobs: a
    job, the same again, with another learning rate, another data order and another rule."""
    identities = []
    for lr, seed, rule in [(1e-2, 0, "gradient"), (1e-2, 0, "gradient"), (2e-2, 0, "gradient"),
                           (1e-2, 1, "gradient"), (1e-2, 0, "average")]:  # fmt: skip
        strategy = sw.ParameterServer(servers=1, mode="sync", rule=rule)
        work = sw.ps.WorkQueue.for_batches(10**7, size=1437, batch=32, seed=seed)
        server = sw.ps.server.Server(mlp(), strategy, torch.optim.AdamW, {"lr": lr}, 0, [], work)
        server._beats.stop()
        identities.append(server.identity)
    return identities


def test_a_server_tells_its_own_job_s_snapshots_from_another_job_s():
    job, again, other_lr, other_order, other_rule = run(_identities, 1)[0]
    # (another rule: before, a snapshot of a job that averaged resumed one that stepped)
    assert job == again and len({job, other_lr, other_order, other_rule}) == 4
    # The data plan is named, not the queue of 10^7 batches written out.
    assert json.loads(job)["work"] == {"size": 1437, "batch": 32, "seed": 0, "batches": 10**7}


@pytest.mark.usefixtures("uncalibrated")
def test_a_ps_job_left_no_usable_snapshot_fails_at_once_with_one_line_and_no_restart(
    tmp_path, run_dir
):
    """Under the supervisor: the server names the file and why, ends with EXIT_NO_SNAPSHOT, and
    the supervisor does not restart a job that would find the same files."""
    (run_dir / "ps-snapshots").mkdir(parents=True)
    foreign = run_dir / "ps-snapshots" / "server0-v000000010.safetensors"
    torch.save({"params": [torch.zeros(3)]}, foreign)  # a pickle: refused unread
    sets = ["strategy.workers=1", "strategy.snapshot_every=10"]
    result = run_ps_job(run_dir, *sets, cwd=tmp_path, timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert f"shardwise: ps server 0: {foreign}: unreadable (" in out
    assert f"shardwise: ps server 0: no snapshot in {foreign.parent} is usable" in out
    assert f"shardwise: ps server rank 0 exited with code {EXIT_NO_SNAPSHOT}" in out
    assert "shardwise: not restarting the job: the servers have no usable snapshot" in out
    assert "restarting the job; servers resume" not in out
    assert foreign.exists()  # nothing removed


TWO_LEVEL_DEATHS = {
    "kill": ("async", False, False),
    "hang": ("sync", True, False),
    "kill-after-push": ("async", False, True),
    "kill-after-skip": ("async", False, "skip"),
}


@pytest.mark.alone  # (2 s and 3 s silence timeouts)
@pytest.mark.parametrize("mode, hang, after_push", TWO_LEVEL_DEATHS.values(), ids=TWO_LEVEL_DEATHS)
def test_two_level_survives_a_killed_or_stuck_worker_behind_a_relay(
    mode, hang, after_push, tmp_path
):
    """1 server, relays 1 and 2 over workers 3, 4 and 5; worker 3 dies (async), or its training
    hangs while it keeps beating (sync): its relay declares it dead (silent) or stuck (its clock
    still while worker 4's moves on), server 0 deals its batch again, and the others finish
    every batch of every epoch (in sync mode through the end of the queue, where workers wait
    for the lost one's batch). Killed after its update was applied and before it asked for its
    next batch, its batch is in the parameters: it is not dealt again (before, a relay's async
    push named no worker, so server 0 dealt that batch again and it was trained twice). Killed
    after skipping its update (a non-finite gradient), its batch is consumed all the same (an
    async SKIP marked none, before: that batch too was trained twice)."""
    args = (str(tmp_path), mode, 3, 2, 1, hang, after_push)
    server, relay_a, relay_b, _, *alive = run(_digits_run, 6, *args, timeout_s=180, dies=(3,))
    silence = relay_a["dead"][3]
    assert list(relay_a["dead"]) == [3]
    assert 3.0 < silence <= 3.0 + 2.0 if hang else silence <= 2.0 + 1.0
    assert not relay_b["dead"] and not server["dead"]
    if after_push:
        assert len((tmp_path / "trained3.jsonl").read_text().splitlines()) == 6
    _each_batch_trained_once(server, tmp_path)
    assert all(w["accuracy"] >= 0.85 for w in alive), alive


@pytest.mark.alone  # (2 s and 3 s silence timeouts)
def test_sync_servers_apply_the_same_rounds_when_a_worker_dies(tmp_path):
    """2 servers, 3 workers, sync; worker 2 dies, and at the end of the queue the others wait
    for its batch. Server 0 decides each round's members and server 1 follows: both apply the
    same number of updates, and every batch is consumed."""
    args = (str(tmp_path), "sync", 2, 0, 2)
    server0, server1, _, *alive = run(_digits_run, 5, *args, timeout_s=180, dies=(2,))
    assert list(server0["dead"]) == [2] and list(server1["dead"]) == [2]
    assert server0["updates"] == server1["updates"]
    assert server0["rounds"] == server1["rounds"]  # the same members, round by round
    assert {2, 3, 4} in [set(r) for r in server0["rounds"]]  # lock-step before the death
    assert [3, 4] in server0["rounds"]  # and without the dead worker after it
    _each_batch_trained_once(server0, tmp_path)
    assert all(w["accuracy"] >= 0.85 for w in alive), alive


def test_the_work_queue_holds_exactly_the_batches_asked_for():
    """4000 batches of 32 from 1437 samples: an epoch holds 44 full batches (its last partial
    one dropped), so 91 epochs are needed, not ceil(4000 * 32 / 1437) = 90 (a job of 4000 steps
    used to do 3960)."""
    work = sw.ps.WorkQueue.for_batches(4000, size=1437, batch=32, seed=0)
    assert len(work) == 4000
    batches = []
    while (batch := work.next(worker=7)) is not None:
        batches.append(batch)
    assert len(batches) == 4000 and all(len(indices) == 32 for _, indices in batches)
    for epoch in {e for e, _ in batches}:
        seen = [i for e, indices in batches if e == epoch for i in indices]
        assert len(seen) == len(set(seen)) and all(0 <= i < 1437 for i in seen)
    assert work.consumed_samples == 4000 * 32  # (asking past the end finished the last)
    with pytest.raises(ValueError, match="holds no batch"):
        sw.ps.WorkQueue.for_batches(10, size=20, batch=32, seed=0)


@pytest.mark.alone  # (bounded in seconds)
def test_a_work_queue_of_ten_million_batches_is_built_at_once_in_little_memory():
    """Batches are computed when dealt (every one was built up front: ~15 GiB here); a batch
    given back is dealt first, and each is consumed once, across an epoch's end too."""
    tracemalloc.start()
    started = time.perf_counter()
    work = sw.ps.WorkQueue.for_batches(10**7, size=1437, batch=32, seed=0)
    work.restore(43, [])  # (resumed at the last batch of epoch 0)
    dealt = [work.next(worker) for worker in range(3)]
    work.give_back(1)
    again = work.next(worker=3)
    for worker in (0, 2, 3):
        work.finish(worker)
    elapsed, (_, peak) = time.perf_counter() - started, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 2**20, (elapsed, peak)
    assert len(work) == 10**7 - 46 and work.consumed_batches == 46
    assert [e for e, _ in dealt] == [0, 1, 1] and again == dealt[1]
    order = torch.randperm(1437, generator=torch.Generator().manual_seed(1)).tolist()
    assert dealt[2][1] == order[32:64]  # batch 45: the second of epoch 1


def test_a_resumed_queue_deals_what_no_update_holds_and_a_dead_worker_s_update_counts():
    """A worker that dies after its update was made leaves its batch consumed (it is in the
    parameters), one that dies before gives it back; a queue resumed from the batches applied
    deals those it lacks first, in order, then the rest; a record that does not fit the queue
    is refused."""
    work = sw.ps.WorkQueue.for_batches(8, size=32, batch=4, seed=0)
    dealt = [work.next(w)[1] for w in (1, 2, 3, 4)]  # batches 0 to 3
    for worker in (1, 3, 4):  # the round that holds 0, 2 and 3
        work.mark_applied(worker)
    work.give_back(3)  # died after its update: batch 2 consumed
    work.give_back(2)  # died before it: batch 1 dealt again
    assert work.consumed_batches == 1 and work.next(5)[1] == dealt[1]
    dealer = Dealer(sw.ps.WorkQueue.for_batches(8, size=32, batch=4, seed=0), None, None)
    state = Dealer(work, None, None).snapshot()  # batches 0, 2 and 3 applied (and not 1)
    dealer.restore(state, version_batches=0)
    assert dealer.consumed() == (3, 12)
    resumed = [dealer.work.next(w) for w in range(6)]
    assert [batch for _, batch in resumed[:5]] == [dealt[1]] + [
        work.batch_of(b)[1] for b in (4, 5, 6, 7)
    ]
    assert resumed[5] is None
    old = Dealer(sw.ps.WorkQueue.for_batches(8, size=32, batch=4, seed=0), None, None)
    old.restore({}, version_batches=6)  # a snapshot without the record: its version's batches
    assert old.consumed() == (6, 24)
    for bad in (
        {"applied_below": 9, "applied_above": torch.tensor([], dtype=torch.int64)},
        {"applied_below": 1, "applied_above": torch.tensor([3, 3])},
        {"applied_below": 1, "applied_above": torch.tensor([1])},
        {"applied_below": 1, "applied_above": [3]},
        {"applied_below": "1", "applied_above": torch.tensor([3])},
    ):
        fresh = Dealer(sw.ps.WorkQueue.for_batches(8, size=32, batch=4, seed=0), None, None)
        with pytest.raises(ValueError):
            fresh.restore(bad, version_batches=0)


def test_server_0_s_dealer_holds_a_worker_until_a_dead_worker_s_batch_comes_back():
    """Dealing alone, no processes: with the queue empty, a worker that asks while another
    trains is held (WAIT, idle); that one's death gives its batch back, dealt at once to the
    held worker; once none is out, a request hears END. A server with no queue answers END."""
    sent = []

    def send(dst, kind, *ints, payload=None):
        sent.append((dst, kind, ints, None if payload is None else payload.tolist()))

    outbox = types.SimpleNamespace(send=send)
    peers = types.SimpleNamespace(live={1, 2}, done=set(), idle=set(), note_served=lambda r: None)
    work = sw.ps.WorkQueue.for_batches(2, size=8, batch=4, seed=0)
    dealer = Dealer(work, peers, outbox)
    assert dealer.plan() == work.plan()
    assert not dealer.request(1, worker=1) and not dealer.request(2, worker=2)
    assert [(dst, kind) for dst, kind, _, _ in sent] == [(1, Kind.BATCH), (2, Kind.BATCH)]
    assert dealer.request(1, worker=1)  # none left; 2 still trains its batch
    assert sent[-1][:3] == (1, Kind.WAIT, (1,)) and peers.idle == {1}
    dealer.lost([2])
    assert sent[-1] == (1, Kind.BATCH, (0, 1, 1), work.batch_of(1)[1]) and peers.idle == set()
    dealer.finished(1)
    assert dealer.consumed() == (2, 8)
    assert not dealer.request(1, worker=1) and sent[-1][:3] == (1, Kind.END, (1,))
    assert not NoDealing(outbox).request(3, worker=3) and sent[-1][:3] == (3, Kind.END, (3,))


def _backup_run(servers: int, backups: int, slow: int, steps: int = STEPS):
    """Sync with backup workers; worker `slow` sleeps before each push. Worker w trains on slice
    w of global batch `version` (the version it pulled: a late worker skips the batches of the
    rounds that closed without it) and counts its pushes."""
    strategy = sw.ParameterServer(servers=servers, mode="sync", backup_workers=backups)
    rank, world = dist.get_rank(), dist.get_world_size()
    workers = world - servers
    if strategy.is_server():
        report = sw.ps.serve(mlp(), strategy, torch.optim.AdamW, lr=1e-2)
        return {"rounds": report.rounds, "late": report.late, "updates": report.updates}
    model, opt = sw.prepare(mlp(), strategy, optimizer=torch.optim.AdamW, lr=1e-2)
    client, index, pushes = model.client, rank - servers, 0
    while client.version < steps:
        x, y = global_batch(client.version, workers)
        part = slice(index * BATCH, (index + 1) * BATCH)
        F.cross_entropy(model(x[part]), y[part]).backward()
        if index == slow:
            time.sleep(0.15)
        opt.step()
        opt.zero_grad()
        pushes += 1
    state = sw.full_state_dict(model)
    strategy.close(model)
    return {"state": state, "pushes": pushes}


@pytest.mark.alone  # (a 0.15 s sleep must outlast the others' steps)
def test_backup_workers_average_the_first_pushes_and_count_the_late_ones():
    """2 servers, 3 workers, backup_workers 1, worker 2 slow: each round is the mean of the
    slices of the workers in it (at least 2 of 3), both servers apply the same rounds, and
    every push a worker sent was either in a round or counted late by both servers. The final
    weights are single-process training on each round's slices."""
    server0, server1, *workers = run(_backup_run, 5, 2, 1, 2, timeout_s=120)
    rounds = server0["rounds"]
    assert server1["rounds"] == rounds and len(rounds) == STEPS
    assert all(len(members) >= 2 for members in rounds)
    assert server0["late"] == server1["late"] and server0["late"].get(4, 0) >= 1
    for rank, worker in enumerate(workers, start=2):
        in_rounds = sum(rank in members for members in rounds)
        assert worker["pushes"] == in_rounds + server0["late"].get(rank, 0)
    skips = {w: {v for v, m in enumerate(rounds) if w + 2 not in m} for w in range(3)}
    expected = single_process_weights(workers=3, skips=skips)
    for worker in workers:
        assert max((worker["state"][k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5


def test_a_batch_a_worker_was_late_with_goes_to_another_worker_first():
    work = sw.ps.WorkQueue.for_batches(4, size=16, batch=4, seed=0)
    assert [work.next(w)[1] for w in (1, 2)] == [work.batch_of(0)[1], work.batch_of(1)[1]]
    work.give_back(1, late=True)
    assert work.next(1)[1] == work.batch_of(2)[1]  # not its own late batch back
    assert work.next(2)[1] == work.batch_of(0)[1]  # that goes to another worker
    assert work.next(2)[1] == work.batch_of(3)[1]
    work.give_back(1, late=True)  # (batch 2) none other left: it takes its own back
    assert work.next(1)[1] == work.batch_of(2)[1] and work.next(1) is None
    assert work.consumed_batches == 3


def _replicated_run(kill_at: int, when: str, servers: int, victim: int = 0, steps: int = STEPS):
    """Sync, each of `servers` shards on a primary (ranks 0..S-1) and its backup (S..2S-1), 2
    workers; primary `victim` SIGKILLs itself right after applying update `kill_at`
    ("applied": the workers may or may not have its answer), or as it is about to apply it
    ("pushed": the pushes of that clock were forwarded, the pulls after them perhaps not even
    read)."""
    strategy = sw.ParameterServer(servers=servers, replicas=2, mode="sync")
    rank = dist.get_rank()
    if strategy.is_server():
        if rank == victim:
            original = sw.ps.server.Server.apply

            def dying_apply(self, flat, staleness, behind):
                if when == "pushed" and self.version == kill_at - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                original(self, flat, staleness, behind)
                if when == "applied" and self.version == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            sw.ps.server.Server.apply = dying_apply
        report = sw.ps.serve(mlp(), strategy, torch.optim.AdamW, lr=1e-2)
        return {"updates": report.updates, "took_over_at": report.took_over_at}
    model, opt = sw.prepare(mlp(), strategy, optimizer=torch.optim.AdamW, lr=1e-2)
    train_on_slices(model, opt, rank - 2 * servers, 2, steps)
    state = sw.full_state_dict(model)
    strategy.close(model)
    return {"state": state, "servers": list(model.client.servers)}


@pytest.mark.parametrize("when, servers", [("applied", 1), ("pushed", 2)])
def test_a_killed_primary_server_is_replaced_by_its_backup_with_no_update_lost(when, servers):
    """Server 0's primary dies mid-run (SIGKILL); the workers go over to its backup, which took
    every message the primary handled (with 2 shards it also takes over deciding the sync
    rounds, announcing its last ones again), and the job ends as single-process training on
    the same batches, within 1e-5."""
    expected = single_process_weights(workers=2)
    results = run(_replicated_run, 2 * servers + 2, 12, when, servers, timeout_s=120, dies=(0,))
    backup, workers = results[servers], results[2 * servers :]
    # (killed before applying update 12, the primary had forwarded its pushes: the backup
    # applied it before it noticed the loss)
    assert backup == {"updates": STEPS, "took_over_at": 12}
    assert all(r["updates"] == STEPS for r in results[1 : 2 * servers])
    for worker in workers:
        assert worker["servers"] == [servers, *range(1, servers)]  # it went over
        assert max((worker["state"][k] - v).abs().max().item() for k, v in expected.items()) <= 1e-5
