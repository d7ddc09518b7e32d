"""Speed of the emulated DLA core's INT8 engine against plain onnxruntime FP32, in one run.

Builds YOLOv5 (random weights, BatchNorm statistics from a few random batches, BN folded),
exports the FP32 ONNX model, derives per-tensor INT8 scales from onnxruntime FP32 runs on random
images (``max|x| / 127``; 1/127 for Sigmoid outputs, as the Q/DQ translator gives SiLU), then
times per frame at batch 1, all with the same intra-op thread count:

  (a) onnxruntime FP32 on the FP32 model (graph optimizations on);
  (b) ``Int8Engine`` on ``build_int8_graph(...)``: uint8 activations with zero point 128, on the
      exact operands this host takes (``operands="auto"``: uint8 x int8 where that kernel sums
      exactly, else the weights re-encoded as uint8), including the DLA_HWC4 input unpack and
      the CHW32 output packing;
  (b') the same engine graph in a bare onnxruntime session (no unpack/pack);
  (b8) ``Int8Engine`` forced onto uint8 x uint8 (``operands="u8u8"``): what a CPU without VNNI
      runs; exact everywhere;
  (c) the same Q/DQ graph with TensorRT-style int8 activations (zero point 0), default session;
  (c') (c) with ``session.qdqisint8allowed=1`` (lets onnxruntime fuse int8 Q/DQ on x86).

Rounds alternate between the variants so that machine noise hits all of them alike; medians and
the ratios to (a) are printed, with the kernels onnxruntime runs for (b) and (c), the INT8 kernel
path this host takes, and checks that (b), (b8) and (c) compute the same values.

    .venv/bin/python bench/emulated_speed.py [--size 672] [--variant s] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _session(
    model: bytes, threads: int, config: dict[str, str] | None = None, *, optimize: bool = True
) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # As Int8Engine does, so that every variant runs under the same thread policy.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def _build_fp32(variant: str, size: int, path: Path) -> None:
    import torch

    from prep.export import export_onnx
    from prep.model import YOLOv5
    from prep.qat import warm_up_batchnorm

    torch.manual_seed(0)
    model = YOLOv5(variant, 80)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # cumulative average: real statistics from a few batches
    gen = torch.Generator().manual_seed(1)
    warm_up_batchnorm(model, [torch.rand(2, 3, 320, 320, generator=gen) for _ in range(3)])
    export_onnx(model.eval().fuse(), path, size)


def _scales(fp32_path: Path, size: int, threads: int, images: int) -> dict[str, float]:
    """``max|x| / 127`` per float tensor over ``images`` random images (Sigmoid outputs: 1/127)."""
    import onnx

    model = onnx.load(str(fp32_path))
    sigmoid_outs = {n.output[0] for n in model.graph.node if n.op_type == "Sigmoid"}
    listed = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name not in listed:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
                listed.add(name)
    sess = _session(model.SerializeToString(), threads)
    names = [o.name for o in sess.get_outputs()]
    amax: dict[str, float] = {}
    rng = np.random.default_rng(2)
    for _ in range(images):
        x = rng.random((1, 3, size, size), dtype=np.float32)
        for name, value in zip(names, sess.run(names, {"images": x}), strict=True):
            if value.dtype == np.float32:
                amax[name] = max(amax.get(name, 0.0), float(np.abs(value).max()))
    amax["images"] = 1.0
    return {k: (1.0 / 127 if k in sigmoid_outs else max(v, 1e-6) / 127) for k, v in amax.items()}


def _time(fns: dict[str, Callable[[], object]], rounds: int, per_round: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=672)
    parser.add_argument("--variant", default="s")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--scale-images", type=int, default=2)
    args = parser.parse_args()

    import torch

    from dlad.devices.int8_engine import Int8Engine
    from dlad.devices.int8_layout import open_session, select_kernel_path
    from dlad.imaging.pre import quantize_hwc4
    from prep.emulate_graph import build_int8_graph, optimized_op_counts

    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}  (cpus: {os.cpu_count()})")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        fp32_path = Path(tmp) / "fp32.onnx"
        _build_fp32(args.variant, args.size, fp32_path)
        scales = _scales(fp32_path, args.size, args.threads, args.scale_images)
        u8 = build_int8_graph(fp32_path, scales, [], heads="int8")
        s8 = build_int8_graph(fp32_path, scales, [], heads="int8", activation_dtype="int8")
        fp32_bytes = fp32_path.read_bytes()
    took = time.perf_counter() - t0
    print(f"built YOLOv5{args.variant} at {args.size} and its graphs in {took:.0f} s")
    for name, graph in (("(b) uint8 zp128", u8), ("(c) int8 zp0", s8)):
        counts = optimized_op_counts(graph.model)
        print(f"{name} kernels: {counts}")
    s8_fused = _session(s8.to_bytes(), args.threads, {"session.qdqisint8allowed": "1"})

    def int8_engine(operands: Any) -> Int8Engine:
        return Int8Engine(
            u8.to_bytes(),
            input_scale=u8.input_scale,
            input_shape=u8.input_shape,
            outputs=u8.outputs,
            threads=args.threads,
            operands=operands,
        )

    engine = int8_engine("auto")
    engine_u8u8 = int8_engine("u8u8")
    print(f"INT8 kernel path (b): {engine.kernel.summary()}")
    print(f"                     {engine.kernel.reason}")
    fp32 = _session(fp32_bytes, args.threads)
    u8_bare = open_session(u8.to_bytes(), threads=args.threads, kernel=select_kernel_path())
    s8_sess = _session(s8.to_bytes(), args.threads)

    rng = np.random.default_rng(3)
    canvas = rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
    hwc4 = quantize_hwc4(canvas, u8.input_scale)
    q = hwc4[:, : args.size, :3].transpose(2, 0, 1)[None].copy()  # int8 NCHW
    x_u8 = (q.view(np.uint8) ^ np.uint8(0x80)).copy()
    x_f32 = q.astype(np.float32) * np.float32(u8.input_scale)

    # Same values from both activation encodings (q_u8 = q_s8 + 128) on the whole network, run
    # as the reference (unfused) Q/DQ arithmetic. The fused kernels round in another order, and
    # on this random network the rare boundary flips that causes grow layer by layer.
    def heads(sess: Any, x: np.ndarray) -> list[np.ndarray]:
        outs = sess.run(None, {"images": x})
        return [(o.view(np.int8) ^ np.int8(-128)) if o.dtype == np.uint8 else o for o in outs]

    ref_u8 = heads(_session(u8.to_bytes(), args.threads, optimize=False), x_u8)
    ref_s8 = heads(_session(s8.to_bytes(), args.threads, optimize=False), q)
    same = all(np.array_equal(a, b) for a, b in zip(ref_u8, ref_s8, strict=True))
    print(f"uint8-zp128 and int8-zp0 graphs, reference arithmetic: heads identical = {same}")

    same = all(
        np.array_equal(a, b) for a, b in zip(engine.run(hwc4), engine_u8u8.run(hwc4), strict=True)
    )
    print(f"(b) and (b8), fused integer kernels: heads identical = {same}")

    fns: dict[str, Callable[[], object]] = {
        "(a) fp32": lambda: fp32.run(None, {"images": x_f32}),
        "(b) int8 engine, auto": lambda: engine.run(hwc4),
        "(b') engine graph, bare session": lambda: u8_bare.run(None, {"images": x_u8}),
        "(b8) int8 engine, u8u8": lambda: engine_u8u8.run(hwc4),
        "(c) s8 zp0 (TensorRT-style)": lambda: s8_sess.run(None, {"images": q}),
        "(c') s8 zp0, qdqisint8allowed=1": lambda: s8_fused.run(None, {"images": q}),
    }
    for fn in fns.values():  # warm-up
        fn()
        fn()
    med = _time(fns, args.rounds, args.per_round)
    frames = args.rounds * args.per_round
    print(
        f"\nYOLOv5{args.variant} {args.size}x{args.size}, batch 1, {args.threads} threads, "
        f"median of {frames} frames each (interleaved rounds):"
    )
    base = med["(a) fp32"]
    for key, ms in med.items():
        print(f"  {key:34s} {ms:8.1f} ms/frame   {ms / base:5.2f} x fp32")
    print(f"ratio (b)/(a) = {med['(b) int8 engine, auto'] / base:.2f}")
    print(f"ratio (b8)/(a) = {med['(b8) int8 engine, u8u8'] / base:.2f}")
    print(f"ratio (c)/(a) = {med['(c) s8 zp0 (TensorRT-style)'] / base:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
