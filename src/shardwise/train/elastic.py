"""Failover inside the job (`train.on_failure: shrink` or `replace`): a lost rank costs no restart
and no checkpoint read.

Each step begins with a snapshot of this rank's training state in memory (`commit`): what it
holds of the weights and optimizer state (`checkpoint_shard`: all of it where they are
replicated), the schedule, the data position and the random generators. Where the state is
sharded (ZeRO), each rank also keeps a copy of its left neighbour's shard, sent to it as the
step begins, so that one lost rank loses no shard. Two snapshots are kept: a rank may have
begun the next step while another failed in this one, never more.

When a collective breaks (a peer died, or the watchdog dropped one that hung), the survivors
agree on the next membership through the job's store (`distributed/membership.py`), form a
new process group (`runtime.reform`), go back to the newest step whose state they all hold,
send each other the shards their new members lack, and rebuild the run around that state on
the new world (`build(..., recovered=)`): the strategy re-cut, the same global batch dealt over
the survivors, the metrics and ledger lines of the steps to run again dropped. A replacement
the launcher starts (`replace`) asks to join; the members take it in at the next step boundary
and send it the whole state. Each transition is one line and a metrics record.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise import comm
from shardwise.checkpoint.reshardable import assemble
from shardwise.checkpoint.run_checkpoint import rng_state
from shardwise.comm import interrupt
from shardwise.comm.broken import describe
from shardwise.comm.interrupt import PeerLost, interrupt_waits_with
from shardwise.distributed import membership, runtime
from shardwise.distributed.membership import Epoch, Membership, member_name
from shardwise.train.build import build
from shardwise.train.recovered import Recovered
from shardwise.train.training_run import TrainingRun

ORIGINAL_WORLD_ENV = "WORLD_SIZE"  # the ranks the job started with (the global batch's)


@dataclass
class Snapshot:
    """This rank's state as a step begins (the state after the step before)."""

    step: int
    layout: dict[str, Any]
    own: dict[str, torch.Tensor]  # this rank's shard (all of the state, where replicated)
    buddy: dict[str, torch.Tensor] | None  # the left neighbour's shard (sharded state only)
    scheduler: dict[str, Any]
    data: dict[str, Any]
    rng: dict[str, Any]
    policy: dict[str, Any]  # the non-finite policy's (`NonFinitePolicy.state_dict`)


