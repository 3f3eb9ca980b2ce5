"""ZeRO stage 3: stage 2, with the parameters sharded too (the ZeRO paper's P_os+g+p).

Each block of the model (each element of an `nn.ModuleList` / `nn.Sequential`, and each other
child with parameters: `stage3_units`) is one unit. Its full parameters exist only around its
compute: all-gathered just before its forward, and freed once its gradient is reduce-scattered;
in between, unless kept (below), freed right after its forward and gathered again when the
gradient of its output arrives in backward. The next unit's gather is started before waiting
on this one's (prefetch), so communication overlaps compute; kept units' gathers are all
started as the forward begins. Memory with fp32 Adam between
steps: 16P/N; during a step, that plus the kept units and one or two gathered ones.
Communication: two all-gathers (one for a kept unit) and one reduce-scatter per step, 1.5x
what DDP sends when no unit is kept, DDP's volume when all are.

Over a shard group of one (one rank, or HSDP with K = 1) without fp32 masters the shard is the
whole model: `ResidentStage3` keeps it as the parameters' own storage, with nothing to gather
or free (stage 2's machinery on stage 3's units, so the checkpoint layout is the same).

`keep_gathered_mb` trades memory for that second all-gather: units that fit the budget, the last
first (their backward comes first, so they are held the shortest), stay gathered from their
forward to their backward. Kept whole, the model sends DDP's volume; its memory during a step
is then stage 2's. By default the last unit is kept (freed after its forward, it would be
gathered again at once, as backward begins with it: FSDP2 keeps its root so, torchtitan its
last block), and the units before it while they fit 1 GiB (`DEFAULT_KEEP_BYTES`: DeepSpeed
keeps up to 1e9 parameters live by default; a small model is then kept whole). Small modules
are no units of their own (`SMALL_UNIT`): their parameters join the root unit, gathered for the
whole step.

Inside `no_sync()` (gradient accumulation) each unit is still gathered for its forward and its
backward, micro-batch by micro-batch, and freed as soon as its gradients are in; what stays is
its full gradient, accumulating until the backward outside reduce-scatters it (stage 2's
`no_sync`): 4P bytes more while accumulating, one reduce-scatter per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shardwise import comm
from shardwise.strategies.zero.freed import disown, own
from shardwise.strategies.zero.masters import ShardViews
from shardwise.strategies.zero.stage2 import ZeroStage2
from shardwise.strategies.zero.units import FlatUnit, Place

# A module with under 1/SMALL_UNIT of the largest unit's trainable parameters is no unit of its
# own: its parameters join the root unit, gathered for the whole step (FSDP's size-based
# wrapping leaves small modules to their parent so). Its three messages a step would cost their
# latency, not their bytes: gloo takes ~0.25 ms a call up to ~100 KB on 2 cores, and the bench
# GPT's embeddings, final norm and head (66 K parameters in 4 units, beside blocks of 790 K)
# cost it 7 ms a step as units of their own (217 against 211 ms; FSDP2 on the same units: 8 ms).
SMALL_UNIT = 8


def stage3_units(model: nn.Module) -> list[nn.Module]:
    """Modules that become stage-3 units, in registration (≈ forward) order: each element of
    an `nn.ModuleList` / `nn.Sequential`, and each other module with trainable parameters met
    on the way down to them, but the small ones (`SMALL_UNIT`). A module that holds such a
    list somewhere below it (a Hugging Face model's `transformer` or `model`, a ResNet's
    encoder) is opened rather than made one unit, so its blocks are gathered one at a time, as
    FSDP2's per-block `fully_shard` does."""
    units = _candidate_units(model)
    sizes = [sum(p.numel() for p in u.parameters() if p.requires_grad) for u in units]
    largest = max(sizes, default=0)
    return [u for u, size in zip(units, sizes, strict=True) if SMALL_UNIT * size >= largest]


def _candidate_units(model: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []

    def visit(module: nn.Module, in_list: bool) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                visit(child, in_list=True)
            elif not in_list and _holds_list(child):
                visit(child, in_list=False)
            elif any(p.requires_grad for p in child.parameters()):
                units.append(child)

    visit(model, in_list=False)
    return units


def _holds_list(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList) for m in module.modules() if m is not module)


