import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests run ranks with one thread each (2 cores, up to 4 ranks); keep the parent quiet too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

from harness import kill_processes_of

# Test files that assert wall-clock bounds (heartbeats, hang and straggler timeouts, the time to
# recover), race a backend's own thread (the peak meter), or measure this machine (calibration,
# step-time models): `make test` runs them after the others, one at a time, with nothing beside
# them. The others (equivalence and unit tests, whose results never depend on the load) run two
# files at once (`-n 2`), which the machine's idle moments (start-up, waits) pay for.
ALONE = {
    "test_balance.py",
    "test_bench_planner.py",
    "test_cli.py",
    "test_costs.py",
    "test_elastic.py",
    "test_emulated_cluster.py",
    "test_faults.py",
    "test_jobstore.py",
    "test_mixed_precision.py",
    "test_observability.py",
    "test_own_loop.py",
    "test_plan_inputs.py",
    "test_planner.py",
    "test_processes.py",
    "test_ps.py",
    "test_ps_fuzz.py",
    "test_ps_liveness.py",
    "test_ps_nonfinite.py",
    "test_report_inputs.py",
    "test_resume.py",
    "test_script_watchdog.py",
    "test_steptime.py",
    "test_work_queue.py",
    "test_zygote.py",
}


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """`make test`'s two runs (`-m "not alone"`, `-m alone`) do not import the other's files:
    collecting them costs seconds a process (inductor, transformers) for tests deselected."""
    if collection_path.suffix != ".py":
        return None
    alone = collection_path.name in ALONE
    selected = {"alone": alone, "not alone": not alone}.get(config.option.markexpr, True)
    return True if not selected else None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in ALONE:
            item.add_marker(pytest.mark.alone)


@pytest.fixture
def run_dir(tmp_path) -> Iterator[Path]:
    """A job's run directory, not created (`tmp_path / "run"`). Whatever process of the job is
    still running when the test ends, passed or failed, is killed: none is left to load the
    machine under the tests that follow."""
    yield tmp_path / "run"
    kill_processes_of(tmp_path / "run")


@pytest.fixture(scope="session")
def _empty_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def uncalibrated(_empty_cache, monkeypatch) -> Path:
    """The commands a test runs find no calibration of this machine, whatever the user's cache
    holds (`XDG_CACHE_HOME` is a cache of the tests' own, out of the working directory, where
    nothing calibrates): no step time is predicted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(_empty_cache))
    return _empty_cache
