"""A server's snapshots of its shard: written atomically every K updates, the last two kept,
and resumed from the newest version that every server has (servers agree through the store)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class ShardSnapshots:
    def __init__(self, directory: str | Path, rank: int, servers: int, store) -> None:
        self.directory, self.rank, self.servers, self.store = Path(directory), rank, servers, store

    def _path(self, version: int) -> Path:
        return self.directory / f"server{self.rank}-v{version:09d}.pt"

    def versions(self) -> list[int]:
        paths = self.directory.glob(f"server{self.rank}-v*.pt")
        return sorted(int(p.stem.rsplit("-v", 1)[1]) for p in paths)

    def save(self, state: dict[str, Any]) -> None:
        """Save `state` (its "version" names it) atomically; keep the last two: a restart
        needs a version that every server has, and they do not all write at the same instant."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(state["version"])
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a crash leaves the previous snapshots intact
        for old in self.versions()[:-2]:
            self._path(old).unlink(missing_ok=True)

    def newest_common(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest snapshot every server has (collective over the servers), or None."""
        mine = self.versions()
        self.store.set(f"shardwise/ps/snapshots/server{self.rank}", json.dumps(mine))
        keys = [f"shardwise/ps/snapshots/server{r}" for r in range(self.servers)]
        self.store.wait(keys)
        common = set(mine)
        for key in keys:
            common &= set(json.loads(self.store.get(key)))
        if not common:
            return None
        path = self._path(max(common))
        return path, torch.load(path, weights_only=True)  # tensors and plain data only
