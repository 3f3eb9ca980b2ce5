"""ZeRO: data parallel without the redundancy (Rajbhandari et al., SC 2020).

Plain data parallel keeps 16 bytes per parameter on every rank with fp32 Adam: parameters (4),
gradients (4) and optimizer state (8). ZeRO shards them over the N ranks, stage by stage:

- Stage 1 shards the optimizer state: each rank's optimizer sees only its 1/N slice of the
  flattened parameters. Gradients are reduce-scattered (each rank receives the averaged slice it
  owns), the rank steps its slice, and the updated slices are all-gathered. 4P + 4P + 8P/N.
- Stage 2 also shards gradients: a bucket's full gradients exist only until its reduce-scatter
  has run, during backward. 4P + (4P + 8P)/N.
- Stage 3 also shards the parameters: each unit (a block of the model) is all-gathered just
  before its forward and again before its backward, and freed right after each; the next unit
  is prefetched. 16P/N.

Communication: reduce-scatter + all-gather is the volume of one all-reduce, so stages 1 and 2
send what DDP sends; stage 3 gathers twice, 1.5x.

Parameters are flattened into "units" (padded so N divides them); rank r owns slice r of every
unit. Stages 1/2 make units by size (`bucket_mb`, reverse registration order, like DDP buckets);
stage 3 makes one unit per module of the model (each element of an `nn.ModuleList` /
`nn.Sequential` and each other child with parameters), so gathering follows the forward pass.
Any element-wise `torch.optim` optimizer (SGD, Adam, AdamW, ...) works unchanged on the slices.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import comm, runtime
from shardwise.mixed_precision import LossScaler, compute_dtype, install_casts
from shardwise.runtime import Runtime
from shardwise.strategies.base import (
    Strategy,
    WrappedModel,
    buffer_tensors,
    load_buffers,
    square_sum,
)
from shardwise.strategies.ddp import broadcast_module_state
from shardwise.strategies.grad_buckets import BucketCallbacks, BucketedBackward, assign_buckets
from shardwise.strategies.offload import DiskOffloadedStep, DiskStore


class FlatUnit:
    """Some parameters flattened into one padded buffer; this rank owns one equal slice of it."""

    def __init__(
        self,
        params: list[nn.Parameter],
        rank: int,
        world_size: int,
        dtype: torch.dtype,
        group: comm.ProcessGroup | None = None,
    ) -> None:
        assert len({p.dtype for p in params}) == 1, "a unit holds one dtype"
        self.params, self.rank, self.group = params, rank, group
        self.shard_numel = -(-sum(p.numel() for p in params) // world_size)
        self.numels = [p.numel() for p in params]
        offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.offset_of = dict(zip(params, offsets, strict=True))  # parameters hash by identity
        padded = self.shard_numel * world_size  # shard_numel is rounded up: N divides this
        exact = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p, n in zip(params, self.numels, strict=True):
                exact[offset : offset + n].copy_(p.reshape(-1))
                offset += n
        self.master_init = self.own(exact).clone() if dtype != exact.dtype else None
        self.full = exact.to(dtype)  # the compute copy (the same tensor without mixed precision)
        self.bind_views()
        self.grad_full: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.handle: comm.Handle | None = None
        self.gather_handle: comm.Handle | None = None

    def bind_views(self) -> None:
        """Make every parameter a view into `full` (so gathering `full` updates the model)."""
        offset = 0
        for p, n in zip(self.params, self.numels, strict=True):
            p.data = self.full[offset : offset + n].view_as(p)
            offset += n

    def slot(self, buffer: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """`p`'s place in a unit-sized buffer."""
        offset = self.offset_of[p]
        return buffer[offset : offset + p.numel()].view_as(p)

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One tensor per parameter (any device/dtype) -> a padded unit-sized flat buffer."""
        out = torch.zeros(self.full.numel(), dtype=dtype, device=self.full.device)
        flat = torch.cat([t.reshape(-1).to(out.device, out.dtype) for t in tensors])
        out[: flat.numel()] = flat
        return out

    def own(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a unit-sized buffer."""
        return buffer[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    # Stage 3: the full buffer exists only while the unit runs forward or backward.
    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def start_gather(self, shard: torch.Tensor) -> None:
        if self.is_gathered() or self.gather_handle is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.gather_handle = comm.all_gather_into_tensor(
            self.full, shard.detach(), group=self.group, async_op=True
        )

    def wait_gather(self) -> None:
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None


def stage3_units(model: nn.Module) -> list[nn.Module]:
    """Modules that become stage-3 units, in registration (≈ forward) order."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                visit(child)
            elif any(p.requires_grad for p in child.parameters()):
                units.append(child)

    visit(model)
    return units


class ZeroEngine:
    """Owns the units, the optimizer's shards and the hooks that move gradients and weights."""

    def __init__(
        self,
        model: nn.Module,
        stage: int,
        bucket_bytes: int,
        rt: Runtime,
        mixed_precision: str | None = None,
        master_device: torch.device | None = None,
    ) -> None:
        self.stage, self.world_size, self.group = stage, rt.world_size, rt.group
        # fp32 masters apart from the compute copy: with mixed precision, and with offload.
        self.master_device = master_device
        self.separate_master = master_device is not None or mixed_precision is not None
        self.compute_dtype = compute_dtype(mixed_precision)
        self.mixed = mixed_precision is not None
        self.scaler = LossScaler() if mixed_precision == "fp16" else None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {p: n for n, p in named}
        params = [p for _, p in named]
        modules, rest = (stage3_units(model), []) if stage == 3 else ([], params)
        if stage == 3:
            covered = {p for m in modules for p in m.parameters()}
            rest = [p for p in params if p not in covered]
            groups = [[p for p in m.parameters() if p.requires_grad] for m in modules]
            groups = [rest, *groups] if rest else groups
        else:
            groups = assign_buckets(params, bucket_bytes)
        self.units = [
            FlatUnit(g, rt.rank, rt.world_size, self.compute_dtype, rt.group) for g in groups
        ]
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.shards = [self._make_shard(u) for u in self.units]
        # Gradients become ready roughly in reverse forward order: reduce units in that order.
        order = list(reversed(range(len(self.units))))
        self.backward = BucketedBackward(
            [self.units[i].params for i in order],
            self.names,
            BucketCallbacks(
                self._on_grad, lambda k: self._launch(order[k]), self._zero, self._finish
            ),
            find_unused_parameters=False,
        )
        if stage == 1:
            for u in self.units:
                u.grad_full = torch.zeros_like(u.full)
        if stage == 3:
            self._install_stage3_hooks(model, modules, rest)
            for u in self.units:
                u.free()
        if self.mixed:
            install_casts(model, self.compute_dtype, self.scaler)

    def _make_shard(self, unit: FlatUnit) -> nn.Parameter:
        # Stages 1/2: the shard is a view of the full buffer, so stepping it updates the model.
        # Stage 3: the full buffer is transient; the shard is the only persistent copy.
        # Mixed precision: the shard is the fp32 master, separate from the compute copy.
        own = unit.own(unit.full)
        if self.separate_master:
            master = unit.master_init if self.mixed else own.clone()
            return nn.Parameter(master.to(self.master_device or master.device))
        return nn.Parameter(own if self.stage < 3 else own.clone())

    def _compute_copy(self, shard: torch.Tensor) -> torch.Tensor:
        """What the ranks all-gather: the master slice in the compute dtype."""
        device = self.units[0].full.device
        return shard.detach().to(device, self.compute_dtype, copy=True)

    # ---- gradients: fill the unit's full gradient buffer, reduce-scatter it, keep our slice
    def _on_grad(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        if unit.grad_full is None:
            unit.grad_full = torch.zeros_like(unit.full, memory_format=torch.contiguous_format)
        slot = unit.slot(unit.grad_full, p)
        if self.stage == 1:  # gradients stay views into the persistent buffer (as in DDP)
            if p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad)
                p.grad = slot
        else:  # stage 2/3: the parameter's gradient is not kept beyond this hook
            slot.copy_(p.grad)
            p.grad = None

    def _zero(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        if unit.grad_full is None:
            unit.grad_full = torch.zeros_like(unit.full)
        unit.slot(unit.grad_full, p).zero_()

    def _launch(self, index: int) -> None:
        unit = self.units[index]
        unit.grad_full.div_(self.world_size)  # average, before summing (fp16-safe)
        unit.reduced = torch.empty(unit.shard_numel, dtype=unit.full.dtype, device=unit.full.device)
        unit.handle = comm.reduce_scatter_tensor(
            unit.reduced, unit.grad_full, group=self.group, async_op=True
        )
        if self.stage == 3:
            unit.free()  # its backward is done: the gathered weights can go

    def _finish(self) -> None:
        for unit, shard in zip(self.units, self.shards, strict=True):
            unit.handle.wait()
            unit.handle = None
            if self.stage == 1 and not self.separate_master:
                # Gradients stay views of the persistent buffer (4P + 4P + 8P/N bytes).
                if shard.grad is not None:
                    raise RuntimeError(
                        "ZeRO stage 1 accumulates gradients only inside no_sync(): call "
                        "optimizer.zero_grad() after each step"
                    )
                own = unit.own(unit.grad_full)
                own.copy_(unit.reduced)
                shard.grad = own
            else:  # the master's own gradient: fp32, on the master's device
                reduced = unit.reduced.to(shard.device, shard.dtype)
                if self.scaler is not None:
                    reduced.div_(self.scaler.scale)
                shard.grad = reduced if shard.grad is None else shard.grad.add_(reduced)
                if self.stage == 1:  # reduced into the master: the next backward starts at zero
                    unit.grad_full.zero_()
                else:  # full gradients are transient from stage 2 on
                    unit.grad_full = None
            unit.reduced = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit, shard in zip(self.units, self.shards, strict=True):
            shard.grad = None
            if self.stage == 1:
                if not set_to_none:
                    unit.grad_full.zero_()
                for p in unit.params:
                    p.grad = None if set_to_none else unit.slot(unit.grad_full, p)

    # ---- parameters: after the step, stages 1/2 all-gather the updated slices
    @torch.no_grad()
    def after_step(self) -> None:
        if self.stage == 3:
            return
        handles = [
            comm.all_gather_into_tensor(u.full, self._compute_copy(s), self.group, async_op=True)
            for u, s in zip(self.units, self.shards, strict=True)
        ]
        for h in handles:
            h.wait()

    # ---- stage 3: gather before forward and backward, free after, prefetch the next unit
    def _install_stage3_hooks(self, model, modules, rest) -> None:
        offset = 1 if rest else 0
        unit_index = {m: i + offset for i, m in enumerate(modules)}
        if rest:  # parameters outside every unit: gathered for the whole forward/backward
            model.register_forward_pre_hook(lambda *_: self._gather(0, prefetch=False))
        for module, i in unit_index.items():
            module.register_forward_pre_hook(lambda _m, _a, i=i: self._gather(i, prefetch=True))
            module.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out))

    def _gather(self, i: int, prefetch: bool, direction: int = 1) -> None:
        unit = self.units[i]
        unit.start_gather(self._compute_copy(self.shards[i]))
        nxt = i + direction
        if prefetch and 0 <= nxt < len(self.units):
            self.units[nxt].start_gather(self._compute_copy(self.shards[nxt]))
        unit.wait_gather()

    def _after_forward(self, i: int, output: Any) -> Any:
        if torch.is_grad_enabled():
            tensors = output if isinstance(output, (tuple, list)) else (output,)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, i=i: self._gather(i, prefetch=True, direction=-1))
        self.units[i].free()
        return output

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self.stage != 1:
            raise RuntimeError(
                f"ZeRO stage {self.stage} reduces every backward pass; to accumulate, call "
                "backward k times (loss / k) before the step: the gradient shards add up"
            )
        return self.backward.paused()

    def grad_shards(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards if s.grad is not None]


