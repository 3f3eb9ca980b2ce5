"""Knowledge distillation: the student under DDP (teacher whole) and ZeRO-3 (teacher sharded
like ZeRO-3's parameters) equal one process's distillation after 20 steps on the same global
batches; the teacher sends nothing in backward and holds no optimizer state (the run's bytes
and optimizer state beside a student-only run's), and holds about 1/N of itself per rank; a
top-K cache of the teacher with K the whole vocabulary is the online teacher, bit for bit, and
`shardwise train` with `distill.cache` (built by the run, read back) trains as with the teacher
online."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import shardwise as sw
from harness import finish, start_cli, train_args
from shardwise.observe.memory import optimizer_tensors
from spawn import run
from state_diff import max_abs_diff

STEPS, BATCH, CLASSES, T, ALPHA = 20, 8, 7, 2.0, 0.7
TOL = 1e-5  # fp32 sums over ranks in another order, 20 AdamW steps


def _student() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, CLASSES))


def _teacher() -> nn.Sequential:
    torch.manual_seed(1)  # 9*31+31 + 31*31+31 + 31*7+7: 1,526 parameters
    return nn.Sequential(
        nn.Linear(9, 31), nn.ReLU(), nn.Linear(31, 31), nn.ReLU(), nn.Linear(31, CLASSES)
    )


def _batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 9, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


LOSS = sw.distill_loss(temperature=T, alpha=ALPHA)


def _one_process() -> dict[str, torch.Tensor]:
    student, teacher = _student(), _teacher().eval()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = _batch(step)
        with torch.no_grad():
            t = teacher(x)
        LOSS(student(x), (y, t)).backward()
        opt.step()
        opt.zero_grad()
    return student.state_dict()


def _distilled(strategy: sw.Strategy, shard: bool | None) -> tuple[dict, dict, int, object]:
    """20 steps (None: no teacher, cross-entropy alone); the state, the bytes per op of the
    last step, the optimizer state's bytes, and the teacher."""
    model, opt = sw.prepare(_student(), strategy, lr=1e-2)
    teacher = None if shard is None else sw.prepare_teacher(_teacher(), shard=shard)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = BATCH // world
    for step in range(STEPS):
        x, y = (t[rank * share : (rank + 1) * share] for t in _batch(step))
        sw.comm.stats.end_step()
        if teacher is None:
            sw.train_step(model, x, y, F.cross_entropy)
        else:
            with torch.no_grad():
                t = teacher(x)
            sw.train_step(model, x, (y, t), LOSS)
        opt.step()
        opt.zero_grad()
        sent = {op: s.bytes for op, s in sw.comm.stats.end_step().by_op.items()}
    state_bytes = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt))
    state = sw.full_state_dict(model)
    model.close()
    return state, sent, state_bytes, teacher


def _two_ranks() -> dict:
    expected = _one_process()
    out = {}
    state, _, _, teacher = _distilled(sw.DDP(), shard=False)
    out["ddp"] = max_abs_diff(state, expected)
    out["ddp teacher grads"] = sum(p.grad is not None for p in teacher.parameters())
    state, sent, opt_bytes, teacher = _distilled(sw.ZeRO(stage=3), shard=True)
    out["zero3"] = max_abs_diff(state, expected)
    _, alone, alone_bytes, _ = _distilled(sw.ZeRO(stage=3), shard=None)
    out["sent"], out["sent alone"] = sent, alone
    out["optimizer bytes"], out["optimizer bytes alone"] = opt_bytes, alone_bytes
    out["teacher held"] = sum(s.numel() for s in teacher.shards)
    out["teacher grads"] = sum(s.grad is not None for s in teacher.shards)
    return out


def test_student_equals_one_process_and_the_teacher_costs_no_backward_nor_state():
    teacher_numel = sum(p.numel() for p in _teacher().parameters())
    for result in run(_two_ranks, 2, timeout_s=300):
        assert result["ddp"] <= TOL and result["zero3"] <= TOL, result
        assert result["ddp teacher grads"] == 0 and result["teacher grads"] == 0
        sent, alone = result["sent"], result["sent alone"]
        # The teacher's only messages: its forward's gathers. Backward's reduce-scatters and
        # the rest are the student's alone, byte for byte.
        assert {op: b for op, b in sent.items() if op != "all_gather"} == {
            op: b for op, b in alone.items() if op != "all_gather"
        }
        assert sent["all_gather"] > alone["all_gather"]
        assert result["optimizer bytes"] == result["optimizer bytes alone"] > 0
        # about teacher / N: each of its 3 units padded to a multiple of N = 2
        assert teacher_numel / 2 <= result["teacher held"] <= teacher_numel / 2 + 3


