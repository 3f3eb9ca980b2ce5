# The two commands of the README. Each sets up .venv (CPU torch pinned by constraints.txt) first.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
# /opt/wheels holds the CPU torch wheel on this project's machines; elsewhere pip uses PyPI.
FIND    := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: setup demo test lint bench clean

# uv installs the same pins faster than pip (37 s against 58 s on this project's 2-core
# machines, most of it compiling torch's bytecode as pip does: where PYTHONDONTWRITEBYTECODE is
# set, as there, a module without it is compiled anew by every process). Without uv, pip.
INSTALL := $(FIND) -c constraints.txt -e '.[dev,hf]'

$(BIN)/shardwise: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	($(PIP) install --quiet --disable-pip-version-check uv && \
	  $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python $(INSTALL)) || \
	  $(PIP) install --quiet --disable-pip-version-check $(INSTALL)
	@touch $@

setup: $(BIN)/shardwise

demo: setup  ## set up and run the default job (digits, 2 ranks, our DDP)
	$(BIN)/shardwise train

# First our own modules' bytecode and the tests' helpers' (an editable install compiles none):
# where none is written, every process the tests start (a job's launcher, each of its ranks)
# would compile them anew. pytest keeps the bytecode of the test files it rewrites (for it,
# PYTHONDONTWRITEBYTECODE is emptied): its three processes (two workers, then the run of the
# tests alone) would each rewrite them, 3 s of CPU apiece. Longest files first: tests/conftest.py.
test: setup  ## set up, lint and run the test suite
	$(BIN)/python -m compileall -q src tests
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not alone"
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m alone

bench: setup  ## ours vs torch DDP, and ZeRO vs FSDP2, world size 2
	$(BIN)/shardwise bench ddp --world-size 2
	$(BIN)/shardwise bench zero --world-size 2

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
