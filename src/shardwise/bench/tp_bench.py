"""Benchmark: tensor parallel's memory and communication, measured against the Megatron formula.

On the tiny GPT, with the model split over all ranks (T = world size): parameter bytes per rank
(the split layers hold 1/T each, layer norms, position embeddings and row-parallel biases are
replicated), all-reduce bytes and calls per training step from our accounting next to what a
Megatron-style block must send, and step time beside single-process training of the same batch
and beside torch's own tensor parallel (`torch.distributed.tensor.parallel`, DTensor) on the same
plan; and its floors (`floor.py`): the compute alone (the same split step with its collectives
skipped) and the compute plus its all-reduces replayed bare. Tensor parallel's all-reduces sit
on the critical path (each layer's output waits for its sum), so its step is bounded by the
unoverlapped floor. All variants run in the same interleaved rounds.

The formula, per step with B*S tokens of width d, L blocks and all-reduces of fp32 activations:
forward: the embedding's g, and g after attention and after the MLP in every block (1 + 2L);
backward: f before q/k/v and before fc1 in every block, and before the head (2L + 1); the
vocabulary-parallel loss adds three all-reduces of one float per token (max, sum of
exponentials, target logit). Each all-reduce of n bytes sends 2(T-1)/T * n per rank.

Run: shardwise bench tp --world-size 2
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from torch import nn

import shardwise as sw
from shardwise import comm
from shardwise.bench.common import (
    emit,
    gpt_batch,
    gpt_model,
    interleaved_times,
    medians,
    train_step,
)
from shardwise.bench.floor import bare_collectives, by_rep, calls_of, floor_figures
from shardwise.comm import parallel_ops
from shardwise.comm.accounting import native_volume
from shardwise.nn.models import TinyGPT, lm_loss


def expected_tp_bytes(model: TinyGPT, batch: int, seq: int, parts: int) -> dict[str, int]:
    """All-reduce calls and bytes one rank sends in one training step (forward + backward)."""
    d, layers = model.tok_emb.embedding_dim, len(model.blocks)
    activation = batch * seq * d * 4
    per_token = batch * seq * 4
    calls = [activation] * ((1 + 2 * layers) + (2 * layers + 1)) + [per_token] * 3
    return {
        "all_reduce_calls": len(calls),
        "all_reduce_bytes": sum(native_volume("all_reduce", n, parts) for n in calls),
    }


def expected_param_bytes(model: nn.Module, parts: int, rank: int) -> int:
    """Bytes of parameters on `rank`: split layers' share (uneven vocabularies: the first
    ranks hold one row more) plus everything replicated."""
    from fnmatch import fnmatchcase

    from shardwise.comm.flat import split_bounds

    total = 0
    plan = {k: v for k, v in model.TP_PLAN.items() if v != "heads"}
    for mname, module in model.named_modules():
        style = next((s for p, s in plan.items() if fnmatchcase(mname, p)), None)
        for pname, p in module.named_parameters(recurse=False):
            if style is None or (style == "rowwise" and pname == "bias"):
                total += p.numel() * 4
                continue
            dim = 1 if style == "rowwise" else 0
            chunks = int(style.partition(":")[2] or 1)
            start, end = split_bounds(p.shape[dim] // chunks, parts)[rank]
            total += p.numel() // p.shape[dim] * (end - start) * chunks * 4
    return total


_model, _batch = gpt_model, gpt_batch


@contextlib.contextmanager
def no_messages() -> Iterator[None]:
    """Tensor parallel's collectives skipped: each rank computes its slices of the layers
    alone, the compute of a step with no communication (its values are partial sums: timed,
    never trained on)."""
    real = parallel_ops.all_reduce
    parallel_ops.all_reduce = lambda *args, **kwargs: comm.Handle("all_reduce", None, None)
    try:
        yield
    finally:
        parallel_ops.all_reduce = real


def torch_tp(model: TinyGPT, parts: int):
    """The same split with torch's DTensor tensor parallel (its own rival implementation)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (parts,))
    plan = {}
    for i, block in enumerate(model.blocks):
        block.attn.n_head //= parts
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(),
            f"blocks.{i}.mlp.0": ColwiseParallel(),
            f"blocks.{i}.mlp.2": RowwiseParallel(),
        }
    # torch's colwise qkv splits the fused [q; k; v] rows contiguously, not head by head: the
    # arithmetic cost is the same, which is what this rival is timed for (not its numbers).
    return parallelize_module(model, mesh, plan)


