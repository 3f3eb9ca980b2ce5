"""The benchmarks' report: each repetition's ratios, with the median a bound is read against."""

from __future__ import annotations

from shardwise.bench.ratio_report import by_rep_lines


def test_each_figure_by_repetition_is_listed_with_its_median():
    results = [
        {
            "model": "gpt",
            "ratio_ours_over_torch_by_rep": [0.943, 0.972, 0.946, 0.941, 0.945],
            "ours": {"over_floor_unoverlapped_by_rep": [1.02, 0.98], "step_time_s": 0.3},
            "ratio_ours_over_torch": 0.953,  # (not a list by repetition: not listed)
        }
    ]
    assert by_rep_lines(results) == [
        # (sorted: 0.941 0.943 0.945 0.946 0.972: the middle one)
        "gpt: ratio_ours_over_torch: 0.943 0.972 0.946 0.941 0.945 (median 0.945)",
        # (an even count: the mean of the middle two)
        "gpt: ours over_floor_unoverlapped: 1.020 0.980 (median 1.000)",
    ]
