"""Parameter-server training: servers own parameter shards and apply updates; workers pull
parameters, compute gradients on their data and push them back.

    strategy = sw.ParameterServer(servers=2, mode="ssp", staleness=2)
    if strategy.is_server():
        report = sw.ps.serve(MyModel(), strategy, torch.optim.AdamW, lr=1e-3)
    else:
        model, opt = sw.prepare(MyModel(), strategy, optimizer=torch.optim.AdamW, lr=1e-3)
        ...  # the usual loop: loss.backward(); opt.step(); opt.zero_grad()
        sw.api.strategy_of(model).close(model)   # tells the servers this worker is done
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise import runtime
from shardwise.ps.server import Server, ServerReport, WorkQueue
from shardwise.ps.sharding import ShardPlan, plan_shards
from shardwise.ps.worker import ParameterServer, PSError


def serve(
    model: nn.Module,
    strategy: ParameterServer,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    work: WorkQueue | None = None,
    **optimizer_kwargs: Any,
) -> ServerReport:
    """Run this rank's server until every worker is done or dead; return what it saw.

    `model` gives the parameter names, shapes and initial values (build it with the same seed
    on every rank). Server 0 deals out `work` (batches of indices) when given one.
    """
    rt = runtime.current() if runtime._runtime is not None else runtime.init()
    if not strategy.is_server(rt.rank):
        raise ValueError(f"rank {rt.rank} is a worker: call sw.prepare(...) there")
    server = Server(
        model,
        strategy,
        optimizer,
        optimizer_kwargs,
        rt.rank,
        strategy.workers(rt.world_size),
        work if rt.rank == 0 else None,
    )
    return server.serve()


__all__ = [
    "PSError",
    "ParameterServer",
    "ServerReport",
    "ShardPlan",
    "WorkQueue",
    "plan_shards",
    "serve",
]
