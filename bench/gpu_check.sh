#!/usr/bin/env bash
# The CUDA path on one GPU, in a few minutes: the CUDA tests (tests/test_cuda.py), then tokens/s and MFU of
# the presets with and without torch.compile (bench/gpu_mfu.py). Figures go to $OUT (bench/results/ by
# default). Runs with the machine's python3 (PYTHON=...), the repository on PYTHONPATH; no network.
# Without a CUDA device it says so and exits 0. Last, a bootstrap and 2 peers of the 124m preset share
# the GPU for a few rounds (bench/size.py: per-phase times and each process's host memory a parameter),
# where $PY can import hivemind (with its p2pd) and the daemon; elsewhere that part says so and is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
found=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null)
if [ "$found" != cuda ]; then
    if [ "$found" = cpu ]; then
        echo "gpu_check: no CUDA device here: the CUDA checks are skipped"
    else
        echo "gpu_check: $PY has no torch: the CUDA checks are skipped (PYTHON=... names another python)"
    fi
    exit 0
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DILOCOD_CACHE=${DILOCOD_CACHE:-/tmp/dilocod-cache}
status=0
# --noconftest: the test harness's fixtures start hivemind; the CUDA tests need none of them.
$PY -m pytest -q --noconftest -p no:cacheprovider -o addopts="" tests/test_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
$PY bench/gpu_mfu.py --out "$OUT/gpu_mfu.json" 2>&1 | tee "$OUT/gpu_mfu.log" || status=1
if $PY -c "import hivemind, dilocod.node.peer" 2>/dev/null; then
    timeout 300 $PY bench/size.py --preset 124m --peers 2 --rounds 3 --set trainer.device=cuda \
        --set trainer.batch_size=8 --set trainer.seq_len=512 --json 2>&1 | tee "$OUT/gpu_swarm.log" || status=1
else
    echo "gpu_check: $PY cannot import hivemind and the daemon: the 2-peer swarm on the GPU is skipped" | tee "$OUT/gpu_swarm.log"
fi
exit $status
