"""Benchmark: what communication costs, per variant, on an emulated multi-host network.

One training run per variant on the same data from the same initial weights: torch DDP, our DDP
without compression, each codec, and each relaxed strategy; and torch DDP with its own
compression hooks (`fp16_compress_hook`, `powerSGD_hook` at our PowerSGD's rank and warm-up),
the rivals our fp16 and PowerSGD rows are read against. Reported per variant: bytes this
rank sent per step (our accounting; torch DDP's by the all-reduce formula), compression ratio
against uncompressed DDP (mean over all steps, and steady state = the median step, which
excludes PowerSGD's plain warm-up steps), step time, wall-clock to reach a target training
loss, and final loss; a PNG of loss against wall-clock; one JSON line. For PowerSGD the ideal
reduction, sum of m*n over sum of (m+n)*r (uncompressed tensors counted whole), is printed
beside the measured one.

Run: shardwise bench comm --models mlp --rate 100mbit   (needs network namespaces; see
`shardwise.distributed.emulated_cluster`; without them it runs on loopback and says so)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.comm.powersgd import PowerSGD
from shardwise.data.datasets import digits, text
from shardwise.job_sections import resolve_data_path
from shardwise.nn.models import MLP, TinyGPT, lm_loss, num_parameters

POWERSGD_RANK, POWERSGD_WARMUP = 4, 10  # ours ('powersgd:RANK:WARMUP') and torch's alike

VARIANTS = {  # (None: torch's DDP, with the hook its name says)
    "torch_ddp": None,
    "ddp": lambda: sw.DDP(),
    "fp16": lambda: sw.DDP(compression="fp16"),
    "torch_fp16_hook": None,  # torch DDP + fp16_compress_hook
    "bf16": lambda: sw.DDP(compression="bf16"),
    "int8": lambda: sw.DDP(compression="int8"),
    "topk_1%": lambda: sw.DDP(compression="topk:0.01"),
    "randomk_1%": lambda: sw.DDP(compression="randomk:0.01"),
    "sign": lambda: sw.DDP(compression="sign"),
    "powersgd_r4": lambda: sw.DDP(compression=f"powersgd:{POWERSGD_RANK}:{POWERSGD_WARMUP}"),
    "torch_powersgd_r4": None,  # torch DDP + powerSGD_hook, the same rank and warm-up
    "local_sgd_h4": lambda: sw.LocalSGD(period=4),
    "gossip_ring": lambda: sw.Gossip(topology="ring"),
    "adaptive": lambda: sw.AdaptiveSync(threshold=0.02),
}


# Each of our rows beside torch's equivalent: the table's "vs torch" column.
RIVALS = {"ddp": "torch_ddp", "fp16": "torch_fp16_hook", "powersgd_r4": "torch_powersgd_r4"}

DEFAULT_TARGET = {"gpt": 2.6, "mlp": 0.3}  # training losses both models reach in 60 steps


def workload(name: str):
    if name == "gpt":
        splits = text(resolve_data_path("genesis_kjv.txt"), seq_len=128)
        factory = lambda: TinyGPT(splits.num_classes, 128, 256, 4, 4)  # noqa: E731
        return factory, splits.train, 8, lm_loss, 1e-3
    splits = digits()
    factory = lambda: MLP([64, 2048, 2048, 10])  # noqa: E731
    return factory, splits.train, 64, torch.nn.functional.cross_entropy, 1e-3


def ideal_powersgd_ratio(model: nn.Module, rank: int = 4) -> float:
    codec = PowerSGD(rank)
    full = sent = 0
    for p in model.parameters():
        r = codec._matrix_rank(p.shape)
        full += p.numel()
        sent += (p.shape[0] + p[0].numel()) * r if r else p.numel()
    return full / sent


def torch_ddp(module: nn.Module, key: str) -> nn.parallel.DistributedDataParallel:
    """torch's DDP, with the comm hook that variant `key` names (none for torch_ddp)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    # powerSGD_hook gets one bucket of 25 MiB (torch's default cuts a 1 MiB first one): with
    # two buckets, its second all-reduce, issued from a gloo callback thread, can interleave
    # with the next bucket's first one from the training thread, and gloo aborts on the
    # mismatch (seen here on the emulated network). The others keep torch's default buckets.
    if key == "torch_powersgd_r4":
        model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25)
    else:
        model = nn.parallel.DistributedDataParallel(module)
    if key == "torch_fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif key == "torch_powersgd_r4":
        state = torch_powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=POWERSGD_WARMUP,
            min_compression_rate=2,  # ours too: compress a matrix that shrinks at least 2x
        )
        model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    return model