def unit_groups(model: nn.Module, units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each unit's trainable parameters: those only modules inside it hold. A parameter that
    modules of two units share (tied embeddings: GPT-2's `lm_head.weight` is `wte.weight`), or
    that a module outside every unit holds, belongs to no unit: it goes to the root unit,
    gathered for the whole forward and backward (FSDP2's root `fully_shard` holds it so)."""
    unit_of_module = {m: i for i, u in enumerate(units) for m in u.modules()}
    holders: dict[nn.Parameter, set[int | None]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(p, set()).add(unit_of_module.get(module))
    return [
        [p for p in u.parameters() if p.requires_grad and holders[p] == {i}]
        for i, u in enumerate(units)
    ]


# The default budget of gathered units kept from forward to backward (`kept_units`), in the
# spirit of DeepSpeed's defaults (`stage3_max_reuse_distance` and `stage3_max_live_parameters`:
# 1e9 parameters; 1 GiB is a quarter of that in fp32). On the bench GPT, kept whole, a step took
# 211.9 and 192.5 ms against 224.0 and 215.6 re-gathering (2 CPU ranks, `bench zero`, two runs).
DEFAULT_KEEP_BYTES = 2**30


def kept_units(sizes: list[int], budget: float | None, first: int = 0) -> set[int]:
    """Indices (counted from `first`) of the units that stay gathered from forward to backward:
    from the last, while their gathered bytes fit the budget. None, the default: the last unit
    whatever its size (its backward comes first, right after the loss: keeping it raises no
    peak), then the ones before it while all the kept units' bytes, the last's included, fit
    `DEFAULT_KEEP_BYTES`. (`sizes` leave out the root unit: it is gathered for the whole step.)"""
    if budget is None:
        if not sizes:
            return set()
        return {first + len(sizes) - 1} | kept_units(
            sizes[:-1], DEFAULT_KEEP_BYTES - sizes[-1], first
        )
    kept, used = set(), 0
    for i in reversed(range(len(sizes))):
        if used + sizes[i] > budget:
            break
        used += sizes[i]
        kept.add(first + i)
    return kept


def _check_recompute_regions(model: nn.Module, units: list[nn.Module]) -> None:
    """A recomputed region (activation checkpointing) must not hold a unit inside it: the
    unit's gather-and-free hooks would run again in the recompute, after its weights are freed."""
    for name, module in model.named_modules():
        if getattr(module.forward, "recomputes", False):
            inner = next((u for u in units if u is not module and _contains(module, u)), None)
            if inner is not None:
                raise ValueError(
                    f"activation_checkpointing: region {name!r} holds a ZeRO-3 unit; "
                    "checkpoint that unit, or modules inside it, instead"
                )


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


class ZeroStage3(ZeroStage2):
    stage = 3
    shard_is_view = False  # the full buffer is transient: the shard is the only lasting copy

    def __init__(self, *args: Any, keep_gathered_bytes: float | None = None, **kwargs: Any) -> None:
        self.keep_gathered_bytes = keep_gathered_bytes  # (read by prepare_units, below)
        super().__init__(*args, **kwargs)

    def unit_params(self, params: list[nn.Parameter], bucket_bytes: int) -> list[list]:
        """One unit per block; parameters outside every block (or shared between blocks) form
        unit 0, gathered for the whole forward and backward."""
        modules = stage3_units(self.module)
        _check_recompute_regions(self.module, modules)
        groups = unit_groups(self.module, modules)
        self.unit_modules = [m for m, g in zip(modules, groups, strict=True) if g]
        covered = {p for g in groups for p in g}
        self.rest = [p for p in params if p not in covered]
        groups = [g for g in groups if g]
        return [self.rest, *groups] if self.rest else groups

    def has_root_unit(self) -> bool:
        return bool(self.rest)  # (the parameters no block holds: `unit_params`)

    def prepare_units(self) -> None:
        super().prepare_units()
        self.grads_in: dict[FlatUnit, set[nn.Parameter]] = {}  # inside no_sync(): per unit
        self.meeting: comm.Handle | None = None  # the ranks' meeting before this forward's reads
        self.met = False  # (in this forward)
        if self.resident_shards:  # (first of the model's own hooks: before any gather)
            self.hooks.append(self.module.register_forward_pre_hook(self._shards_may_differ))
        offset = 1 if self.rest else 0
        module_names = {m: n for n, m in self.module.named_modules()}
        unit_names = ["(root)"] * offset + [module_names[m] for m in self.unit_modules]
        for unit, unit_name in zip(self.units, unit_names, strict=True):
            own(unit.params, [self.names[p] for p in unit.params], unit_name)
        if self.rest:
            # (the first block's gather goes out with the root's: 219 -> 215 ms a step on the
            # bench GPT, whose embeddings compute between them)
            gather_rest = self.module.register_forward_pre_hook(lambda *_: self._gather(0))
            self.hooks.append(gather_rest)
        self.kept = kept_units(
            [u.full.numel() * u.full.element_size() for u in self.units[offset:]],
            self.keep_gathered_bytes,
            offset,
        )
        if self.kept:
            self.hooks.append(self.module.register_forward_pre_hook(self._gather_kept))
        for i, module in enumerate(self.unit_modules, start=offset):
            self.hooks += [
                module.register_forward_pre_hook(lambda _m, _a, i=i: self._gather(i)),
                module.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out)),
            ]
        for u in self.units:
            u.free()

    def place_shards(self) -> Place | None:
        """Where units are gathered through shared memory and the ranks gather the shards as
        they are (no fp32 masters, whose compute copy they gather instead), each shard is made
        there: a rank's gather then reads every peer's where it lies, with no slot to fill and
        no wait, once the ranks have met after their last steps (`_shards_may_differ`). The
        bench GPT's forward met five times a step (a gather a unit), and now meets once."""
        if self.shared is None or not isinstance(self.masters, ShardViews):
            return None
        return self.shared.new_buffer

    def _shards_may_differ(self, *_) -> None:
        """A forward begins: the ranks' shards may have changed since they last met (a step, a
        load), so its first gather has them meet first."""
        self.met = False

    def _gather(self, i: int, direction: int = 1) -> None:
        """Unit `i` gathered, the next one's gather (in `direction`) started first."""
        self._start_gather(i)
        nxt = i + direction
        if 0 <= nxt < len(self.units):
            self._start_gather(nxt)
        self.units[i].wait_gather()
        self._wait_meeting()

    def _wait_meeting(self) -> None:
        if self.meeting is not None:  # (done: a gather behind it on the thread is)
            self.meeting.wait()
            self.meeting = None

    def _gather_kept(self, *_) -> None:
        """As a forward with backward to come begins: every kept unit's gather started, in
        forward order, behind the first unit's. They stay gathered until their backward
        anyway, and one after the other, their gathers take the communication thread once a
        step rather than once a unit (the bench GPT, kept whole: 0.8-2.8 ms a step faster,
        two runs). The model's own hook: a recomputed region never runs it again."""
        if torch.is_grad_enabled():
            for i in (0, *sorted(self.kept)):
                self._start_gather(i)

    def _start_gather(self, i: int) -> None:
        """Start gathering unit `i` unless it is gathered or on its way: its compute copy is
        made once per gather (a unit's own hook follows its neighbour's prefetch)."""
        unit = self.units[i]
        if unit.is_gathered() or unit.gather_handle is not None:
            return
        # The shard is sent as it is where it already is what the ranks gather (never a view
        # of the full buffer here, unlike stages 1/2); else its compute copy. (A shard group of
        # one: the shard is the whole, cast into the full buffer directly.)
        shard = self.shards[i]
        if self.resident_shards and not self.met:
            self._wait_meeting()  # (a forward's whose gathers were never waited for)
            self.meeting, self.met = self.shared.start_meeting(), True
        ready = shard.dtype == unit.full.dtype and shard.device == unit.full.device
        one = self.groups.shard_size == 1
        unit.start_gather(shard if ready or one else self._compute_copy(shard))

    def _after_forward(self, i: int, output: Any) -> Any:
        if not torch.is_grad_enabled():  # no backward to come
            self.units[i].free()
            return output
        for t in tree_leaves(output):  # any output: a tensor, tuples, dicts, HF's ModelOutput
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, i=i: self._gather(i, direction=-1))
        if i not in self.kept:
            self.units[i].free()
        return output

    def _launch(self, index: int) -> None:
        super()._launch(index)
        self.units[index].free()  # its backward is done: the gathered weights can go
        self.grads_in.pop(self.units[index], None)

    def _on_grad(self, p: nn.Parameter) -> None:
        super()._on_grad(p)
        if self.backward.enabled:
            return  # the unit is freed once its reduce-scatter is launched
        # Inside no_sync() nothing is launched: free the unit once all its gradients are in.
        unit = self.unit_of[p]
        self.grads_in.setdefault(unit, set()).add(p)
        if len(self.grads_in[unit]) == len(unit.params):
            del self.grads_in[unit]
            unit.free()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.grads_in.clear()  # (what a no_sync() backward that raised left counted)

    def _take_back_abandoned(self) -> None:
        super()._take_back_abandoned()
        for unit in self.units:  # (the gathers it started ahead: none reads a shard after this)
            unit.wait_gather()
        self._wait_meeting()

    def gather_parameters(self) -> None:
        """Gathered on demand, unit by unit, in the next forward. A unit still gathered (kept
        after a forward whose backward never came) holds the old values: it goes."""
        for unit in self.units:
            unit.wait_gather()
            if unit.is_gathered():
                unit.free()
        self._wait_meeting()

    @torch.no_grad()
    def load_full_params(self, params: dict[str, torch.Tensor]) -> None:
        # A unit kept gathered after a forward whose backward never came would go on computing
        # with the values loaded over: `gather_parameters` frees it (the next forward gathers).
        self.gather_parameters()
        super().load_full_params(params)

    def take_full_params(self, unit: FlatUnit, full: torch.Tensor) -> None:
        pass  # the shard is the only copy: nothing else to update

    def release(self) -> None:
        super().release()
        for unit in self.units:
            disown(unit.params)


class ResidentStage3(ZeroStage2):
    """Stage 3 over a shard group of one, in fp32 without masters: the one shard holds every
    parameter, so it is the model's own storage (16P/1, as stage 3 promises) and no unit is ever
    gathered, freed or copied. The units are stage 3's (its checkpoints' layout)."""

    stage = 3
    unit_params = ZeroStage3.unit_params
