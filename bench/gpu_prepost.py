"""GPU pre/post-processing vs its baselines, in one run on one machine (the H200 via the device
tool; it needs a CUDA GPU, cuda-python with NVRTC, torch + torchvision and OpenCV).

Pre: 1920x1080 BGR → 672x672 int8 DLA_HWC4 (letterbox, bilinear, pad 114, quantise):
  dlad kernel from device memory / with the host→device copy from pinned memory,
  vs OpenCV on the CPU (cv2.resize + copyMakeBorder + numpy quantise) and vs torch on the GPU.
Post: YOLOv5s at 672 (3 fp16 CHW16 heads, 27,783 anchors, 80 classes; conf 0.25, IoU 0.45):
  dlad kernels at batch 1 (end to end: launches + sync) and batched (per frame),
  vs torchvision's batched_nms pipeline on the same GPU and vs the numpy reference.
Post, DFL families: YOLO11n-shaped heads at 640 (4 x 16 box bins + 80 classes a cell, 8,400
  cells; YOLOv8 and YOLO11 share them) and YOLO26n's (4 distances + 80): dlad's family kernel and
  the shared NMS at batch 1 and 8 vs Ultralytics' decode (DFL, dist2bbox) + torchvision's
  batched_nms on the same GPU, the detections compared.
Bytes: each kernel's fewest bytes against a device-to-device copy's bandwidth, same run.

    python bench/gpu_prepost.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlad.families import yolov8
from dlad.families.yolov5 import ANCHORS, postprocess, program
from dlad.gpu.driver import GpuContext, _check, _driver, probe
from dlad.gpu.prepost import GpuPipeline, HeadSpec
from dlad.imaging.post import pack_chw16, unpack_head
from dlad.imaging.pre import hwc4_layout, letterbox_geometry

SIZE = 672
SCALE = 0.0078125
CONF, IOU = 0.25, 0.45


def wall(fn: Callable[[], object], n: int, warm: int = 5) -> float:
    """Median wall time of ``fn`` in microseconds."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


class Events:
    def __init__(self, ctx: GpuContext, stream: Any) -> None:
        self.ctx, self.stream = ctx, stream
        self.a, self.b = ctx.event(timing=True), ctx.event(timing=True)

    def time_us(self, fn: Callable[[], object], n: int) -> float:
        """GPU time per call of ``n`` back-to-back calls, microseconds."""
        drv = _driver()
        fn()
        _check(drv.cuStreamSynchronize(self.stream), "sync")
        _check(drv.cuEventRecord(self.a, self.stream), "rec")
        for _ in range(n):
            fn()
        _check(drv.cuEventRecord(self.b, self.stream), "rec")
        _check(drv.cuEventSynchronize(self.b), "sync")
        ms = _check(drv.cuEventElapsedTime(self.a, self.b), "elapsed")
        return float(ms) * 1e3 / n


def copy_bandwidth(ctx: GpuContext, stream: Any) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30
    a, b = ctx.alloc(n, zero=False), ctx.alloc(n, zero=False)
    ev = Events(ctx, stream)
    drv = _driver()
    us = ev.time_us(lambda: _check(drv.cuMemcpyDtoDAsync(b.ptr, a.ptr, n, stream), "copy"), 10)
    a.free()
    b.free()
    return 2 * n / (us * 1e-6)


