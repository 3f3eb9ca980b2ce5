"""shardwise: distributed training strategies for PyTorch, implemented on the collectives.

import shardwise as sw
rt = sw.init()
model, opt = sw.prepare(MyModel(), sw.DDP(), optimizer=torch.optim.AdamW, lr=1e-3)
loader = sw.data.loader(dataset, batch_size=32, shuffle=True, seed=0)
"""

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
