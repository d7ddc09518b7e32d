"""Per model family: the emulated DLA's modelled latency, and the three-engine pool's throughput
on the emulated Orin (docs/BENCHMARKS.md, "Model families").

    python bench/family_pool.py [--variant s] [--size 640] [--out runs/family_pool]
        [--families yolov5 yolov8 yolo11 yolo26] [--no-pool]

1. **Modelled latency.** Each family's model (random weights: the latency model reads the graph
   only) goes through QAT's quantize + calibrate (one random batch), export and the translator,
   as ``prep all`` does; ``prep.latency.estimate`` then prices the translated graph with the
   translator's FP16 nodes (YOLO11's and YOLO26's attention products), INT8 body, INT8 and FP16
   heads, at batch 1 on one DLA core; and what attention in DLA layers costs of it.
2. **Pool throughput.** The emulated Orin of ``bench/three_engines.py`` (timing mode,
   pre/post-processing off) with each DLA core at the family's FP16-heads time and the GPU's
   published YOLOv5s curve scaled by it (as the emulated GPU scales every model): the
   saturated throughput of {dla0, dla1}, {gpu} and the pool {dla0, dla1, gpu}, each against its
   contention-aware ideal.

Prints markdown tables and writes dlad-bench's CSV/JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from three_engines import HELD, ROOT, ideal, run  # bench/, beside this script

sys.path.insert(0, str(ROOT))
from prep import qat
from prep.export import export_onnx
from prep.families import prep_family
from prep.latency import estimate
from prep.translate import translate


def modelled(family: str, variant: str, size: int) -> dict[str, object]:
    """The translated ``family`` model's modelled DLA time, INT8 and FP16 heads."""
    torch.manual_seed(0)
    model = prep_family(family).build(variant, 80).eval()
    qat.warm_up_batchnorm(model, [torch.rand(2, 3, size, size)])
    qmodel, _ = qat.quantize(model.eval(), qat.QATConfig())
    qat.calibrate(qmodel, [torch.rand(1, 3, size, size)])
    qat.set_head_output_quant(qmodel, True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qat.onnx"
        export_onnx(qmodel, path, size)
        result = translate(path, extra_ops=("Resize", "Split"))
    row: dict[str, object] = {"fp16_nodes": len(result.fp16_nodes)}
    for heads in ("int8", "fp16"):
        est = estimate(result.model, fp16_nodes=result.fp16_nodes, heads=heads)
        row[f"{heads}_heads_ms"] = est.total_ms
        row["layers"] = len(est.layers)
        # attention in DLA layers (prep.families.dla_attention): its share of the frame
        row["attention_ms"] = sum(x.time_us for x in est.layers if "/attn/" in x.name) / 1e3
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", default="s")
    p.add_argument("--size", type=int, default=640)
    p.add_argument("--families", nargs="+", default=["yolov5", "yolov8", "yolo11", "yolo26"])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "family_pool")
    p.add_argument("--no-pool", action="store_true", help="the modelled latencies only")
    args = p.parse_args()
    args.contention, args.time_scale = 1.0, 1.0
    args.out.mkdir(parents=True, exist_ok=True)
    load_avg, t0 = os.getloadavg()[0], time.monotonic()
    rows = {f: modelled(f, args.variant, args.size) for f in args.families}
    print(f"\n## modelled DLA latency, {args.variant} at {args.size}, batch 1, one core\n")
    print("| family | INT8 heads ms | FP16 heads ms | attention ms | FP16 nodes | layers |")
    print("|---|---|---|---|---|---|")
    for family, r in rows.items():
        print(
            f"| {family}{args.variant} | {r['int8_heads_ms']:.3f} | {r['fp16_heads_ms']:.3f} "
            f"| {r['attention_ms']:.3f} | {r['fp16_nodes']} | {r['layers']} |"
        )
    if args.no_pool:
        return 0
    print("\n## the pool on the emulated Orin (FP16 heads)\n")
    table = []
    for family, r in rows.items():
        dla_us = float(str(r["fp16_heads_ms"])) * 1e3
        got = {}
        for devices in (["dla0", "dla1"], ["gpu"], ["dla0", "dla1", "gpu"]):
            name = f"{family}_" + "_".join(devices)
            held = str(sum(HELD[d] for d in devices))
            row = run(args.out, name, devices, "latency", args, "--concurrency", held,
                      dla_us=dla_us)  # fmt: skip
            got[len(devices)] = (float(row["throughput_rps"]), ideal(devices, 1.0, 1.0, dla_us))
        table.append((family, got))
    print(f"\nload average before: {load_avg:.2f}; {time.monotonic() - t0:.0f} s\n")
    print("| family | 2 DLAs /s | GPU /s | pool /s | pool / GPU | pool / ideal |")
    print("|---|---|---|---|---|---|")
    for family, got in table:
        (dla, _), (gpu, _), (pool, pool_ideal) = got[2], got[1], got[3]
        print(
            f"| {family}{args.variant} | {dla:.1f} | {gpu:.1f} | {pool:.1f} | {pool / gpu:.2f} "
            f"| {pool / pool_ideal:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
