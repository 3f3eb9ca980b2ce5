"""ZeRO's flat units: each parameter's slot in a unit-sized buffer, made once for a buffer kept
as long as the unit (`keep_slots`) or sliced each time for any other, is its place there."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.strategies.zero.units import FlatUnit


def test_a_parameters_slot_is_its_place_in_the_buffer_kept_or_not():
    torch.manual_seed(0)
    params = [
        nn.Parameter(torch.randn(3, 5)),
        nn.Parameter(torch.randn(7)),
        nn.Parameter(torch.randn(2, 2)),
    ]
    unit = FlatUnit(params, rank=1, world_size=2, dtype=torch.float32, group=None, all_gather=None)
    kept, other = torch.zeros_like(unit.full), torch.zeros_like(unit.full)
    unit.keep_slots(kept)
    start = 0
    for i, p in enumerate(params):  # (laid end to end, in order: 15, 7 and 4 elements)
        for buffer in (kept, other):
            slot = unit.slot(buffer, p)
            assert slot.shape == p.shape
            slot.copy_(torch.full(p.shape, float(i + 1)))
            assert torch.equal(buffer[start : start + p.numel()], torch.full((p.numel(),), i + 1.0))
        start += p.numel()
    assert torch.equal(kept, other) and kept[start:].eq(0).all()  # (the padding untouched)
    # The kept buffer's slots are made once and handed out as they are; any other's are sliced
    # anew each time.
    assert unit.slot(kept, params[1]) is unit.slot(kept, params[1])
    assert unit.slot(other, params[1]) is not unit.slot(other, params[1])
