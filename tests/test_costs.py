"""The cost model against measurement: for each strategy at world size 4 on the tiny GPT, and at
world size 2 on the MLP (the GPT for tensor and pipeline parallelism), the predicted model-state
bytes per rank are within 2% of what `memory_report` measures on the real model after backward
(parameters, master weights, gradients, optimizer state, each), the activations within 10% of
the ActivationMeter's, the peak within 10% of the most bytes of tensors alive at once over the
last two steps (a `PeakMeter` on the real run: every tensor the process holds, and every
operator's outputs while they live, less what was alive before the model was built), and the
predicted bytes and calls per step of each collective equal what the ranks' comm counters
recorded over the steps they trained (and, for pipelines, the sends and receives a stage posts,
which the step-time model prices)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os

import pytest
import torch

import shardwise as sw
import small_models
from shardwise import comm
from shardwise.comm.compressed_collectives import make_codec
from shardwise.comm.compression import wire_nbytes
from shardwise.config import SECTIONS
from shardwise.distributed.mesh import coordinates
from shardwise.nn.recompute import checkpoint_activations
from shardwise.observe.memory import ActivationMeter, PeakMeter, live_bytes
from shardwise.plan.cost_models.pipeline_costs import posts_per_step
from shardwise.plan.costs import CostJob, bucket_sizes
from shardwise.plan.predictors import predict
from spawn import run

pytestmark = pytest.mark.alone  # (the peak meter races gloo's own thread, which frees buffers late)

# Bytes are counted from the second step: the first also agrees on DDP's bucket order (one
# broadcast, once), which a step's prediction leaves out. The STEPS - 1 counted are a multiple
# of local SGD's period: its average happens inside the window.
STEPS = 5
BATCH = 8
CATEGORIES = ("params", "master_weights", "grads", "optimizer")
STRATEGIES = [
    {"name": "ddp"},
    {"name": "ddp", "bucket_mb": 0.01},
    {"name": "ddp", "algorithm": "ring", "bucket_mb": 0.01},
    {"name": "zero", "stage": 1},
    {"name": "zero", "stage": 2, "bucket_mb": 0.01},
    {"name": "zero", "stage": 3},
    # (every unit gathered again for backward, recomputing; the default keeps these whole)
    {"name": "zero", "stage": 3, "activation_checkpointing": True, "keep_gathered_mb": 0},
    {"name": "zero", "stage": 1, "mixed_precision": "bf16"},
    {"name": "zero", "stage": 2, "mixed_precision": "bf16", "bucket_mb": 0.01},
    {"name": "zero", "stage": 3, "mixed_precision": "bf16"},
    {"name": "local_sgd", "period": 2},
]
# Codecs, other all-reduces, relaxed and model-parallel strategies: on the tiny GPT only (the
# MLP has no tensor-parallel plan, and 3 linear layers do not make 4 pipeline stages).
GPT_ONLY = [
    {"name": "ddp", "compression": "fp16", "bucket_mb": 0.02},
    {"name": "ddp", "compression": "int8", "bucket_mb": 0.02},
    {"name": "ddp", "compression": "topk:0.1"},
    {"name": "ddp", "compression": "sign", "bucket_mb": 0.02},
    {"name": "ddp", "compression": "powersgd:2", "bucket_mb": 0.02},
    {"name": "ddp", "algorithm": "hierarchical", "group_size": 2, "bucket_mb": 0.02},
    {"name": "gossip", "topology": "ring"},
    {"name": "gossip", "topology": "exponential", "global_every": 2},
    {"name": "adaptive", "threshold": 1e9},
    {"name": "tp"},
    {"name": "tp", "activation_checkpointing": True},
    {"name": "pp", "schedule": "gpipe", "microbatches": 4},
    {"name": "pp", "schedule": "1f1b", "microbatches": 2},
    {"name": "pp", "schedule": "1f1b", "microbatches": 2, "activation_checkpointing": True},
    {"name": "pp", "schedule": "zb-h1", "microbatches": 4},
    {"name": "zero", "stage": 2, "compression": "int8", "bucket_mb": 0.02},
    {"name": "zero", "stage": 3, "accumulate": 2},  # (train.accumulate: not the section's)
    {"name": "zero", "stage": 3, "keep_gathered_mb": 0.06},  # (the last block, norm and head kept)
    {"name": "tp", "accumulate": 2},
]
CAST_OR_POWERSGD = ("fp16", "bf16", "powersgd")  # (all-reduces in place: nothing gathered)
WORLD_2 = [{"name": "pp", "schedule": "interleaved", "microbatches": 4}]  # (4 layers: 2 x 2)
MESH = [  # world 4 only
    {"name": "mesh", "dp": 2, "tp": 2, "activation_checkpointing": True},
    {"name": "mesh", "dp": 2, "pp": 2, "microbatches": 2},
    {"name": "mesh", "dp": 2, "tp": 2, "data": "zero3"},
    {"name": "mesh", "dp": 2, "pp": 2, "microbatches": 2, "data": "zero3"},
    {"name": "mesh", "dp": 2, "pp": 2, "microbatches": 4, "schedule": "interleaved"},
    {"name": "mesh", "dp": 2, "pp": 2, "microbatches": 2, "schedule": "zb-h1", "data": "zero1"},
]


def _section(options: dict):
    by_name = {s.model_fields["name"].default: s for s in SECTIONS}
    own = {k: v for k, v in options.items() if k != "accumulate"}
    return by_name[options["name"]].model_validate(own)


def _batch(name: str, step: int, index: int, share: int):
    g = torch.Generator().manual_seed(step)
    if name == "mlp":
        x, y = torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    else:
        tokens = torch.randint(0, 11, (BATCH, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    mine = slice(index * share, (index + 1) * share)
    return x[mine].clone(), y[mine].clone()  # a batch of its own, as the loader gives


@functools.cache
def _built_on_meta(name: str, recompute: bool = False) -> torch.nn.Module:
    """Model `name` on the meta device, with its blocks recomputed or not: one for every case
    that asks, as the planner prices every strategy on one model (`config_plan.MetaJob`), and
    with it the traces they share (`TRACES`)."""
    with torch.device("meta"):
        model = small_models.build(name)
    checkpoint_activations(model, recompute)
    return model


TRACES: dict = {}  # (`CostJob.traces`: the models' traces that cases priced on them share)


def _measure(model_name: str, options: dict, tmp: str) -> tuple[dict, dict, dict]:
    """(measured memory, measured bytes per step by op, predicted costs) on this rank."""
    section = _section(options)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    accumulate = options.get("accumulate", 1)
    loss_fn = small_models.loss_fn(model_name)
    job = CostJob(
        _built_on_meta(model_name, section.activation_checkpointing),
        world,
        rank,
        batch=small_models.fake_batch(model_name),
        loss_fn=loss_fn,
        global_batch=BATCH,
        accumulate=accumulate,
        traces=TRACES,
    )
    predicted = predict(job, section).as_dict()
    before = live_bytes()  # what earlier cases left (torch's caches: it lasts)
    model = small_models.build(model_name)
    checkpoint_activations(model, section.activation_checkpointing)
    model, opt = sw.prepare(model, section.build(world, tmp), lr=1e-3)
    replicas, index = sw.data_shard(model)
    comm.stats.reset()
    peaks = []
    # ZeRO's steps are alike from the second on (the optimizer state exists), but gloo frees
    # its reduce-scatter's buffers on its own thread, at times after the step has gone on: the
    # lowest is the program's own (of three where 4 ranks share 2 cores: there it happened in
    # two steps running). A local SGD or gossip period is two steps, whose peak is the higher.
    shared_cores = world > (os.cpu_count() or 1)
    metered = STEPS - (3 if options["name"] == "zero" and shared_cores else 2)
    for step in range(STEPS):
        x, y = _batch(model_name, step, index, BATCH // replicas)
        meter = ActivationMeter()
        with PeakMeter() if step >= metered else contextlib.nullcontext() as peak:
            with meter:
                sw.train_step(model, x, y, loss_fn, total=BATCH, accumulate=accumulate)
            if step == STEPS - 1:
                memory = {**sw.memory_report(model, opt), "activations": meter.peak}
            opt.step()
            opt.zero_grad()
        if peak is not None:
            peaks.append(peak.peak - before)
        if step == 0:
            comm.stats.reset()
    memory["peak"] = min(peaks) if options["name"] == "zero" else max(peaks)
    # Ops that record only waiting (a codec's or the hierarchical algorithm's thread) or
    # receiving (recv: a point-to-point message is counted by its sender) carry no bytes.
    totals = comm.stats.total().by_op
    measured = {op: t.bytes / (STEPS - 1) for op, t in totals.items() if t.bytes}
    calls = {op: t.calls / (STEPS - 1) for op, t in totals.items() if t.bytes}
    # Sends and receives each (a receive is counted with no bytes): what a stage posts.
    calls["posts"] = sum(totals[op].calls for op in ("send", "recv") if op in totals) / (STEPS - 1)
    model.close()
    return memory, (measured, calls), predicted


def _all(tmp: str) -> list:
    # Every case at world 4, where no formula's factor of the world is 1 (a ring all-reduce
    # sends 2(w-1)/w of its buffer: all of it at 2) and the GPT's layers are what 4 ranks'
    # shards and buckets cut differently. At world 2 the MLP's cases (where each rank has a
    # core of its own, and two ranks' shards and buckets cut another model), and the GPT's
    # tensor and pipeline parallel ones (a 2-way split, 2 stages: first and last adjacent).
    if torch.distributed.get_world_size() == 4:
        cases = [("gpt", o) for o in STRATEGIES + GPT_ONLY + MESH]
    else:
        split = [o for o in GPT_ONLY if o["name"] in ("tp", "pp")]
        cases = [("mlp", o) for o in STRATEGIES] + [("gpt", o) for o in split + WORLD_2]
    # The meters find the tensors alive through the garbage collector, three times a case: a
    # full pass over the 180,000 objects torch's import made took 60% of the test's time.
    # Frozen, they are out of its passes (a tensor among them is counted neither before the
    # model is built nor at the peak: the difference is the same).
    gc.collect()
    gc.freeze()
    return [(name, options, _measure(name, options, tmp)) for name, options in cases]


def _peak_unmodelled(options: dict) -> bool:
    """ZeRO-2/3 on a mesh's data axis, and ZeRO-3 under accumulation, predict no peak: their
    units' buffers are not emulated there (the shifted bounds were 12-31% low)."""
    mesh_zero = options.get("data") in ("zero2", "zero3")
    return mesh_zero or (options.get("stage") == 3 and options.get("accumulate", 1) > 1)


