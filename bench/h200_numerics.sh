#!/usr/bin/env bash
# The emulated DLA core's integers on the H200 machine's host CPU (Intel Xeon: AVX-512 VNNI and
# AMX; a second x86 ISA beside the project's AMD EPYC machines), through the device tool:
#   run(command="bash bench/h200_numerics.sh", carry=[".whl"], timeout_s=600)
# .whl/ is made here by bench/fetch_h200_wheels.sh (pyzmq, structlog, modelopt & co.). Prints the
# kernel path and head digests (bench/int8_digest.py: compare "heads_sha256.auto" with the
# x86-64 digest recorded in dlad/models/demo/expected_detections.json), then runs the numerics
# tests: exact sums, the bundled model's bytes and detections, the INT8 graph against its
# integer and torch references, the daemon's round trip and examples/detect.py's comparison.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD:$PWD/clients" PYTHONUNBUFFERED=1 DLAD_CACHE_DIR=/tmp/dlad-cache
out="${OUT:-/tmp/out}"; mkdir -p "$out"
grep -m1 "model name" /proc/cpuinfo | tee "$out/cpu.txt"
grep -m1 -o -w -E "avx512_vnni|amx_int8|avx_vnni" /proc/cpuinfo | sort -u | tr '\n' ' ' | tee -a "$out/cpu.txt"; echo
python3 -c "import onnxruntime, onnx, numpy; print('onnxruntime', onnxruntime.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__)"
python3 bench/int8_digest.py | tee "$out/int8_digest.json"
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    -W "ignore::DeprecationWarning" -rs \
    tests/dlad/test_int8_layout.py tests/dlad/test_int8_engine.py tests/dlad/test_bundled_model.py \
    tests/prep/test_emulate_graph.py "tests/dlad/test_daemon.py::test_round_trip_detections_match_prep" \
    tests/dlad/test_examples.py ${PYTEST_EXTRA:-} 2>&1 | tee "$out/numerics_tests.log" | tail -25
exit "${PIPESTATUS[0]}"
