import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests run ranks with one thread each (2 cores, up to 4 ranks); keep the parent quiet too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

from harness import kill_processes_of


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
