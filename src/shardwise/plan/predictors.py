"""Which cost model prices which strategy: one table, keyed by the strategy's YAML name (its
`StrategySection.name`), and what the planner and the trainer ask through it: a rank's costs,
the mesh a strategy makes of the world, and how many batches a step consumes."""

from __future__ import annotations

from shardwise.plan.cost_models import (
    CostModel,
    all_data_parallel,
    ddp_costs,
    mesh_costs,
    pipeline_costs,
    ps_costs,
    relaxed_costs,
    tensor_parallel_costs,
    zero_costs,
)
from shardwise.plan.costs import CostJob, Costs
from shardwise.strategies.section import StrategySection

MODELS: dict[str, CostModel] = {
    "ddp": ddp_costs.MODEL,
    "zero": zero_costs.MODEL,
    "local_sgd": relaxed_costs.LOCAL_SGD,
    "gossip": relaxed_costs.GOSSIP,
    "adaptive": relaxed_costs.ADAPTIVE,
    "tp": tensor_parallel_costs.MODEL,
    "pp": pipeline_costs.MODEL,
    "mesh": mesh_costs.MODEL,
    "ps": ps_costs.MODEL,
}


def cost_model(name: str) -> CostModel | None:
    """The cost model of the strategy named `name`, or None where there is none yet."""
    return MODELS.get(name)


def predict(job: CostJob, strategy: StrategySection) -> Costs:
    """The costs of `strategy` for `job`; strategies without a cost model say so in notes."""
    model = cost_model(strategy.name)
    if model is None:
        return Costs(notes=[f"no cost model for strategy {strategy.name!r} yet"])
    return model.costs(job, strategy)


def mesh_sizes(strategy: StrategySection, world_size: int) -> tuple[int, int, int]:
    """(data-parallel replicas, tensor-parallel size, pipeline stages) of `strategy`."""
    model = cost_model(strategy.name)
    return (model.sizes if model is not None else all_data_parallel)(strategy, world_size)


def replicas(strategy: StrategySection, world_size: int) -> int:
    """How many different batches one step of `strategy` consumes (data-parallel replicas)."""
    return mesh_sizes(strategy, world_size)[0]
