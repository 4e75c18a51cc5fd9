# Quick start: `make demo` and `make test`; each creates/reuses the local virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: venv test clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q mpich
	$(PY) -m pip install -q -e ".[dev,mpi,bench]"
	touch $(STAMP)

# Two pytest workers, each taking whole files: a serial run keeps 2 cores ~30% busy (the ranks
# mostly start, wait and exchange), two workers about twice as busy. Every multi-rank test has
# its own file store or port and namespace prefix, so the workers never collide. TEST_WORKERS= runs serially.
TEST_WORKERS ?= -n 2 --dist loadfile

test: $(STAMP)
	$(VENV)/bin/ruff check .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P -m pytest -q -p no:cacheprovider --durations=15 $(TEST_WORKERS)

# make demo (the main job), make bench, make bench-micro
include benchmarks/bench.mk

clean:
	rm -rf $(VENV) build *.egg-info
