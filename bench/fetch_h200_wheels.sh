#!/usr/bin/env bash
# Download, here, the wheels the H200 machine lacks (Python 3.12, x86_64) for
# `bench/h200_prep_full.sh` and `bench/h200_gpu.sh`, into .whl/ (ignored by git; carried to the
# device with carry=[".whl"]).
# The daemon needs pyzmq, structlog, uvloop and msgspec, which the device image lacks (it has msgpack, anyio,
# onnx, onnxruntime, prometheus-client and rich). modelopt imports omegaconf (-> antlr4 4.9.x,
# sdist only: built into a wheel here), pulp and pydantic eagerly; onnx-graphsurgeon and
# faster-coco-eval are not in the device image. py-spy profiles the daemon there
# (bench/daemon_throughput.py --profile; its binary lands in /tmp/site/bin). pybind11 builds the
# scheduler's C++ core there (bench/h200_env.sh). ultralytics (its models are the DFL families')
# and ultralytics-thop are not in the image either; their other needs (opencv-python-headless,
# pyyaml, scipy, ...) are. PyAV (av) decodes the camera benchmark's streams and psutil reads its
# processes' CPU time (bench/cameras.py).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    pyzmq==27.3.0 structlog==26.1.0 uvloop==0.23.0 \
    nvidia-modelopt==0.47.0 onnx-graphsurgeon==0.6.1 faster-coco-eval==1.8.0 omegaconf==2.3.0 \
    pulp==3.3.2 pydantic pydantic-core annotated-types typing-inspection py-spy==0.4.3 \
    pybind11==3.1.0 msgspec==0.23.0 ultralytics==8.4.190 ultralytics-thop==2.2.3 av==18.1.0 psutil==7.2.2
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl mlcommons-loadgen==6.0.17
# LoadGen's few (bench/h200_mlperf.sh carries .whl-mlperf/ alone)
mkdir -p .whl-mlperf
for name in pyzmq structlog uvloop msgspec pybind11 psutil faster_coco_eval mlcommons_loadgen; do
    cp .whl/"$name"-*.whl .whl-mlperf/
done
# The camera benchmark's few (bench/h200_cameras.sh carries .whl-cam/ alone)
mkdir -p .whl-cam
for name in pyzmq structlog uvloop msgspec pybind11 av psutil; do cp .whl/"$name"-*.whl .whl-cam/; done
ls -la .whl .whl-cam .whl-mlperf
