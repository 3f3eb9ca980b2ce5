"""Seeded initialisation of a meta-device model, computed one parameter at a time.

`SeededInit(build, seed)` builds the model inside `empty_parameters()` (parameters on the meta
device) while recording every tensor operation the construction runs: the constructors'
`reset_parameters` draws, a Hugging Face model's `post_init` re-initialisation, an embedding's
padding row zeroed through a view, `nn.Parameter(torch.randn(..))`. It is then the model's
`ParameterSource`: reading a parameter replays only the recorded operations that its value
depends on, on the CPU, so each rank computes only the parameters it keeps:

    init = sw.SeededInit(lambda: LlamaForCausalLM(config), seed=0)
    model, opt = sw.prepare(init.model, sw.ZeRO(stage=3), lr=1e-3, source=init)

and gets bitwise the values `torch.manual_seed(0); build()` gives on one process.

Why the values are the same: a random operation's output depends only on the generator's state
when it starts. While recording, each random operation on a meta tensor also runs on a CPU
scratch tensor of the same size and strides (freed at once), so the generator advances exactly
as in the real construction, and the state before each one is saved. Replaying an operation
restores its saved state first, so any parameter can be computed alone, in any order, without
replaying the others (torchdistx's deferred_init records a graph the same way; here the
generator states make the replay per parameter instead of one ordered pass).

Tensors are identified by their storage (a view shares it) and a view by its geometry
(storage offset, size, stride), so `weight[pad].zero_()` replays onto the right row.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import init
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from shardwise.nn.meta_init import empty_parameters

_TO_COPY = torch.ops.aten._to_copy.default
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


@dataclass(frozen=True)
class _Ref:
    """A tensor argument: a view (offset, size, stride, dtype) of recorded storage `storage`."""

    storage: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    writes: tuple[int, ...]  # storages the op mutates in place
    creates: tuple[int, ...]  # storages of its outputs, one per output (-1: not a new storage)
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator and its state before the op


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors `func` mutates (its schema's `Tensor(a!)` arguments)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                written.append(value)
    return written


def _on_cpu(x):
    return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x


class _Recorder(TorchDispatchMode):
    """Appends every operation to `tape`, tensors replaced by `_Ref`s to numbered storages."""

    def __init__(self) -> None:
        super().__init__()
        self.tape: list[_Op] = []
        self.ids: dict[int, int] = {}  # a live storage's address -> its number
        self.nbytes: list[int] = []  # per storage number
        self.constants: dict[int, torch.Tensor] = {}  # tensors made before recording began

    def new_storage(self, t: torch.Tensor) -> int:
        # Numbered when an op makes it: an address freed and reused is a new storage.
        self.ids[t.untyped_storage()._cdata] = len(self.nbytes)
        self.nbytes.append(t.untyped_storage().nbytes())
        return len(self.nbytes) - 1

    def ref(self, t: torch.Tensor) -> _Ref:
        key = t.untyped_storage()._cdata
        if key not in self.ids:  # made outside the construction: its value is a constant
            self.constant(t)
        return _Ref(self.ids[key], t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def constant(self, t: torch.Tensor) -> None:
        """Number `t`'s storage as a constant: a copy of its values now (the construction may
        change it later)."""
        if t.is_meta:
            raise ValueError("build() used a meta tensor made outside it: no values to replay")
        self.constants[self.new_storage(t)] = _flat(t).clone()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LIFTS:  # (`torch.tensor(..)`, a Python index: made without an op, at an
            for x in _tensors(args):  # address a freed recorded storage may have had)
                self.constant(x)
        inputs = {x.untyped_storage()._cdata for x in _tensors((args, kwargs))}
        rng = None
        if _is_random(func):
            gen = kwargs.get("generator") or torch.default_generator
            rng = (gen, gen.get_state())
            if any(x.is_meta for x in _tensors((args, kwargs))) or _makes_meta(kwargs):
                _draw_on_scratch(func, args, kwargs)  # the generator advances as it would
        ref_args, ref_kwargs = tree_map(
            lambda x: self.ref(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
        out = func(*args, **kwargs)
        writes = tuple(self.ref(t).storage for t in _written_args(func, args, kwargs))
        creates = tuple(
            self.new_storage(t) if t.untyped_storage()._cdata not in inputs else -1
            for t in _tensors(out)
        )
        if writes or any(c >= 0 for c in creates):
            self.tape.append(_Op(func, ref_args, ref_kwargs, writes, creates, rng))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return found


def _makes_meta(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


# (`trunc_normal_` through the helper it calls, which transformers' table reaches as well.
# Code that took one of them by name before the recording began keeps torch's own.)
_SKIP_META = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@contextlib.contextmanager
def _initialisers_drawn_on_scratch():
    """torch's `trunc_normal_`, `orthogonal_`, `sparse_` and `dirac_` return at once on a meta
    tensor: nothing is dispatched, so nothing would be recorded and the generator would not
    advance (every later draw off, without a word: a ViT's weights, say). Inside, each runs on a CPU
    scratch tensor of the same size and strides instead, copied into the meta one: its draws,
    its arithmetic and the copy are recorded as any other construction's. (transformers keeps
    torch's `orthogonal_` and `sparse_` in a table of its own: replaced there too.)"""
    originals = {name: getattr(init, name) for name in _SKIP_META}
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", {})
    theirs = {name: table[name] for name in _SKIP_META if name in table}
    try:
        for name, fn in originals.items():
            setattr(init, name, _drawn_on_scratch(fn))
        for name, fn in theirs.items():
            table[name] = _drawn_on_scratch(fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(init, name, fn)
        table.update(theirs)


def _drawn_on_scratch(initialise: Callable) -> Callable:
    @functools.wraps(initialise)
    def on_scratch(tensor: torch.Tensor, *args, **kwargs):
        if not tensor.is_meta:
            return initialise(tensor, *args, **kwargs)
        scratch = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        initialise(scratch, *args, **kwargs)
        with torch.no_grad():
            tensor.copy_(scratch)
        return tensor

    return on_scratch


def _draw_on_scratch(func, args, kwargs) -> None:
    """`func` run on CPU scratch tensors shaped as its meta arguments, then freed."""

    def scratch(x):
        if isinstance(x, torch.Tensor) and x.is_meta:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        return _on_cpu(x)

    with torch.no_grad():
        func(*tree_map(scratch, args), **tree_map(scratch, kwargs))


class SeededInit:
    """`build()` with `torch.manual_seed(seed)` on the meta device (`.model`), and the source
    (`sw.ParameterSource`) of the values that construction gives its parameters."""

    def __init__(self, build: Callable[[], nn.Module], seed: int) -> None:
        torch.manual_seed(seed)
        recorder = _Recorder()
        with empty_parameters(), _initialisers_drawn_on_scratch(), recorder:
            model = build()
        if not isinstance(model, nn.Module):
            raise TypeError(f"build() must return an nn.Module, got {type(model).__name__}")
        self.model = model
        self._tape, self._nbytes, self._constants = (
            recorder.tape,
            recorder.nbytes,
            recorder.constants,
        )
        self._params: dict[str, _Ref] = {
            name: recorder.ref(p)
            for name, p in model.named_parameters(remove_duplicate=False)
            if p.is_meta
        }
        self._ops_on: dict[int, list[int]] = {}  # storage -> indices of the ops that make it
        for i, op in enumerate(self._tape):
            for s in {*op.writes, *(c for c in op.creates if c >= 0)}:
                self._ops_on.setdefault(s, []).append(i)
        self.peak_scratch_bytes = 0  # the most bytes of replay scratch alive at once
        self._live_bytes = 0

    # ---- ParameterSource ------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._params

    def read(self, name: str) -> torch.Tensor:
        ref = self._param(name)
        base = self._storage(ref.storage, len(self._tape))
        view = _view(base, ref)
        whole = view.is_contiguous() and view.numel() == base.numel()
        return view if whole else view.clone()

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        ref = self._param(name)
        value = _view(self._storage(ref.storage, len(self._tape)), ref)
        return value.reshape(-1)[start:stop].clone()

    # ---- replay ---------------------------------------------------------------------------
    def _param(self, name: str) -> _Ref:
        if name not in self._params:
            raise ValueError(f"the seeded model has no parameter {name!r}")
        return self._params[name]

    @torch.no_grad()
    def _storage(self, storage: int, before: int) -> torch.Tensor:
        """Storage `storage` as the ops recorded before index `before` leave it, 1-D."""
        if storage in self._constants:
            return self._constants[storage].clone()
        base = None
        for i in self._ops_on.get(storage, []):
            if i >= before:
                break
            op = self._tape[i]
            if storage in op.writes:
                self._run(op, i, {storage: base})
            else:
                base = self._track(_flat(self._output(op, i, storage)))
        assert base is not None, f"storage {storage} has no recorded origin"
        return base

    def _output(self, op: _Op, index: int, storage: int) -> torch.Tensor:
        source = op.args[0]
        if (
            op.func is _TO_COPY
            and source.dtype == op.kwargs.get("dtype", source.dtype)
            and self._whole(source)
        ):
            # A copy onto the meta device: at replay the source's own values (no second copy).
            # (Only of a whole storage: a copy of a slice starts its own at offset 0.)
            return _view(self._storage(source.storage, index), source)
        out = self._run(op, index, {})
        outs = _tensors(out)
        return outs[op.creates.index(storage)]

    def _whole(self, ref: _Ref) -> bool:
        """Whether `ref` is its whole storage, laid out contiguously from its start."""
        laid_out = torch.empty(ref.size, dtype=ref.dtype, device="meta")  # (no storage)
        return (
            ref.offset == 0
            and laid_out.stride() == ref.stride
            and laid_out.nbytes == self._nbytes[ref.storage]
        )

    def _run(self, op: _Op, index: int, known: dict[int, torch.Tensor]):
        def value(x):
            if isinstance(x, _Ref):
                if x.storage not in known:
                    known[x.storage] = self._storage(x.storage, index)
                return _view(known[x.storage], x)
            return _on_cpu(x)

        args, kwargs = tree_map(value, (op.args, op.kwargs), is_leaf=_is_ref)
        if op.rng is None:
            return op.func(*args, **kwargs)
        gen, state = op.rng
        saved = gen.get_state()
        gen.set_state(state)
        try:
            return op.func(*args, **kwargs)
        finally:
            gen.set_state(saved)

    def _track(self, base: torch.Tensor) -> torch.Tensor:
        """Counts `base`'s bytes as live scratch until it is freed."""
        n = base.untyped_storage().nbytes()
        self._live_bytes += n
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, self._live_bytes)
        weakref.finalize(base, self._free, n)
        return base

    def _free(self, n: int) -> None:
        self._live_bytes -= n


def _is_ref(x) -> bool:
    return isinstance(x, _Ref)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t` as a 1-D tensor of `t`'s dtype."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))


def _view(base: torch.Tensor, ref: _Ref) -> torch.Tensor:
    assert base.dtype == ref.dtype, f"a {ref.dtype} view of a {base.dtype} storage"
    return base.as_strided(ref.size, ref.stride, ref.offset)
