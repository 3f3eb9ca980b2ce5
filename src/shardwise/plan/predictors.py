"""Which cost model prices which strategy: one table, keyed by the strategy's YAML name."""

from __future__ import annotations

from collections.abc import Callable

from shardwise.plan.costs import (
    Costs,
    Job,
    adaptive_costs,
    ddp_costs,
    gossip_costs,
    local_sgd_costs,
    mesh_costs,
    pp_costs,
    tp_costs,
    zero_costs,
)
from shardwise.plan.ps_costs import ps_costs
from shardwise.strategies.section import StrategySection

PREDICTORS: dict[str, Callable[[Job, StrategySection], Costs]] = {
    "ddp": ddp_costs,
    "zero": zero_costs,
    "local_sgd": local_sgd_costs,
    "gossip": gossip_costs,
    "adaptive": adaptive_costs,
    "tp": tp_costs,
    "pp": pp_costs,
    "mesh": mesh_costs,
    "ps": ps_costs,
}


def predict(job: Job, strategy: StrategySection) -> Costs:
    """The costs of `strategy` for `job`; strategies without a cost model say so in notes."""
    predictor = PREDICTORS.get(strategy.name)
    if predictor is None:
        return Costs(notes=[f"no cost model for strategy {strategy.name!r} yet"])
    return predictor(job, strategy)
