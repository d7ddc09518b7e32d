#!/usr/bin/env bash
# The pool on the device machine, in one device call:
#   run(command="bash bench/h200_pool.sh", carry=[".whl"], timeout_s=600)
# 1. the GPU tests (CUDA: kernels, the torch engine, GPU batches); 2. its batch curve (bench/torch_gpu_batches.py);
# 3. one model on two emulated DLAs plus the real GPU through the SDK (bench/h200_pool.py).
set -uo pipefail
source bench/h200_env.sh
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/gpu.txt"
status=0
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W "ignore::DeprecationWarning" \
        tests/dlad/gpu tests/dlad/test_torch_gpu.py tests/dlad/test_emulated_gpu.py tests/dlad/test_dram.py -rs 2>&1 \
        | tee "$out/torch_tests.log" | tail -15
    status=${PIPESTATUS[0]}
fi
timeout 150 python3 bench/torch_gpu_batches.py --replays 300 --out "$out/torch_batches.json" 2>&1 | tail -25
timeout 300 python3 bench/h200_pool.py --out "$out/pool" 2>&1 | grep -v '^\$' | tail -40
exit "$status"
