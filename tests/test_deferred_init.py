"""A model built on the meta device and initialised shard by shard (`sw.SeededInit`) gets
bitwise the parameters the same seed gives the whole model built on one process: under ZeRO-3
at world 1, 2 and 4 (each rank computing only the parameters its slices touch), tensor and
pipeline parallel at world 1 and 2 (each rank reading its own slices and layers; world 4 is in
test_meta_init); the replay holds one parameter at a time."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

import hf_models as H
import shardwise as sw
from shardwise.nn.models import TinyGPT
from spawn import run

SEED = 5


def sequential() -> nn.Module:
    """Odd sizes, and an embedding whose padding row the constructor zeroes through a view."""
    return nn.Sequential(
        nn.Embedding(11, 7, padding_idx=3), nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5)
    )


def tiny_gpt() -> nn.Module:
    return TinyGPT(37, seq_len=8, d_model=16, n_layer=2, n_head=2)


def hf(kind: str):
    return lambda: H.model_class(kind)(H.config(kind))


BUILDS = {"tiny_gpt": tiny_gpt, "sequential": sequential, "gpt2": hf("gpt2"), "llama": hf("llama")}


class Counting:
    """The source, counting the elements each rank asks it for."""

    def __init__(self, source) -> None:
        self.source, self.elements = source, 0

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def read(self, name: str) -> torch.Tensor:
        value = self.source.read(name)
        self.elements += value.numel()
        return value

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        self.elements += stop - start
        return self.source.read_flat(name, start, stop)


def _bitwise(strategy, build) -> dict:
    torch.manual_seed(SEED)
    expected = build().state_dict()
    init = sw.SeededInit(build, SEED)
    meta = all(p.is_meta for p in init.model.parameters())
    source = Counting(init)
    model, _ = sw.prepare(init.model, strategy, lr=1e-3, source=source)
    got = sw.full_state_dict(model)
    model.close()
    equal = got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    params = {p.data_ptr(): p for p in build().parameters()}.values()
    return {
        "meta": meta,
        "equal": equal,
        "read": source.elements,
        "numel": sum(p.numel() for p in params),
        "peak": init.peak_scratch_bytes,
        "largest": max(p.numel() * p.element_size() for p in params),
    }


def bitwise_everywhere() -> dict:
    out = {f"zero3/{k}": _bitwise(sw.ZeRO(stage=3), b) for k, b in BUILDS.items()}
    world = dist.get_world_size()
    if world <= 2:  # (world 4: tests/test_meta_init.py, on models with 4 heads and 8 layers)
        out["tp/tiny_gpt"] = _bitwise(sw.TensorParallel(), tiny_gpt)
        out["pp/sequential"] = _bitwise(sw.Pipeline(stages=world), sequential)
    return out


def test_seeded_meta_init_is_bitwise_the_single_process_model_under_every_sharding():
    for world in (1, 2, 4):
        for rank, result in enumerate(run(bitwise_everywhere, world)):
            for case, r in result.items():
                assert r["meta"] and r["equal"], (world, rank, case, r)
                # The replay holds one parameter's scratch at a time (measured on its buffers).
                assert r["peak"] <= r["largest"], (world, rank, case, r)
                if case.startswith("zero3") and world == 4:  # a quarter, plus unit boundaries
                    assert r["read"] < 0.5 * r["numel"], (case, r)
        assert len(result) == (6 if world <= 2 else 4)


def test_the_generator_ends_as_the_real_construction_leaves_it_and_reads_are_checked():
    torch.manual_seed(SEED)
    sequential()
    after = torch.get_rng_state()
    init = sw.SeededInit(sequential, SEED)
    assert torch.equal(torch.get_rng_state(), after)  # later draws match the one-process run
    # Any order, any parameter alone: the padding row is zero, the rest as built.
    torch.manual_seed(SEED)
    expected = sequential().state_dict()
    for name in reversed(list(expected)):
        assert torch.equal(init.read(name), expected[name]), name
    assert torch.equal(init.read_flat("0.weight", 20, 28), expected["0.weight"].flatten()[20:28])
    assert not init.read("0.weight")[3].any()
    try:
        init.read("0.bias")
        raise AssertionError("no error")
    except ValueError as e:
        assert str(e) == "the seeded model has no parameter '0.bias'"


_MEASURE_RSS = """
import torch, shardwise as sw
from torch import nn

def rss(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

def build():
    return nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(4)))

init = sw.SeededInit(build, 0)
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here
base = rss("VmRSS")
for name in init.model.state_dict():
    init.read_flat(name, 0, 10)
replay = rss("VmHWM") - base
torch.manual_seed(0)
model = build()
print(replay, rss("VmHWM") - base)
"""


def test_the_replay_holds_one_parameter_at_a_time_by_the_process_own_peak_memory():
    """The kernel's peak resident memory of a process reading each parameter's slice, as a
    ZeRO-3 rank does. glibc returns every allocation over 64 KiB to the kernel when freed
    (MALLOC_MMAP_THRESHOLD_), so resident memory is what is alive."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE_RSS], env=env, capture_output=True, text=True, check=True
    )
    replay, whole = map(int, out.stdout.split())
    largest, total = 2048 * 2048 * 4, 4 * 2048 * 2049 * 4
    assert whole >= total  # the measure sees a normal build's parameters
    # One 16 MiB weight (not two, not the 64 MiB model), plus the ~2 MiB the interpreter
    # allocates on first use of these code paths.
    assert replay < largest + 4 * 2**20, (replay, largest)


class _Initialised(nn.Module):
    """torch's initialisers that skip meta tensors (sparse_ indexes with Python ints), and
    parameters copied from slices."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 4), nn.Linear(4, 4), nn.Linear(5, 5)
        nn.init.orthogonal_(self.a.weight)
        nn.init.trunc_normal_(self.b.weight, std=0.02)
        nn.init.sparse_(self.c.weight, sparsity=0.4)
        self.conv = nn.Conv2d(3, 3, 3)
        nn.init.dirac_(self.conv.weight)
        self.d = nn.Linear(3, 3)  # (its draws come after theirs)
        self.sliced = nn.Parameter(torch.randn(10)[5:8])
        self.columns = nn.Parameter(torch.randn(2, 6)[:, 3:])


def test_initialisers_that_skip_meta_tensors_and_sliced_parameters_are_bitwise():
    # Before: orthogonal_, trunc_normal_ and sparse_ did nothing on the meta device (every
    # later draw off, a ViT's weights among them), and a parameter copied from a slice read
    # the slice's storage from its start.
    for build in (_Initialised, lambda: H.build("vit")):
        torch.manual_seed(SEED)
        expected = build().state_dict()
        init = sw.SeededInit(build, SEED)
        for name, _ in init.model.named_parameters():
            assert torch.equal(init.read(name), expected[name]), name
