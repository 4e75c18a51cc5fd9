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

test: $(STAMP)
	$(VENV)/bin/ruff check .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P -m pytest -q -p no:cacheprovider --durations=15

# make demo (the main job), make bench, make bench-micro
include benchmarks/bench.mk

clean:
	rm -rf $(VENV) build *.egg-info
