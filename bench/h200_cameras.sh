#!/usr/bin/env bash
# The camera benchmark (bench/cameras.py) on the device machine, with GPU pre/post:
#   run(command="bash bench/h200_cameras.sh", carry=[".whl-cam"], timeout_s=600)
# .whl-cam/ (the daemon's wheels, PyAV and psutil: what fits the device tool's 64 MiB beside the
# tree) is made here by bench/fetch_h200_wheels.sh. PYTEST_ARGS runs tests first (for example
# the GPU batch tests); BENCH_ARGS replaces the benchmark's arguments.
set -uo pipefail
WHEELS="${WHEELS:-.whl-cam}"
source bench/h200_env.sh
status=0
if [[ -n "${PYTEST_ARGS:-}" ]]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -W "ignore::DeprecationWarning" \
        ${PYTEST_ARGS} -rs 2>&1 | tee "$out/gpu_tests.log" | tail -15
    status=${PIPESTATUS[0]}
fi
timeout "${BENCH_TIMEOUT:-420}" python3 bench/cameras.py --pre-post cuda --json "$out/cameras.json" \
    ${BENCH_ARGS:---cameras 1 8 16 --size 1920x1080 --seconds 10}
exit "$status"