def _gloo_late_free(options: dict, predicted: dict, world: int) -> int:
    """Bytes gloo's own thread may still hold when the meter looks: it lets go of a collective's
    buffers on its own time, after the caller's wait has returned (a tensor it holds keeps its
    Python object, which the meter's scan finds). Four places it was seen in CI runs:
    ZeRO 1-2 with fp32 masters copy a reduced slice to fp32 as the backend frees the buffer it
    reduced (+52,244 B once: the fp32 slice); without masters, gloo's own copy of the flat
    gradients it reduce-scattered (+104,320 B once, ZeRO-1 on the MLP at world 2, a loaded
    machine: the gradients' bytes); a DDP wire codec's gather of every rank's message
    (`Codec.reduce`, on the codec's thread) still alive as the next step's meter starts (+83,680 B
    once, topk:0.1 at world 4: the gathered buffer); local SGD's flat copy of the parameters
    it averaged (+104,488 B once, period 2 on the MLP at world 2: the parameters' bytes). Up to
    one such buffer more is the race."""
    if options.get("name") == "local_sgd":
        return predicted["memory"]["params"]
    if options.get("name") == "zero" and options.get("stage") in (1, 2):
        masters = options.get("mixed_precision") or options.get("offload")
        return predicted["memory"]["master_weights" if masters else "params"]
    codec = options.get("compression")
    if options.get("name") != "ddp" or codec is None or codec.split(":")[0] in CAST_OR_POWERSGD:
        return 0
    held = [p.numel() for p in _built_on_meta("gpt").parameters()][::-1]
    largest = max(bucket_sizes(held, 4, options.get("bucket_mb")))
    return world * wire_nbytes(make_codec(codec).layout(largest))


