"""Offload of ZeRO's master weights and optimizer state to memory-mapped files on disk.

Each shard's fp32 master weights and each of its optimizer-state tensors live in a file of their
own, mapped into memory (MAP_SHARED). The optimizer steps one shard at a time; after a shard's
step its pages are released from this process (`madvise(MADV_DONTNEED)`: the kernel writes dirty
pages back to the file), so only the shard being stepped occupies memory: state that does not
fit in RAM is loaded piecewise, ZeRO-Infinity style (Rajbhandari et al., SC 2021), on the CPU.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from torch import nn


class DiskStore:
    """Tensors backed by files in one directory (removed by `remove`; one made `fresh` also
    when the store is collected or the process exits: a script that never closes its model
    leaves no files behind); pages are dropped after each use."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._maps: dict[str, mmap.mmap] = {}
        self._removal: weakref.finalize | None = None  # (`fresh`: the directory is its own)

    @classmethod
    def fresh(cls, parent: Path, prefix: str) -> DiskStore:
        """A store in a new directory of its own under `parent` (made if missing)."""
        parent.mkdir(parents=True, exist_ok=True)
        store = cls(tempfile.mkdtemp(prefix=prefix, dir=parent))
        store._removal = weakref.finalize(store, _remove_in, os.getpid(), store.directory)
        return store

    def place(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A file-backed tensor holding `value` (same dtype and shape)."""
        value = value.detach().to("cpu").contiguous()
        path = self.directory / f"{name}.bin"
        nbytes = max(1, value.numel() * value.element_size())  # mmap cannot map 0 bytes
        with open(path, "wb") as f:
            f.truncate(nbytes)
        fd = os.open(path, os.O_RDWR)
        try:
            self._maps[name] = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)  # the mapping keeps the file open
        tensor = torch.frombuffer(self._maps[name], dtype=value.dtype, count=value.numel())
        tensor = tensor.view(value.shape)
        tensor.copy_(value)
        return tensor

    def release(self, name: str) -> None:
        """Drop the pages of `name` from memory; the file keeps the data."""
        self._maps[name].madvise(mmap.MADV_DONTNEED)

    def nbytes(self) -> int:
        return sum(len(m) for m in self._maps.values())

    def remove(self) -> None:
        """Delete the files (the tensors that map them must not be used afterwards)."""
        self._maps.clear()  # the mappings close once no tensor refers to them
        if self._removal is not None:
            self._removal()  # (once: then neither collection nor the exit runs it again)
        else:
            shutil.rmtree(self.directory, ignore_errors=True)


def _remove_in(pid: int, directory: Path) -> None:
    """Remove a fresh store's directory, from the process that made it (a forked child that
    exits runs its parent's exit handlers too)."""
    if os.getpid() == pid:
        shutil.rmtree(directory, ignore_errors=True)


class DiskOffloadedStep:
    """Wraps `optimizer.step`: shard by shard, with state moved to and released from disk."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, shards: list[nn.Parameter], store: DiskStore
    ):
        if len(optimizer.param_groups) != 1:
            raise ValueError("disk offload steps shard by shard and needs one parameter group")
        self.optimizer, self.shards, self.store = optimizer, shards, store
        self.step = optimizer.step
        for i, shard in enumerate(shards):  # master weights go to disk right away
            shard.data = store.place(f"unit{i}.master", shard.data)
            store.release(f"unit{i}.master")

    def __call__(self, closure=None):
        group = self.optimizer.param_groups[0]
        everything, loss = group["params"], None
        try:
            for i, shard in enumerate(self.shards):
                group["params"] = [shard]
                loss = self.step(closure)
                self._move_new_state_to_disk(i, shard)
                for name in self._names(i, shard):
                    self.store.release(name)
        finally:
            group["params"] = everything
        return loss

    def _names(self, i: int, shard: nn.Parameter) -> list[str]:
        keys = [k for k, v in self.optimizer.state.get(shard, {}).items() if torch.is_tensor(v)]
        return [f"unit{i}.master", *(f"unit{i}.{k}" for k in keys)]

    def _move_new_state_to_disk(self, i: int, shard: nn.Parameter) -> None:
        state = self.optimizer.state.get(shard, {})
        for key, value in state.items():
            name = f"unit{i}.{key}"
            if torch.is_tensor(value) and name not in self.store._maps:
                state[key] = self.store.place(name, value)
