"""Saving a run checkpoint (the format: `run_checkpoint.py`): this rank's state copied now, its
files written from a background thread, and rank 0 putting the checkpoint in place."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from shardwise.checkpoint import state_tree
from shardwise.checkpoint.reshardable import fsync_path, make_manifest, optimizer_name, sha256_file
from shardwise.checkpoint.run_checkpoint import (
    FORMAT,
    PREFIX,
    SHARDED,
    RunCheckpointError,
    complete,
    rng_state,
)
from shardwise.comm.store import wait_for
from shardwise.distributed import runtime
from shardwise.strategies.base import DistributedModel


def rank_state(
    model: DistributedModel, optimizer, scheduler, step: int, data: dict[str, Any]
) -> dict[str, Any]:
    numpy_state = list(np.random.get_state())
    numpy_state[1] = numpy_state[1].tolist()  # a uint32 array: JSON's list of ints
    rng = {**rng_state(), "numpy": numpy_state}
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        "rng": rng,
        "data": data,
    }


@dataclass
class Snapshot:
    """One rank's state at a step, copied to CPU: what a save writes while training goes on."""

    step: int
    strategy: str  # the model's checkpoint_name()
    optimizer: str  # the class whose state it holds (`optimizer_name`)
    save_no: int  # the how-many-th save of this process: the same on every rank
    meta: Any  # JSON of the exact state, tensors replaced by their keys
    tensors: dict[str, torch.Tensor]
    layout: dict[str, Any] | None  # the reshardable part (None: the strategy cannot reshard)
    shard: dict[str, torch.Tensor] | None  # this rank's tensors of it (None: another rank's)


def snapshot(
    model: DistributedModel, optimizer, scheduler, step: int, save_no: int, data: dict[str, Any]
) -> Snapshot:
    tensors: dict[str, torch.Tensor] = {}
    meta = state_tree.split(rank_state(model, optimizer, scheduler, step, data), "s", tensors)
    try:
        layout, shard = model.checkpoint_shard(optimizer)
    except NotImplementedError:  # model-parallel: resumes on the same ranks only
        layout, shard = None, None
    if shard is not None:
        shard = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in shard.items()}
    name = optimizer_name(optimizer)
    return Snapshot(step, model.checkpoint_name(), name, save_no, meta, tensors, layout, shard)


class Saver:
    """Writes this rank's snapshots from a background thread (or in the caller, `sync=True`).

    Every rank writes its files into the same hidden directory and reports their checksums
    through the job's store; rank 0 waits for all of them, writes the manifest, renames the
    directory into place and drops old checkpoints. No collective runs in the thread, so the
    training step's collectives go on undisturbed. One save is in flight at a time."""

    def __init__(
        self, run_dir: Path, rt, keep: int, sync: bool = False, job: dict | None = None
    ) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.rt, self.keep, self.sync = rt, keep, sync
        self.job = job  # `job_signature`, recorded in each manifest
        self.store = runtime.store()
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.saves = 0
        # Whether the checkpoints already in the directory are this run's (it resumed from
        # them, or goes on from its peers' state): else a save prunes only its own, never those
        # of another run that used the directory (`Checkpointer.adopt`).
        self.adopted = False
        self._own: set[str] = set()  # (rank 0's saves' names)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.done: list[tuple[int, Path, float]] = []  # (step, directory, seconds to write)

    def save(self, model: DistributedModel, optimizer, scheduler, step: int, data) -> Path:
        """Copy the state now and write it (in the background unless `sync`); returns the
        directory the checkpoint will have."""
        self.wait()
        snap = snapshot(model, optimizer, scheduler, step, self.saves, data)
        self.saves += 1
        if self.sync:
            self._write(snap)
            self._raise()
        else:
            self._thread = threading.Thread(target=self._write, args=(snap,), daemon=True)
            self._thread.start()
        return self.root / f"{PREFIX}{step:09d}"

    def take_done(self) -> list[tuple[int, Path, float]]:
        """The saves finished since the last call: (step, directory, seconds writing)."""
        taken = []
        while self.done:
            taken.append(self.done.pop(0))
        return taken

    def wait(self) -> None:
        """Until the save in flight is written (and, on rank 0, in place)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RunCheckpointError(f"saving a checkpoint failed: {error}") from error

    def _write(self, snap: Snapshot) -> None:
        try:
            started = time.perf_counter()
            final = self._write_files(snap)
            self.done.append((snap.step, final, time.perf_counter() - started))
        except BaseException as e:  # reported by the next wait(): the thread cannot raise
            self._error = e

    def _write_files(self, snap: Snapshot) -> Path:
        rank, world = self.rt.rank, self.rt.world_size
        final = self.root / f"{PREFIX}{snap.step:09d}"
        tmp = self.root / f".{PREFIX}{snap.step:09d}.tmp-{self.attempt}-{snap.save_no}"
        (tmp / SHARDED).mkdir(parents=True, exist_ok=True)
        written = {
            f"rank{rank}.safetensors": lambda p: save_file(snap.tensors, str(p)),
            f"rank{rank}.json": lambda p: p.write_text(json.dumps(snap.meta)),
        }
        if snap.shard is not None:
            name = f"{SHARDED}/rank{rank}.safetensors"
            written[name] = lambda p: save_file(snap.shard, str(p))
        sums = {}
        for name, write in written.items():
            write(tmp / name)
            fsync_path(tmp / name)
            sums[name] = sha256_file(tmp / name)
        # Per checkpoint directory: two checkpointers of one job (two models, or a script's own
        # beside the trainer's) each count their saves from 0.
        key = f"shardwise/checkpoint/{self.root.resolve()}/{snap.save_no}"
        self.store.set(f"{key}/rank{rank}", json.dumps(sums))
        if rank != 0:
            return final
        keys = [f"{key}/rank{r}" for r in range(world)]
        wait_for(self.store, keys, self.rt.timeout.total_seconds())
        for r in range(1, world):
            sums.update(json.loads(self.store.get(keys[r])))
        exact = {n: s for n, s in sums.items() if not n.startswith(f"{SHARDED}/")}
        manifest = {
            "format": FORMAT,
            "step": snap.step,
            "world_size": world,
            "strategy": snap.strategy,
            "sha256": exact,
            "reshardable": snap.layout is not None,
            **({"job": self.job} if self.job is not None else {}),
        }
        if snap.layout is not None:
            shards = {n.removeprefix(f"{SHARDED}/"): s for n, s in sums.items() if n not in exact}
            sharded = make_manifest(snap.step, world, snap.layout, shards, None, snap.optimizer)
            _write_json(tmp / SHARDED / "manifest.json", sharded)
        fsync_path(tmp / SHARDED)
        _write_json(tmp / "manifest.json", manifest)  # last: the directory is now complete
        fsync_path(tmp)
        shutil.rmtree(final, ignore_errors=True)  # (a checkpoint of this step from a dead attempt)
        os.replace(tmp, final)
        fsync_path(self.root)
        # This save stays, and the `keep` - 1 before it. A checkpoint of a later step belongs to
        # a past the run left (it resumed from an earlier one, that one being unreadable or
        # named): kept, it would be what a restart or the next --resume continues.
        self._own.add(final.name)
        others = [
            p for p in complete(self.root) if p != final and (self.adopted or p.name in self._own)
        ]
        later = [p for p in others if p.name > final.name]  # (zero-padded: by step)
        earlier = [p for p in others if p.name < final.name]
        for old in later + earlier[: max(0, len(earlier) - (self.keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        return final


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))
    fsync_path(path)
