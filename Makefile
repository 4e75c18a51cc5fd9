# Quick start: `make demo` and `make test`; each creates/reuses the local virtual environment.
# `make test-compat`: the framework integrations against older framework releases, and torchtitan (.venv-compat).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: venv test test-compat clean

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
# --no-loadscope-reorder: the files in tests/conftest.py's order (the longest first), not xdist's (by number of tests).
TEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(VENV)/bin/ruff check .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P -m pytest -q -p no:cacheprovider --durations=15 $(TEST_WORKERS)

# make test-compat: the framework integrations (examples/ under their launchers, the checkpoints'
# consolidation lines of compressed_opt.integrations) against the previous minor release of each
# framework, in a venv of their own (make test keeps pyproject's pins). The newest release of each
# previous minor line; the same CPU torch.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
# torchtitan (compressed_opt.integrations.torchtitan) is tested here too, at the release it was
# written for: its three 4-rank runs and one 8-rank run take ~7 minutes and it pulls ~400 MB (pandas, pyarrow,
# datasets, wandb), more than make test's budget; tests/test_torchtitan.py skips where it is absent.
COMPAT_PINS ?= transformers==5.22.2 accelerate==1.14.0 pytorch-lightning==2.5.6 torchtitan==0.3.0
COMPAT_TESTS ?= tests/test_integrations.py tests/test_framework_integrations.py tests/test_torchtitan.py
COMPAT_STAMP := $(COMPAT_VENV)/.installed

$(COMPAT_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q "$(TORCH_PIN)"
	$(COMPAT_PY) -m pip install -q -e . $(COMPAT_PINS) "pytest>=7" "pytest-timeout>=2.1" "$(TORCH_PIN)"
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	@$(COMPAT_PY) -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|pytorch-lightning) '
	PATH="$(CURDIR)/$(COMPAT_VENV)/bin:$$PATH" $(COMPAT_PY) -P -m pytest -q -p no:cacheprovider --durations=15 \
		$(COMPAT_TESTS)

# make demo (the main job), make bench, make bench-micro
include benchmarks/bench.mk

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info
