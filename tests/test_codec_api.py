"""One codec API beyond DDP: ZeRO's reduce-scatter and the parameter server's pushes and pulls.

ZeRO (one spawn, several codecs): the gradient slice a rank receives after one backward is
checked against what the ranks' own gradients, computed apart by plain torch on the same batches
and exchanged by plain `torch.distributed`, say it must be: within fp16/bf16 rounding of the
exact mean for the cast codecs; for int8 and top-k, exactly the sum of the decoded encodings of
every rank's chunk (each encoded by a codec in the state the strategy's was in); and the bytes
the accounting counted equal the encodings' sizes. (Exact resume with codec state:
tests/test_state.py's table.)

Parameter server: a compressed async job's parameters after its steps are those a
single-process replay of the same pushes gives; a worker whose HELLO names another codec, and a
compressed PUSH with an index out of range, are refused in one line, and the server serves on.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from ps_batches import global_batch, mlp
from shardwise.comm.compressed_collectives import codec_fingerprint, make_codec
from shardwise.comm.compression import to_bytes
from shardwise.comm.flat import unflatten
from shardwise.nn.models import MLP
from shardwise.ps import protocol
from shardwise.ps.protocol import Kind
from shardwise.ps.sharding import flat_values
from spawn import run

WORLD = 2
BATCH = 4


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(BATCH, 13, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _local_full_grads(model: torch.nn.Module, params_order: list[str], padded: int):
    """Every rank's flat gradient (this unit's order, padded, divided by the world as ZeRO
    weighs it), by plain torch: a copy of the model, backward on each rank's batch, gathered."""
    replica = copy.deepcopy(model)
    x, y = _batch(dist.get_rank())
    F.cross_entropy(replica(x), y).backward()
    grads = dict(replica.named_parameters())
    mine = torch.zeros(padded)
    flat = torch.cat([grads[n].grad.reshape(-1) for n in params_order])
    mine[: flat.numel()] = flat / dist.get_world_size()
    everyone = [torch.empty(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return everyone


def zero_codecs() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP([13, 32, 5])
    out = {}
    for spec in ("fp16", "bf16", "int8", "topk:0.25"):
        zero, _ = sw.prepare(copy.deepcopy(model), sw.ZeRO(stage=2, compression=spec), lr=1e-2)
        (unit,) = zero.units  # 25 MiB units: one
        unit_names = [zero.names[p] for p in unit.params]  # (the unit's layout)
        fulls = _local_full_grads(model, unit_names, unit.full.numel())
        before = copy.deepcopy(zero.codec.state_dict())
        x, y = _batch(rank)
        sw.comm.stats.end_step()
        F.cross_entropy(zero(x), y).backward()
        counted = {op: t.bytes for op, t in sw.comm.stats.end_step().by_op.items() if t.bytes}
        received = zero.shards[0].grad.detach().clone()
        chunk = unit.shard_numel
        mine = [f.view(n, chunk)[rank] for f in fulls]
        result = {"counted": counted, "chunk": chunk}
        if spec in ("fp16", "bf16"):
            exact = sum(m.double() for m in mine)
            scale = sum(m.double().abs() for m in mine)
            result["rounding"] = ((received.double() - exact).abs() / (scale + 1e-30)).max().item()
        else:
            # The definition: every rank r encoded its chunk for this rank with a codec in the
            # state the strategy's was in; this rank decodes each and sums them, in rank order.
            expected = 0
            for full in fulls:
                codec = make_codec(spec)
                codec.load_state_dict(before)
                encoded = codec.encode_chunks(full, key=0, chunks=n)[rank]
                expected = expected + codec.decode(encoded, chunk)
            result["definition_diff"] = (received - expected).abs().max().item()
            result["nonzero"] = int((received != 0).sum())
        out[spec] = result
        zero.close()
    return out


def test_zero_reduce_scatter_through_each_codec():
    for rank, results in enumerate(run(zero_codecs, WORLD)):
        for spec, r in results.items():
            chunk = r["chunk"]
            if spec == "fp16":  # each value cast once (2^-11 relative), the sum once more
                assert r["rounding"] <= 2 * 2**-11 + 1e-6, (rank, r)
                assert r["counted"] == {"reduce_scatter": chunk * 2}  # (n-1)/n of 2n*chunk
            elif spec == "bf16":
                assert r["rounding"] <= 2 * 2**-8, (rank, r)
                assert r["counted"] == {"reduce_scatter": chunk * 2}
            elif spec == "int8":  # chunk int8 codes + one fp32 scale go to the other rank
                assert r["definition_diff"] == 0.0, (rank, r)
                assert r["counted"] == {"all_to_all": chunk + 4}
            else:  # top-k: k fp32 values + k int32 indices, k of each rank's chunk
                k = int(chunk * 0.25)
                assert r["definition_diff"] == 0.0, (rank, r)
                assert 0 < r["nonzero"] <= 2 * k  # at most the union of both ranks' picks
                assert r["counted"] == {"all_to_all": k * 8}


def test_zero_compression_is_checked_before_anything_runs():
    with pytest.raises(ValueError, match="compression must be"):
        sw.ZeRO(stage=2, compression="zip")
    with pytest.raises(ValueError, match="use 'bf16'"):
        sw.ZeRO(stage=2, compression="topk:0.1", mixed_precision="fp16")
    with pytest.raises(ValueError, match="ps compression must be"):
        sw.ParameterServer(compression="powersgd:4")
    with pytest.raises(ValueError, match="rule 'gradient' and no relays"):
        sw.ParameterServer(compression="int8", rule="average")


PS_STEPS = 6
PUSH, PULL = "topk:0.3", "int8"  # error feedback on the worker; a mirror on the server


def ps_with_a_codec():
    """Server 0 (sync), an honest worker (rank 1) and a client (rank 2) that sends a compressed
    PUSH with an index out of range, reads the answer, then says DONE."""
    strategy = sw.ParameterServer(mode="sync", compression=PUSH, pull_compression=PULL)
    rank = dist.get_rank()
    if rank == 0:
        return {"final": sw.ps.serve(mlp(), strategy, torch.optim.AdamW, lr=1e-2).final}
    model, opt = sw.prepare(mlp(), strategy, optimizer=torch.optim.AdamW, lr=1e-2)
    client = model.client  # (HELLO with the codecs' fingerprint and a first pull: done)
    if rank == 2:
        refusal = _malformed_push(client)
        strategy.close(model)  # DONE: the sync rounds go on without it
        return {"refusal": refusal}
    while client.clock < PS_STEPS:
        x, y = global_batch(client.clock, 1)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    held = flat_values(client.params).clone()
    strategy.close(model)
    return {"held": held, "traffic": protocol.traffic.snapshot()}


def _malformed_push(client) -> str:
    """A compressed PUSH, right in all but one index, out of range; the server's answer."""
    numel = sum(p.numel() for p in client.params)
    codec = make_codec(PUSH)
    values, indices = codec.encode(torch.randn(numel))
    indices[0] = numel + 7  # decoding it would write past the gradient
    payload = to_bytes([values, indices])
    ints = (client.clock, client.version, 0, codec_fingerprint(PUSH))
    protocol.send(0, Kind.PUSH, *ints, payload=payload, group=client.group)
    h, text = protocol.recv(0, group=client.group)
    assert Kind(int(h[0])) == Kind.ERROR
    return protocol.unpack(text)


def _replay(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The job by definition, in one process: the worker's gradient at the parameters it
    holds, encoded with error feedback and decoded; an AdamW step on it; the difference from
    the worker's copy encoded and decoded into that copy. (The server's parameters, the copy.)"""
    model = mlp()
    params = list(model.parameters())
    server = torch.nn.Parameter(flat_values(params).clone())
    opt = torch.optim.AdamW([server], lr=1e-2)
    push, pull = make_codec(PUSH), make_codec(PULL)
    held = server.detach().clone()
    for step in range(steps):
        with torch.no_grad():
            for p, value in zip(params, unflatten(held, params), strict=True):
                p.copy_(value)
        x, y = global_batch(step, 1)
        F.cross_entropy(model(x), y).backward()
        grad = flat_values([p.grad for p in params])
        model.zero_grad()
        (encoded,) = push.encode_chunks(grad, key=0)
        server.grad = push.decode(encoded, grad.numel())
        opt.step()
        held += pull.decode(pull.encode(server.detach() - held), held.numel())
    return server.detach(), held


def test_a_compressed_ps_job_is_its_definition_and_a_bad_push_is_refused_in_one_line():
    server, worker, raw = run(ps_with_a_codec, 3)
    expected_server, expected_held = _replay(PS_STEPS)
    assert torch.equal(server["final"], expected_server)
    assert torch.equal(worker["held"], expected_held)
    # What went on the wire, by the formats: a header (8 int64) per message; a compressed PUSH
    # carries k fp32 values + k int32 indices and one mark byte; an int8 pull numel codes, a
    # scale and the mark; the first pull numel fp32 values and a mark value.
    numel = expected_server.numel()
    k = int(numel * 0.3)
    pushes = worker["traffic"][("sent", 0, "PUSH")]
    assert pushes == (PS_STEPS, PS_STEPS * (64 + 8 * k + 1))
    oks = worker["traffic"][("received", 0, "OK")]  # the HELLO's, the first pull's, the rest
    assert oks == (PS_STEPS + 2, 64 * (PS_STEPS + 2) + 4 * (numel + 1) + PS_STEPS * (numel + 5))
    text = raw["refusal"]
    assert "\n" not in text and f"topk indices out of [0, {numel})" in text, text
