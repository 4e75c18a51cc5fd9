#!/usr/bin/env bash
# The GPU checks in one command, for the first session lent a CUDA machine (about 3-5 minutes on one
# GPU): the CuPy kernels against the CPU reference (tests/gpu, which skips without a GPU), the
# kernel throughput against a copy of the same bytes, and a compression-stage step() against
# torch.optim.AdamW(fused=True) on the GPU. Results (logs and JSON) go to $OUT if set (the device
# tool's folder that comes back), else to ./gpu-check. Nothing is fetched: it needs a Python with
# PyTorch (CUDA), CuPy, pytest, pytest-timeout and setuptools already installed (PYTHON=...,
# default python3), and installs this checkout into a temporary folder without the network.
#
#   bash benchmarks/gpu_check.sh                 # then copy the figures into docs/benchmarks.md
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-gpu-check}
SITE=$(mktemp -d /tmp/co-site.XXXXXX)
mkdir -p "$DEST"
rc=0
$PY -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" . > "$DEST/install.log" 2>&1 \
    || { echo "install failed"; cat "$DEST/install.log"; exit 1; }
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
$PY -c 'import torch, compressed_opt.cuda.gpu as g; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
"device", torch.cuda.get_device_name() if torch.cuda.is_available() else None, "kernels", g.is_available())' \
    | tee "$DEST/environment.txt"
echo "== tests/gpu"
timeout 240 $PY -P -m pytest -q -p no:cacheprovider -p no:xdist -o addopts= tests/gpu 2>&1 | tee "$DEST/gpu_tests.log" \
    || rc=1
echo "== kernels against a copy"
timeout 120 $PY -P benchmarks/kernels.py --device cuda --sizes-mb 16,64,256 --json "$DEST/kernels_cuda.json" 2>&1 \
    | tee "$DEST/kernels_cuda.log" || rc=1
echo "== step() against fused AdamW"
timeout 180 $PY -P benchmarks/step_vs_fused.py --device cuda --shapes 9000000x100,64000000x4 --steps 9 \
    --out "$DEST/step_vs_fused_cuda.json" 2>&1 | tee "$DEST/step_vs_fused_cuda.log" || rc=1
rm -rf "$SITE"
exit $rc
