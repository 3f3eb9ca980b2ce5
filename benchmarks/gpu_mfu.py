"""The GPU path measured: a GPT-2-124M-class model in bf16 on one GPU, plain torch against
`torch.compile` against each of our strategies at world 1 (over NCCL), in tokens/s and MFU.

MFU = 6 N T / (step time x peak), N the parameters (embeddings included), T the tokens of a
step, peak the GPU's dense bf16 FLOP/s (989 TFLOP/s on an H100/H200 SXM; `--peak-tflops`).
Every variant trains an identical copy of the model with fused AdamW under bf16 autocast on the
same batch; variants are timed in rotating order, `--reps` rounds of `--steps` steps, after
warm-up (compilation included there), and each is reported at its median. Ours with
`torch.compile` compiles each transformer block's forward (the blocks are ZeRO-3's units: its
gather and free hooks run around the compiled code, as FSDP2 users compile per block).

Run (not part of CI; on a machine with a GPU):
    PYTHONPATH=src python benchmarks/gpu_mfu.py                  # the full table, one JSON line
    PYTHONPATH=src python benchmarks/gpu_mfu.py --tiny --device cpu   # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import shardwise as sw
from shardwise.nn.models import TinyGPT, lm_loss

OURS = {
    "ddp": lambda: sw.DDP(),
    "zero1": lambda: sw.ZeRO(stage=1),
    "zero2": lambda: sw.ZeRO(stage=2),
    "zero3": lambda: sw.ZeRO(stage=3),
}


def gpt(tiny: bool) -> TinyGPT:
    torch.manual_seed(0)
    if tiny:
        return TinyGPT(256, seq_len=64, d_model=64, n_layer=2, n_head=4)
    return TinyGPT(50304, seq_len=1024, d_model=768, n_layer=12, n_head=12)  # ~124M


def compile_blocks(model: torch.nn.Module) -> None:
    """Compile each block's forward in place (hooks on the block stay outside the graph)."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward)


def variants(args, device: torch.device) -> dict:
    made = {}
    plain = gpt(args.tiny).to(device)
    made["torch"] = (plain, torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=args.fused))
    compiled = gpt(args.tiny).to(device)
    made["torch.compile"] = (
        torch.compile(compiled),
        torch.optim.AdamW(compiled.parameters(), lr=1e-4, fused=args.fused),
    )
    for key, strategy in OURS.items():
        for with_compile in (False, True):
            model = gpt(args.tiny).to(device)
            if with_compile:
                compile_blocks(model)
            name = key + (" + compile" if with_compile else "")
            made[name] = sw.prepare(model, strategy(), optimizer=torch.optim.AdamW, lr=1e-4)
    return made


def timed(model, opt, batch, steps: int, device: torch.device) -> float:
    x, y = batch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: a smoke run")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.fused = device.type == "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    sw.init()  # world 1: NCCL on a GPU, gloo on the CPU
    model = gpt(args.tiny)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.head.out_features, (args.batch, model.seq_len + 1), generator=g)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    step_tokens = args.batch * model.seq_len
    made = variants(args, device)
    for m, opt in made.values():  # warm-up: compilation, allocation
        timed(m, opt, batch, 3, device)
    times: dict[str, list[float]] = {k: [] for k in made}
    for rep in range(args.reps):
        order = list(made)[rep % len(made) :] + list(made)[: rep % len(made)]
        for key in order:
            times[key].append(timed(*made[key], batch, args.steps, device))
    result = {"bench": "gpu_mfu", "device": torch.cuda.get_device_name() if args.fused else "cpu"}
    result.update(params=params, tokens_per_step=step_tokens, peak_tflops=args.peak_tflops)
    base = statistics.median(times["torch.compile"])
    print(f"{'variant':>18} {'step ms':>9} {'tokens/s':>11} {'MFU':>7} {'vs compiled':>12}")
    for key, ts in times.items():
        step = statistics.median(ts)
        mfu = 6 * params * step_tokens / step / (args.peak_tflops * 1e12)
        result[key] = {"step_s": step, "tokens_per_s": step_tokens / step, "mfu": mfu}
        print(
            f"{key:>18} {1000 * step:9.1f} {step_tokens / step:11,.0f} "
            f"{100 * mfu:6.1f}% {step / base:11.3f}x"
        )
    print(json.dumps(result))
    for m, _ in made.values():
        if hasattr(m, "close"):
            m.close()
    sw.shutdown()


if __name__ == "__main__":
    main()
