"""The relaxed synchronisation strategies' cost models (`strategies.relaxed`): each rank holds
the whole model and steps alone, as one process does; they differ in how often, and with whom,
the parameters are averaged.

    local SGD    every `period` steps, one all-reduce of all parameters (Stich, 2019)
    gossip       every step, its parameters to each peer of its topology (and, every
                 `global_every` steps, one all-reduce instead)
    adaptive     every step, one float all-reduced to agree whether the replicas drifted;
                 the averages it then makes depend on the data
"""

from __future__ import annotations

from shardwise.comm.accounting import native_volume
from shardwise.plan.cost_models import CostModel
from shardwise.plan.costs import FP32, CostJob, Costs, replica_costs
from shardwise.plan.peaks import step_peak
from shardwise.plan.work import data_parallel_compute
from shardwise.strategies.relaxed import neighbours
from shardwise.strategies.section import StrategySection


def _average_bytes(job: CostJob, costs: Costs) -> int:
    """The bytes of one all-reduce of every parameter, and the replica's weight beside them
    (its samples: `relaxed.weighted_mean`)."""
    return native_volume("all_reduce", (sum(costs.optimizer_numels) + 1) * FP32, job.world_size)


def _relaxed_peak(job: CostJob, costs: Costs, copies: int, buffers: int = 0) -> int | None:
    """A relaxed strategy's peak: its synchronisation holds `copies` flat copies of the
    parameters (the flattened parameters, what it receives, the average) after the step."""
    full = FP32 * sum(costs.optimizer_numels)
    return step_peak(
        job,
        costs.memory,
        costs.optimizer_numels,
        job.global_batch // job.world_size,
        made_grads=costs.memory["grads"],
        buffers=buffers,
        after_step=copies * full,
    )


def local_sgd_costs(job: CostJob, s: StrategySection) -> Costs:
    """A local SGD rank: an average every period."""
    costs = replica_costs(job)
    costs.peak = _relaxed_peak(job, costs, 2)  # the flattened parameters and their mean
    average = _average_bytes(job, costs)
    costs.add_comm("all_reduce", average / s.period, 1 / s.period)
    if s.warmup_steps:
        costs.notes.append("warm-up steps all-reduce gradients every step: not in the average")
    return costs


def gossip_costs(job: CostJob, s: StrategySection) -> Costs:
    """A gossip rank: its parameters to each peer, or a global average every global_every."""
    costs = replica_costs(job)
    peers = neighbours(s.topology, job.rank, job.world_size)
    # Gossip holds its flattened parameters, one copy from each peer, and two partial sums.
    costs.peak = _relaxed_peak(job, costs, 2 if s.global_every == 1 else len(peers) + 3)
    exchange = len(peers) * sum(costs.optimizer_numels) * FP32  # its parameters to each peer
    if s.global_every:
        k = s.global_every
        costs.add_comm("gossip", exchange * (k - 1) / k, (k - 1) / k)
        costs.add_comm("all_reduce", _average_bytes(job, costs) / k, 1 / k)
    else:
        costs.add_comm("gossip", exchange)
    return costs


def adaptive_costs(job: CostJob, s: StrategySection) -> Costs:
    """An adaptive-sync rank: the drift check every step; its averages are not predicted."""
    costs = replica_costs(job)
    # The anchor (the parameters at the last average) lasts; the check flattens the parameters
    # and takes their difference from it.
    costs.peak = _relaxed_peak(job, costs, 2, buffers=FP32 * sum(costs.optimizer_numels))
    costs.add_comm("all_reduce", native_volume("all_reduce", FP32, job.world_size))
    costs.notes.append("adaptive: averages when the replicas drift; those are data-dependent")
    return costs


LOCAL_SGD = CostModel(local_sgd_costs, data_parallel_compute)
GOSSIP = CostModel(gossip_costs, data_parallel_compute)
ADAPTIVE = CostModel(adaptive_costs, data_parallel_compute)
