"""The sample ledger: which dataset indices each rank trained on, step by step.

With `train.sample_ledger: true`, rank r appends one JSON line per step to
`RUN_DIR/ledger/rank{r}.jsonl`: {"step", "batch" (global batches drawn so far), "stage" (of
`data.stages`: 0 before the first), "epoch", "world_size", "indices" (of the stage's data)}.
It is evidence from the ranks themselves that a resumed run (on as many ranks or on others)
skipped and repeated no sample. Lines of steps after the checkpoint a run resumes from are
dropped first, since those steps run again.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.data.sharded_loader import ShardedLoader


def _path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ledger" / f"rank{rank}.jsonl"


def write(
    run_dir: Path, rank: int, step: int, batch: int, loader: ShardedLoader, stage: int = 0
) -> None:
    path = _path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {
        "step": step,
        "batch": batch,
        "stage": stage,
        "epoch": loader.epoch,
        "world_size": loader.replicas,
        "indices": loader.last_indices,
    }
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def truncate_rank(run_dir: Path, rank: int, step: int) -> None:
    """Keep this rank's lines of steps up to `step`."""
    _truncate(_path(run_dir, rank), step)


def truncate(run_dir: Path, step: int) -> None:
    """Keep every rank's lines of steps up to `step` (ranks of an earlier world included)."""
    for path in (Path(run_dir) / "ledger").glob("rank*.jsonl"):
        _truncate(path, step)


def _truncate(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError):  # a line cut short by a kill
            continue
    path.write_text("".join(kept), encoding="utf-8")


def read(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> its lines, in order."""
    found = {}
    for path in sorted((Path(run_dir) / "ledger").glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        found[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return found
