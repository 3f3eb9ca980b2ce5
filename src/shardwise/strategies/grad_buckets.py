"""Bucketed gradient reduction during backward, shared by DDP and ZeRO.

Gradients are grouped into buckets. A post-accumulate-grad hook per parameter hands each fresh
gradient to the strategy (`on_grad`, which moves it into the bucket) and counts the bucket down;
a complete bucket is launched (`launch`, asynchronous) as soon as every earlier bucket has been,
so all ranks issue their collectives in the same order even if gradients arrive in another.
At the end of backward an autograd callback launches what is left and calls `finish`, which
waits, so reduced gradients are ready when `loss.backward()` returns.

A reentrant activation checkpoint (`torch.utils.checkpoint(..., use_reentrant=True)`) runs its
region's backward as a backward of its own, nested in the outer one: the gradients of the
region's parameters are made there, and a callback queued from their hooks runs when the nested
backward ends, before the outer one has made the rest. So the end is asked of the first hook of
each backward, nested or not, and a nested backward's end is the end only where every parameter
has its gradient (torch's DDP likewise ends once every bucket is ready).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

# DDP's default bucket: an eighth of the gradients' bytes, within 1-25 MiB. The last bucket
# (the first layers', made last) cannot overlap backward; cut finer, less of the step waits on
# it: fp16 gradients of a 12.9 MB GPT over a 100 Mbit link stepped in 0.70 s in 1.6 MiB
# buckets, 0.86 s in one of 25 MiB (torch's default, 1 MiB first then 25 MiB: 0.81 s).
# Past 200 MiB of gradients it is torch's 25 MiB: per-call latency stays a small share.
BUCKETS_PER_MODEL, SMALLEST_BUCKET, LARGEST_BUCKET = 8, 2**20, 25 * 2**20


def default_bucket_bytes(grad_bytes: int, shared_cores: bool = False) -> int:
    """The bucket size in bytes for `grad_bytes` of gradients when none is given.

    `shared_cores`: the collectives run on the cores that compute (gloo, every rank on one
    host: loopback copies and sums are CPU work). Overlap then buys nothing and every call
    costs, so the buckets are the largest: on 2 cores (bench ddp, 5 interleaved rounds) the
    GPT's 12.9 MB of gradients stepped in 258 ms in one bucket against 270 ms in eight, the
    MLP's 23.3 MB in 59 ms against 64 ms (torch DDP: 256 and 62 ms)."""
    if shared_cores:
        return LARGEST_BUCKET
    return min(LARGEST_BUCKET, max(SMALLEST_BUCKET, grad_bytes // BUCKETS_PER_MODEL))


def bucket_bytes(bucket_mb: float | None, grad_bytes: int, shared_cores: bool = False) -> int:
    """`bucket_mb` in bytes, or the default for `grad_bytes` of gradients where it is None."""
    if bucket_mb is None:
        return default_bucket_bytes(grad_bytes, shared_cores)
    return int(bucket_mb * 2**20)


def shares_cores(device: torch.device, num_nodes: int) -> bool:
    """Whether collectives run on the cores that compute: the CPU, every rank on one host."""
    return device.type == "cpu" and num_nodes == 1


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters, in the given order, into buckets of at most `bucket_bytes` per dtype."""
    buckets: list[list[nn.Parameter]] = []
    open_bucket: dict[tuple, tuple[list[nn.Parameter], int]] = {}
    for p in params:
        key = (p.dtype, p.device)
        members, size = open_bucket.get(key, ([], 0))
        if members and size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(p)
        open_bucket[key] = (members, size + p.numel() * p.element_size())
    buckets.extend(members for members, _ in open_bucket.values())
    return buckets


@dataclass
class BucketCallbacks:
    on_grad: Callable[[nn.Parameter], None]  # move p's fresh gradient into its bucket
    launch: Callable[[int], None]  # start reducing bucket i
    zero_unused: Callable[[nn.Parameter], None]  # p got no gradient: make its slot zero
    finish: Callable[[], None]  # wait for every launched reduction


class BucketedBackward:
    """Hooks that launch bucket reductions in order while backward runs."""

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        names: dict[nn.Parameter, str],
        callbacks: BucketCallbacks,
        find_unused_parameters: bool,
        if_intended: str = "pass find_unused_parameters=True",
    ) -> None:
        """`if_intended`: what the error on a parameter left with no gradient advises."""
        self.callbacks = callbacks
        self.names = names
        self.find_unused_parameters = find_unused_parameters
        self.if_intended = if_intended
        self.enabled = True  # False inside no_sync(): gradients stay local
        # Whether a backward inside no_sync() made gradients that no backward outside it has
        # reduced since (`check_reduced`).
        self.held_back = False
        self.rebucket(buckets)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.bucket_of
        ]
        self._in_backward = False
        # The backwards (autograd's graph tasks: the outer one, reentrant checkpoints' nested
        # in it) that will call `_end_of_graph_task` as they end, and whether one nested ended
        # with parameters still waiting for their gradient (`end_deferred` ends it then).
        self._ends_asked: set[int] = set()
        self._nested_ended_early = False
        # Whether the last backward was ended by a nested one's end (every parameter had its
        # gradient), the outer one running on: until the next forward, a gradient of ours
        # is one accumulated twice in it (a weight used inside and outside a checkpoint).
        self._ended_in_nested = False

    def rebucket(self, buckets: list[list[nn.Parameter]]) -> None:
        """The same parameters, cut into other buckets (between backward passes)."""
        self.bucket_of = {p: i for i, members in enumerate(buckets) for p in members}
        self.sizes = [len(members) for members in buckets]
        self._reset()

    def _reset(self) -> None:
        self.pending = list(self.sizes)
        self.next_launch = 0
        self.ready: set[nn.Parameter] = set()
        self._ends_asked = set()
        self._nested_ended_early = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if (p in self.ready or self._ended_in_nested) and self.enabled:
            raise RuntimeError(
                f"{self.names[p]} received its gradient twice in one backward: it is used "
                "both inside and outside a reentrant activation checkpoint (use "
                "torch.utils.checkpoint(..., use_reentrant=False)), or a backward runs again "
                "after one that raised (call zero_grad() on every rank first)"
            )
        if not self.enabled:
            self.callbacks.on_grad(p)
            self.held_back = True
            return
        task = torch._C._current_graph_task_id()
        if task not in self._ends_asked:  # (this backward's first hook, or a nested one's)
            self._ends_asked.add(task)
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_graph_task)
        # (after the backward is known begun: where this raises, `take_back` undoes it all)
        self.callbacks.on_grad(p)
        self._nested_ended_early = False  # (the outer backward went on making ours)
        self.ready.add(p)
        self.pending[self.bucket_of[p]] -= 1
        while self.next_launch < len(self.sizes) and self.pending[self.next_launch] == 0:
            self._launch_next()

    def check_ended(self) -> None:
        """Refuse a forward that follows a backward that raised, with no `take_back` between: its
        gradients are partial, and the next backward would add to them. (In the forward, as
        torch's DDP refuses it: a backward's hooks cannot tell another backward from one that
        recomputes a checkpointed region within it.) A forward without autograd (evaluation)
        starts no backward: it may run."""
        self._ended_in_nested = False  # (the next backward is another one)
        if not (self._in_backward and torch.is_grad_enabled()):
            return
        if self._nested_ended_early:
            unused = [self.names[p] for p in self.bucket_of if p not in self.ready]
            raise RuntimeError(
                f"the last backward's end was not told ({len(unused)} parameter(s) without a "
                f"gradient: {', '.join(unused[:4])}): its last gradients of ours came from a "
                "reentrant checkpoint's nested backward and the outer one made none after (the "
                "step ends it), or it raised; call zero_grad() on every rank before the next "
                "forward, or step first"
            )
        raise RuntimeError(
            "a backward raised before its end, and zero_grad() was not called since: its "
            "gradients are partial (call zero_grad() on every rank before the next forward)"
        )

    def end_deferred(self) -> None:
        """End a backward whose end could not be told within it: its last gradients of ours
        were made in a reentrant checkpoint's nested backward, some parameters still had none,
        and the outer backward made none after (they are unused: zero where
        `find_unused_parameters`, else the usual error). Called by what reads the gradients
        next: the step, clipping, the check of their finiteness. (Not the next forward, which
        cannot tell it from a backward that raised after the nested one: `check_ended`.)"""
        if self._in_backward and self._nested_ended_early:
            self._end_of_backward()

    def check_reduced(self) -> None:
        """Refuse to read gradients (the step, clipping) where the last backward ran inside
        no_sync() and none outside it followed: they are this rank's alone. DDP's replicas
        stepped apart from each other from then on; ZeRO-2/3 dropped them (the shards' own
        gradients come only from a reduction)."""
        if self.held_back:
            raise RuntimeError(
                "the gradients of the last backward were never reduced: it ran inside "
                "model.no_sync(), and no backward outside it followed (run the last "
                "micro-batch's backward outside no_sync(), as sw.train_step(..., accumulate=K) "
                "does, or zero_grad() to drop them)"
            )

    def take_back(self, undo: Callable[[], None]) -> None:
        """Where a backward began and never ended (it raised: autograd runs no callback of a
        backward that raised, so `_end_of_backward` never came), `undo()` what it launched,
        then forget it: its launches and counts. (`zero_grad` asks, on every rank: what
        no_sync() held back goes with the gradients too.)"""
        self.held_back = False
        if self._in_backward:
            undo()
            self._in_backward = False
            self._reset()

    @property
    def launching_last(self) -> bool:
        """Whether the launch in progress is this backward's last: backward has made every
        parameter's gradient (what runs on makes none), and the wait for all comes next."""
        return self.next_launch == len(self.sizes) - 1

    def _launch_next(self) -> None:
        self.callbacks.launch(self.next_launch)
        self.next_launch += 1

    def _end_of_graph_task(self) -> None:
        """A backward this object's hooks ran in has ended: the outer one (autograd evaluates
        no node meanwhile), or one nested in it, which ends ours where every parameter has its
        gradient (the rest of the outer backward makes none of ours then)."""
        if not self._in_backward:
            return  # (ended already: at a nested backward's end, or it raised)
        nested = torch._C._current_autograd_node() is not None
        if len(self.ready) < len(self.bucket_of) and nested:
            self._nested_ended_early = True  # (the outer backward's hooks make the rest)
            return
        self._end_of_backward()
        self._ended_in_nested = nested

    def _end_of_backward(self) -> None:
        unused = [p for p in self.bucket_of if p not in self.ready]
        if unused and not self.find_unused_parameters:
            # (a backward that raised, like any other: `take_back` undoes what it launched)
            names = ", ".join(self.names[p] for p in unused[:8])
            raise RuntimeError(
                f"{len(unused)} parameter(s) received no gradient in this backward pass "
                f"({names}); if that is intended, {self.if_intended}"
            )
        self._in_backward = False
        for p in unused:  # an unused parameter contributes a zero gradient, as in torch DDP
            self.callbacks.zero_unused(p)
        while self.next_launch < len(self.sizes):
            self._launch_next()
        self._reset()
        self.callbacks.finish()
        self.held_back = False  # (reduced with the rest)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No reductions inside: gradients accumulate locally (what `no_sync()` means)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