def test_a_top_k_cache_of_the_whole_vocabulary_is_the_online_teacher():
    teacher = _teacher().eval()
    online, cached = _student(), _student()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (online, cached)]
    with torch.no_grad():
        cache = [sw.top_k_logits(teacher(_batch(s)[0]), CLASSES) for s in range(5)]  # offline
    for step in range(5):
        x, y = _batch(step)
        with torch.no_grad():
            t = teacher(x)
        LOSS(online(x), (y, t)).backward()
        LOSS(cached(x), (y, cache[step])).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for a, b in zip(online.state_dict().values(), cached.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_top_k_teacher_is_its_k_logits_renormalised():
    student, teacher = torch.randn(4, CLASSES), torch.randn(4, CLASSES)
    values, indices = sw.top_k_logits(teacher, 3)
    got = LOSS(student, (torch.zeros(4, dtype=torch.long), (values, indices)))
    # by hand: the teacher's softmax over its 3 largest logits only, KL against the student
    p = torch.softmax(values / T, dim=-1)
    log_q = torch.log_softmax(student / T, dim=-1).gather(1, indices)
    soft = (p * (p.log() - log_q)).sum() / 4
    hard = F.cross_entropy(student, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(got, ALPHA * T**2 * soft + (1 - ALPHA) * hard)


def test_bad_options_are_one_line():
    for call, words in [
        (lambda: sw.distill_loss(temperature=0), "temperature must be > 0"),
        (lambda: sw.distill_loss(alpha=1.5), r"alpha must be in \[0, 1\]"),
        (lambda: sw.top_k_logits(torch.zeros(2, 5), 6), r"k=6 must be in \[1, 5\]"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            call()
        assert "\n" not in str(err.value)


TEACHERS = """
import torch
from shardwise.nn.models import MLP

def digits_teacher():
    torch.manual_seed(3)
    return MLP([64, 96, 10])
"""


def test_an_offline_cache_of_every_logit_trains_as_the_online_teacher(tmp_path):
    # The same job twice at once: the teacher run on each batch, and its logits of every
    # sample read from a cache the run builds first (K = all 10 classes).
    (tmp_path / "teachers.py").write_text(TEACHERS)
    base = ["distill.teacher=teachers:digits_teacher", "train.steps=20", "train.tensorboard=false"]
    cache = tmp_path / "cache" / "digits_teacher.safetensors"
    online, cached = (
        start_cli(*train_args(tmp_path / name, *base, *extra), cwd=tmp_path)
        for name, extra in (("online", []), ("cached", [f"distill.cache={cache}"]))
    )
    for code, out in finish(online, cached):
        assert code == 0, out[-3000:]
    with safe_open(str(cache), framework="pt") as f:
        assert f.get_tensor("values").shape == (1438, 10)  # every training sample, every logit
    weights = [
        load_file(str(tmp_path / n / "checkpoint" / "model.safetensors"))
        for n in ("online", "cached")
    ]
    assert max_abs_diff(*weights) == 0.0  # (each row of a linear layer: the same bits in any batch)


def test_a_damaged_cache_is_one_line(tmp_path):
    values = torch.randn(5, 3)
    for tensors, words in [
        ({"values": values, "indices": torch.zeros(5, 3, dtype=torch.int32) + 9}, "indices out of"),
        ({"values": values, "indices": torch.zeros(4, 3, dtype=torch.int32)}, "5 samples"),
        (
            {"values": values * float("nan"), "indices": torch.zeros(5, 3, dtype=torch.int32)},
            "non-finite",
        ),
        ({"values": values}, "not a teacher cache"),
    ]:
        path = tmp_path / "cache.safetensors"
        save_file(tensors, str(path), metadata={"classes": "4"})
        with pytest.raises(ValueError, match=words) as err:
            sw.TeacherCache(path, 5)
        assert "\n" not in str(err.value)
    # Another teacher's: over 4 classes where the student has 10 (before: a traceback from
    # inside the loss for more classes, silently accepted for fewer).
    distinct = torch.arange(3, dtype=torch.int32).repeat(5, 1)  # (a class once in each row)
    save_file({"values": values, "indices": distinct}, str(path), metadata={"classes": "4"})
    with pytest.raises(ValueError, match="logits over 4 classes, and the student has 10"):
        sw.TeacherCache(path, 5, student_classes=10)
    assert sw.TeacherCache(path, 5, student_classes=4).classes == 4


def test_padded_positions_count_in_neither_term():
    # A language model's tokens with right padding (label -100): the loss is the one over
    # the real tokens alone, whatever the padding, and no gradient reaches a padded position
    # (before, the soft term averaged over every row, padding included).
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    teacher, labels = torch.randn(2, 6, 11, generator=g), torch.randint(0, 11, (2, 6), generator=g)
    labels[:, 3:] = -100
    real = labels.reshape(-1) != -100
    loss_fn = sw.distill_loss(temperature=2.0, alpha=0.3)
    loss = loss_fn(student, (labels, teacher))
    rows, teacher_rows = student.reshape(-1, 11)[real], teacher.reshape(-1, 11)[real]
    alone = loss_fn(rows, (labels.reshape(-1)[real], teacher_rows))
    torch.testing.assert_close(loss, alone, rtol=1e-6, atol=0)
    loss.backward()
    assert (
        not student.grad.reshape(-1, 11)[~real].any() and student.grad.reshape(-1, 11)[real].any()
    )
