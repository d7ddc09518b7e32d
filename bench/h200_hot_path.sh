#!/usr/bin/env bash
# The device machine's measurements of the hot path, shared-memory frames and GPU post latency:
#   run(command="bash bench/h200_hot_path.sh tests|gpu|daemon|daemon-shm|profile-shm|frames|shm|plane-tests|plane-gpu", carry=[".whl"], timeout_s=600)
# tests:  the GPU tests and the shared-memory tests (the host is a second x86 ISA);
# gpu:    bench/gpu_prepost.py (pre/post kernels vs baselines; batch-1 post, sleeping and polling);
# daemon: bench/daemon_throughput.py, pre/post off, CPU and CUDA, 3 trials, then one profiled run;
# daemon-shm: the same, pre/post off and CUDA, frames in the message and in shared memory
#         ($TRIALS trials, default 3; $BATCH frames a message, default 1; $VARIANTS: the
#         daemon_throughput --variant values, ';'-separated, each also run, alternating);
# profile-shm: one run of each of those, profiled (py-spy), with the CPU by thread;
# frames: bench/gpu_frames.py (a frame's way into the pre kernel: CPU, GPU and wall per frame);
# shm:    bench/shm_frames.py (tcp / ipc / shared memory, 1.35 MB and 6.2 MB frames, 3 trials).
# plane-tests: the native plane's tests, its GPU chain on the real GPU included (and its cuDLA
#         engine on the fakes: a second x86 ISA);
# plane-gpu: bench/daemon_throughput.py, GPU pre/post over tcp, the daemon against the bare
#         server, 3 trials (BENCHMARKS §9.21).
set -uo pipefail
source bench/h200_env.sh
export PATH="/tmp/site/bin:$PATH"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/gpu.txt"
status=0
for part in "$@"; do
    case "$part" in
    tests)
        timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
            -W "ignore::DeprecationWarning" tests/dlad/gpu tests/dlad/test_shm.py \
            tests/dlad/test_protocol.py tests/dlad/test_daemon.py -rs 2>&1 \
            | tee "$out/tests.log" | tail -12
        status=$((status | PIPESTATUS[0])) ;;
    gpu)
        timeout 300 python3 bench/gpu_prepost.py --json "$out/prepost.json" 2>&1 | tail -40 ;;
    daemon)
        timeout 420 python3 bench/daemon_throughput.py --seconds 5 --transports tcp \
            --pre-post-backends cpu,cuda --trials 3 2>&1 | tee "$out/throughput.txt"
        timeout 120 python3 bench/daemon_throughput.py --seconds 5 --transports tcp \
            --pre-post-backends cuda --profile "$out/profile" 2>&1 | tee "$out/profile.txt" ;;
    daemon-shm)
        variants=()
        IFS=';' read -ra found <<< "${VARIANTS:-}"
        for v in "${found[@]}"; do variants+=(--variant "$v"); done
        timeout 540 python3 bench/daemon_throughput.py --seconds 5 --transports tcp \
            --pre-post-backends cuda --shm --trials "${TRIALS:-3}" --batch "${BATCH:-1}" \
            "${variants[@]}" 2>&1 | tee "$out/throughput_shm.txt" ;;
    profile-shm)
        timeout 200 python3 bench/daemon_throughput.py --seconds 5 --transports tcp \
            --pre-post-backends cuda --shm --profile /tmp/profile 2>&1 \
            | tee "$out/profile_shm.txt" ;;
    frames)
        timeout 200 python3 bench/gpu_frames.py --json "$out/frames.json" 2>&1 | tail -20 ;;
    shm)
        timeout 500 python3 bench/shm_frames.py --seconds 4 --trials 3 2>&1 | tee "$out/shm.txt" ;;
    plane-tests)
        timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
            -W "ignore::DeprecationWarning" tests/dlad/gpu/test_native_chain.py \
            tests/dlad/test_native_gpu.py tests/dlad/test_native_gpu_batches.py \
            tests/dlad/test_native_plane.py \
            tests/dlad/test_native_engines.py tests/dlad/test_native_daemon.py \
            tests/dlad/cudla/test_native_cudla.py tests/dlad/test_torch_gpu.py \
            tests/dlad/test_scheduler.py -rs 2>&1 | tee "$out/plane-tests.log" | tail -12
        status=$((status | PIPESTATUS[0])) ;;
    plane-gpu)
        timeout 540 python3 bench/daemon_throughput.py --seconds 5 --transports tcp \
            --pre-post-backends cuda --floor --trials 3 --only on-cuda-plane \
            --variant 'plane:shm.enabled=false;soc.dram_contention=0' 2>&1 \
            | tee "$out/plane_gpu.txt" ;;
    esac
done
exit "$status"
