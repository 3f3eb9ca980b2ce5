"""One cost model per strategy: its bytes, memory and step-time work, in its own module.

Each module ends with its entry (`CostModel`): the function that prices one rank's model
state, peak and collectives per step (`Costs`), the one that prices its step's compute at a
calibration (`Compute`; None where there is no step-time model yet), and the mesh its options
make of the world (data-parallel replicas, tensor-parallel size, pipeline stages).
`plan.predictors` maps each strategy's YAML name to its entry; adding a strategy adds its
module here and one line there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardwise.plan.costs import CostJob, Costs
from shardwise.plan.work import Compute
from shardwise.strategies.section import StrategySection

PriceCosts = Callable[[CostJob, StrategySection], Costs]
# (job, strategy, its costs, the calibration, the rates of ranks working at once or None)
PriceCompute = Callable[[CostJob, StrategySection, Costs, dict, dict | None], Compute]
MeshSizes = Callable[[StrategySection, int], tuple[int, int, int]]


def all_data_parallel(strategy: StrategySection, world_size: int) -> tuple[int, int, int]:
    """Every rank a replica of the whole model: (world_size, 1, 1)."""
    return world_size, 1, 1


@dataclass(frozen=True)
class CostModel:
    """What the planner asks of one strategy."""

    costs: PriceCosts
    compute: PriceCompute | None = None
    sizes: MeshSizes = all_data_parallel  # (dp, tp, pp) of a world of this many ranks
