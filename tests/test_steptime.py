"""The step-time model's pieces against their definitions: the pipeline's critical path against
the bubble formula of the GPipe paper, and a call's price against the calibration's timings."""

import pytest
import torch

from shardwise.plan.cost_models.pipeline_costs import pipeline_finish
from shardwise.plan.rates import arrival_wait, call_seconds, shared_rates
from shardwise.plan.steptime import predict_step
from shardwise.strategies.pipeline import schedule_order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 3, 8])
def test_pipeline_path_is_the_bubble_formula(schedule, stages, microbatches):
    # Stages alike (forward f, backward b per micro-batch): the step takes (m + S - 1)(f + b),
    # m slots of work and S - 1 of bubble (Huang et al. 2019), for either schedule; each
    # message of L seconds adds 2 (S - 1) L to GPipe's (the first micro-batch's way forward
    # and the last one's way back).
    f, b, latency = 1.0, 2.0, 0.25
    orders = [schedule_order(schedule, s, stages, microbatches) for s in range(stages)]
    ends = pipeline_finish(orders, [f] * stages, [b] * stages, [0.0] * (stages - 1))
    assert ends[0] == pytest.approx((microbatches + stages - 1) * (f + b))
    assert all(end <= ends[0] for end in ends)  # the first stage ends the step
    late = pipeline_finish(orders, [f] * stages, [b] * stages, [latency] * (stages - 1))
    if schedule == "gpipe":
        bubble = (microbatches + stages - 1) * (f + b) + 2 * (stages - 1) * latency
        assert late[0] == pytest.approx(bubble)
    else:  # (1F1B's alternation waits on messages more often: never less than GPipe)
        assert late[0] >= ends[0] + 2 * (stages - 1) * latency - 1e-9


def test_a_slow_stage_sets_the_pace():
    # One stage three times slower than the others: after the pipeline fills, every stage
    # waits on it, so the step is its m micro-batches plus the others' one each.
    stages, m = 3, 6
    forward, backward = [1.0, 3.0, 1.0], [2.0, 6.0, 2.0]
    orders = [schedule_order("gpipe", s, stages, m) for s in range(stages)]
    ends = pipeline_finish(orders, forward, backward, [0.0, 0.0])
    slow = m * (forward[1] + backward[1])
    others = forward[0] + forward[2] + backward[0] + backward[2]
    assert ends[0] == pytest.approx(slow + others)


def test_a_call_is_priced_from_the_timings_of_its_group_size():
    cal = {
        "collectives": {
            "all_reduce": {
                "points": [[8, 1e-3], [1000, 2e-3], [3000, 6e-3]],
                "bandwidth": 1e6,
                "groups": {"2": {"points": [[8, 5e-4], [1000, 5e-4]], "bandwidth": 2e6}},
            }
        }
    }
    assert call_seconds(cal, "all_reduce", 8) == pytest.approx(1e-3)  # a measured payload
    assert call_seconds(cal, "all_reduce", 1) == pytest.approx(1e-3)  # (smaller: the least)
    assert call_seconds(cal, "all_reduce", 2000) == pytest.approx(4e-3)  # between two
    assert call_seconds(cal, "all_reduce", 4000) == pytest.approx(6e-3 + 1000 / 1e6)  # past
    assert call_seconds(cal, "all_reduce", 3000, ranks=2) == pytest.approx(5e-4 + 2000 / 2e6)
    assert call_seconds(cal, "all_reduce", 8, ranks=3) == pytest.approx(1e-3)  # (not measured)


