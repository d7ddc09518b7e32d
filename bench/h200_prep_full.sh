#!/usr/bin/env bash
# The full-size prep chain (YOLOv5s at 640) on the project's H200 machine, through the device
# tool: installs the carried wheels (.whl/, made here by bench/fetch_h200_wheels.sh), runs
# `prep all --preset full` and copies the manifests, metrics and translator outputs (not the
# weights) to $OUT.
#   run(command="bash bench/h200_prep_full.sh", carry=[".whl"], timeout_s=600)
# FAMILY=yolo11 (or yolov8, yolo26, yolo26_one2one) runs that family's model at the same size.
set -uo pipefail
source bench/h200_env.sh   # the carried wheels, the C++ core (dlad.imaging reads its rules), $out
python3 -c "import torch, modelopt, onnx_graphsurgeon; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
family="${FAMILY:-yolov5}"
work="/tmp/runs/full_$family"
timeout "${PREP_TIMEOUT:-520}" python3 -m prep all --preset full --workdir "$work" -q \
    --set "model.family=$family" 2>&1 | grep -v -i -E "warn|no INT8 scale" | tee "$out/prep.log"
status=${PIPESTATUS[0]}
for stage in data cache train qat export translate build validate; do
    [[ -f "$work/$stage/manifest.json" ]] && cp "$work/$stage/manifest.json" "$out/manifest_$stage.json"
done
cp "$work"/translate/model_precision_config.json "$work"/translate/model_precision_config_calib.cache "$out/" 2>/dev/null
exit "$status"
