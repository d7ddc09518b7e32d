"""The torch GPU engine's batch curve, measured in one run on one CUDA GPU (the H200 via the
device tool; needs torch with CUDA and onnx, both in the device image).

For each batch size (default 1, 2, 4, 8, 16) it runs ``replays`` batches of the bundled demo
images (letterboxed, quantised to DLA_HWC4 int8, cycled) through ``TorchGpu.run`` and reports:

* host latency p50 / p99: the wall time of one ``run()`` call as a caller sees it (frame copies
  into the pinned buffer, host-to-device, CUDA-graph replay, device-to-host, per-frame head
  copies, the lock);
* frames/s: ``b`` over the mean host latency (one caller, batches back to back);
* GPU graph time (median of ``timing.compute_us``: the replay alone, CUDA events) and the
  stream span (median ``timing.actual_us``: copies included);
* ratios against batch 1: frames/s gained, p50 latency paid; and, for context, the same
  latency ratio on NVIDIA's published Orin GPU curve (``dlad.devices.emulated_gpu``).

    python3 bench/torch_gpu_batches.py [--loadable X.emu] [--program X.pt2] [--replays 200]
        [--sizes 1,2,4,8,16] [--out result.json] [--device cuda]

Without ``--program`` it first exports the loadable here (``prep.torch_export``), with this
host's torch: a ``.pt2`` is read by the torch version that wrote it. ``--device cpu`` runs the
same loop eagerly on the CPU (a smoke test of the script, not a measurement worth keeping).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dlad.devices.emulated_gpu import batch_curve_us
from dlad.devices.torch_gpu import TorchGpu, TorchGpuError
from dlad.imaging.pre import letterbox, quantize_hwc4
from dlad.loadable import Loadable, read_loadable
from dlad.models import DEMO


def demo_frames(loadable: Loadable) -> list[np.ndarray]:
    """The bundled images as the engine's input frames."""
    frames = []
    for path in sorted((DEMO / "images").glob("*.jpg")):
        rgb = np.asarray(Image.open(path).convert("RGB"))
        canvas, _ = letterbox(rgb, loadable.image_size)
        frames.append(quantize_hwc4(canvas, loadable.input_scale))
    return frames


def measure(
    engine: TorchGpu, frames: list[np.ndarray], size: int, replays: int, warm: int
) -> dict[str, float]:
    """One batch size: host latency percentiles, frames/s, GPU times (µs)."""
    batches = [[frames[(i * size + j) % len(frames)] for j in range(size)] for i in range(4)]
    for i in range(warm):
        engine.run(batches[i % len(batches)])
    host_us, graph_us, span_us = [], [], []
    for i in range(replays):
        t0 = time.perf_counter_ns()
        _, timing = engine.run(batches[i % len(batches)])
        host_us.append((time.perf_counter_ns() - t0) / 1e3)
        graph_us.append(timing.compute_us if timing.compute_us is not None else float("nan"))
        span_us.append(timing.actual_us)
    host = np.asarray(host_us)
    return {
        "batch": size,
        "host_p50_us": float(np.percentile(host, 50)),
        "host_p99_us": float(np.percentile(host, 99)),
        "host_mean_us": float(host.mean()),
        "frames_per_s": size / (float(host.mean()) * 1e-6),
        "gpu_graph_us": statistics.median(graph_us),
        "gpu_span_us": statistics.median(span_us),
        "curve_us": engine.curve_us[size],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loadable", type=Path, default=DEMO / "fp16_heads.dla0.emu")
    p.add_argument("--program", type=Path, help="a .pt2 made by prep torch-export (default: "
                   "export the loadable here, into a temporary directory)")  # fmt: skip
    p.add_argument("--sizes", default="1,2,4,8,16", help="batch sizes (default 1,2,4,8,16)")
    p.add_argument("--replays", type=int, default=200, help="timed batches per size (200)")
    p.add_argument("--warm", type=int, default=20, help="untimed batches per size first (20)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (smoke)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if not sizes or sizes[0] < 1 or args.replays < 1:
        print("torch_gpu_batches: sizes and replays must be >= 1", file=sys.stderr)
        return 2
    loadable = read_loadable(args.loadable)
    max_batch = sizes[-1]
    with tempfile.TemporaryDirectory() as tmp:
        program = args.program
        export_s = None
        if program is None:
            from prep.torch_export import export_torch

            t0 = time.perf_counter()
            program = export_torch(args.loadable, Path(tmp) / "program.pt2", max_batch=max_batch)
            export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            engine = TorchGpu(loadable, program, max_batch=max_batch, device=args.device)
        except TorchGpuError as e:
            print(f"torch_gpu_batches: {e}", file=sys.stderr)
            return 2
        setup_s = time.perf_counter() - t0
        frames = demo_frames(loadable)
        rows = [measure(engine, frames, b, args.replays, args.warm) for b in sizes]
        engine.close()
    orin = batch_curve_us(loadable, max_batch=max_batch)
    base = rows[0]
    for row in rows:
        row["fps_vs_first"] = row["frames_per_s"] / base["frames_per_s"]
        row["p50_vs_first"] = row["host_p50_us"] / base["host_p50_us"]
        row["orin_curve_vs_first"] = orin[row["batch"]] / orin[base["batch"]]
    exported = "given" if export_s is None else f"{export_s:.1f} s"
    h, w = loadable.image_size
    print(
        f"{loadable.name} {h}x{w} on {engine.device} ({_device_name(args.device)}); "
        f"{args.replays} batches per size; export {exported}, warm-up {setup_s:.1f} s"
    )
    head = (f"{'batch':>5} {'frames/s':>9} {'p50 us':>9} {'p99 us':>9} {'graph us':>9} "
            f"{'span us':>9} {'fps x':>6} {'p50 x':>6} {'Orin x':>6}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['batch']:>5} {r['frames_per_s']:>9.0f} {r['host_p50_us']:>9.1f} "
              f"{r['host_p99_us']:>9.1f} {r['gpu_graph_us']:>9.1f} {r['gpu_span_us']:>9.1f} "
              f"{r['fps_vs_first']:>6.2f} {r['p50_vs_first']:>6.2f} "
              f"{r['orin_curve_vs_first']:>6.2f}")  # fmt: skip
    if args.out is not None:
        result: dict[str, Any] = {
            "loadable": str(args.loadable),
            "device": engine.device,
            "device_name": _device_name(args.device),
            "host": platform.node(),
            "torch": _torch_version(),
            "replays": args.replays,
            "warm": args.warm,
            "export_s": export_s,
            "warm_up_s": setup_s,
            "program_metadata": engine.metadata,
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(torch.device(device)))
    return platform.processor() or "cpu"


if __name__ == "__main__":
    sys.exit(main())
