"""shardwise: distributed training strategies for PyTorch, implemented on the collectives.

import shardwise as sw
rt = sw.init()
model, opt = sw.prepare(MyModel(), sw.DDP(), optimizer=torch.optim.AdamW, lr=1e-3)
loader = sw.data.loader(dataset, batch_size=32, shuffle=True, seed=0)

Every name here is imported on first use (PEP 562): `import shardwise` itself imports nothing
heavy, so the `shardwise` command can start a job's zygote before torch is imported
(`entry.py`). `preload()` imports them all at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (what type checkers and editors see: the same names, imported)
    from shardwise import comm, data, optim, ps
    from shardwise.api import (
        clip_grad_norm_,
        data_shard,
        declare_batch,
        full_state_dict,
        init,
        no_sync,
        parallel_loss,
        predict,
        prepare,
        train_step,
    )
    from shardwise.checkpoint.checkpointer import Checkpointer
    from shardwise.checkpoint.reshardable import export_checkpoint, load_checkpoint, save_checkpoint
    from shardwise.data import partition
    from shardwise.data.balance import ThroughputBalancer
    from shardwise.distributed.mesh import DeviceMesh, build_mesh
    from shardwise.distributed.runtime import Runtime, shutdown
    from shardwise.faults.nonfinite import NonFinitePolicy, NonFiniteStop
    from shardwise.faults.watchdog import Watchdog
    from shardwise.nn.deferred_init import SeededInit
    from shardwise.nn.hf_weights import HFWeights
    from shardwise.nn.meta_init import ParameterSource, empty_parameters
    from shardwise.nn.schedules import Schedule, lr_scheduler, scaled_lr
    from shardwise.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
    from shardwise.observe.memory import memory_report
    from shardwise.observe.metrics import MetricsWriter
    from shardwise.ps import ParameterServer
    from shardwise.recipes.continual import grow_rows, start_from
    from shardwise.recipes.distillation import (
        TeacherCache,
        distill_loss,
        prepare_teacher,
        top_k_logits,
    )
    from shardwise.recipes.pruning import GlobalMagnitudePruner, NMPruner
    from shardwise.strategies import (
        DDP,
        AdaptiveSync,
        Gossip,
        Hybrid,
        LocalSGD,
        MeshParallel,
        Pipeline,
        Strategy,
        TensorParallel,
        ZeRO,
    )
    from shardwise.train.validator import Evaluation, Validator, evaluate

# The module that defines each name ("shardwise": a subpackage of that name).
_NAMES = {
    "shardwise": ("comm", "data", "optim", "ps"),
    "shardwise.api": (
        "clip_grad_norm_",
        "data_shard",
        "declare_batch",
        "full_state_dict",
        "init",
        "no_sync",
        "parallel_loss",
        "predict",
        "prepare",
        "train_step",
    ),
    "shardwise.checkpoint.checkpointer": ("Checkpointer",),
    "shardwise.checkpoint.reshardable": ("export_checkpoint", "load_checkpoint", "save_checkpoint"),
    "shardwise.data": ("partition",),
    "shardwise.data.balance": ("ThroughputBalancer",),
    "shardwise.distributed.mesh": ("DeviceMesh", "build_mesh"),
    "shardwise.distributed.runtime": ("Runtime", "shutdown"),
    "shardwise.faults.nonfinite": ("NonFinitePolicy", "NonFiniteStop"),
    "shardwise.faults.watchdog": ("Watchdog",),
    "shardwise.nn.deferred_init": ("SeededInit",),
    "shardwise.nn.hf_weights": ("HFWeights",),
    "shardwise.nn.meta_init": ("ParameterSource", "empty_parameters"),
    "shardwise.nn.schedules": ("Schedule", "lr_scheduler", "scaled_lr"),
    "shardwise.nn.sync_batchnorm": ("SyncBatchNorm", "convert_sync_batchnorm"),
    "shardwise.observe.memory": ("memory_report",),
    "shardwise.observe.metrics": ("MetricsWriter",),
    "shardwise.ps": ("ParameterServer",),
    "shardwise.recipes.continual": ("grow_rows", "start_from"),
    "shardwise.recipes.distillation": (
        "TeacherCache",
        "distill_loss",
        "prepare_teacher",
        "top_k_logits",
    ),
    "shardwise.recipes.pruning": ("GlobalMagnitudePruner", "NMPruner"),
    "shardwise.strategies": (
        "DDP",
        "AdaptiveSync",
        "Gossip",
        "Hybrid",
        "LocalSGD",
        "MeshParallel",
        "Pipeline",
        "Strategy",
        "TensorParallel",
        "ZeRO",
    ),
    "shardwise.train.validator": ("Evaluation", "Validator", "evaluate"),
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:  # a subpackage or module not listed: `shardwise.strategies`, say
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    found = importlib.import_module(f"{module}.{name}" if module == __name__ else module)
    value = found if module == __name__ else getattr(found, name)
    globals()[name] = value  # (once: later lookups do not come here)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def preload() -> None:
    """Import every name above now (a zygote or a forkserver does it once for its forks)."""
    for name in __all__:
        getattr(__import__(__name__), name)


__version__ = "0.1.0"

__all__ = [
    "DDP",
    "AdaptiveSync",
    "Checkpointer",
    "DeviceMesh",
    "Evaluation",
    "GlobalMagnitudePruner",
    "Gossip",
    "HFWeights",
    "Hybrid",
    "LocalSGD",
    "MeshParallel",
    "MetricsWriter",
    "NMPruner",
    "NonFinitePolicy",
    "NonFiniteStop",
    "ParameterServer",
    "ParameterSource",
    "Pipeline",
    "Runtime",
    "Schedule",
    "SeededInit",
    "Strategy",
    "SyncBatchNorm",
    "TeacherCache",
    "TensorParallel",
    "ThroughputBalancer",
    "Validator",
    "Watchdog",
    "ZeRO",
    "build_mesh",
    "clip_grad_norm_",
    "comm",
    "convert_sync_batchnorm",
    "data",
    "data_shard",
    "declare_batch",
    "distill_loss",
    "empty_parameters",
    "evaluate",
    "export_checkpoint",
    "full_state_dict",
    "grow_rows",
    "init",
    "load_checkpoint",
    "lr_scheduler",
    "memory_report",
    "no_sync",
    "optim",
    "parallel_loss",
    "partition",
    "predict",
    "prepare",
    "prepare_teacher",
    "ps",
    "save_checkpoint",
    "scaled_lr",
    "shutdown",
    "start_from",
    "top_k_logits",
    "train_step",
]