def torch_bytes(key: str, model: nn.Module, step: int) -> int:
    """What torch's DDP sends per rank in `step` (0-based), which our accounting does not see:
    the ring all-reduce volume of what its hook all-reduces (fp32, fp16, or PowerSGD's
    factors and uncompressed tensors after the warm-up)."""
    world = dist.get_world_size()
    ring = lambda nbytes: 2 * (world - 1) * nbytes // world  # noqa: E731
    params = num_parameters(model)
    if key == "torch_fp16_hook":
        return ring(2 * params)
    if key == "torch_powersgd_r4" and step >= POWERSGD_WARMUP:
        codec = PowerSGD(POWERSGD_RANK)
        values = sum(
            (p.shape[0] + p[0].numel()) * r if (r := codec._matrix_rank(p.shape)) else p.numel()
            for p in model.parameters()
        )
        return ring(4 * values)
    return ring(4 * params)


def train_variant(key: str, model_name: str, steps: int) -> dict:
    factory, dataset, batch, loss_fn, lr = workload(model_name)
    torch.manual_seed(0)
    rival = key.startswith("torch_")
    if rival:
        model = torch_ddp(factory(), key)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        model, opt = sw.prepare(factory(), VARIANTS[key](), optimizer=torch.optim.AdamW, lr=lr)
    loader = sw.data.loader(dataset, batch, shuffle=True, seed=0)
    params = num_parameters(model)
    world = dist.get_world_size()
    batches = (b for _ in range(10**6) for b in loader)
    curve, sent = [], []
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        x, y = next(batches)
        sw.comm.stats.end_step()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_bytes = sw.comm.stats.end_step().bytes
        if rival:  # not through our layer: the ring all-reduce volume of what it reduces
            step_bytes = torch_bytes(key, model, step)
        sent.append(step_bytes)
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        curve.append((time.perf_counter() - start, mean.item() / world))
    if not rival:
        model.close()
    steady = sorted(sent)[len(sent) // 2]  # median: PowerSGD's warm-up steps send plain grads
    return {
        "curve": curve,
        "bytes_per_step": sum(sent) / len(sent),
        "steady_bytes_per_step": steady,
        "params": params,
    }


def summarise(results: dict, target: float, ideal: float) -> dict:
    # Ratios against our uncompressed DDP, or torch's when only that ran (the same bytes).
    plain = results.get("ddp") or results.get("torch_ddp")
    base = plain["bytes_per_step"] if plain else 0
    steady_base = plain["steady_bytes_per_step"] if plain else 0
    relaxed = ("local_sgd", "gossip", "adaptive")  # no steady per-step volume: it varies by design
    table = {}
    for key, r in results.items():
        curve = r["curve"]
        window = [[v for _, v in curve[max(0, i - 4) : i + 1]] for i in range(len(curve))]
        smooth = [sum(w) / len(w) for w in window]  # mean of the last 5 steps' losses
        reached = next((curve[i][0] for i, v in enumerate(smooth) if v <= target), None)
        table[key] = {
            "bytes_per_step": r["bytes_per_step"],
            "compression_ratio": base / r["bytes_per_step"]
            if base and r["bytes_per_step"]
            else None,
            "steady_bytes_per_step": r["steady_bytes_per_step"],
            "steady_ratio": (
                steady_base / r["steady_bytes_per_step"]
                if steady_base and r["steady_bytes_per_step"] and not key.startswith(relaxed)
                else None
            ),
            "step_time_s": curve[-1][0] / len(curve),
            "time_to_target_s": reached,
            "final_loss": smooth[-1],
        }
    for ours, theirs in RIVALS.items():
        if ours in table and theirs in table:
            table[ours]["vs_torch"] = versus(table[ours], table[theirs])
    if "powersgd_r4" in table:
        psgd = table["powersgd_r4"]
        psgd["ideal_ratio"] = ideal
        psgd["fraction_of_ideal"] = (psgd["steady_ratio"] or 0) / ideal
    return table


def versus(ours: dict, theirs: dict) -> dict:
    """Ours against torch's equivalent: time to the target loss (ratio, < 1: we are faster)
    and the final loss (relative difference, < 0: ours is lower)."""
    a, b = ours["time_to_target_s"], theirs["time_to_target_s"]
    return {
        "time_to_target_ratio": a / b if a is not None and b else None,
        "final_loss_diff": (ours["final_loss"] - theirs["final_loss"]) / theirs["final_loss"],
    }


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.cm.tab20.colors  # twelve variants: one distinct colour each
    for i, (key, r) in enumerate(results.items()):
        t, v = zip(*r["curve"], strict=True)
        ax.plot(
            t,
            v,
            label=key,
            color=colors[(2 * i) % 20 + (2 * i) // 20],
            linewidth=2 if key in ("torch_ddp", "powersgd_r4", "torch_powersgd_r4") else 1,
        )
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description="shardwise bench comm (one rank)")
    parser.add_argument("--model", default="gpt", choices=["gpt", "mlp"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--network", default="loopback")
    args = parser.parse_args()
    rt = sw.init()
    results = {}
    for key in args.variants.split(","):
        results[key] = train_variant(key, args.model, args.steps)
        if rt.is_main:
            print(f"{key}: {results[key]['curve'][-1][0]:.1f} s", flush=True)
    if rt.is_main:
        factory, *_ = workload(args.model)
        target = args.target_loss or DEFAULT_TARGET[args.model]
        table = summarise(results, target, ideal_powersgd_ratio(factory()))
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        title = f"{args.model}, world {rt.world_size}, {args.network}"
        plot(results, out / f"comm_{args.model}.png", title)
        print_table(table, title)
        line = {
            "bench": "comm",
            "model": args.model,
            "network": args.network,
            "world_size": rt.world_size,
            "steps": args.steps,
            "target_loss": target,
            "results": table,
        }
        (out / f"comm_{args.model}.json").write_text(json.dumps(line) + "\n")
        print(json.dumps(line))
    sw.shutdown()


def print_table(table: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"comm benchmark: {title}")
    columns = (
        "variant",
        "mean sent/step",
        "ratio",
        "steady sent/step",
        "steady ratio",
        "step s",
        "to target s",
        "final loss",
        "vs torch: time, loss",
    )
    for col in columns:
        t.add_column(col, justify="right")
    for key, v in table.items():
        ratio = f"{v['compression_ratio']:.1f}x" if v["compression_ratio"] else "-"
        steady = f"{v['steady_ratio']:.1f}x" if v["steady_ratio"] else "-"
        if "ideal_ratio" in v:
            steady += f" (ideal {v['ideal_ratio']:.1f}x, {v['fraction_of_ideal']:.0%})"
        reached = f"{v['time_to_target_s']:.1f}" if v["time_to_target_s"] is not None else "never"
        steady_bytes = f"{v['steady_bytes_per_step'] / 2**20:.3f} MiB" if v["steady_ratio"] else "-"
        rival = "-"
        if vs := v.get("vs_torch"):
            ratio_t = vs["time_to_target_ratio"]
            time_text = f"{ratio_t:.2f}x" if ratio_t is not None else "n/a"
            rival = f"{time_text}, {vs['final_loss_diff']:+.1%}"
        t.add_row(
            key,
            f"{v['bytes_per_step'] / 2**20:.3f} MiB",
            ratio,
            steady_bytes,
            steady,
            f"{v['step_time_s']:.2f}",
            reached,
            f"{v['final_loss']:.4f}",
            rival,
        )
    Console(width=150).print(t)


if __name__ == "__main__":
    main()
