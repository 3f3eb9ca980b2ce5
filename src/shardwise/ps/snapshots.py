"""A server's snapshots of its shard: written atomically every K updates, the last two kept,
and resumed from the newest version that every server can use (servers agree through the store).

One file per version, `server{rank}-v{version:09d}.safetensors`: the tensors (the shard, the
optimizer's moments), and in its header the rest as JSON (version, the job's identity, the
optimizer's settings) with a SHA-256 over both. Nothing is unpickled. A file that does not
read, whose checksum fails, or that another job wrote is named in one line and passed over: the
servers fall back to an older version that every one of them can use. If there was a version
that every server kept but none is usable, resuming cannot work and starting afresh would
silently throw the run away: `SnapshotError`, and the server process ends with
`EXIT_NO_SNAPSHOT`, which the supervisor does not restart on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shardwise.checkpoint import state_tree
from shardwise.checkpoint.reshardable import fsync_path

FORMAT = "shardwise-ps-snapshot-v1"
EXIT_NO_SNAPSHOT = 5  # exit code of a server left with no usable snapshot: a restart cannot help


class SnapshotError(ValueError):
    """A snapshot that cannot be resumed from (the message names the file), or none left."""


class ShardSnapshots:
    """Server `rank`'s snapshots in `directory`; `identity` (JSON: model, shard, optimizer,
    options, data plan) and `numels` (its parameters' sizes) are what a usable one must hold."""

    def __init__(
        self,
        directory: str | Path,
        rank: int,
        servers: int,
        store,
        identity: str,
        numels: list[int],
    ) -> None:
        self.directory, self.rank, self.servers, self.store = Path(directory), rank, servers, store
        self.identity, self.numels = identity, list(numels)
        self._name = re.compile(rf"server{rank}-v(\d{{9}})\.safetensors")

    def _path(self, version: int) -> Path:
        return self.directory / f"server{self.rank}-v{version:09d}.safetensors"

    def versions(self) -> list[int]:
        names = (p.name for p in self.directory.glob(f"server{self.rank}-v*.safetensors"))
        return sorted(int(m[1]) for name in names if (m := self._name.fullmatch(name)))

    def save(self, state: dict[str, Any]) -> None:
        """Save `state` (its "version" names it) with this job's identity, atomically; keep it
        and the one before: a restart needs a version that every server has, and they do not
        all write at once."""
        self.directory.mkdir(parents=True, exist_ok=True)
        version = state["version"]
        tensors: dict[str, torch.Tensor] = {}
        meta = json.dumps(state_tree.split({**state, "identity": self.identity}, "s", tensors))
        header = {"format": FORMAT, "state": meta, "sha256": _digest(meta, tensors)}
        path = self._path(version)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata=header)
        fsync_path(tmp)
        os.replace(tmp, path)  # atomic: a crash leaves the previous snapshots intact
        fsync_path(self.directory)
        kept = self.versions()
        keep = {version, *[v for v in kept if v < version][-1:]}
        for v in set(kept) - keep:  # (any above this one: a timeline given up when it resumed)
            self._path(v).unlink(missing_ok=True)

    def load(self, version: int) -> dict[str, Any]:
        """The state in this server's snapshot of `version`, checked; `SnapshotError` (one
        line: the file and why) if it does not read, is damaged, or is another job's."""
        path = self._path(version)
        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                names = f.keys()  # (a file handle, not a dict)
                tensors = {k: f.get_tensor(k) for k in names}
        except (SafetensorError, OSError) as e:
            raise SnapshotError(f"{path}: unreadable ({first_line(e)})") from None
        if header.get("format") != FORMAT:
            raise SnapshotError(f"{path}: not a parameter-server snapshot of shardwise")
        meta = header.get("state", "")
        if header.get("sha256") != _digest(meta, tensors):
            raise SnapshotError(f"{path}: damaged (its SHA-256 does not match its contents)")
        try:
            state = state_tree.join(json.loads(meta), tensors)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise SnapshotError(f"{path}: malformed ({first_line(e)})") from None
        if problem := self._problem(state, version):
            raise SnapshotError(f"{path}: {problem}")
        return state

    def _problem(self, state: Any, version: int) -> str | None:
        if not isinstance(state, dict) or state.get("identity") != self.identity:
            return "a snapshot of another job (model, optimizer, options or data differ)"
        if state.get("version") != version:
            return f"it holds version {state.get('version')!r}, its name says {version}"
        params = state.get("params")
        if (
            not isinstance(params, list)
            or [p.numel() if isinstance(p, torch.Tensor) else None for p in params] != self.numels
        ):
            return f"its shard is not this server's ({len(self.numels)} tensors: {self.numels})"
        return None

    def newest_common(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest snapshot every server can use (collective over the servers): None if no
        version was kept by all of them (a fresh start), `SnapshotError` if one was but none
        of those is usable on every server."""
        kept, states = self.versions(), {}
        for version in kept:
            try:
                states[version] = self.load(version)
            except SnapshotError as e:
                print(f"shardwise: ps server {self.rank}: {e}; passed over", file=sys.stderr)
        sys.stderr.flush()
        everyone = self._exchange({"kept": kept, "usable": sorted(states)})
        usable = set.intersection(*(set(s["usable"]) for s in everyone))
        if usable:
            return self._path(max(usable)), states[max(usable)]
        common = sorted(set.intersection(*(set(s["kept"]) for s in everyone)))
        if not common:
            return None
        bad = sorted({r for r, s in enumerate(everyone) for v in common if v not in s["usable"]})
        raise SnapshotError(
            f"no snapshot in {self.directory} is usable by every server (versions {common} "
            f"are damaged or another job's on server(s) {bad}); a restart cannot help: move "
            "the directory away to start afresh"
        )

    def _exchange(self, mine: dict[str, list[int]]) -> list[dict[str, list[int]]]:
        """Every server's `mine`, in rank order (through the job's store)."""
        self.store.set(f"shardwise/ps/snapshots/server{self.rank}", json.dumps(mine))
        keys = [f"shardwise/ps/snapshots/server{r}" for r in range(self.servers)]
        self.store.wait(keys)
        return [json.loads(self.store.get(key)) for key in keys]


def _digest(meta: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the JSON and every tensor (name, dtype, shape, bytes)."""
    digest = hashlib.sha256(meta.encode())
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def first_line(error: BaseException) -> str:
    """An error's message as one bounded line (for `shardwise: ...` messages)."""
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
