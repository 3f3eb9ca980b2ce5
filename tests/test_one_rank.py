"""At one rank every strategy is plain training: no messages (a slice of one is the whole, one
replica is its own average), and the same weights as the model trained with no wrapper, to the
bit. The model has odd widths, a frozen layer and BatchNorm's buffers; ZeRO-2 with fp32 masters
kept apart (offload to the CPU) takes the path where the reduced gradient is the full buffer."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from shardwise import comm
from spawn import run

STRATEGIES = {
    "ddp": lambda: sw.DDP(),
    "zero1": lambda: sw.ZeRO(stage=1),
    "zero2": lambda: sw.ZeRO(stage=2),
    "zero3": lambda: sw.ZeRO(stage=3),
    "zero1_offload": lambda: sw.ZeRO(stage=1, offload="cpu"),
    "zero2_offload": lambda: sw.ZeRO(stage=2, offload="cpu"),
    "local_sgd": lambda: sw.LocalSGD(period=2),
    "gossip": lambda: sw.Gossip(),
    "adaptive": lambda: sw.AdaptiveSync(threshold=1e-9),
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(7, 13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 11), nn.Linear(11, 3)
    )
    model[3].requires_grad_(False)  # frozen
    return model


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 7, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)
    ]


def _all_strategies() -> dict:
    loss_fn = nn.functional.cross_entropy
    plain = _model()
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    for x, y in _batches():
        loss_fn(plain(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = plain.state_dict()
    results = {}
    for name, strategy in STRATEGIES.items():
        model, opt = sw.prepare(_model(), strategy(), optimizer=torch.optim.AdamW, lr=1e-2)
        comm.stats.reset()
        for x, y in _batches():
            sw.train_step(model, x, y, loss_fn, total=x.shape[0])
            opt.step()
            opt.zero_grad()
        sent = comm.stats.total()  # (before the state dict, which may gather)
        got = sw.full_state_dict(model)
        model.close()
        results[name] = (
            max((got[k].float() - v.float()).abs().max().item() for k, v in want.items()),
            {op: t.calls for op, t in sent.by_op.items() if t.calls},
        )
    return results


def test_every_strategy_at_one_rank_is_plain_training_bit_for_bit():
    (results,) = run(_all_strategies, 1)
    assert results == {name: (0.0, {}) for name in STRATEGIES}  # (no difference, no call)


def _tensor_parallel_at_one_rank() -> tuple[float, dict]:
    from shardwise.nn.models import TinyGPT, lm_loss

    def gpt() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(vocab_size=13, seq_len=8, d_model=16, n_layer=2, n_head=2)

    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, 13, (4, 9), generator=g) for _ in range(3)]
    plain = gpt()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for t in tokens:
        lm_loss(plain(t[:, :-1]), t[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    model, opt = sw.prepare(gpt(), sw.TensorParallel(), optimizer=torch.optim.AdamW, lr=1e-2)
    comm.stats.reset()
    for t in tokens:
        sw.train_step(model, t[:, :-1], t[:, 1:], lm_loss)
        opt.step()
        opt.zero_grad()
    sent = comm.stats.total()
    got, want = sw.full_state_dict(model), plain.state_dict()
    diff = max((got[k] - v).abs().max().item() for k, v in want.items())
    return diff, {op: t.calls for op, t in sent.by_op.items() if t.calls}


def test_tensor_parallel_at_one_rank_is_plain_training():
    # The layers' f and g are the identity at tp=1 and the loss is torch's cross-entropy.
    (result,) = run(_tensor_parallel_at_one_rank, 1)
    assert result == (0.0, {})