class Elastic:
    """This rank's part in keeping the job alive across lost and new ranks."""

    def __init__(self, cfg, members: Membership) -> None:
        self.cfg = cfg
        self.global_replicas = int(os.environ.get(ORIGINAL_WORLD_ENV, len(members.epoch.members)))
        self.membership = members
        self.snapshots: deque[Snapshot] = deque(maxlen=2)
        interrupt_waits_with(self.membership.failed)

    @classmethod
    def starting(cls, run: TrainingRun) -> Elastic:
        """The job's first members, this rank's run among them."""
        rt, cfg = run.rt, run.cfg
        first = membership.first_epoch(rt.world_size)
        members = Membership(runtime.job_keys(), membership.my_id(rt.rank), first, _settle_s(cfg))
        elastic = cls(cfg, members)
        elastic.attach(run)
        return elastic

    def attach(self, run: TrainingRun) -> None:
        """`run` goes on through this object: its transitions, and its watchdog drops a rank
        that hangs instead of ending the job."""
        run.elastic = self
        run.watchdog.elastic = self.membership

    # ---- each step ----------------------------------------------------------------------
    def before_step(self, run: TrainingRun, step: int) -> TrainingRun:
        """As `step` begins: take waiting replacements in where due (the run rebuilt), then
        snapshot the state."""
        replacing = self.cfg.train.on_failure == "replace"
        if replacing and run.faults.rejoins(step) and self.membership.epoch.step < step:
            # (a test's replacement joins here: wait for it)
            while not self.membership.joiners_waiting():
                time.sleep(0.05)
            run.joiners_due = True
        if run.joiners_due:
            self.commit(run, step)
            run = self.admit(run, step)
        self.commit(run, step)
        return run

    def commit(self, run: TrainingRun, step: int) -> None:
        """Snapshot this rank's state as `step` begins (sharded: its neighbour's shard too)."""
        while self.snapshots and self.snapshots[-1].step >= step:
            self.snapshots.pop()  # (a rollback went back: later ones are void)
        layout, own = run.model.checkpoint_shard(run.opt, every_rank=True)
        own = {key: value.detach().clone() for key, value in sorted(own.items())}
        buddy = None
        if layout["num_shards"] > 1:  # sharded: the left neighbour's shard, kept here
            buddy = _from_left_neighbour(own, run.rt)
        self.snapshots.append(
            Snapshot(
                step,
                layout,
                own,
                buddy,
                copy.deepcopy(run.scheduler.state_dict()),
                copy.deepcopy(run.feed.state_dict()),
                rng_state(),
                run.policy.state_dict(),
            )
        )

    def finished(self) -> None:
        """The job's work is done: a replacement still waiting to join leaves."""
        self.membership.close()

    def joiners_waiting(self) -> int:
        """Rank 0, each step: replacements waiting to join (0 under `shrink`)."""
        if self.cfg.train.on_failure != "replace":
            return 0
        return self.membership.joiners_waiting()

    # ---- transitions --------------------------------------------------------------------
    def recover(self, run: TrainingRun, error: PeerLost) -> TrainingRun:
        """A collective broke: go on with the survivors from the newest step all of them
        hold the state of."""
        started = time.monotonic()
        old = self.membership.epoch
        if not self.snapshots:  # (lost before the first step's state was kept: nothing to go on)
            raise error
        committed = self.snapshots[-1].step
        epoch = self.membership.agree_after_failure(committed)
        snapshot = next((s for s in self.snapshots if s.step == epoch.step), None)
        if snapshot is None:
            raise RuntimeError(
                f"shardwise: {member_name(self.membership.me)} holds no state of step "
                f"{epoch.step} to go on from (it holds steps {[s.step for s in self.snapshots]})"
            )
        what = f"{epoch.why or describe(error)}; the job goes on with"
        return self._move(run, old, epoch, snapshot, what, started)

    def admit(self, run: TrainingRun, step: int) -> TrainingRun:
        """Take the waiting replacements in as `step` begins."""
        started = time.monotonic()
        old = self.membership.epoch
        epoch = self.membership.admit(step)
        snapshot = next(s for s in self.snapshots if s.step == step)
        return self._move(run, old, epoch, snapshot, f"{epoch.why}; the job goes on with", started)

    def _move(self, run, old: Epoch, epoch: Epoch, snapshot, what: str, started) -> TrainingRun:
        interrupt.next_membership()  # (a communication thread still in the old group lets go)
        _close(run)
        rt = runtime.reform(epoch.number, epoch.rank_of(self.membership.me), len(epoch.members))
        recovered = self.gather(old, epoch, snapshot)
        rebuilt = self.rebuild(run.cfg, run.out, recovered)
        seconds = time.monotonic() - started
        if rt.is_main:
            print(
                f"shardwise: step {epoch.step}: {what} {len(epoch.members)} ranks "
                f"({', '.join(member_name(m) for m in epoch.members)}) after {seconds:.2f} s, "
                "no checkpoint read",
                flush=True,
            )
        rebuilt.metrics.log_event(
            {
                "step": epoch.step,
                "membership": epoch.number,
                "members": epoch.members,
                "left": epoch.left,
                "joined": epoch.joined,
                "why": epoch.why,
                "world_size": len(epoch.members),
                "transition_s": seconds,
            }
        )
        return rebuilt

    def rebuild(self, cfg, out: Path, recovered: Recovered) -> TrainingRun:
        run = build(cfg, str(out), resume=True, recovered=recovered)
        self.attach(run)
        run.watchdog.start()
        self.snapshots.clear()
        return run

    def gather(self, old: Epoch, epoch: Epoch, snapshot: Snapshot | None) -> Recovered:
        """Every shard of the state of `epoch.step` on every member of `epoch`, from those
        that hold it (rank 0, a member of `old`, publishes what a newcomer needs to know)."""
        rt = runtime.current()
        store = runtime.store()
        if rt.is_main:
            assert snapshot is not None
            meta = {
                "layout": snapshot.layout,
                "keys": {k: [list(v.shape), str(v.dtype)] for k, v in snapshot.own.items()},
                "scheduler": snapshot.scheduler,
                "data": snapshot.data,
                "policy": snapshot.policy,
            }
            store.set("elastic-state", json.dumps(meta))
        meta = json.loads(store.get("elastic-state"))
        layout = meta["layout"]
        shards = layout["num_shards"]
        holds = [_holdings(old, member, shards) for member in epoch.members]
        mine = holds[rt.rank]
        pieces = []
        for k in range(shards):
            holders = [r for r, held in enumerate(holds) if k in held]
            if not holders:
                raise RuntimeError(
                    f"shardwise: shard {k} of the state was lost with "
                    f"{', '.join(member_name(m) for m in epoch.left)} (its copy too)"
                )
            if k in mine:
                mine_alone = shards == 1 or k == old.rank_of(self.membership.me)
                shard = snapshot.own if mine_alone else snapshot.buddy
            else:
                shard = _empty(meta["keys"])
            if len(holders) < len(epoch.members):
                _broadcast(shard, holders[0])
            pieces.append(shard)
        units = [[(n, shape) for n, shape in unit["params"]] for unit in layout["units"]]
        params, states = assemble(units, pieces, [f"shard {k}" for k in range(shards)])
        own = snapshot is not None
        return Recovered(
            epoch.step - 1,
            params,
            states,
            snapshot.scheduler if own else meta["scheduler"],
            snapshot.data if own else meta["data"],
            snapshot.rng if own else None,
            self.global_replicas,
            snapshot.policy if own else meta["policy"],
        )


