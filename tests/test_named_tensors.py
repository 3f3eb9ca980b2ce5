"""Tensors gathered from peers without pickle (`comm/named_tensors.py`): what a full state dict
of a pipeline or a mesh travels in. Every dtype and shape arrives as sent, in order; a header
that lies about its tensors is one error line, and nothing in the package unpickles from peers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.comm.named_tensors import _read, all_gather_named
from spawn import run


def _sent(rank: int) -> list:
    g = torch.Generator().manual_seed(rank)
    return [
        (("w", f"rank{rank}"), torch.randn(3, 5, generator=g)),
        (("b16",), torch.randn(7, generator=g).to(torch.bfloat16)),
        (("mask", "x", "y"), torch.rand(2, 2, generator=g) > 0.5),
        (("step",), torch.tensor(rank * 10, dtype=torch.int64)),
        (("empty",), torch.empty(0, 4)),
    ]


def _gather() -> list:
    rank = torch.distributed.get_rank()
    return all_gather_named(_sent(rank) if rank == 0 else _sent(rank)[:3])


def test_every_rank_receives_every_rank_s_tensors_as_sent():
    for got in run(_gather, 2):
        for rank, part in enumerate(got):
            want = _sent(rank) if rank == 0 else _sent(rank)[:3]
            assert [k for k, _ in part] == [k for k, _ in want]
            for (_, a), (_, b) in zip(part, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _header(entries) -> torch.Tensor:
    return torch.tensor(list(json.dumps(entries).encode()), dtype=torch.uint8)


@pytest.mark.parametrize(
    "entries, body, complaint",
    [
        ([[["a"], "float32", [2]]], 4, "fewer than its header says"),
        ([[["a"], "float32", [1]]], 8, "more than its header says"),
        ([[["a"], "object", [1]]], 4, "malformed tensor header entry"),
        ([[["a"], "float32", [-1]]], 4, "malformed tensor header entry"),
        ([[[1], "float32", [1]]], 4, "malformed tensor header entry"),
        ({"a": 1}, 0, "not a list"),
    ],
)
def test_a_header_that_lies_is_one_error_line(entries, body, complaint):
    with pytest.raises(ValueError, match=re.escape(complaint)):
        _read(_header(entries), torch.zeros(body, dtype=torch.uint8), rank=1)
    with pytest.raises(ValueError, match="malformed tensor header"):
        _read(torch.tensor(list(b"\xff{"), dtype=torch.uint8), torch.zeros(0), rank=1)


def test_no_module_unpickles_what_a_peer_sends():
    source = Path(shardwise.__file__).parent
    calls = re.compile(r"_object\(|object_list\(|pickle\.loads?\(|torch\.load\(")
    found = [
        f"{path.relative_to(source)}:{n}"
        for path in source.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if calls.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, found
