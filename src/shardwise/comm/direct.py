"""The collectives on a training step's path, issued by the process group itself.

`torch.distributed.all_reduce` and its kin are Python wrappers around the process group's own
methods: before the call they check the tensor and the group, look the default group up,
build a fresh options object and ask whether a coalescing manager is open. On the 2-core VM,
world 2, a float's median all-reduce took 168-170 us through the process group's method and
182-186 through the wrapper (10,000 calls each, taking turns; the wrapper alone costs 2.0 us
warm, but code run right after a wait runs from cold caches there). Our layer knows what those
checks establish, so it issues the calls on every step's path itself, and leaves to the
wrapper only what it must handle:

- a tensor that overrides torch functions (a subclass; what tracing hands us): the wrapper
  dispatches it;
- a complex tensor: the wrapper handles it (reduces its real view, where it does);
- a reduction other than the plain ones (a pre-multiplied sum).

Here are what those calls take (`GATHER`, `SCATTER`, the options of each); each
collective of `collectives.py` chooses between them and the wrapper in its own frame, and
`_issue` makes the call it chose with its arguments: a frame per choice (a function, or a
`partial` of one) cost 2-3 us a call end to end there. The process group's call returns the
backend's `Work`, as the wrapper's `async_op=True` does. (Unlike the wrapper's, a call made
inside torch's `_coalescing_manager` runs at once: our layer never opens one.)
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    ReduceScatterOptions,
)

# torch's wrappers of the flat gather and scatter, by this release's names (2.13 renamed them)
torch_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
torch_reduce_scatter_flat = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
# The process group's own flat gather and scatter, (group, output, input, options) -> Work
# (torch 2.13's names; earlier releases name them `_allgather_base`, `_reduce_scatter_base`;
# its all-reduce is `ProcessGroup.allreduce(group, [tensor], options)`)
GATHER = getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
SCATTER = (
    getattr(dist.ProcessGroup, "reduce_scatter_single", None)
    or dist.ProcessGroup._reduce_scatter_base
)

# Options are read, never changed, by the process group's call: one object per reduction
# (another reduction, such as a pre-multiplied sum, goes through the wrapper).
RED_OP = dist.ReduceOp.RedOpType


def _options(kind: type, op: dist.ReduceOp.RedOpType | None = None):
    options = kind()
    if op is not None:
        options.reduceOp = op
    options.asyncOp = True
    return options


_REDUCTIONS = [getattr(dist.ReduceOp, name) for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")]
ALL_REDUCE_OPTIONS = {op: _options(AllreduceOptions, op) for op in _REDUCTIONS}
SCATTER_SUM_OPTIONS = _options(ReduceScatterOptions, dist.ReduceOp.SUM)
GATHER_OPTIONS = _options(AllgatherOptions)
