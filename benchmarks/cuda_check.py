"""The CUDA/NCCL path, checked on a machine with one GPU (not part of CI, which has none).

Every strategy trains an MLP for a few AdamW steps on `cuda:0` in a world of one over NCCL
(so every collective really goes through NCCL), and its final full state dict is compared with
plain torch training on the same GPU from the same weights and batches. bf16 variants are
compared by loss. Then a sharded checkpoint written from the GPU is read back on the CPU.

Run: PYTHONPATH=src python benchmarks/cuda_check.py      (exit status 0 when all pass)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

import shardwise as sw
from shardwise.nn.models import MLP, TinyGPT, lm_loss

STEPS = 10
VARIANTS = {
    "ddp": lambda: sw.DDP(bucket_mb=0.05),
    "ddp_ring": lambda: sw.DDP(bucket_mb=0.05, algorithm="ring"),
    "ddp_fp16": lambda: sw.DDP(compression="fp16"),
    "ddp_powersgd": lambda: sw.DDP(compression="powersgd:4"),
    "ddp_topk": lambda: sw.DDP(compression="topk:0.5"),
    "ddp_sign": lambda: sw.DDP(compression="sign"),
    "ddp_int8": lambda: sw.DDP(compression="int8"),
    "zero1": lambda: sw.ZeRO(stage=1),
    "zero2": lambda: sw.ZeRO(stage=2),
    "zero3": lambda: sw.ZeRO(stage=3),
    "zero2_offload_cpu": lambda: sw.ZeRO(stage=2, offload="cpu"),
    "zero3_offload_disk": lambda: sw.ZeRO(stage=3, offload="disk"),
    "zero3_bf16": lambda: sw.ZeRO(stage=3, mixed_precision="bf16"),
    "zero1_fp16": lambda: sw.ZeRO(stage=1, mixed_precision="fp16"),
    "local_sgd": lambda: sw.LocalSGD(period=2),
}
# With one rank a lossy codec has nothing to average, but its error feedback and encode/decode
# still run: compare those by loss, not by weights.
APPROXIMATE = {
    "ddp_fp16",
    "ddp_powersgd",
    "ddp_topk",
    "ddp_sign",
    "ddp_int8",
    "zero3_bf16",
    "zero1_fp16",
}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g))
        for _ in range(STEPS)
    ]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> float:
    loss = torch.zeros(())
    for x, y in batches():
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        sw.clip_grad_norm_(model, 0.5)  # torch's own clip for the plain reference
        opt.step()
        opt.zero_grad()
    return loss.item()


def check_gpt(rt: sw.Runtime) -> dict:
    """Tensor parallel (vocabulary-parallel loss) and a 1-stage pipeline with 4 micro-batches,
    on the GPU, against the tiny GPT trained on the CPU."""
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 65, (8, 33), generator=g) for _ in range(STEPS)]

    def make() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(65, seq_len=32, d_model=64, n_layer=2, n_head=4)

    reference = make().to(rt.device)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for t in data:
        t = t.to(rt.device)
        lm_loss(reference(t[:, :-1]), t[:, 1:]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out = {}
    for name, strategy in {"tp": sw.TensorParallel(), "pipeline": sw.Pipeline(stages=1)}.items():
        try:
            model, opt = sw.prepare(make(), strategy, lr=1e-3)
            for t in data:
                t = t.to(rt.device)
                sw.train_step(model, t[:, :-1], t[:, 1:], lm_loss)
                opt.step()
                opt.zero_grad()
            got = sw.full_state_dict(model)
            expected = reference.state_dict()
            diff = max((got[k] - v).abs().max().item() for k, v in expected.items())
            # The vocabulary-parallel loss rounds differently from F.cross_entropy; Adam
            # amplifies that on near-zero gradients, as in the CPU tests.
            out[name] = {"ok": diff < 5e-5, "max_abs_diff": diff}
        except Exception as e:
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return out


def check_linear_into_slot(device: torch.device) -> dict:
    """DDP's Linear layers write their weight's gradient into the bucket (`linear_into_bucket`;
    at world 1 DDP keeps no buckets, so this is checked here, as in the CPU tests): on the GPU,
    into a slot at an odd offset of a larger buffer, against autograd's own linear."""
    from shardwise.strategies.linear_into_bucket import LinearIntoSlot

    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 600).to(device)
    x = torch.randn(4, 16, 1024, device=device, requires_grad=True)
    grad_out = torch.randn(4, 16, 600, device=device)
    expected = torch.autograd.grad(
        torch.nn.functional.linear(x, layer.weight, layer.bias),
        [x, layer.weight, layer.bias],
        grad_out,
    )
    buffer = torch.full((layer.weight.numel() + 6,), float("nan"), device=device)
    slot = buffer[3 : 3 + layer.weight.numel()].view_as(layer.weight)

    class OneSlot:
        def claim_slot(self, weight, grad):
            return slot

    LinearIntoSlot.apply(x, layer.bias, layer.weight, OneSlot()).backward(grad_out)
    got = [x.grad, layer.weight.grad, layer.bias.grad]
    diff = max((g - e).abs().max().item() for g, e in zip(got, expected, strict=True))
    in_slot = layer.weight.grad.data_ptr() == slot.data_ptr()
    untouched = bool(buffer[:3].isnan().all() and buffer[-3:].isnan().all())
    bits = all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    return {
        "ok": in_slot and untouched and diff < 1e-5,
        "same_bits": bits,
        "max_abs_diff": diff,
        "grad_is_the_slot": in_slot,
    }


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    rt = sw.init()
    if rt.device.type != "cuda":  # a dry run of the script itself
        print(f"no CUDA device: running on {rt.device} over {rt.backend}")
    cuda = rt.device.type == "cuda"
    torch.manual_seed(0)
    initial = MLP([32, 256, 256, 10]).state_dict()
    reference = MLP([32, 256, 256, 10]).to(rt.device)  # plain torch on the same device
    reference.load_state_dict(initial)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_loss = train(reference, ref_opt, rt.device)
    expected = reference.state_dict()
    results, failed = {}, []
    for name, make in VARIANTS.items():
        model = MLP([32, 256, 256, 10])
        model.load_state_dict(initial)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            wrapped, opt = sw.prepare(model, make(), optimizer=torch.optim.AdamW, lr=1e-3)
            loss = train(wrapped, opt, rt.device)
            got = sw.full_state_dict(wrapped)
            diff = max((got[k].float() - v).abs().max().item() for k, v in expected.items())
            on_gpu = all(p.device == rt.device for p in wrapped.parameters())
            if name in APPROXIMATE:
                ok = abs(loss - ref_loss) / ref_loss < 0.05 and on_gpu
            else:
                ok = diff < 1e-5 and on_gpu
            results[name] = {
                "ok": ok,
                "max_abs_diff": diff,
                "loss": loss,
                "on_gpu": on_gpu,
                "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0,
                "seconds": time.perf_counter() - start,
            }
            if name == "zero3":
                with tempfile.TemporaryDirectory() as d:
                    sw.save_checkpoint(wrapped, opt, d, step=STEPS)
                    from shardwise.checkpoint.reshardable import read_full_state

                    params, _, step = read_full_state(d)
                    back = max((params[k] - v.cpu()).abs().max().item() for k, v in got.items())
                    results[name]["checkpoint_roundtrip_diff"] = back
                    results[name]["ok"] &= back == 0 and step == STEPS
            wrapped.close()
        except Exception as e:  # report every variant, not only the first failure
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if not results[name]["ok"]:
            failed.append(name)
        print(name, results[name], flush=True)
    results["linear_into_slot"] = check_linear_into_slot(rt.device)
    print("linear_into_slot", results["linear_into_slot"], flush=True)
    if not results["linear_into_slot"]["ok"]:
        failed.append("linear_into_slot")
    for name, result in check_gpt(rt).items():
        results[f"gpt_{name}"] = result
        print(f"gpt_{name}", result, flush=True)
        if not result["ok"]:
            failed.append(f"gpt_{name}")
    print(f"reference loss {ref_loss:.5f}; failed: {failed or 'none'}")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    print(
        json.dumps(
            {
                "bench": "cuda_check",
                "device": device,
                "torch": torch.__version__,
                "nccl": nccl,
                "results": results,
            }
        )
    )
    sw.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
