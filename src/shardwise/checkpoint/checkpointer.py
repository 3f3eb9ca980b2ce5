"""The checkpointer: exact, asynchronous checkpoints of a training run and its resume, from any
training loop (the trainer's, or a user's own).

    model, opt = sw.prepare(MyModel(), sw.ZeRO(stage=2))
    ckpt = sw.Checkpointer("runs/mine", model, opt, scheduler)   # every rank
    start, extra = ckpt.resume()        # the newest complete checkpoint; (0, None) without one
    for step in range(start + 1, steps + 1):
        ...
        if step % 100 == 0:
            ckpt.save(step, extra={"loader": loader.state_dict()})   # copied now, written behind
    ckpt.close()                        # the save in flight is written

What a save holds and how it is written: `run_checkpoint.py`. A resume on the number of ranks
the checkpoint was saved on is bit-identical; on another number, strategies whose state
reshards go on from the reshardable part.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardwise.arguments import whole_number
from shardwise.checkpoint import run_checkpoint
from shardwise.checkpoint.hf_export import record_hf_config
from shardwise.checkpoint.reshardable import check_paired, check_step
from shardwise.checkpoint.run_checkpoint import Found, RunCheckpointError
from shardwise.checkpoint.run_saver import Saver
from shardwise.comm import store as store_wait
from shardwise.distributed import runtime


class Checkpointer:
    """Saves and loads one model's (with its optimizer's and LR schedule's) training state in
    `run_dir/checkpoints/`. Collective: every rank makes one and calls it alike."""

    def __init__(
        self,
        run_dir: str | Path,
        model,
        optimizer,
        scheduler=None,
        *,
        keep: int = 2,
        asynchronous: bool = True,
        job: dict[str, Any] | None = None,
    ) -> None:
        """`model`, `optimizer`: what `sw.prepare` returned; `keep`: how many checkpoints stay;
        `job`: `run_checkpoint.job_signature` of the job, recorded in each checkpoint and
        checked by a resume (None: not checked)."""
        whole_number("keep", keep, least=1)
        check_paired(model, optimizer)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rt = model.runtime
        self.saver = Saver(self.run_dir, self.rt, keep, sync=not asynchronous, job=job)
        self._config_recorded = False  # (`record_model_config`)
        self._loads = 0  # checkpoints chosen so far: each choice has a key of its own
        self.last_stall_s = 0.0  # the last save's copy: the only time training waits for it

    def record_model_config(self) -> None:
        """Rank 0: the model's Hugging Face config beside the run's checkpoints (what `shardwise
        export --hf` writes as config.json), once, as the run first saves: not when made, since
        a job refused at its resume (another run's checkpoints) must leave that run's as it was."""
        if self.rt.is_main and not self._config_recorded:
            record_hf_config(self.model, self.run_dir)
        self._config_recorded = True

    def save(self, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Copy this rank's state after `step` now (the only stall) and write it in the
        background; `extra`: what else the next step depends on (tensors and JSON values, e.g.
        a loader's `state_dict()`). Returns the directory the checkpoint will have."""
        check_step(step)
        self.record_model_config()
        started = time.perf_counter()
        path = self.saver.save(self.model, self.optimizer, self.scheduler, step, extra or {})
        self.last_stall_s = time.perf_counter() - started  # what training waited for
        return path

    def newest(self, fresh_start_ok: bool = True) -> Found | None:
        """The checkpoint to load, chosen by rank 0 (after its saves are in place) and read by
        the others from the job's store: every rank loads the same one, and only rank 0 reads
        the files. Without `fresh_start_ok`, a run whose checkpoints are all unusable is a
        `RunCheckpointError` (not a silent start from scratch)."""
        self.saver.wait()  # (rank 0's: its last save is in place before it chooses)
        store = runtime.store()
        key = f"shardwise/load/{self.run_dir.resolve()}/{self._loads}"  # per run directory
        self._loads += 1
        if self.rt.is_main:
            store.set(key, json.dumps(self._choose(fresh_start_ok)))
        choice = json.loads(store_wait.get(store, key, self.rt.timeout.total_seconds()))
        if isinstance(choice, dict):
            raise RunCheckpointError(choice["error"])
        return None if choice is None else Found(Path(choice[0]), *choice[1:])

    def _choose(self, fresh_start_ok: bool) -> Any:
        name = self.model.checkpoint_name()
        found = run_checkpoint.newest(self.run_dir, self.rt.world_size, name, job=self.saver.job)
        if found is not None:
            return [str(found.directory), found.step, found.world_size]
        existing = run_checkpoint.complete(self.run_dir / "checkpoints")
        if existing and not fresh_start_ok:
            return {
                "error": f"none of the {len(existing)} checkpoints in {self.run_dir} can be "
                "resumed from (see above); move them away to start afresh"
            }
        return None

    def adopt(self) -> None:
        """The checkpoints already in the run directory are this run's: its saves prune them
        as their own (`keep`; and where it went back to an earlier one, those after it). A
        load or `resume` adopts them; a checkpointer that never does prunes only its own
        saves, never another run's."""
        self.saver.adopted = True

    def load(self, found: Found) -> tuple[int, dict[str, Any]]:
        """Restore the state `found` holds; its step and the `extra` saved with it."""
        self.adopt()
        restored = run_checkpoint.load(found, self.model, self.optimizer, self.scheduler)
        return restored["step"], restored["data"]

    def resume(self) -> tuple[int, dict[str, Any] | None]:
        """Load the newest complete checkpoint of the run: its step and `extra`; (0, None)
        where the run has none."""
        found = self.newest(fresh_start_ok=False)
        self.adopt()  # (none: nothing to adopt but what this run saves from here)
        if found is None:
            if self.rt.is_main:
                where = f"no checkpoint in {self.run_dir}"
                print(f"shardwise: {where}: starting from step 0", flush=True)
            return 0, None
        step, extra = self.load(found)
        if self.rt.is_main:
            how = (
                ""
                if found.world_size == self.rt.world_size
                else f", resharded from {found.world_size} to {self.rt.world_size} ranks"
            )
            print(f"shardwise: resumed from {found.directory} (step {step}{how})", flush=True)
        return step, extra

    def take_done(self) -> list[tuple[int, Path, float]]:
        """The saves written since the last call: (step, directory, seconds writing)."""
        return self.saver.take_done()

    def wait(self) -> None:
        """Until the save in flight is written (a failed one raises here)."""
        self.saver.wait()

    def close(self) -> None:
        self.wait()