@pytest.mark.parametrize("world", [2, 4])
def test_predicted_memory_and_bytes_match_the_measured(world, tmp_path):
    failures = []
    for rank, results in enumerate(run(_all, world, str(tmp_path), timeout_s=300)):
        for model_name, options, (memory, measured, predicted) in results:
            where = f"rank {rank}, {model_name}, {options}"
            for category in CATEGORIES:
                want, got = predicted["memory"][category], memory[category]
                if abs(want - got) > 0.02 * max(got, 1):
                    failures.append(f"{where}: {category} predicted {want}, measured {got}")
            for what in ("activations", "peak"):
                want, got = predicted[what], memory[what]
                if want is None and what == "peak" and _peak_unmodelled(options):
                    continue
                late = _gloo_late_free(options, predicted, world) if what == "peak" else 0
                if late and want is not None and -0.1 * got <= got - want <= late + 0.1 * got:
                    continue
                if want is None or abs(want - got) > 0.1 * got:
                    failures.append(f"{where}: {what} predicted {want}, measured {got}")
            measured, calls = measured
            if predicted["comm"] != measured:
                failures.append(f"{where}: bytes predicted {predicted['comm']}, got {measured}")
            posts = calls.pop("posts")
            if predicted["calls"] != calls:
                failures.append(f"{where}: calls predicted {predicted['calls']}, got {calls}")
            one_chunk = options.get("schedule", "1f1b") in ("gpipe", "1f1b")
            if one_chunk and ("pp" in options or options["name"] == "pp"):  # priced posts
                sizes = {"dp": options.get("dp", 1), "tp": 1, "pp": options.get("pp", world)}
                stage = coordinates(rank, sizes)["pp"]
                want = posts_per_step(stage, sizes["pp"], options["microbatches"])
                if posts != want:
                    failures.append(f"{where}: {want} point-to-point posts priced, {posts} made")
    assert not failures, "\n".join(failures)