def _zero3_waits(model_name: str, keep_mb: float | None, tmp: str) -> tuple[dict, dict]:
    """(exposed calls per step by op as a real ZeRO-3 step makes them, as predicted): a call
    is exposed when no unit computed between its issue and its wait (the others were started
    a unit ahead, and the step-time model prices them as `prefetched_*`)."""
    import torch

    import shardwise as sw
    import small_models
    from shardwise import comm
    from shardwise.comm.shared_memory import SharedMemoryCollectives
    from shardwise.plan.costs import CostJob
    from shardwise.plan.predictors import predict
    from shardwise.strategies.zero import ZeROConfig
    from shardwise.strategies.zero.stage3 import stage3_units

    batch, loss_fn = small_models.fake_batch(model_name), small_models.loss_fn(model_name)
    section = ZeROConfig(stage=3, keep_gathered_mb=keep_mb)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    with torch.device("meta"):
        meta = small_models.build(model_name)
    predicted: dict[str, float] = {}
    job = CostJob(meta, world, rank, batch=batch, loss_fn=loss_fn, global_batch=8)
    for t in predict(job, section).traffic:
        if not t.prefetched:
            predicted[t.op] = predicted.get(t.op, 0) + t.calls

    events: list[tuple] = []  # ("issue" | "wait", call) and ("compute",), in order

    class Observed:  # (a handle whose wait is noted: ZeRO-3 only waits on what it is given)
        def __init__(self, handle, call) -> None:
            self.handle, self.call = handle, call

        def wait(self) -> None:
            events.append(("wait", self.call))
            self.handle.wait()

    def observed(start, op):
        def issue(*args, **kwargs):
            handle, call = start(*args, **kwargs), (op, len(events))
            events.append(("issue", call))
            return Observed(handle, call)

        return issue

    def computed(_module, _inputs, out) -> None:  # a unit's forward, then its backward's start
        events.append(("compute",))
        out.register_hook(lambda _grad: events.append(("compute",)))

    # (the gradients' reduction: a reduce-scatter, or where gloo's ranks share a host an
    # exchange of the slices, an all-to-all, or there in shared memory; the gathers there are
    # direct messages, or in shared memory: through slots, or from shards that live there.)
    names = ("all_gather_into_tensor", "all_gather_pairwise", "reduce_scatter_tensor")
    names += ("all_to_all_single", "start_reduce_scatter", "start_all_gather")
    names += ("start_gather_resident",)  # (stage 3's shards, read where they lie)
    places = [comm] * 4 + [SharedMemoryCollectives] * 3
    ops = ("all_gather", "all_gather", "reduce_scatter", "all_to_all", "reduce_scatter")
    ops += ("all_gather", "all_gather")
    starts = [getattr(place, name) for place, name in zip(places, names, strict=True)]
    for place, name, start, op in zip(places, names, starts, ops, strict=True):
        setattr(place, name, observed(start, op))
    try:
        model, _ = sw.prepare(small_models.build(model_name), section.build(world, tmp), lr=1e-3)
        for unit in stage3_units(model.module):
            unit.register_forward_hook(computed)
        for _ in range(2):
            events.clear()
            sw.train_step(model, *batch(8 // world), loss_fn, total=8)
    finally:
        for place, name, start in zip(places, names, starts, strict=True):
            setattr(place, name, start)
    exposed: dict[str, float] = {}
    issued: dict[tuple, int] = {}
    for i, event in enumerate(events):
        if event[0] == "issue":
            issued[event[1]] = i
        elif event[0] == "wait" and event[1] in issued:
            between = events[issued.pop(event[1]) : i]
            if not any(e[0] == "compute" for e in between):
                exposed[event[1][0]] = exposed.get(event[1][0], 0) + 1
    model.close()
    return exposed, predicted


# (the default keeps these small models whole: the GPT re-gathers every unit for backward)
@pytest.mark.parametrize("model_name,keep_mb", [("mlp", None), ("gpt", 0.0)])
def test_zero3_calls_priced_as_exposed_are_those_a_step_waits_for_at_once(
    model_name, keep_mb, tmp_path
):
    from spawn import run

    waits = run(_zero3_waits, 2, model_name, keep_mb, str(tmp_path), timeout_s=120)
    for exposed, predicted in waits:
        assert exposed == predicted


def _calibration(shared_bytes_rate: float, concurrency: float) -> dict:
    alone = {"flop_rate": 1e11, "bytes_rate": 7e10, "op_overhead_s": 4e-6, "sample_read_s": 3e-6}
    shared = {**alone, "bytes_rate": shared_bytes_rate}
    points = {"points": [[8, 1e-4], [4 << 20, 2e-3]], "bandwidth": 2e9}
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "send", "post", "exchange")
    return {
        **alone,
        "concurrency": concurrency,
        "shared": shared,
        "collectives": dict.fromkeys(kinds, points),
        "arrival_waits": [[1e-3, 1e-4], [0.1, 1e-4]],
    }


def test_ranks_with_cores_of_their_own_compute_at_the_rates_measured_all_at_once():
    # 2 ranks on 2 cores, working at once, contend for memory: element-wise work at half its
    # rate alone. Data-parallel ranks always work at once: their step slows by the traced
    # bytes at the shared rate. A 2-stage pipeline of 8 micro-batches works at once only part
    # of the time: its critical path, at the rates alone, stays the longer bound. 4 ranks on
    # those cores take turns (the concurrency), whatever the shared rates.
    import small_models
    from shardwise.plan.costs import CostJob
    from shardwise.strategies.ddp import DDPConfig
    from shardwise.strategies.pipeline import PPConfig

    uncontended, contended = _calibration(7e10, 2.0), _calibration(3.5e10, 2.0)
    assert shared_rates(contended, 2)["bytes_rate"] == 3.5e10
    assert shared_rates(contended, 4) is None and shared_rates({"flop_rate": 1.0}, 2) is None

    def step(cal: dict, strategy, world: int = 2) -> dict:
        with torch.device("meta"):
            model = small_models.build("gpt")
        batch, loss = small_models.fake_batch("gpt"), small_models.loss_fn("gpt")
        job = CostJob(model, world, 0, batch=batch, loss_fn=loss, global_batch=16)
        return predict_step(job, strategy, cal)

    ddp = DDPConfig()
    fast, slow = step(uncontended, ddp), step(contended, ddp)
    assert slow["sharing"] > fast["sharing"] + 1e-6
    assert slow["compute"] == pytest.approx(fast["compute"])  # (the path: one rank alone)
    pipeline = PPConfig(microbatches=8)
    assert step(contended, pipeline)["total"] == pytest.approx(step(uncontended, pipeline)["total"])
    four = [step(cal, ddp, world=4)["total"] for cal in (uncontended, contended)]
    assert four[0] == pytest.approx(four[1])


def test_the_wait_for_ranks_to_arrive_follows_the_calibrated_bursts():
    # A small collective waited 2, 4, 6 and 10 ms after bursts of 1, 5, 20 and 100 ms: the
    # wait a step adds is the curve at its compute less what a call after the shortest burst
    # (as every call was timed) already holds; past the longest, along the last segment.
    cal = {"arrival_waits": [[0.001, 0.002], [0.005, 0.004], [0.020, 0.006], [0.100, 0.010]]}
    assert arrival_wait(cal, 0.0) == 0.0
    assert arrival_wait(cal, 0.001) == 0.0
    assert arrival_wait(cal, 0.003) == pytest.approx(0.001)
    assert arrival_wait(cal, 0.060) == pytest.approx(0.006)  # halfway from 20 to 100 ms
    assert arrival_wait(cal, 0.200) == pytest.approx(0.013)  # 100 ms more at 4 ms / 80 ms
    flat = {"arrival_waits": [[0.001, 0.002], [0.005, 0.003], [0.020, 0.0025]]}
    assert arrival_wait(flat, 0.5) == pytest.approx(0.0005)  # (never a falling extrapolation)