def time_variants(model, opt, x, y, parts: int, steps: int, reps: int) -> dict:
    """Seconds per step by repetition, in the same interleaved rounds: ours, its two floors
    (`floor.py`: the compute alone, and its all-reduces replayed bare), torch's tensor parallel
    (where it runs here), single-process training."""

    def ours_step() -> None:
        sw.train_step(model, x, y, lm_loss)
        opt.step()
        opt.zero_grad()

    def compute_step() -> None:
        with no_messages():
            ours_step()

    if calls_of(compute_step):
        raise RuntimeError("the compute floor still communicates: a collective is not skipped")
    single = _model()
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4)
    variants = {
        "ours_tp": ours_step,
        "compute": compute_step,
        "bytes:ours_tp": bare_collectives(calls_of(ours_step)),
        "single_process": train_step(single, single_opt, (x, y), lm_loss),
    }
    errors = {}
    try:
        rival = torch_tp(_model(), parts)
        rival_opt = torch.optim.AdamW(rival.parameters(), lr=1e-4)
        variants["torch_tp"] = train_step(rival, rival_opt, (x, y), lm_loss)
    except Exception as e:  # report, do not hide, a rival that cannot run here
        errors["torch_tp_error"] = f"{type(e).__name__}: {e}"
    return interleaved_times(variants, steps, reps), errors


def main() -> None:
    parser = argparse.ArgumentParser(description="shardwise bench tp (one rank)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    rt = sw.init()
    parts = rt.world_size
    x, y = _batch(args.batch)

    model, opt = sw.prepare(_model(), sw.TensorParallel(), lr=1e-4)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    full_bytes = sum(p.numel() * 4 for p in _model().parameters())
    sw.comm.stats.end_step()
    sw.train_step(model, x, y, lm_loss)
    opt.step()
    opt.zero_grad()
    measured = sw.comm.stats.end_step().by_op["all_reduce"]
    expected = expected_tp_bytes(_model(), args.batch, 128, parts)

    times, errors = time_variants(model, opt, x, y, parts, args.steps, args.reps)
    result = {
        "bench": "tp",
        "model": "gpt",
        "tp": parts,
        "batch": args.batch,
        "param_bytes_full": full_bytes,
        "param_bytes_per_rank": local_bytes,
        "param_bytes_per_rank_expected": expected_param_bytes(_model(), parts, rt.rank),
        "all_reduce_calls": measured.calls,
        "all_reduce_calls_expected": expected["all_reduce_calls"],
        "all_reduce_bytes": measured.bytes,
        "all_reduce_bytes_expected": expected["all_reduce_bytes"],
        "step_time_s": {**medians(times), **errors},
        "floor": floor_figures(times, "ours_tp"),
    }
    if "torch_tp" in times:
        result["ratio_ours_over_torch_tp_by_rep"] = by_rep(times, "ours_tp", "torch_tp")
    if rt.is_main:
        print_report(result)
        emit(result, args.out)
    sw.shutdown()


def print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"tensor parallel, tiny GPT, T={r['tp']}, batch {r['batch']} x 128 (rank 0)")
    for col in ("quantity", "measured", "formula", "note"):
        t.add_column(col, justify="right")
    mib = 2**20
    t.add_row(
        "params / rank",
        f"{r['param_bytes_per_rank'] / mib:.3f} MiB",
        f"{r['param_bytes_per_rank_expected'] / mib:.3f} MiB",
        f"{r['param_bytes_per_rank'] / r['param_bytes_full']:.3f} of "
        f"{r['param_bytes_full'] / mib:.2f} MiB",
    )
    t.add_row(
        "all-reduces / step",
        str(r["all_reduce_calls"]),
        str(r["all_reduce_calls_expected"]),
        "2 per block fwd + 2 bwd, +2, +3 loss",
    )
    t.add_row(
        "all-reduce bytes / step",
        f"{r['all_reduce_bytes'] / mib:.3f} MiB",
        f"{r['all_reduce_bytes_expected'] / mib:.3f} MiB",
        "sent by this rank",
    )
    for key, value in r["step_time_s"].items():
        shown = f"{1000 * value:.1f} ms" if isinstance(value, float) else value
        t.add_row(f"step time: {key}", shown, "", "")
    floor = r["floor"]
    t.add_row("ours ÷ compute", f"{floor['over_floor_overlapped']:.3f}", "", "the overlapped floor")
    t.add_row(
        "ours ÷ compute+bytes",
        f"{floor['over_floor_unoverlapped']:.3f}",
        "",
        "by rep: " + " ".join(f"{v:.3f}" for v in floor["over_floor_unoverlapped_by_rep"]),
    )
    Console(width=120).print(t)


if __name__ == "__main__":
    main()
