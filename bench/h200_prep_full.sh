#!/usr/bin/env bash
# The full-size prep chain (YOLOv5s at 640) on the project's H200 machine, through the device
# tool: installs the carried wheels (.whl/, made here by bench/fetch_h200_wheels.sh), runs
# `prep all --preset full` and copies the manifests, metrics and translator outputs (not the
# weights) to $OUT.
#   run(command="bash bench/h200_prep_full.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, modelopt, onnx_graphsurgeon; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
work=/tmp/runs/full
timeout "${PREP_TIMEOUT:-520}" python3 -m prep all --preset full --workdir "$work" -q 2>&1 | grep -v -i warn | tee "$out/prep.log"
status=${PIPESTATUS[0]}
for stage in data cache train qat export translate build validate; do
    [[ -f "$work/$stage/manifest.json" ]] && cp "$work/$stage/manifest.json" "$out/manifest_$stage.json"
done
cp "$work"/translate/model_precision_config.json "$work"/translate/model_precision_config_calib.cache "$out/" 2>/dev/null
exit "$status"
