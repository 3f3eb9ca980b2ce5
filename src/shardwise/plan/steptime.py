"""Predicted step time of a job: what each rank computes, traced on fake tensors (`work`),
priced at the rates `shardwise calibrate` measured (`rates`), plus its collectives from the
cost model. Each strategy's cost model (`plan.cost_models`, through `predictors`) says what its
step computes; this module weighs the bounds and adds the collectives.

    collectives each call at the calibrated mean time of one of its kind and payload (its
                bytes per call) after a little compute, and the waiting for ranks that share
                cores to arrive after the step's compute (`arrival_wait`: the calibrated
                waits after bursts of compute). A call started a unit of
                compute before it is waited for (ZeRO-3's prefetched gathers, ZeRO's
                reduce-scatters but the last unit's of backward) at what the calibration
                saw such a call add to its caller: its wait, and the cycles its copies
                took from the compute meanwhile
    sharing     compute takes the longer of this rank's critical path, at the rates of a
                rank alone, and all ranks' work done at once: where each rank has a core, at
                the rates measured with every rank working (they contend for memory:
                `shared_rates`); where ranks outnumber the cores, over the machine's
                concurrency (they take turns)
    schedules   a pipeline's critical path comes from running its schedule
                (`cost_models.pipeline_costs`); tensor parallel's compute is traced on this rank's
                share of the model (its split layers, the replicated rest and the
                vocabulary-parallel loss)

On a CPU the collectives compete with compute for the same cores, so nothing is hidden: their
time adds to the step's. Strategies whose extra work the trace cannot see (gradient codecs'
compression, ZeRO's flat copies) are priced by what they communicate only.
"""

from __future__ import annotations

from shardwise.plan.costs import CostJob, Costs, trainer_comm
from shardwise.plan.predictors import cost_model
from shardwise.plan.rates import arrival_wait, call_seconds, shared_rates
from shardwise.strategies.section import StrategySection

KIND = {  # how each recorded op is priced: which calibrated collective it behaves like
    "all_reduce": "all_reduce",
    "broadcast": "all_reduce",
    "reduce": "all_reduce",
    # (ZeRO's gathers on one host go as direct messages, `comm.all_gather_pairwise`, 1.3-1.4x
    # faster than gloo's all-gather, which calibration times: priced on the slow side)
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_to_all": "reduce_scatter",  # (a codec's: each rank's slices, sent once)
    "send": "send",
    "gossip": "exchange",
    "ring_all_reduce": "exchange",
}


def comm_seconds(costs: Costs, cal: dict, compute_s: float, world: int) -> float:
    """Every collective call (the trainer's loss all-reduce among them) at the calibrated
    time of its kind and payload (each call after a little compute, as in a step), and the
    waiting for ranks that share cores to arrive after the step's compute (`arrival_wait`). A
    pipeline's messages, and the tensor-parallel all-reduces inside its stages' ops, are priced
    in its schedule (`pipeline_finish`) instead."""
    trainer = trainer_comm(world)
    seconds = sum(call_seconds(cal, KIND[op], nbytes) for op, nbytes in trainer.items())
    for t in costs.traffic:
        if t.op != "send" and not t.in_path:
            kind = KIND.get(t.op, "all_reduce")
            if t.kind in cal["collectives"]:  # (a calibration from before it was measured: by op)
                kind = t.kind  # (summed on the cores that compute: priced whole, never hidden)
            elif t.prefetched:  # started a unit of compute before it is waited for
                kind = f"prefetched_{kind}"
            seconds += t.calls * call_seconds(cal, kind, t.nbytes / t.calls, t.ranks)
    return seconds + arrival_wait(cal, compute_s)


def step_timed(strategy: StrategySection) -> bool:
    """Whether `strategy`'s cost model prices its step time (a parameter server's does not)."""
    model = cost_model(strategy.name)
    return model is not None and model.compute is not None


def predict_step(
    job: CostJob, strategy: StrategySection, cal: dict, costs: Costs | None = None
) -> dict[str, float]:
    """Seconds per step by part (compute with the optimizer, the sharing of the machine and
    the pipeline's waits, comm) and the total; `costs`: the strategy's, where the caller has
    them (`predictors.predict`), else priced here.

    Compute is the longer of two bounds: this rank's critical path (a pipeline's from running
    its schedule) at the rates of a rank alone, and every rank's work done at once: where
    each rank has a core, at the rates of `shared_rates`, else over the machine's concurrency
    (ranks that share cores take turns)."""
    if not step_timed(strategy):
        raise ValueError(f"no step-time model for strategy {strategy.name!r} yet")
    model = cost_model(strategy.name)
    if costs is None:
        costs = model.costs(job, strategy)
    n = job.world_size
    shared = shared_rates(cal, n)
    work = model.compute(job, strategy, costs, cal, shared)
    at_once = work.everyone / n if shared is not None else work.everyone / cal.get("concurrency", 1)
    compute = max(work.path, at_once)
    busy = min(work.ideal, compute)
    parts = {
        "compute": busy,
        "sharing": compute - busy,  # waiting for cores, memory, pipeline inputs
        "comm": comm_seconds(costs, cal, compute, n) if n > 1 else 0.0,
    }
    parts["total"] = sum(parts.values())
    return parts
