"""Predicted peak memory against CUDA's own count, on a machine with one GPU (not part of CI).

For the tiny GPT in a world of one over NCCL, under each strategy (activation checkpointing
too), the cost model's peak (`predictors.predict(...).peak`, made before the run) is compared with
what the caching allocator reports for one training step (`torch.cuda.max_memory_allocated`,
less what was allocated before the model was built, cuBLAS's workspace included) and with our
`PeakMeter` on the same step (less what it found alive before the model was built).
Prints one line per strategy and one JSON line; exit status 0 when every prediction is within
10% of CUDA's figure.

Run: PYTHONPATH=src python benchmarks/peak_check.py
"""

from __future__ import annotations

import gc
import json
import sys

import torch

import shardwise as sw
from shardwise.config import SECTIONS
from shardwise.nn.models import TinyGPT, lm_loss
from shardwise.nn.recompute import checkpoint_activations
from shardwise.observe.memory import PeakMeter, live_bytes
from shardwise.plan.costs import Job
from shardwise.plan.predictors import predict

BATCH, SEQ, VOCAB = 16, 64, 64
CASES = [
    {"name": "ddp"},
    {"name": "ddp", "activation_checkpointing": True},
    {"name": "zero", "stage": 1},
    {"name": "zero", "stage": 2},
    {"name": "zero", "stage": 3},
    {"name": "zero", "stage": 3, "mixed_precision": "bf16"},
    {"name": "local_sgd", "period": 1},
]


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, seq_len=SEQ, d_model=256, n_layer=4, n_head=8)


def section(options: dict):
    by_name = {s.model_fields["name"].default: s for s in SECTIONS}
    return by_name[options["name"]].model_validate(options)


def check(options: dict, rt: sw.Runtime) -> dict:
    s = section(options)
    with torch.device("meta"):
        meta = model()
    checkpoint_activations(meta, s.activation_checkpointing)

    def batch(n: int):
        return torch.randint(0, VOCAB, (n, SEQ)), torch.randint(0, VOCAB, (n, SEQ))

    job = Job(meta, 1, 0, batch=batch, loss_fn=lm_loss, global_batch=BATCH, backend=rt.backend)
    predicted = predict(job, s).peak
    gc.collect()  # the previous case's tensors are gone before the baseline
    torch.cuda.synchronize()
    before, before_live = torch.cuda.memory_allocated(), live_bytes(rt.device)
    real = model()
    checkpoint_activations(real, s.activation_checkpointing)
    wrapped, opt = sw.prepare(real.to(rt.device), s.build(1, "/tmp/peak_check"), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(rt.device)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if step == 2:  # the state exists from the first step on: meter a later one
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            meter = PeakMeter(rt.device)
            meter.__enter__()
        sw.train_step(wrapped, x, y, lm_loss, total=BATCH)
        opt.step()
        opt.zero_grad()
    meter.__exit__(None, None, None)
    torch.cuda.synchronize()
    cuda = torch.cuda.max_memory_allocated() - before
    wrapped.close()
    del wrapped, opt, real
    return {
        "predicted": predicted,
        "cuda_max_allocated": cuda,
        "peak_meter": meter.peak - before_live,
        "error": (predicted - cuda) / cuda,
    }


def main() -> int:
    rt = sw.init()
    if rt.device.type != "cuda":
        print(f"no CUDA device ({rt.device}): nothing to compare with")
        return 0
    # cuBLAS's workspace is allocated at the first matmul and kept: before any baseline.
    warm = torch.randn(64, 64, device=rt.device, requires_grad=True)
    (warm @ warm).sum().backward()
    results = {}
    for options in CASES:
        name = json.dumps(options, separators=(",", ":"))
        try:
            results[name] = check(options, rt)
        except Exception as e:  # report every case, not only the first failure
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        r = results[name]
        if isinstance(r["error"], float):
            print(
                f"{name:60s} predicted {r['predicted'] / 2**20:8.2f} MiB  cuda "
                f"{r['cuda_max_allocated'] / 2**20:8.2f} MiB  meter "
                f"{r['peak_meter'] / 2**20:8.2f} MiB  error {100 * r['error']:+.1f} %"
            )
        else:
            print(f"{name:60s} {r['error']}")
    print(json.dumps({"peak_check": results}))
    ok = all(isinstance(r["error"], float) and abs(r["error"]) <= 0.1 for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
