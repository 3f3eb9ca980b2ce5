"""Bad input to the planner and the calibration it prices at: every bad number on the command
line, in a --spec file or in a stored calibration is one line naming it, never a traceback nor
a NaN in a prediction; the search answers at any device count it accepts."""

from __future__ import annotations

import json
import math
import time

import pytest

from harness import run_cli, train_args
from shardwise import cli
from shardwise.plan import calibrate
from shardwise.plan.search import PRESETS, ClusterSpec, TransformerSpec, candidates

# (argv, what the one line says); "SPEC" stands for a YAML file holding the case's text.
HUGE = [arg for n in ("devices", "batch", "heads", "hidden") for arg in (f"--{n}", "735134400")]
SPEC = "layers: 80\nhidden: 8192\nheads: 64\nseq: 4096\nvocab: 32000\nbatch: 1024\n"
BAD = [
    (["plan", "--params", "nan", "--devices", "8"], "--params must be a number from 1 to"),
    (["plan", "--params", "inf", "--devices", "8"], "--params must be a number"),
    (["plan", "--params", "-1", "--devices", "8"], "--params must be a number"),
    (["plan", "--params", "7e9", "--devices", "0"], "--devices must be a whole number"),
    (["plan", "--params", "7e9", "--devices", "2.5"], "--devices must be a whole number"),
    (["plan", "--params", "7e9", "--devices", "lots"], "got 'lots'"),
    (["plan", "--preset", "70b", "--devices", "1e10"], "from 1 to 1,000,000,000, got 1e+10"),
    (["plan", "--preset", "70b", "--devices", "64", "--memory-gb", "nan"], "--memory-gb must"),
    (["plan", "--preset", "70b", "--devices", "64", "--memory-gb", "0"], "--memory-gb must"),
    (["plan", "--preset", "70b", "--devices", "64", "--network-gbit", "inf"], "--network-gbit"),
    (["plan", "--preset", "70b", "--devices", "64", "--tflops", "-400"], "--tflops must"),
    (["plan", "--preset", "70b", "--devices", "64", "--devices-per-node", "0"], "per-node must"),
    (["plan", "--preset", "70b", "--devices", "64", "--top", "-1"], "--top must"),
    (["plan", "--preset", "70b", "--devices", "64", "--layers", "0"], "--layers must"),
    (["plan", "--preset", "70b", "--devices", "64", "--hidden", "8192.5"], "--hidden must"),
    (["plan", "--preset", "70b", "--devices", "64", "--heads", "-64"], "--heads must"),
    (["plan", "--preset", "70b", "--devices", "64", "--seq", "inf"], "--seq must"),
    (["plan", "--preset", "70b", "--devices", "64", "--vocab", "NaN"], "--vocab must"),
    (["plan", "--preset", "70b", "--devices", "64", "--batch", "0"], "--batch must"),
    (["plan", "--preset", "70b", "--devices", "64", "--ffn", "-1"], "--ffn must"),
    (["plan", "--preset", "70b", "--devices", "64", "--heads", "60"], "must divide hidden"),
    (["plan", "--config", "digits", "--nproc", "0"], "--nproc must be a whole number"),
    (["plan", "--config", "digits", "--nproc", "2"], "no calibration for 2 ranks"),
    # 735,134,400 has 1,344 divisors: as devices, batch and heads, 1,690,752 ways to split (ZeRO
    # 0-3 on every mesh; and 4 HSDP plans: its nodes of 8 over whole-world data parallel).
    (
        ["plan", "--preset", "70b", "--layers", "1e9", *HUGE],
        "split 1690756 ways, more than the 100000 priced at most",
    ),
    (["plan", "--spec", "SPEC", "devices: .nan\n"], "devices must be a whole number"),
    (["plan", "--spec", "SPEC", "devices: 64\nmemory_gb: -80\n"], "memory_gb must be a number"),
    (["plan", "--spec", "SPEC", "devices: 64\nnetwork_gbit: fast\n"], "got 'fast'"),
    (["plan", "--spec", "SPEC", "devices: true\n"], "devices must be a whole number"),
    (["plan", "--spec", "SPEC", "devices: [64\n"], "not YAML at line"),
    (["plan", "--spec", "SPEC", "devices: 8\ndevices: 64\n"], "key 'devices' given twice"),
    # Flags another question reads (before: ignored in silence)
    (["plan", "--params", "7e9", "--preset", "70b", "--devices", "2"], "alone: not with --preset"),
    (["plan", "--params", "7e9", "--devices", "8", "--layers", "3"], "alone: not with --layers"),
    (["plan", "--params", "7e9", "--devices", "8", "--tflops", "9"], "alone: not with --tflops"),
    (["plan", "--config", "digits", "--devices", "2"], "on this machine: not with --devices"),
    (["plan", "--preset", "70b", "--devices", "64", "--nproc", "2"], "--nproc: only with --config"),
    (["calibrate", "--nproc", "0"], "--nproc must be a whole number >= 1, got '0'"),
    (["calibrate", "--passes", "three"], "--passes must be a whole number >= 1"),
    (["calibrate", "--calls", "1.5"], "--calls must be a whole number >= 1"),
    # (before: a traceback after the whole measurement, a minute at the defaults)
    (["calibrate", "--out", "/proc/nope/c.json"], "c.json: [Errno 2] No such file or directory"),
    (["calibrate", "--out", "/"], "cannot write /: it is a directory (give a file's path)"),
]


