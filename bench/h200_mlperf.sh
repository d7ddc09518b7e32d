#!/usr/bin/env bash
# MLPerf LoadGen against dlad on the device machine, in one device call:
#   run(command="bash bench/h200_mlperf.sh", carry=[".whl-mlperf"], timeout_s=600)
# the emulated DLA cores (numeric) and the real GPU (the torch engine) as one pool; LoadGen's
# four scenarios, then AccuracyOnly scored with mAP (bench/mlperf.py, docs/BENCHMARKS.md §14).
# .whl-mlperf: bench/fetch_h200_wheels.sh.
set -uo pipefail
WHEELS=.whl-mlperf source bench/h200_env.sh
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/gpu.txt"
timeout 560 python3 bench/mlperf.py --engines gpu --samples 300 --duration-s "${SECONDS_A_RUN:-60}" \
    --server-qps "${SERVER_QPS:-800}" --server-latency-ms 50 --offline-qps "${OFFLINE_QPS:-4000}" \
    --single-stream-ms "${SS_MS:-2}" --multi-stream-ms "${MS_MS:-7}" \
    --accuracy --out "$out/mlperf" --json "$out/mlperf.json" 2>&1 | grep -v '^\$' | tail -20
