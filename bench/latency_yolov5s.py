"""Modelled DLA latency of YOLOv5s at 672x672 (the published configuration) per head variant.

    .venv/bin/python bench/latency_yolov5s.py

Exports a YOLOv5s (80 classes; weights do not matter to the model) at 672, runs
``prep.latency.estimate`` for the three head variants and prints them beside NVIDIA's published
figures (docs/reference/cudla.md §6: ~2.4 ms INT8 CHW32 heads, 3.82 ms FP16 CHW16 heads at batch 1).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prep.emulated_build import HEAD_VARIANTS
from prep.export import export_onnx
from prep.latency import estimate
from prep.model import YOLOv5

PUBLISHED_MS = {"int8_heads": 2.4, "fp16_heads": 3.82, "fp16_heads_last_c3": None}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "yolov5s_672.onnx"
        export_onnx(YOLOv5("s", 80).eval().fuse(), path, 672)
        print(f"{'variant':<22}{'modelled ms':>12}{'published ms':>14}{'ratio':>8}")
        for v in HEAD_VARIANTS:
            est = estimate(path, fp16_nodes=v.extra_fp16, heads=v.heads)
            pub = PUBLISHED_MS[v.name]
            ratio = f"{est.total_ms / pub:.3f}" if pub else "-"
            print(f"{v.name:<22}{est.total_ms:>12.3f}{pub or '-':>14}{ratio:>8}")


if __name__ == "__main__":
    main()