@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_a_bad_number_is_one_line_and_exit_2(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (no calibration of this machine)
    if "SPEC" in argv:
        spec = tmp_path / "job.yaml"
        spec.write_text(SPEC + argv[-1])
        argv = [str(spec) if a == "SPEC" else a for a in argv[:-1]]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith(f"shardwise: {argv[0]}: "), err
    assert says in err


@pytest.mark.alone  # (bounded in seconds)
def test_a_billion_devices_are_planned_in_well_under_a_second(capsys):
    # The search walked every number up to the device count, twice: 49 s for 10^9 devices.
    # Now it walks the divisors of gcd(devices, batch). Against the definition (tp at most
    # 64, dividing the 64 heads; pp at most the 80 layers; few enough to walk here):
    argv = ["plan", "--preset", "70b", "--devices", "1e9", "--batch", "1e9", "--json"]
    started = time.perf_counter()
    assert cli.main(argv) == 0
    assert time.perf_counter() - started < 5  # (0.1 s alone on 2 shared cores)
    meshes = {(p["dp"], p["tp"], p["pp"]) for p in json.loads(capsys.readouterr().out)}
    n = 10**9
    expected = {
        (n // (tp * pp), tp, pp)
        for tp in range(1, 65)
        for pp in range(1, 81)
        if n % (tp * pp) == 0 and 64 % tp == 0 and 10**9 % (n // (tp * pp)) == 0
    }
    assert meshes == expected and len(meshes) > 10
    # With the preset's batch of 1,024 no split exists (dp would be over 10^9 / (64 x 80)).
    assert cli.main(["plan", "--preset", "70b", "--devices", "1e9"]) == 1
    assert "no dp x tp x pp makes 1000000000 devices" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["70b", "tiny_gpt"])
def test_the_meshes_searched_are_every_split_the_definition_allows(name):
    # Against the definition, walked the slow way: dp x tp x pp = devices, tp dividing the
    # heads (64 at most), pp at most the layers, dp dividing the batch; by tp, then pp.
    spec = PRESETS[name]
    for devices in range(1, 300):
        found = candidates(spec, ClusterSpec(devices=devices))
        meshes = list(dict.fromkeys((p.dp, p.tp, p.pp) for p in found))
        expected = [
            (devices // (tp * pp), tp, pp)
            for tp in range(1, devices + 1)
            for pp in range(1, devices + 1)
            if devices % (tp * pp) == 0
            and tp <= 64
            and spec.heads % tp == 0
            and pp <= spec.layers
            and spec.batch % (devices // (tp * pp)) == 0
        ]
        assert meshes == expected, devices


def test_specs_and_clusters_made_in_code_check_their_numbers():
    with pytest.raises(ValueError, match="devices must be a whole number"):
        ClusterSpec(devices=1.5)
    with pytest.raises(ValueError, match="tflops must be a number"):
        ClusterSpec(devices=8, tflops=math.nan)
    with pytest.raises(ValueError, match="ffn must be a whole number"):
        TransformerSpec(layers=2, hidden=8, heads=2, seq=4, vocab=5, batch=2, ffn=-1)


def _calibration(nproc: int = 2) -> dict:
    """A calibration of `nproc` ranks as `shardwise calibrate` writes it (made-up rates)."""
    rates = {"flop_rate": 1e11, "bytes_rate": 7e10, "op_overhead_s": 4e-6, "sample_read_s": 3e-6}
    points = [[8, 1e-4], [4096, 2e-4], [4 << 20, 2e-3]]
    timings = {"latency_s": 1e-4, "bandwidth": 2e9, "points": points}
    collectives = {kind: json.loads(json.dumps(timings)) for kind in calibrate.KINDS}
    collectives["all_reduce"]["groups"] = {"2": json.loads(json.dumps(timings))}
    collectives["send"]["bandwidth"] = math.inf  # (as _fit writes where seconds stay flat)
    return {
        **{"host": "h", "nproc": nproc, "threads_per_rank": 1, "measured_at": time.time()},
        **rates,
        "concurrency": 2.0,
        "shared": dict(rates),
        "collectives": collectives,
        "arrival_waits": [[1e-3, 1e-4], [5e-3, 2e-4], [0.1, 1e-3]],
    }


def _set(path: str, value: object):
    def poison(cal: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            cal = cal[int(key)] if isinstance(cal, list) else cal[key]
        if value is KeyError:
            del cal[last]
        else:
            cal[int(last) if isinstance(cal, list) else last] = value

    return poison


POISONS = [  # (what is done to a good calibration, the field the one line names)
    (_set("flop_rate", "fast"), "flop_rate must be a number from 1 to 1e+18, got 'fast'"),
    (_set("flop_rate", math.nan), "flop_rate must be a number from 1 to 1e+18, got nan"),
    (_set("bytes_rate", math.inf), "bytes_rate must be a number"),
    (_set("op_overhead_s", True), "op_overhead_s must be a number from 0 to 3600, got True"),
    (_set("op_overhead_s", KeyError), "op_overhead_s is missing"),
    (_set("sample_read_s", -1), "sample_read_s must be a number"),
    (_set("concurrency", 0), "concurrency must be a number from 0.01 to 2, got 0"),
    (_set("measured_at", "today"), "measured_at must be a number"),
    (_set("nproc", 4), "nproc must be 2, got 4"),
    (_set("shared.bytes_rate", None), "shared.bytes_rate must be a number"),
    (_set("shared.collectives", {}), "shared.collectives: not one of"),
    (_set("collectives.exchange", KeyError), "collectives.exchange is missing"),
    (_set("collectives.all_reduce.points", KeyError), "from an older shardwise"),
    (_set("collectives.post", [1, 2]), "collectives.post must be a JSON object, got an array"),
    (_set("collectives.send.points.1.1", "2e-4"), "collectives.send.points[1][1] must be"),
    (_set("collectives.send.points.1", [4096]), "collectives.send.points[1] must be a pair"),
    (_set("collectives.send.points.1.0", 1 << 30), "points[2][0] is below the x before it"),
    (_set("collectives.send.bandwidth", -math.inf), "collectives.send.bandwidth must be"),
    (_set("collectives.all_reduce.groups.2.latency_s", math.nan), "groups.2.latency_s must"),
    (_set("arrival_waits", [[1e-3, 1e-4]]), "arrival_waits must be a list of 2 or more"),
    (_set("arrival_waits.0.1", math.inf), "arrival_waits[0][1] must be a number"),
]


@pytest.mark.parametrize(("poison", "says"), POISONS, ids=[s.split(" ")[0] for _, s in POISONS])
def test_a_poisoned_calibration_is_one_line_naming_its_field(poison, says, tmp_path):
    path = tmp_path / "calibration.json"
    good = _calibration()
    path.write_text(json.dumps(good))  # (NaN and Infinity as Python's json writes them)
    assert calibrate.load(2, path) == good  # (what calibrate writes loads: the checks pass it)
    poison(good)
    path.write_text(json.dumps(good))
    with pytest.raises(ValueError) as raised:
        calibrate.load(2, path)
    line = str(raised.value)
    assert len(line.splitlines()) == 1 and says in line
    assert line.startswith(f"{path}: ") and line.endswith("run shardwise calibrate --nproc 2 again")


@pytest.mark.parametrize(
    "text", [b"{", b"\xff\xfe", b"[" * 100_000, b" " * (calibrate.MAX_FILE_BYTES + 1)]
)
def test_a_calibration_that_is_not_json_is_one_line(text, tmp_path):
    path = tmp_path / "calibration.json"
    path.write_bytes(text)
    with pytest.raises(ValueError, match=r"(not JSON|bytes, not a calibration).*again$"):
        calibrate.load(2, path)


def test_plan_config_at_a_poisoned_calibration_is_one_line(tmp_path, monkeypatch, capsys):
    # Its ranking is by predicted step time: without usable rates there is none to give.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cal = _calibration()
    cal["flop_rate"] = "fast"
    calibrate.cache_path(2).parent.mkdir(parents=True)
    calibrate.cache_path(2).write_text(json.dumps(cal))
    assert cli.main(["plan", "--config", "digits", "--nproc", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"shardwise: plan: {calibrate.cache_path(2)}: flop_rate must be a number from 1 to "
        "1e+18, got 'fast': run shardwise calibrate --nproc 2 again"
    ]


def test_training_at_a_poisoned_calibration_says_so_and_trains_without_a_step_time(tmp_path):
    # A NaN rate priced every step at "nan ms"; a string stopped every run. Now the run
    # notes the file and the field, and goes on with no step time predicted.
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    cal = _calibration(nproc=1)
    cal["flop_rate"] = math.nan
    file = tmp_path / "shardwise" / "calibration" / calibrate.cache_path(1).name
    file.parent.mkdir(parents=True)
    file.write_text(json.dumps(cal))
    argv = train_args(tmp_path / "run", "train.steps=2", config=None, nproc=1, measure=True)
    done = run_cli(*argv, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    note = f"shardwise: {file}: flop_rate must be a number from 1 to 1e+18, got nan: run "
    note += "shardwise calibrate --nproc 1 again: no step time predicted"
    assert note in done.stdout.splitlines()
    assert "nan" not in done.stdout.replace(note, "").lower()
    predicted = json.loads((tmp_path / "run" / "prediction.json").read_text())
    assert "step_time_s" not in predicted and predicted["memory"]["total"] > 0