def yolov5s_heads(rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Realistic raw heads: background objectness far below threshold, ~40 objects each lit
    on a few neighbouring cells and anchors (so NMS has work), random box and class logits."""
    nc, raws, packed = 80, [], []
    for stride in (8, 16, 32):
        g = SIZE // stride
        raw = rng.normal(0.0, 1.0, size=(3 * (5 + nc), g, g)).astype(np.float32)
        for a in range(3):
            raw[a * (5 + nc) + 4] = rng.normal(-9.0, 1.5, size=(g, g))
        for _ in range(40 // 3):
            cx, cy, a = rng.integers(1, g - 1), rng.integers(1, g - 1), rng.integers(0, 3)
            cls = rng.integers(0, nc)
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    raw[a * (5 + nc) + 4, cy + dy, cx + dx] = rng.normal(2.0, 1.0)
                    raw[a * (5 + nc) + 5 + cls, cy + dy, cx + dx] = rng.normal(3.0, 0.5)
        packed.append(pack_chw16(raw))
        raws.append(unpack_head(packed[-1], raw.shape[0], g, g, None))
    return raws, packed


def bench_pre(ctx: GpuContext, results: dict[str, Any], bw: float) -> None:
    import cv2
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(1080, 1920, 3), dtype=np.uint8)
    geometry = letterbox_geometry(1920, 1080, SIZE)
    pitch = hwc4_layout(3, SIZE, SIZE, 1)[0]
    pipe = GpuPipeline(ctx, (SIZE, SIZE), [HeadSpec(18, 2, 2, 8)], program(ANCHORS[:1], 18))
    drv = _driver()
    dst = ctx.alloc(SIZE * pitch * 4)
    src = pipe.upload(image)
    pinned = ctx.host_alloc(image.nbytes)
    pinned.array[:] = image.reshape(-1)
    ev = Events(ctx, pipe.stream)

    def pre() -> None:
        pipe.pre(src, image.shape, "BGR", geometry, dst.ptr, input_scale=SCALE)

    def pre_h2d() -> None:
        _check(drv.cuMemcpyHtoDAsync(src, pinned.host_ptr, image.nbytes, pipe.stream), "h2d")
        pre()

    def pre_sync() -> None:
        pre()
        _check(drv.cuStreamSynchronize(pipe.stream), "sync")

    gpu_us = ev.time_us(pre, 2000)
    gpu_h2d_us = ev.time_us(pre_h2d, 500)
    gpu_wall_us = wall(pre_sync, 300)

    lut = np.clip(np.round(np.arange(256, dtype=np.float32) / 255.0 / SCALE), -128, 127).astype(
        np.int8
    )

    def opencv() -> np.ndarray:
        resized = cv2.resize(
            image, (geometry.new_w, geometry.new_h), interpolation=cv2.INTER_LINEAR
        )
        top, left = geometry.pad_y, geometry.pad_x
        canvas = cv2.copyMakeBorder(
            resized, top, SIZE - geometry.new_h - top, left, SIZE - geometry.new_w - left,
            cv2.BORDER_CONSTANT, value=(114, 114, 114),
        )  # fmt: skip
        out = np.zeros((SIZE, pitch, 4), np.int8)
        out[:, :SIZE, :3] = lut[canvas[:, :, ::-1]]
        return out

    cv_us = wall(opencv, 50)

    dev = torch.device("cuda")
    timg = torch.from_numpy(image).to(dev)
    tlut = torch.from_numpy(lut).to(dev)

    def torch_pre() -> torch.Tensor:
        x = timg.flip(-1).permute(2, 0, 1)[None].float()
        x = F.interpolate(
            x, size=(geometry.new_h, geometry.new_w), mode="bilinear", align_corners=False
        )
        x = x.round().clamp_(0, 255).to(torch.uint8)
        canvas = torch.full((3, SIZE, SIZE), 114, dtype=torch.uint8, device=dev)
        canvas[:, geometry.pad_y : geometry.pad_y + geometry.new_h,
               geometry.pad_x : geometry.pad_x + geometry.new_w] = x[0]  # fmt: skip
        out = torch.zeros((SIZE, pitch, 4), dtype=torch.int8, device=dev)
        out[:, :SIZE, :3] = tlut[canvas.permute(1, 2, 0).long()]
        return out

    for _ in range(10):
        torch_pre()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(500):
        torch_pre()
    e.record()
    torch.cuda.synchronize()
    torch_us = s.elapsed_time(e) * 1e3 / 500
    torch_wall_us = wall(lambda: (torch_pre(), torch.cuda.synchronize()), 200)

    nbytes = image.nbytes + SIZE * pitch * 4
    floor_us = nbytes / bw * 1e6
    results["pre"] = {
        "bytes_min": nbytes,
        "floor_us": floor_us,
        "dlad_gpu_us": gpu_us,
        "dlad_gpu_with_h2d_pinned_us": gpu_h2d_us,
        "dlad_wall_launch_sync_us": gpu_wall_us,
        "opencv_cpu_us": cv_us,
        "opencv_threads": cv2.getNumThreads(),
        "torch_gpu_us": torch_us,
        "torch_wall_us": torch_wall_us,
        "ratio_opencv_over_dlad": cv_us / gpu_us,
        "ratio_torch_over_dlad": torch_us / gpu_us,
        "fraction_of_bandwidth": floor_us / gpu_us,
    }
    pipe.close()
    dst.free()
    pinned.free()


def bench_pre_nv12(ctx: GpuContext, results: dict[str, Any]) -> None:
    """A 1080p camera frame as NV12 (what hardware and FFmpeg's H.264 decoders give) against
    the same frame as BGR, same run: the pre kernel's GPU time with and without the pinned
    H2D copy of the frame (NV12 is half the bytes), and OpenCV's CPU NV12 -> BGR conversion
    that a client would otherwise run before sending BGR."""
    import cv2

    rng = np.random.default_rng(1)
    bgr = rng.integers(0, 256, size=(1080, 1920, 3), dtype=np.uint8)
    nv12 = rng.integers(0, 256, size=(1620, 1920), dtype=np.uint8)
    geometry = letterbox_geometry(1920, 1080, SIZE)
    pitch = hwc4_layout(3, SIZE, SIZE, 1)[0]
    pipe = GpuPipeline(ctx, (SIZE, SIZE), [HeadSpec(18, 2, 2, 8)], program(ANCHORS[:1], 18))
    drv = _driver()
    dst = ctx.alloc(SIZE * pitch * 4)
    ev = Events(ctx, pipe.stream)
    out: dict[str, Any] = {}
    for name, image, fmt in (("bgr", bgr, "BGR"), ("nv12", nv12, "NV12")):
        src = pipe.upload(image)
        pinned = ctx.host_alloc(image.nbytes)
        pinned.array[:] = image.reshape(-1)

        def pre(src: int = src, image: np.ndarray = image, fmt: str = fmt) -> None:
            pipe.pre(src, image.shape, fmt, geometry, dst.ptr, input_scale=SCALE, colour=1)  # type: ignore[arg-type]

        def pre_h2d(src: int = src, pinned: Any = pinned, image: np.ndarray = image) -> None:
            _check(drv.cuMemcpyHtoDAsync(src, pinned.host_ptr, image.nbytes, pipe.stream), "h2d")
            pre()

        out[f"{name}_frame_bytes"] = image.nbytes
        out[f"{name}_gpu_us"] = ev.time_us(pre, 2000)
        out[f"{name}_gpu_with_h2d_pinned_us"] = ev.time_us(pre_h2d, 500)
        pinned.free()
    out["opencv_nv12_to_bgr_cpu_us"] = wall(lambda: cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV12), 50)
    out["ratio_nv12_over_bgr_gpu"] = out["nv12_gpu_us"] / out["bgr_gpu_us"]
    out["ratio_nv12_over_bgr_with_h2d"] = (
        out["nv12_gpu_with_h2d_pinned_us"] / out["bgr_gpu_with_h2d_pinned_us"]
    )
    results["pre_nv12"] = out
    pipe.close()
    dst.free()


def device_heads(ctx: GpuContext, packed: list[np.ndarray], batch: int) -> list[Any]:
    """Each head's buffer repeated ``batch`` times in device memory (the caller frees them)."""
    bufs = []
    drv = _driver()
    for p in packed:
        many = np.ascontiguousarray(np.stack([p] * batch))
        b = ctx.alloc(many.nbytes, zero=False)
        _check(drv.cuMemcpyHtoD(b.ptr, many.ctypes.data, many.nbytes), "h2d")
        bufs.append(b)
    return bufs


def bench_post(ctx: GpuContext, results: dict[str, Any], bw: float) -> None:
    import torch
    import torchvision

    rng = np.random.default_rng(1)
    raws, packed = yolov5s_heads(rng)
    geometry = letterbox_geometry(1920, 1080, SIZE)
    specs = [HeadSpec(255, SIZE // s, SIZE // s, s) for s in (8, 16, 32)]
    batch = 8
    pipe1 = GpuPipeline(ctx, (SIZE, SIZE), specs, program(ANCHORS, specs[0].c))
    pipe8 = GpuPipeline(ctx, (SIZE, SIZE), specs, program(ANCHORS, specs[0].c), batch=batch)
    bufs = device_heads(ctx, packed, batch)
    ptrs = [b.ptr for b in bufs]
    kw = {"conf_threshold": CONF, "iou_threshold": IOU, "max_det": 300}

    def post1() -> None:
        pipe1.post(ptrs, [geometry], **kw)  # type: ignore[arg-type]

    def post1_sync() -> list[Any]:
        post1()
        return pipe1.synchronize()

    def post1_spin() -> list[Any]:
        post1()
        return pipe1.synchronize(spin_us=500.0)  # a latency-bound caller polls the event

    def post8() -> None:
        pipe8.post(ptrs, [geometry] * batch, **kw)  # type: ignore[arg-type]

    def post8_sync() -> list[Any]:
        post8()
        return pipe8.synchronize()

    expected = postprocess(raws, ANCHORS, (8, 16, 32), geometry, conf_threshold=CONF,
                           iou_threshold=IOU)  # fmt: skip
    got = post1_sync()[0]
    assert got.detections.shape == expected.shape, (got.detections.shape, expected.shape)
    wall1 = wall(post1_sync, 500, warm=20)
    wall1_spin = wall(post1_spin, 500, warm=20)
    gpu1 = Events(ctx, pipe1.stream).time_us(post1, 1000)
    stages = stage_times(ctx, pipe1, ptrs)
    wall8 = wall(post8_sync, 200, warm=10) / batch
    gpu8 = Events(ctx, pipe8.stream).time_us(post8, 300) / batch
    ref_us = wall(lambda: postprocess(raws, ANCHORS, (8, 16, 32), geometry,
                                      conf_threshold=CONF, iou_threshold=IOU), 30)  # fmt: skip

    dev = torch.device("cuda")
    theads = [torch.from_numpy(r).to(dev).half() for r in raws]
    anchors = torch.from_numpy(ANCHORS).to(dev)
    grids = []
    for r in raws:
        g = r.shape[1]
        yv, xv = torch.meshgrid(
            torch.arange(g, device=dev), torch.arange(g, device=dev), indexing="ij"
        )
        grids.append(torch.stack((xv, yv), -1).view(1, g, g, 2).float())

    def tv_pipeline() -> torch.Tensor:
        # YOLOv5's own decode + non_max_suppression (single label), torchvision batched_nms.
        preds = []
        for lvl, (h, grid) in enumerate(zip(theads, grids, strict=True)):
            g = h.shape[1]
            y = h.float().view(3, 85, g, g).permute(0, 2, 3, 1).sigmoid()
            xy = (y[..., :2] * 2 - 0.5 + grid) * (8 << lvl)
            wh = (y[..., 2:4] * 2) ** 2 * anchors[lvl].view(3, 1, 1, 2)
            preds.append(torch.cat((xy, wh, y[..., 4:]), -1).view(-1, 85))
        x = torch.cat(preds)
        x = x[x[:, 4] > CONF]
        scores, cls = (x[:, 5:] * x[:, 4:5]).max(1)
        keep = scores > CONF
        x, scores, cls = x[keep], scores[keep], cls[keep]
        boxes = torch.cat((x[:, :2] - x[:, 2:4] / 2, x[:, :2] + x[:, 2:4] / 2), 1)
        idx = torchvision.ops.batched_nms(boxes, scores, cls, IOU)[:300]
        out = torch.cat((boxes[idx], scores[idx, None], cls[idx, None].float()), 1)
        out[:, [0, 2]] = ((out[:, [0, 2]] - geometry.pad_x) / geometry.scale).clamp(0, 1920)
        out[:, [1, 3]] = ((out[:, [1, 3]] - geometry.pad_y) / geometry.scale).clamp(0, 1080)
        return out.cpu()

    tv_out = tv_pipeline()
    tv_wall = wall(tv_pipeline, 300, warm=20)

    head_sectors = sum(3 * (SIZE // s) ** 2 for s in (8, 16, 32)) * 32
    floor_us = head_sectors / bw * 1e6
    results["post"] = {
        "candidates": int(got.found),
        "detections": len(got.detections),
        "torchvision_detections": int(tv_out.shape[0]),
        "dlad_batch1_wall_us": wall1,
        "dlad_batch1_wall_spin_us": wall1_spin,
        "dlad_batch1_gpu_us": gpu1,
        "dlad_batch1_gpu_stages_us": stages,
        f"dlad_batch{batch}_wall_per_frame_us": wall8,
        f"dlad_batch{batch}_gpu_per_frame_us": gpu8,
        "torchvision_wall_us": tv_wall,
        "numpy_reference_us": ref_us,
        "ratio_torchvision_over_dlad_wall": tv_wall / wall1,
        "ratio_numpy_over_dlad_wall": ref_us / wall1,
        "bytes_min_objectness_sectors": head_sectors,
        "floor_us": floor_us,
    }
    pipe1.close()
    pipe8.close()
    for b in bufs:
        b.free()


def dfl_heads(
    rng: np.random.Generator, size: int, bins: int, nc: int = 80
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Realistic raw DFL heads: class logits far below threshold but for ~40 objects lit on a
    few neighbouring cells (so NMS has work), random box logits."""
    raws, packed = [], []
    for stride in (8, 16, 32):
        g = size // stride
        raw = rng.normal(0.0, 1.0, size=(4 * bins + nc, g, g)).astype(np.float32)
        if bins == 1:
            raw[:4] = rng.uniform(0.5, 4.0, size=(4, g, g))
        raw[4 * bins :] = rng.normal(-9.0, 1.5, size=(nc, g, g))
        for _ in range(40 // 3):
            cx, cy, cls = rng.integers(1, g - 1), rng.integers(1, g - 1), rng.integers(0, nc)
            raw[4 * bins + cls, cy - 1 : cy + 2, cx - 1 : cx + 2] = rng.normal(2.0, 1.0, (3, 3))
        packed.append(pack_chw16(raw))
        raws.append(unpack_head(packed[-1], raw.shape[0], g, g, None))
    return raws, packed


def bench_post_dfl(ctx: GpuContext, results: dict[str, Any], name: str, bins: int) -> None:
    import torch
    import torchvision

    size, nc, batch = 640, 80, 8
    rng = np.random.default_rng(2)
    raws, packed = dfl_heads(rng, size, bins, nc)
    geometry = letterbox_geometry(1920, 1080, size)
    specs = [HeadSpec(4 * bins + nc, size // s, size // s, s) for s in (8, 16, 32)]
    program_ = yolov8.program(specs[0].c, nc)
    pipe1 = GpuPipeline(ctx, (size, size), specs, program_)
    pipe8 = GpuPipeline(ctx, (size, size), specs, program_, batch=batch)
    bufs = device_heads(ctx, packed, batch)
    ptrs = [b.ptr for b in bufs]
    kw = {"conf_threshold": CONF, "iou_threshold": IOU, "max_det": 300}

    def post1_sync() -> list[Any]:
        pipe1.post(ptrs, [geometry], **kw)  # type: ignore[arg-type]
        return pipe1.synchronize()

    def post8_sync() -> list[Any]:
        pipe8.post(ptrs, [geometry] * batch, **kw)  # type: ignore[arg-type]
        return pipe8.synchronize()

    expected = yolov8.postprocess(raws, (8, 16, 32), nc, geometry, conf_threshold=CONF,
                                  iou_threshold=IOU)  # fmt: skip
    got = post1_sync()[0]
    assert got.detections.shape == expected.shape, (got.detections.shape, expected.shape)
    wall1 = wall(post1_sync, 500, warm=20)
    wall8 = wall(post8_sync, 200, warm=10) / batch
    ref_us = wall(lambda: yolov8.postprocess(raws, (8, 16, 32), nc, geometry), 30)

    dev = torch.device("cuda")
    theads = [torch.from_numpy(r).to(dev).half() for r in raws]
    points, strides = [], []
    for r, s in zip(raws, (8, 16, 32), strict=True):  # Ultralytics' make_anchors, offset 0.5
        g = r.shape[1]
        sy, sx = torch.meshgrid(torch.arange(g, device=dev) + 0.5,
                                torch.arange(g, device=dev) + 0.5, indexing="ij")  # fmt: skip
        points.append(torch.stack((sx, sy), -1).view(-1, 2))
        strides.append(torch.full((g * g, 1), float(s), device=dev))
    anchor_points, stride_t = torch.cat(points), torch.cat(strides)
    proj = torch.arange(bins, device=dev, dtype=torch.float32)

    def tv_pipeline(images: int = 1) -> list[torch.Tensor]:
        # Ultralytics' Detect decode (DFL softmax expectation, dist2bbox xywh x stride) and
        # non_max_suppression (single label), torchvision's batched_nms, per image.
        x = torch.cat([h.float().view(1, 4 * bins + nc, -1) for h in theads], 2)
        x = x.expand(images, -1, -1).transpose(1, 2)  # [B, A, C]
        box, cls = x[..., : 4 * bins], x[..., 4 * bins :]
        if bins > 1:
            box = (box.view(images, -1, 4, bins).softmax(3) * proj).sum(3)
        lt, rb = box.chunk(2, 2)
        x1y1, x2y2 = anchor_points - lt, anchor_points + rb
        xy, wh = (x1y1 + x2y2) / 2 * stride_t, (x2y2 - x1y1) * stride_t
        boxes = torch.cat((xy - wh / 2, xy + wh / 2), 2)
        scores, labels = cls.sigmoid().max(2)
        outs = []
        for i in range(images):
            keep = scores[i] > CONF
            b, sc, lb = boxes[i][keep], scores[i][keep], labels[i][keep]
            idx = torchvision.ops.batched_nms(b, sc, lb, IOU)[:300]
            out = torch.cat((b[idx], sc[idx, None], lb[idx, None].float()), 1)
            out[:, [0, 2]] = ((out[:, [0, 2]] - geometry.pad_x) / geometry.scale).clamp(0, 1920)
            out[:, [1, 3]] = ((out[:, [1, 3]] - geometry.pad_y) / geometry.scale).clamp(0, 1080)
            outs.append(out.cpu())
        return outs

    tv_out = tv_pipeline()[0].numpy()
    same = tv_out.shape == got.detections.shape and bool(
        np.array_equal(tv_out[:, 5], got.detections[:, 5])
        and np.allclose(tv_out[:, :5], got.detections[:, :5], rtol=1e-4, atol=1e-2)
    )
    tv_wall = wall(tv_pipeline, 300, warm=20)
    tv_wall8 = wall(lambda: tv_pipeline(batch), 100, warm=10) / batch
    results[f"post_{name}"] = {
        "bins": bins,
        "cells": sum((size // s) ** 2 for s in (8, 16, 32)),
        "candidates": int(got.found),
        "detections": len(got.detections),
        "torchvision_detections": int(tv_out.shape[0]),
        "detections_identical_to_torchvision": same,
        "dlad_batch1_wall_us": wall1,
        f"dlad_batch{batch}_wall_per_frame_us": wall8,
        "torchvision_batch1_wall_us": tv_wall,
        f"torchvision_batch{batch}_wall_per_frame_us": tv_wall8,
        "numpy_reference_us": ref_us,
        "ratio_torchvision_over_dlad_batch1": tv_wall / wall1,
        f"ratio_torchvision_over_dlad_batch{batch}": tv_wall8 / wall8,
    }
    pipe1.close()
    pipe8.close()
    for b in bufs:
        b.free()


def stage_times(ctx: GpuContext, pipe: GpuPipeline, ptrs: list[int]) -> dict[str, float]:
    """Where the batch-1 frame's GPU time goes, warm: the frame's graph (settings already on
    the device) cut after each kernel, timed back to back; each stage is the difference from
    the cut before (the first cut holds only the memset that stands in for the sort's reset
    of the candidate counter)."""
    drv = _driver()
    sizes = [h.nbytes for h in pipe.heads]
    cuts: list[float] = []
    for kernels in range(5):
        graph, exe = pipe._capture(1, ptrs, sizes, copy=False, kernels=kernels)

        def run(exe: Any = exe) -> None:
            _check(drv.cuGraphLaunch(exe, pipe.stream), "cuGraphLaunch")

        cuts.append(Events(ctx, pipe.stream).time_us(run, 1000))
        _check(drv.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
        _check(drv.cuGraphDestroy(graph), "cuGraphDestroy")
    names = ("memset", "decode", "select_sort", "mask", "scan")
    out = {f"cut_after_{n}": t for n, t in zip(names, cuts, strict=True)}
    out |= {n: cuts[i] - cuts[i - 1] for i, n in enumerate(names) if i}
    return out


def bench_fence(ctx: GpuContext, results: dict[str, Any]) -> None:
    """Latency of the GPU → host-polled fence (pre done → emulated DLA may start)."""
    from dlad.gpu.fences import FencePoller, MappedFence

    poller = FencePoller()
    fence = MappedFence(ctx, poller)
    stream = ctx.stream()
    drv = _driver()
    lat = []
    for _ in range(300):
        import threading

        v = fence.next_value()
        ev = threading.Event()
        fence.on_reached(v, ev.set)
        fence.expect_gpu_signal(v)
        t0 = time.perf_counter_ns()
        _check(drv.cuStreamWriteValue32(stream, fence.device_ptr, v & 0xFFFFFFFF, 0), "write")
        ev.wait(5)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    results["fence_gpu_to_host_us"] = {"p50": float(np.percentile(lat, 50)),
                                       "p99": float(np.percentile(lat, 99))}  # fmt: skip
    # The daemon's path: the word write plus a blocking-sync event the fence's waiter sleeps on.
    pipe = GpuPipeline(ctx, (64, 64), [HeadSpec(18, 2, 2, 8)], program(ANCHORS[:1], 18))
    lat = []
    for _ in range(300):
        v = fence.next_value()
        t0 = time.perf_counter_ns()
        fence.gpu_signal(pipe, v)
        fence.wait(v, 5)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    results["fence_gpu_to_host_event_us"] = {"p50": float(np.percentile(lat, 50)),
                                             "p99": float(np.percentile(lat, 99))}  # fmt: skip
    pipe.close()
    fence.free()
    poller.close()


def open_gpu() -> tuple[GpuContext, dict[str, Any]]:
    """The GPU's context and the results' header (the GPU, the host, the date); exits when
    there is no GPU."""
    found = probe()
    if not found.available:
        raise SystemExit(f"needs a GPU: {found.reason}")
    header = {
        "gpu": found.describe(),
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    return GpuContext(0), header


SECTIONS = ("pre", "pre_nv12", "post", "post_dfl", "fence")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
        help="the sections to run (default: all)",
    )  # fmt: skip
    args = parser.parse_args()
    ctx, results = open_gpu()
    stream = ctx.stream()
    bw = copy_bandwidth(ctx, stream)
    results["d2d_copy_GBps"] = bw / 1e9
    if "pre" in args.only:
        bench_pre(ctx, results, bw)
    if "pre_nv12" in args.only:
        bench_pre_nv12(ctx, results)
    if "post" in args.only:
        bench_post(ctx, results, bw)
    if "post_dfl" in args.only:
        bench_post_dfl(ctx, results, "yolo11", yolov8.BINS)
        bench_post_dfl(ctx, results, "yolo26", 1)
    if "fence" in args.only:
        bench_fence(ctx, results)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
