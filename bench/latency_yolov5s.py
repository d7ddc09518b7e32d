"""Modelled DLA latency of YOLOv5s at 672x672 (the published configuration) per head variant.

    .venv/bin/python bench/latency_yolov5s.py

Exports a YOLOv5s (80 classes; weights do not matter to the model) at 672, runs
``prep.latency.estimate`` for the three head variants and prints them beside NVIDIA's published
figures (docs/reference/cudla.md §6: ~2.4 ms INT8 CHW32 heads, 3.82 ms FP16 CHW16 heads at batch 1).
Then the emulated Orin GPU re-checked against NVIDIA's GPU batch curve: the emulated GPU scales
that curve by a model's modelled DLA time against the published 3.82 ms, so for YOLOv5s-672 with
FP16 heads its times are the curve times modelled / published; printed per batch size.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dlad.curves import interpolate
from dlad.devices.emulated_gpu import ORIN_DLA_YOLOV5S_MS, ORIN_GPU_YOLOV5S_MS
from prep.emulated_build import HEAD_VARIANTS
from prep.export import export_onnx
from prep.latency import estimate
from prep.model import YOLOv5

PUBLISHED_MS = {"int8_heads": 2.4, "fp16_heads": 3.82, "fp16_heads_last_c3": None}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "yolov5s_672.onnx"
        export_onnx(YOLOv5("s", 80).eval().fuse(), path, 672)
        modelled = {}
        print(f"{'variant':<22}{'modelled ms':>12}{'published ms':>14}{'ratio':>8}")
        for v in HEAD_VARIANTS:
            est = estimate(path, fp16_nodes=v.extra_fp16, heads=v.heads)
            pub = PUBLISHED_MS[v.name]
            ratio = f"{est.total_ms / pub:.3f}" if pub else "-"
            print(f"{v.name:<22}{est.total_ms:>12.3f}{pub or '-':>14}{ratio:>8}")
            modelled[v.name] = est.total_ms
    scale = modelled["fp16_heads"] / ORIN_DLA_YOLOV5S_MS
    print(f"\nemulated GPU, YOLOv5s-672 (scale {scale:.3f})")
    print(f"{'batch':>5}{'emulated ms':>14}{'published ms':>15}{'ratio':>8}")
    for batch, published in ORIN_GPU_YOLOV5S_MS.items():
        emulated = interpolate(ORIN_GPU_YOLOV5S_MS, batch) * scale
        print(f"{batch:>5}{emulated:>14.3f}{published:>15.2f}{emulated / published:>8.3f}")


if __name__ == "__main__":
    main()
