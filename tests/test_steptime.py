"""The step-time model's pieces against their definitions: the pipeline's critical path against
the bubble formula of the GPipe paper, and a call's price against the calibration's timings."""

import pytest

from shardwise.steptime import call_seconds, pipeline_finish
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
