"""The planner: model states against the ZeRO paper's Figure 1; the search over strategies
for a 70B and a 1T transformer (in under a second, feasible, ranked; formulas that trade as
they should); the command line. (Bad input to it: test_plan_inputs.py.)"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from harness import main_in_process, run_cli
from shardwise.comm import shared_memory
from shardwise.config import load_config
from shardwise.plan import calibrate
from shardwise.plan.model_states import model_states
from shardwise.plan.search import (
    PRESETS,
    ClusterSpec,
    Plan,
    TransformerSpec,
    plan_sets,
    price,
    search,
)

FIGURE_1 = {"DP": 120e9, "ZeRO-1": 31.4e9, "ZeRO-2": 16.6e9, "ZeRO-3": 1.875e9}


@pytest.mark.alone  # (bounded in seconds)
def test_plan_reproduces_zero_figure_1_from_the_command_line(fresh_launchers):
    # (a new Python process, as a user's shell starts it: the bound is on what they wait)
    argv = ["plan", "--params", "7.5e9", "--devices", "64", "--precision", "mixed", "--json"]
    started = time.perf_counter()
    done = run_cli(*argv, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - started < 10  # (a Python start; the plan itself is instant)
    plans = {p["strategy"]: p for p in json.loads(done.stdout)}
    assert set(plans) == set(FIGURE_1)
    for name, total in FIGURE_1.items():  # the figure rounds to 0.1 GB
        assert plans[name]["total_bytes"] == pytest.approx(total, abs=0.05e9), name


def test_each_stage_shards_one_more_category():
    p, n = 1e6, 8
    dp, z1, z2, z3 = (model_states(p, n, stage, "fp32") for stage in (0, 1, 2, 3))
    assert (dp.params_bytes, dp.grads_bytes, dp.optimizer_bytes) == (4 * p, 4 * p, 8 * p)
    assert z1.optimizer_bytes == 8 * p / n and z1.grads_bytes == 4 * p
    assert z2.grads_bytes == 4 * p / n and z2.params_bytes == 4 * p
    assert z3.params_bytes == 4 * p / n
    assert z3.comm_bytes_per_step == 1.5 * z2.comm_bytes_per_step == 1.5 * dp.comm_bytes_per_step


@pytest.mark.alone  # (bounded in seconds)
def test_seventy_billion_on_1024_devices_answers_in_under_a_second_and_fits():
    spec, cluster = PRESETS["70b"], ClusterSpec(devices=1024, memory_gb=80, network_gbit=400)
    started = time.perf_counter()
    fits, rejected = search(spec, cluster)
    assert time.perf_counter() - started < 1.0
    assert 69e9 < spec.params() < 71e9
    best = fits[0]
    assert best.dp * best.tp * best.pp == 1024 and best.memory["total"] <= 80e9
    # Feasible by its own parts: the categories add up, and plain data parallel cannot fit.
    parts = ("params", "grads", "optimizer", "activations", "gathered")
    assert sum(best.memory[k] for k in parts) == pytest.approx(best.memory["total"])
    plain = next(p for p in rejected if (p.tp, p.pp, p.zero, p.checkpointing) == (1, 1, 0, False))
    assert plain.memory["params"] == pytest.approx(2 * spec.params(), rel=0.01)
    assert "needs" in plain.reason and "of 80 GB" in plain.reason
    assert all(p.step_time_s >= best.step_time_s for p in fits)


def test_the_top_ten_plans_for_70b_are_configs_shardwise_trains():
    """`shardwise plan --preset 70b --devices 1024`: each of the ten fastest says it runs, and
    its overrides make a config of its mesh, ZeRO stage (bf16, offload), checkpointing,
    micro-batches (a pipeline's, else train.accumulate) and per-replica batch."""
    spec = PRESETS["70b"]
    fits, _ = search(spec, ClusterSpec(devices=1024, memory_gb=80, network_gbit=400))
    for plan in fits[:10]:
        assert plan.unsupported == "", plan.strategy
        cfg = load_config("tiny_gpt", [*plan_sets(plan), "launch.nproc=1024"])
        s = cfg.strategy
        assert (s.name, s.dp, s.tp, s.pp) == ("mesh", plan.dp, plan.tp, plan.pp)
        assert s.data == f"zero{plan.zero}" and s.mixed_precision == "bf16"
        assert s.offload == ("cpu" if plan.offload else None)
        assert s.activation_checkpointing == plan.checkpointing
        micro = s.microbatches if plan.pp > 1 else cfg.train.accumulate
        assert micro == plan.microbatches
        assert cfg.data.batch_size * plan.dp == spec.batch
    assert any(p.offload for p in fits[:10]) and any(p.microbatches > 1 for p in fits[:10])


@pytest.mark.alone  # (bounded in seconds)
def test_a_trillion_parameters_on_10000_devices_in_under_a_second():
    started = time.perf_counter()
    fits, _ = search(PRESETS["1t"], ClusterSpec(devices=10_000))
    assert time.perf_counter() - started < 1.0
    assert fits and fits[0].memory["total"] <= 80e9


def test_checkpointing_zero_and_micro_batches_trade_memory_as_the_formulas_say():
    spec, cluster = PRESETS["70b"], ClusterSpec(devices=1024)
    base = Plan(
        dp=256,
        tp=4,
        pp=1,
        zero=1,
        micro_batch=4,
        microbatches=1,
        checkpointing=False,
        offload=False,
    )
    plain = price(base, spec, cluster)
    ckpt = price(replace(base, checkpointing=True), spec, cluster)
    zero3 = price(replace(base, zero=3), spec, cluster)
    assert ckpt.memory["activations"] < plain.memory["activations"] / 5
    assert ckpt.time["compute"] == pytest.approx(plain.time["compute"] * 4 / 3)
    assert zero3.memory["params"] == pytest.approx(plain.memory["params"] / 256)
    assert zero3.comm_bytes["data"] == pytest.approx(1.5 * plain.comm_bytes["data"])


def test_the_plan_command_ranks_plans_as_json_from_flags_or_yaml(tmp_path, capsys):
    """As a user runs it; its exit codes after that from `main`, in this process (a command's
    start costs 2 s of imports)."""
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "layers: 80\nhidden: 8192\nheads: 64\nseq: 4096\nvocab: 32000\nbatch: 1024\n"
        "ffn: 36864\ndevices: 1024\nmemory_gb: 80\nnetwork_gbit: 400\n"
    )
    argv = ["plan", "--spec", str(spec), "--json"]
    done = run_cli(*argv, timeout=60)
    assert done.returncode == 0, done.stderr
    plans = json.loads(done.stdout)
    fitting = [p for p in plans if p["fits"]]
    assert (
        fitting[0]["strategy"] == search(PRESETS["70b"], ClusterSpec(devices=1024))[0][0].strategy
    )
    assert {"strategy", "dp", "tp", "pp", "memory", "comm_bytes", "step_time_s"} <= set(plans[0])
    assert [p["step_time_s"] for p in fitting] == sorted(p["step_time_s"] for p in fitting)
    assert all(p["reason"] for p in plans if not p["fits"])
    for form in ([], ["--json"]):  # nothing fits in a millionth of a GB: 1, whatever the form
        tiny = spec.read_text().replace("memory_gb: 80", "memory_gb: 0.000001")
        (tmp_path / "tiny.yaml").write_text(tiny)
        assert main_in_process(capsys, "plan", "--spec", str(tmp_path / "tiny.yaml"), *form)[0] == 1
    spec.write_text("layers: 80\nwidth: 3\n")
    code, _, err = main_in_process(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "unknown keys ['width']" in err


@pytest.mark.alone  # (it measures the machine)
def test_calibrate_then_plan_a_config_for_this_machine(tmp_path, monkeypatch, capsys):
    """`shardwise calibrate` as a user runs it; `shardwise plan` in this process (`main`): a
    command's start costs 2 s of imports, four times here."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def plan(*more: str) -> tuple[int, str, str]:
        return main_in_process(capsys, "plan", "--config", "digits", "--nproc", "2", *more)

    code, _, err = plan()
    assert code == 2
    assert err.strip().splitlines() == [
        "shardwise: plan: no calibration for 2 ranks on this machine: run shardwise calibrate "
        "--nproc 2"
    ]
    argv = ["calibrate", "--nproc", "2", "--passes", "1", "--quick"]
    argv += ["--calls", "10"]  # (the points' count and order are checked, not their accuracy)
    started = time.time()
    done = run_cli(*argv, timeout=300, env={"XDG_CACHE_HOME": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    stored = next((tmp_path / "shardwise" / "calibration").glob("*-n2-t*.json"))
    rates = json.loads(stored.read_text())
    assert started < rates["measured_at"] < time.time()  # when: its age is told with its use
    assert rates["flop_rate"] > 0 and 0 < rates["concurrency"] <= 2 and rates["sample_read_s"] > 0
    # (and DDP's sum, ZeRO-2/3's and ZeRO's gathers through shared memory, both ranks being
    # on this one host)
    shared = {"shared_all_reduce", "shared_reduce_scatter", "shared_all_gather"}
    one_host = shared if shared_memory.supported() else set()
    assert set(rates["collectives"]) == calibrate.KINDS | one_host
    # A small collective's wait after each burst of compute, the bursts longer and longer.
    bursts = [burst for burst, _ in rates["arrival_waits"]]
    assert len(bursts) == len(calibrate.BURSTS) and bursts == sorted(bursts)
    assert all(wait > 0 for _, wait in rates["arrival_waits"])
    # A mean time per payload, 8 B to 4 MiB (volumes as comm counts them).
    for kind in calibrate.KINDS | one_host:
        points = rates["collectives"][kind]["points"]
        # A prefetched call adds what it costs beyond the compute it overlaps: a small one can
        # add nothing (measured 0 after the clamp, seen at 4 B with 10 calls), never less.
        least = 0.0 if kind.startswith("prefetched_") else 1e-12
        assert len(points) == 6 and all(seconds >= least for _, seconds in points), (kind, points)
        assert [v for v, _ in points] == sorted(v for v, _ in points)
    code, out, err = plan("--json")
    assert code == 0, err[-2000:]
    rows = json.loads(out)
    names = {row["strategy"] for row in rows}
    assert {"ddp", "ddp-ring", "zero1", "zero2", "zero3", "pp2-gpipe", "pp2-1f1b"} <= names
    times = [row["step_time_s"] for row in rows]
    assert times == sorted(times) and all(t > 0 for t in times)
    zero = {row["strategy"]: row["memory_bytes"] for row in rows}
    assert zero["zero3"] < zero["zero2"] < zero["zero1"] < zero["ddp"]
    assert list(tmp_path.glob("runs*")) == []  # nothing written but the calibration
    # A batch of 6 a rank: a pipeline over both ranks runs (and is priced) at 12, which its 4
    # micro-batches divide; before, the candidate was checked at 6 and the plan failed whole.
    code, out, err = plan("--set", "data.batch_size=6", "--json")
    assert code == 0, err[-2000:]
    by_name = {row["strategy"]: row for row in json.loads(out)}
    assert by_name["ddp"]["batch_size"] == 6 and by_name["pp2-1f1b"]["batch_size"] == 12
    del rates["collectives"]["all_reduce"]["points"]  # as an older shardwise wrote it
    stored.write_text(json.dumps(rates))
    code, _, err = plan()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "from an older shardwise" in err and "calibrate --nproc 2" in err


def test_a_calibration_says_how_old_it_is_and_when_to_measure_again():
    at = 1_800_000_000.0
    assert calibrate.age_note({"measured_at": at}, now=at + 1800) == "calibrated 0.5 h ago"
    old = calibrate.age_note({"measured_at": at}, now=at + 27 * 3600)
    assert old.startswith("calibrated 27.0 h ago: rates drift") and "recalibrate" in old
    assert "unknown time" in calibrate.age_note({})  # (from an older shardwise)


def test_calibration_passes_are_averaged_point_by_point():
    def table(scale: float) -> dict:  # one pass: seconds = scale x (1 ms + volume / 1 GB/s)
        points = [[v, scale * (1e-3 + v / 1e9)] for v in (8, 4096, 65536)]
        return {"all_reduce": {"points": points, "groups": {"2": {"points": points}}}}

    averaged = calibrate._averaged([table(1.0), table(2.0), table(3.0)])
    for rates in (averaged["all_reduce"], averaged["all_reduce"]["groups"]["2"]):
        assert [v for v, _ in rates["points"]] == [8, 4096, 65536]
        means = [2 * (1e-3 + v / 1e9) for v in (8, 4096, 65536)]  # each point's mean
        assert [t for _, t in rates["points"]] == pytest.approx(means)
        assert rates["latency_s"] == pytest.approx(2e-3)  # the line through the means
        assert rates["bandwidth"] == pytest.approx(0.5e9)


def test_a_one_stage_plan_holds_the_embedding_and_the_head():
    """2 layers of h 4096 under a 256,000-token vocabulary: 2.51B parameters, 40.1 GB of model
    state (16 bytes each) on one device. Before, a one-stage plan counted one vocabulary matrix
    (23.4 GB of state) and fitted in 30 GB without offload."""
    spec = TransformerSpec(layers=2, hidden=4096, heads=32, seq=2048, vocab=256000, batch=1)
    fits, rejected = search(spec, ClusterSpec(devices=1, memory_gb=30))
    assert fits and all(plan.offload for plan in fits)
    for plan in rejected:
        state = sum(plan.memory[k] for k in ("params", "grads", "optimizer"))
        if not plan.offload:
            assert state >= 16 * spec.params(), plan.strategy


def test_model_states_send_what_a_ring_sends():
    """2 (N-1)/N of the gradients for an all-reduce, a third more for ZeRO-3 (the paper's 2Ψ
    and 3Ψ are the large-N figures): at 2 devices, half of what was printed before."""
    assert model_states(1e9, 2, 0, "fp32").comm_bytes_per_step == 4e9
    assert model_states(1e9, 2, 3, "fp32").comm_bytes_per_step == 6e9
    assert model_states(1e9, 1, 0, "fp32").comm_bytes_per_step == 0.0
