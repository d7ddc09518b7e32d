#!/usr/bin/env bash
# The GPU tests and the GPU pre/post benchmark on the project's H200 machine (device tool):
#   run(command="bash bench/h200_gpu.sh", carry=[".whl"], timeout_s=600)
# .whl/ is made here by bench/fetch_h200_wheels.sh (pyzmq, structlog, modelopt & co.).
# PYTEST_ARGS picks the tests, BENCH_ARGS the benchmark's sections (--only post_dfl), SKIP_TESTS=1
# and SKIP_BENCH=1 leave either out.
set -uo pipefail
source bench/h200_env.sh
python3 -c "import cuda.bindings, cuda.core; print('cuda-bindings', cuda.bindings.__version__)" || true
status=0
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
        -W "ignore::DeprecationWarning" ${PYTEST_ARGS:-tests/dlad/gpu tests/prep/test_qat_gpu.py} \
        -rs 2>&1 | tee "$out/gpu_tests.log" | tail -40
    status=${PIPESTATUS[0]}
fi
if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
    timeout "${BENCH_TIMEOUT:-200}" python3 bench/gpu_prepost.py --json "$out/gpu_prepost.json" ${BENCH_ARGS:-} 2>&1 | tail -60
    # Per-kernel durations of one batch-1 post-processing frame (Nsight Compute).
    if command -v ncu >/dev/null; then
        timeout 120 ncu --clock-control none -k regex:post_ --metrics gpu__time_duration.sum \
            python3 bench/gpu_post_profile.py 300 2>&1 | grep -E "post_|duration|kept" | tail -9
    fi
fi
exit "$status"
