"""The emulated core's cost on an AVX2 CPU without VNNI, as instructions executed (valgrind).

No AVX2-only machine is at hand, but valgrind shows programs an AVX2 CPU without AVX-512 or VNNI,
whatever the host, and onnxruntime then takes the kernels such a CPU runs. Time under valgrind
means nothing; instructions executed (callgrind's ``Ir``) are exact and repeatable, and for these
SIMD-bound kernels their ratio is a fair proxy for the time ratio. Per frame of YOLOv5s at 672:

  fp32   onnxruntime FP32 on the FP32 graph (the baseline);
  u8u8   the INT8 engine on uint8 x uint8 operands: what dlad runs on such a CPU (exact);
  u8s8   the INT8 engine forced onto uint8 x int8: the layout before dlad 0.2 (saturates there).

Each variant runs in its own process, once with 0 frames and once with ``--frames`` frames; the
difference divided by the frames is its cost per frame (set-up and graph building cancel out).

    .venv/bin/python bench/int8_avx2_cost.py [--frames 2] [--size 672]     # needs valgrind
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("fp32", "u8u8", "u8s8")


def _child(variant: str, frames: int, size: int, work: Path) -> None:
    """Run ``frames`` frames of ``variant`` (graphs cached in ``work``)."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    from emulated_speed import _build_fp32, _scales, _session

    from dlad.devices.int8_engine import Int8Engine
    from dlad.imaging.pre import quantize_hwc4
    from prep.emulate_graph import build_int8_graph

    fp32_path = work / "fp32.onnx"
    scales_path = work / "scales.json"
    if not fp32_path.exists():
        _build_fp32("s", size, fp32_path)
        scales_path.write_text(json.dumps(_scales(fp32_path, size, 1, 1)))
    scales = json.loads(scales_path.read_text())
    rng = np.random.default_rng(3)
    canvas = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    if variant == "fp32":
        session = _session(fp32_path.read_bytes(), 1)
        x = rng.random((1, 3, size, size), dtype=np.float32)
        for _ in range(frames):
            session.run(None, {"images": x})
        return
    graph = build_int8_graph(fp32_path, scales, [], heads="int8")
    engine = Int8Engine(
        graph.to_bytes(),
        input_scale=graph.input_scale,
        input_shape=graph.input_shape,
        outputs=graph.outputs,
        operands=variant,  # type: ignore[arg-type]
    )
    hwc4 = quantize_hwc4(canvas, graph.input_scale)
    for _ in range(frames):
        engine.run(hwc4)


def _instructions(variant: str, frames: int, size: int, work: Path) -> int:
    out = work / f"callgrind.{variant}.{frames}"
    cmd = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
        "--child", variant, "--frames", str(frames), "--size", str(size), "--work", str(work),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: valgrind failed:\n{proc.stderr[-3000:]}")
    found = re.search(r"Collected\s*:\s*(\d+)", proc.stderr)
    if found is None:
        raise SystemExit(f"{variant}: no instruction count in valgrind's output")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=2)
    parser.add_argument("--size", type=int, default=672)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.frames, args.size, args.work)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _child("fp32", 0, args.size, work)  # build the graphs once, natively
        per_frame = {}
        for variant in VARIANTS:
            base = _instructions(variant, 0, args.size, work)
            total = _instructions(variant, args.frames, args.size, work)
            per_frame[variant] = (total - base) / args.frames
            print(f"{variant}: {per_frame[variant] / 1e9:.2f} G instructions / frame", flush=True)
    fp32 = per_frame["fp32"]
    print(f"\nYOLOv5s {args.size}, 1 thread, valgrind's AVX2 CPU (no AVX-512, no VNNI):")
    for variant in VARIANTS:
        print(f"  {variant:5s} {per_frame[variant] / 1e9:7.2f} G instr/frame  "
              f"{per_frame[variant] / fp32:5.2f} x fp32")  # fmt: skip
    print(f"u8u8 / u8s8 = {per_frame['u8u8'] / per_frame['u8s8']:.2f}")


if __name__ == "__main__":
    main()
