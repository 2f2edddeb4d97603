#!/usr/bin/env bash
# The CUDA path on one GPU, in a few minutes: the CUDA tests (tests/test_cuda.py), then tokens/s and MFU of
# the presets with and without torch.compile (bench/gpu_mfu.py). Figures go to $OUT (bench/results/ by
# default). Runs with the machine's python3 (PYTHON=...), the repository on PYTHONPATH; no network.
# Without a CUDA device it says so and exits 0. The 2-peer swarm on one GPU needs hivemind on the GPU
# machine and is not part of this script yet.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device here: the CUDA checks are skipped"
    exit 0
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DILOCOD_CACHE=${DILOCOD_CACHE:-/tmp/dilocod-cache}
status=0
# --noconftest: the test harness's fixtures start hivemind; the CUDA tests need none of them.
$PY -m pytest -q --noconftest -p no:cacheprovider -o addopts="" tests/test_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
$PY bench/gpu_mfu.py --out "$OUT/gpu_mfu.json" 2>&1 | tee "$OUT/gpu_mfu.log" || status=1
exit $status