def join(cfg, run_dir: str) -> TrainingRun:
    """A replacement started by the launcher: ask to join, wait to be taken in, and receive
    the whole state from the members."""
    me = membership.my_id(int(os.environ["RANK"]))
    runtime.init_joiner(cfg.launch.backend, cfg.launch.comm_timeout_s)
    members = Membership(runtime.job_keys(), me, membership.first_epoch(0), _settle_s(cfg))
    members.ask_to_join()
    print(f"shardwise: {member_name(me)} asks to join the job", flush=True)
    epoch = members.wait_to_be_admitted()
    if epoch is None:
        print(f"shardwise: {member_name(me)}: the job ended before it could join", flush=True)
        raise SystemExit(0)
    old = members.previous(epoch, int(os.environ[ORIGINAL_WORLD_ENV]))
    elastic = Elastic(cfg, members)
    runtime.reform(epoch.number, epoch.rank_of(me), len(epoch.members))
    recovered = elastic.gather(old, epoch, None)
    return elastic.rebuild(cfg, Path(run_dir), recovered)


def _settle_s(cfg) -> float:
    """How long a member that neither reports nor is known gone is waited for: as long as a
    hang is."""
    return cfg.launch.hang_timeout_s


def _holdings(old: Epoch, member: str, shards: int) -> set[int]:
    """The shards of `old`'s state `member` holds: its own and its left neighbour's (all
    of it, where the state is replicated); none for a newcomer."""
    if member not in old.members:
        return set()
    if shards == 1:
        return {0}
    rank = old.rank_of(member)
    return {rank, (rank - 1) % len(old.members)}


def _pack(tensors: dict[str, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """The tensors (in key order) as one flat tensor per dtype: one message each."""
    flat: dict[torch.dtype, list[torch.Tensor]] = {}
    for value in tensors.values():
        flat.setdefault(value.dtype, []).append(value.reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in flat.items()}


def _unpack(flat: dict[torch.dtype, torch.Tensor], into: dict[str, torch.Tensor]) -> None:
    offsets = dict.fromkeys(flat, 0)
    for value in into.values():
        n = value.numel()
        start = offsets[value.dtype]
        value.copy_(flat[value.dtype][start : start + n].view_as(value))
        offsets[value.dtype] = start + n


def _from_left_neighbour(own: dict[str, torch.Tensor], rt) -> dict[str, torch.Tensor]:
    """Send this rank's shard to its right neighbour; the left one's, received (shards are
    alike in keys and shapes)."""
    sends = _pack(own)
    received = {dtype: torch.empty_like(flat) for dtype, flat in sends.items()}
    right, left = (rt.rank + 1) % rt.world_size, (rt.rank - 1) % rt.world_size
    comm.exchange(
        [(flat, right) for flat in sends.values()],
        [(flat, left) for flat in received.values()],
        op="elastic_copy",
    )
    buddy = {key: torch.empty_like(value) for key, value in own.items()}
    _unpack(received, buddy)
    return buddy


def _empty(keys: dict[str, list]) -> dict[str, torch.Tensor]:
    return {
        key: torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
        for key, (shape, dtype) in sorted(keys.items())
    }


def _broadcast(shard: dict[str, torch.Tensor], src: int) -> None:
    flat = _pack(shard)
    for value in flat.values():
        comm.broadcast(value, src)
    _unpack(flat, shard)


def _close(run: TrainingRun) -> None:
    """What the old run holds: its watchdog, files, threads and hooks (no collective)."""
    run.watchdog.stop()
    run.metrics.close()
    run.model.close()
