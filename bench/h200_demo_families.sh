#!/usr/bin/env bash
# The demo chain (`prep all --preset demo`: 256 x 256, the CPU demo's data and settings) for the
# DFL families on the project's H200 machine, training on its GPU; brings back what
# `prep bundle` reads (every stage's manifest, the emulated loadables, the translator's scales,
# the QAT checkpoint, the held-out images, the metrics), not the training data or weights.
#   run(command="bash bench/h200_demo_families.sh", carry=[".whl"], timeout_s=600)
# FAMILIES="yolo11 yolo26" by default. Then, here: prep bundle --workdir <files_at>/demo_<family> ...
set -uo pipefail
source bench/h200_env.sh
status=0
for family in ${FAMILIES:-yolo11 yolo26}; do
    work="/tmp/runs/demo_$family"
    timeout "${PREP_TIMEOUT:-280}" python3 -m prep all --preset demo --workdir "$work" -q \
        --set "model.family=$family" 2>&1 | grep -v -i -E "warn|no INT8 scale" | tail -12
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    keep="$out/demo_$family"
    mkdir -p "$keep"
    (cd "$work" && cp --parents */manifest.json validate/metrics.json build/*.emu \
        translate/model_precision_config.json translate/model_precision_config_calib.cache \
        qat/qat.pt data/val/annotations.json "$keep"/ 2>/dev/null)
    mkdir -p "$keep/data/val/images"
    python3 - "$work" "$keep" <<'PY'
import json, shutil, sys
from pathlib import Path
work, keep = Path(sys.argv[1]), Path(sys.argv[2])
gt = json.loads((work / "data/val/annotations.json").read_text())
for im in sorted(gt["images"], key=lambda im: im["id"])[:6]:  # the images prep bundle takes
    shutil.copyfile(work / "data/val/images" / im["file_name"], keep / "data/val/images" / im["file_name"])
PY
done
exit "$status"