class ZeroModel(WrappedModel):
    def __init__(self, module: nn.Module, engine: ZeroEngine) -> None:
        super().__init__(module)
        self.engine = engine

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.no_sync()


def _zero_step(optimizer: torch.optim.Optimizer, engine: ZeroEngine, inner):
    """The optimizer's step under ZeRO: skip on fp16 overflow (all ranks agree), step the
    shards (`inner`), then all-gather the updated parameters (stages 1/2)."""

    def step(_optimizer, closure=None):
        if engine.scaler is not None:
            overflow = engine.scaler.found_overflow(engine.grad_shards())
            engine.scaler.after_step(overflow)
            if overflow:
                return None
        loss = inner(closure)
        engine.after_step()
        return loss

    # A bound method, as LR schedulers expect when they wrap `optimizer.step`.
    return types.MethodType(step, optimizer)


@dataclass
class ZeRO(Strategy):
    """Options for ZeRO.

    stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters) sharded over the ranks.
    bucket_mb: stages 1/2: size of the flat units gradients are reduce-scattered in.
    mixed_precision: None (fp32), 'bf16' or 'fp16' compute and communication, with fp32 master
        weights in the sharded optimizer; 'fp16' adds dynamic loss scaling.
    offload: None, 'cpu' (master weights, their gradients and optimizer state in host memory
        while training on a GPU) or 'disk' (the same in memory-mapped files under `offload_dir`,
        one sub-directory per rank, stepped and paged in shard by shard).
    """

    stage: int = 1
    bucket_mb: float = 25.0
    mixed_precision: str | None = None
    offload: str | None = None
    offload_dir: str = "shardwise-offload"

    def __post_init__(self) -> None:
        compute_dtype(self.mixed_precision)  # validates the name
        if self.offload not in (None, "cpu", "disk"):
            raise ValueError(f"offload must be None, 'cpu' or 'disk', got {self.offload!r}")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {self.stage!r}")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")

    def wrap(self, model: nn.Module, runtime: Runtime) -> ZeroModel:
        broadcast_module_state(model, group=runtime.group)
        engine = ZeroEngine(
            model,
            self.stage,
            int(self.bucket_mb * 2**20),
            runtime,
            self.mixed_precision,
            master_device=torch.device("cpu") if self.offload else None,
        )
        return ZeroModel(model, engine)

    def make_optimizer(
        self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
    ) -> torch.optim.Optimizer:
        engine = model.engine
        optimizer = optimizer_cls(engine.shards, **kwargs)
        optimizer.zero_grad = engine.zero_grad
        inner = optimizer.step
        if self.offload == "disk":
            store = DiskStore(Path(self.offload_dir) / f"rank{runtime.current().rank}")
            inner = DiskOffloadedStep(optimizer, engine.shards, store)
        optimizer.step = _zero_step(optimizer, engine, inner)
        return optimizer

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Parameters all-gathered from the shards the optimizer steps (fp32 masters under
        mixed precision), buffers as the module holds them."""
        engine, full = model.engine, {}
        for unit, shard in zip(engine.units, engine.shards, strict=True):
            # Gather on the compute device: offloaded masters live on the CPU, NCCL does not.
            device = unit.full.device
            flat = torch.empty(unit.full.numel(), dtype=shard.dtype, device=device)
            comm.all_gather_into_tensor(flat, shard.detach().to(device).contiguous(), engine.group)
            for p in unit.params:
                full[engine.names[p]] = unit.slot(flat, p).clone()
        state = model.module.state_dict(keep_vars=True)
        return {k: full[k] if k in full else v.detach().clone() for k, v in state.items()}

    def local_grads(self, model: nn.Module) -> list[torch.Tensor]:
        return model.engine.grad_shards()

    def grad_square_sum(self, model: nn.Module) -> torch.Tensor:
        device = model.engine.units[0].full.device  # offloaded shards are on the CPU
        squares = square_sum(self.local_grads(model)).to(device)
        comm.all_reduce(squares, group=model.engine.group)  # disjoint shards: sum over ranks
        return squares

    def checkpoint_shard(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        engine = model.engine
        layout = {
            "num_shards": engine.world_size,
            "strategy": f"zero-{self.stage}",
            "units": [
                {"params": [[engine.names[p], list(p.shape)] for p in u.params]}
                for u in engine.units
            ],
        }
        tensors = buffer_tensors(model) if runtime.current().rank == 0 else {}
        for i, shard in enumerate(engine.shards):
            tensors[f"unit{i}/param"] = shard.detach()
            for key, value in optimizer.state.get(shard, {}).items():
                if torch.is_tensor(value):
                    tensors[f"unit{i}/{key}"] = value
        return layout, tensors

    @torch.no_grad()
    def load_full_state(self, model, optimizer, params, states) -> None:
        engine = model.engine
        load_buffers(model, params)
        for unit, shard in zip(engine.units, engine.shards, strict=True):
            names = [engine.names[p] for p in unit.params]

            full = unit.flatten([params[n] for n in names], shard.dtype)
            shard.copy_(unit.own(full))
            if self.stage < 3:
                unit.full.copy_(full)  # the model's parameters are views of it
            optimizer.state[shard] = {
                key: value.clone().to(shard.device)
                if value.dim() == 0
                else unit.own(unit.flatten([states[n][key] for n in names], shard.dtype)).clone()
                for key, value in states.get(names[0], {}).items()
            }

    def close(self, model: nn.Module) -> None:
        model.engine.backward.remove()
