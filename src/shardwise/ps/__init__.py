"""Parameter-server training: servers own shards and apply updates; workers pull and push.

Servers own parameter shards and apply updates; workers pull parameters, compute gradients on
their data and push them back.

    strategy = sw.ParameterServer(servers=2, mode="ssp", staleness=2)
    if strategy.is_server():
        report = sw.ps.serve(MyModel(), strategy, torch.optim.AdamW, lr=1e-3)
    else:
        model, opt = sw.prepare(MyModel(), strategy, optimizer=torch.optim.AdamW, lr=1e-3)
        ...  # the usual loop: loss.backward(); opt.step(); opt.zero_grad()
        strategy.close(model)   # tells the servers this worker is done

With `relays=R` (a two-level job), ranks S..S+R-1 run `sw.ps.relay(MyModel(), strategy)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.distributed import runtime
from shardwise.faults.injection import FaultInjector
from shardwise.ps.relay import Relay, RelayReport
from shardwise.ps.server import Server, ServerReport
from shardwise.ps.sharding import ShardPlan, plan_shards
from shardwise.ps.work_queue import WorkQueue
from shardwise.ps.worker import ParameterServer, PSError


def serve(
    model: nn.Module,
    strategy: ParameterServer,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    work: WorkQueue | None = None,
    faults: FaultInjector | None = None,
    lr_schedule: Callable[[int], float] | None = None,
    **optimizer_kwargs: Any,
) -> ServerReport:
    """Run this rank's server until every worker is done or dead; return what it saw.

    `model` gives the parameter names, shapes and initial values (build it with the same seed
    on every rank). Server 0 deals out `work` (batches of indices) when given one. `faults`
    (tests, demos): kill, hang or slow this server at an update. `lr_schedule`: the rate's
    multiplier at a training step (`sw.Schedule`), a step being as many pushed batches as there
    are workers (one sync update; as many asynchronous ones).
    """
    rt = runtime.init()
    if not strategy.is_server(rt.rank):
        raise ValueError(
            f"rank {rt.rank} is not a server: call sw.prepare(...) on workers, "
            "sw.ps.relay(...) on relays"
        )
    workers = strategy.workers(rt.world_size)
    strategy.check_backups(rt.world_size)
    clients = list(strategy.relay_groups(rt.world_size)) if strategy.relays else workers
    server = Server(
        model,
        strategy,
        optimizer,
        optimizer_kwargs,
        rt.rank,
        clients,
        work if strategy.shard_of(rt.rank) == 0 else None,  # (a backup of server 0 deals too)
        workers=len(workers),
        faults=faults,
        lr_schedule=lr_schedule,
    )
    return server.serve()


def relay(
    model: nn.Module, strategy: ParameterServer, faults: FaultInjector | None = None
) -> RelayReport:
    """Run this rank's relay (a two-level job) until its workers are done or dead; `faults`:
    kill, hang or slow it at a forwarded push."""
    rt = runtime.init()
    if not strategy.is_relay(rt.rank):
        raise ValueError(f"rank {rt.rank} is not a relay of this job")
    return Relay(model, strategy, rt, faults).serve()


__all__ = [
    "PSError",
    "ParameterServer",
    "RelayReport",
    "ServerReport",
    "ShardPlan",
    "WorkQueue",
    "plan_shards",
    "relay",
    "serve",
]
