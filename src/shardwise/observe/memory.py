"""Model-state memory accounting: bytes held in parameters, gradients and optimizer state.

Tensors are counted by their underlying storage, once: a gradient that is a view into a DDP
bucket costs nothing beyond the bucket.
"""

from __future__ import annotations

import gc
import itertools
import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each storage the tensors use (by address), each counted once."""
    out: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2) holds its shard locally
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # Scalar state (Adam's step counter) is included: it is real memory, if tiny.
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, extra: Iterable[torch.Tensor] = ()
) -> dict[str, int]:
    """Bytes per category, each storage counted once (in the first category that holds it)."""
    seen: set[int] = set()
    report: dict[str, int] = {}
    # The optimizer's parameters may be shards the model does not hold (ZeRO): where they are
    # not views of the model's parameters, they are master weights (the only persistent copy in
    # ZeRO-3; fp32 beside a bf16 compute copy under mixed precision).
    params = list(model.parameters())
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    categories = {
        "params": params,
        "master_weights": masters,
        "grads": [p.grad for p in (*params, *masters) if p.grad is not None],
        "optimizer": optimizer_tensors(optimizer),
        "buffers": list(extra),
    }
    for name, tensors in categories.items():
        storages = {k: v for k, v in storage_bytes(tensors).items() if k not in seen}
        seen.update(storages)
        report[name] = sum(storages.values())
    report["total"] = sum(report.values())
    return report


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated on the GPU, or resident (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class PeakMeter(TorchDispatchMode):
    """The most bytes of tensor storage alive at once on `device` inside `with meter:`.

    What is alive when it starts is found by the garbage collector (every tensor the process
    holds: parameters, gradient buckets, optimizer state, flat buffers, the batch), and every
    operator's outputs inside it are added while their storage lives. It is what
    `torch.cuda.max_memory_allocated` measures on a GPU, for any device, without the caching
    allocator's rounding; tensors made by threads of the strategy's own (a codec's) are not
    seen. Each new high pays for a scan of what is alive: meter a step or two, not a run.
    """

    def __init__(
        self, device: torch.device | str = "cpu", alive: Iterable[torch.Tensor] | None = None
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        # What is alive at the start, where the caller knows it (fake tensors: a step traced
        # on them); else every real tensor the garbage collector finds.
        self.alive = alive
        self.scanned = False
        self.live: dict[int, list] = {}  # storage address -> [weak reference, bytes last seen]
        self.total = 0  # the bytes last seen, summed: at least what is alive, or stale
        self.start = self.peak = 0

    def _add(self, t: object) -> None:
        t = getattr(t, "_local_tensor", t)
        if not isinstance(t, torch.Tensor) or t.device.type != self.device.type:
            return
        storage = t.untyped_storage()
        entry = self.live.get(storage._cdata)
        if entry is not None and entry[0].expired():  # (addresses recur)
            self.total -= entry[1]
            del self.live[storage._cdata]
            entry = None
        nbytes = storage.nbytes()
        if entry is None:
            if nbytes:
                self.live[storage._cdata] = [StorageWeakRef(storage), nbytes]
                self.total += nbytes
        else:  # seen again: its size may have changed in place
            self.total += nbytes - entry[1]
            entry[1] = nbytes

    def current(self) -> int:
        """Bytes alive now, every size read afresh: a storage can be freed, or resized in place
        (ZeRO-3 frees a unit's gathered parameters by resizing their storage to nothing),
        without an operator the meter sees."""
        live = {}
        for key, (ref, _) in self.live.items():
            if not ref.expired():
                live[key] = [ref, torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()]
        self.live = live
        self.total = sum(entry[1] for entry in live.values())
        return self.total

    def scan(self) -> PeakMeter:
        """Find what is alive (entering does it, unless done before: call it first where its
        cost, a pass of the garbage collector, should be timed apart)."""
        for t in self.alive if self.alive is not None else _all_tensors():
            self._add(t)
        self.start = self.peak = self.current()
        self.scanned = True
        return self

    def include(self, *tensors: torch.Tensor) -> None:
        """Count tensors made between `scan` and entering (a batch)."""
        for t in tensors:
            self._add(t)
        self.start = self.peak = self.current()

    def __enter__(self) -> PeakMeter:
        if not self.scanned:
            self.scan()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._add(t)
        if self.total > self.peak:  # perhaps a new peak: drop the dead, then count exactly
            self._drop_expired()  # (sizes last seen are an upper bound, but for regrowth)
            if self.total > self.peak:
                self.peak = max(self.peak, self.current())
        return out

    def _drop_expired(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(key)[1]


def live_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of tensor storage alive now on `device`: every tensor the process holds."""
    meter = PeakMeter(device)
    for t in _all_tensors():
        meter._add(t)
    return meter.current()


def _all_tensors() -> list[torch.Tensor]:
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on deprecated torch attributes)
        warnings.simplefilter("ignore")
        return [
            obj
            for obj in gc.get_objects()
            if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor)
        ]


def model_device(model: nn.Module) -> torch.device:
    """Where `model` computes: its first parameter's or buffer's device (the CPU where it has
    neither: `next(model.parameters())` was a bare `StopIteration`)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if first is None else first.device


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank bytes in parameters, gradients and optimizer state (master weights included
    where a strategy keeps them), and the process's peak. Call it after backward, before the
    step, to see the model state at its fullest."""
    report = model_state_bytes(model, optimizer)
    report["peak"] = peak_bytes(model_device(model))
    return report


def is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight transposed): weights, not
    activations."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class ActivationMeter:
    """Bytes autograd keeps alive for backward (the activations), now and at the peak.

    Inside `with meter:`, every tensor autograd saves for backward is wrapped; the wrapper counts
    its storage while alive (once per storage, however often it is saved) and uncounts it when
    the graph that holds it is freed, after that micro-batch's backward. Parameters and views of
    them are weights, not activations, and are not counted. It measures any schedule the same
    way, ours or torch's, on any device.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if is_weight(tensor) or tensor.numel() == 0:
            return tensor
        return _Saved(self, tensor)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _add(self, key: int, nbytes: int) -> None:
        entry = self._refs.setdefault(key, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def _remove(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._refs[key]

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        # Detached: a tensor a node saves of its own output would otherwise hold that node,
        # a cycle through C++ that only the backward breaks (by freeing what it saved), never
        # where the graph is retained (a zero-bubble B pass), so the graph would leak.
        self.meter, self.tensor, self.key = meter, tensor.detach(), storage.data_ptr()
        meter._add(self.key, storage.nbytes())

    def __del__(self) -> None:
        self.meter._remove(self.key)
