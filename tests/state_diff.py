"""The equivalence tests' measure: how far one state dict is from another."""

from __future__ import annotations

import torch


def max_abs_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over every tensor of two state dicts with the same keys
    (compared in fp32, so that a bf16 state meets its fp32 reference)."""
    assert got.keys() == expected.keys(), set(got) ^ set(expected)
    diffs = torch.stack([(got[k].float() - expected[k].float()).abs().max() for k in got])
    return diffs.max().item()  # (a NaN anywhere is the answer: Python's max would drop it)
