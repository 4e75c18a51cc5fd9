# Quick start: `make demo` and `make test`; each creates/reuses the local virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q mpich
	$(PY) -m pip install -q -e ".[dev,mpi]"
	touch $(STAMP)

test: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P benchmarks/comm_bandwidth.py --launch 2 --sizes-mb 1,4,16,64

clean:
	rm -rf $(VENV) build *.egg-info
