import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests run ranks with one thread each (2 cores, up to 4 ranks); keep the parent quiet too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import harness
from harness import kill_processes_of

# A test that asserts wall-clock bounds (heartbeats, hang and straggler timeouts, the time to
# recover), races a backend's own thread (the peak meter) or measures this machine (calibration)
# is marked `alone`, each with its reason (`pytestmark = pytest.mark.alone` where the whole file
# is): `make test` runs those after the others, one at a time, with nothing beside them. The
# others (equivalence, unit and end-to-end tests whose results never depend on the load, and
# whose deadlines only bound a failure) run two files at once (`-n 2`), which the machine's idle
# moments (start-up, waits) pay for.
ALONE = "pytest.mark.alone"
WHOLLY_ALONE = "pytestmark = pytest.mark.alone"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """`make test`'s two runs (`-m "not alone"`, `-m alone`) do not import files that hold
    nothing for them: collecting them costs seconds a process (inductor, transformers) for
    tests deselected. (Read from the file's text: whether it marks a test, or itself, alone.)"""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    wanted = config.option.markexpr
    if wanted not in ("alone", "not alone"):
        return None
    text = collection_path.read_text()
    if wanted == "alone":
        return True if ALONE not in text else None
    return True if WHOLLY_ALONE in text else None


# The files whose tests take longest, longest first (seconds of the `-n 2` run on 2 cores,
# measured 2026-12-01: test_cli 66 ... test_steptime 9; test_compile 41 when inductor's cache is
# cold, as in CI). xdist hands whole files to its two workers in collection order
# (`--no-loadscope-reorder`, from pytest-xdist 3.6; its default order, by count of tests, puts
# one-test files such as test_compile last): given out first, none of them is what one worker
# still runs while the other idles at the end. Files not named follow, in their order.
LONGEST_FIRST = (
    "test_cli", "test_ps", "test_zygote", "test_processes", "test_compile", "test_hf_models",
    "test_layerwise_optim", "test_model_parallel", "test_zero", "test_checkpoint", "test_mesh3",
    "test_docs", "test_evaluation", "test_ddp", "test_user_models", "test_shared_memory",
    "test_meta_init", "test_emulated_cluster", "test_state", "test_hf_pretrained",
    "test_ps_fuzz", "test_faults", "test_mixed_precision", "test_recompute", "test_relaxed",
    "test_deferred_init", "test_resume", "test_weighted_batches", "test_compression",
    "test_pipeline_schedules", "test_hf_export", "test_steptime",
)  # fmt: skip


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.stem, len(place)))  # (stable: else as found)


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
def fresh_launchers(monkeypatch) -> None:
    """`harness.run_cli` and `start_cli` start each command as a new Python process, as a
    user's shell does, not as a fork of the test process's zygote: for the tests of what a
    launcher's processes are (their command lines in /proc, their signals as they start, the
    ports they listen on)."""
    monkeypatch.setattr(harness, "FRESH_LAUNCHERS", True)


@pytest.fixture
def uncalibrated(_empty_cache, monkeypatch) -> Path:
    """The commands a test runs find no calibration of this machine, whatever the user's cache
    holds (`XDG_CACHE_HOME` is a cache of the tests' own, out of the working directory, where
    nothing calibrates): no step time is predicted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(_empty_cache))
    return _empty_cache
