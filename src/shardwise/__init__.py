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

# name -> the module that defines it ("shardwise": a subpackage of that name)
_WHERE = {
    "comm": "shardwise",
    "data": "shardwise",
    "optim": "shardwise",
    "ps": "shardwise",
    "clip_grad_norm_": "shardwise.api",
    "data_shard": "shardwise.api",
    "declare_batch": "shardwise.api",
    "full_state_dict": "shardwise.api",
    "init": "shardwise.api",
    "no_sync": "shardwise.api",
    "parallel_loss": "shardwise.api",
    "predict": "shardwise.api",
    "prepare": "shardwise.api",
    "train_step": "shardwise.api",
    "Checkpointer": "shardwise.checkpoint.checkpointer",
    "export_checkpoint": "shardwise.checkpoint.reshardable",
    "load_checkpoint": "shardwise.checkpoint.reshardable",
    "save_checkpoint": "shardwise.checkpoint.reshardable",
    "partition": "shardwise.data",
    "ThroughputBalancer": "shardwise.data.balance",
    "DeviceMesh": "shardwise.distributed.mesh",
    "build_mesh": "shardwise.distributed.mesh",
    "Runtime": "shardwise.distributed.runtime",
    "shutdown": "shardwise.distributed.runtime",
    "NonFinitePolicy": "shardwise.faults.nonfinite",
    "NonFiniteStop": "shardwise.faults.nonfinite",
    "Watchdog": "shardwise.faults.watchdog",
    "SeededInit": "shardwise.nn.deferred_init",
    "HFWeights": "shardwise.nn.hf_weights",
    "ParameterSource": "shardwise.nn.meta_init",
    "empty_parameters": "shardwise.nn.meta_init",
    "Schedule": "shardwise.nn.schedules",
    "lr_scheduler": "shardwise.nn.schedules",
    "scaled_lr": "shardwise.nn.schedules",
    "SyncBatchNorm": "shardwise.nn.sync_batchnorm",
    "convert_sync_batchnorm": "shardwise.nn.sync_batchnorm",
    "memory_report": "shardwise.observe.memory",
    "MetricsWriter": "shardwise.observe.metrics",
    "ParameterServer": "shardwise.ps",
    "grow_rows": "shardwise.recipes.continual",
    "start_from": "shardwise.recipes.continual",
    "TeacherCache": "shardwise.recipes.distillation",
    "distill_loss": "shardwise.recipes.distillation",
    "prepare_teacher": "shardwise.recipes.distillation",
    "top_k_logits": "shardwise.recipes.distillation",
    "GlobalMagnitudePruner": "shardwise.recipes.pruning",
    "NMPruner": "shardwise.recipes.pruning",
    "DDP": "shardwise.strategies",
    "AdaptiveSync": "shardwise.strategies",
    "Gossip": "shardwise.strategies",
    "Hybrid": "shardwise.strategies",
    "LocalSGD": "shardwise.strategies",
    "MeshParallel": "shardwise.strategies",
    "Pipeline": "shardwise.strategies",
    "Strategy": "shardwise.strategies",
    "TensorParallel": "shardwise.strategies",
    "ZeRO": "shardwise.strategies",
    "Evaluation": "shardwise.train.validator",
    "Validator": "shardwise.train.validator",
    "evaluate": "shardwise.train.validator",
}


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
