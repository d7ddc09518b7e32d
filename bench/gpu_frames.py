"""A frame's way into the GPU pre-processing kernel: the calling thread's CPU, the GPU time and
the wall time per frame, for each way a frame can reach the kernel, in one run (the H200 via
the device tool; it needs a CUDA GPU and cuda-python with NVRTC).

    python bench/gpu_frames.py [--frames 400] [--trials 3] [--json out.json]

Ways, for a frame that came in a message (pageable host memory):

- ``pageable DMA``: ``cuMemcpyHtoDAsync`` from the message's buffer, which the driver stages
  through its own pinned memory before it returns, then the kernel;
- ``pinned DMA``: the CPU copies the frame into the pipeline's pinned buffer, a DMA takes it to
  device memory, then the kernel;
- ``pinned in place``: the CPU copies it into the pinned, device-mapped buffer and the kernel
  reads it there (no copy call);

and for a frame in a client's shared-memory segment (registered with ``cuMemHostRegister``):

- ``registered DMA``: a DMA from the segment, then the kernel;
- ``registered in place``: the kernel reads the segment.

Each frame is queued, then waited for (one frame at a time, as a daemon slot does), from a
ring of 8 distinct frames so that no way reads a frame that is still in a CPU cache from the
frame before. CPU is ``time.thread_time`` around the queueing calls; GPU time from events
around the frame's work; wall from the first call to the end of the wait. Ways alternate in
every trial; medians over frames, then median [min, max] over trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dlad.families.yolov5 import ANCHORS, program
from dlad.gpu.driver import GpuContext, _check, _driver
from dlad.gpu.prepost import GpuPipeline, HeadSpec
from dlad.imaging.pre import hwc4_layout, letterbox_geometry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_prepost import open_gpu

SIZE = 672
SCALE = 0.0078125
RING = 8
SHAPES = {"672x672": (672, 672, 3), "1080p": (1080, 1920, 3)}


def measure(
    ctx: GpuContext, pipe: GpuPipeline, enqueue: Callable[[int], None], frames: int
) -> dict[str, float]:
    """Median CPU, GPU and wall microseconds per frame of ``enqueue(i)`` then a wait."""
    drv = _driver()
    start, end = ctx.event(timing=True), ctx.event(timing=True)
    cpu, gpu, wall = [], [], []
    for i in range(frames + 10):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        _check(drv.cuEventRecord(start, pipe.stream), "cuEventRecord")
        enqueue(i % RING)
        _check(drv.cuEventRecord(end, pipe.stream), "cuEventRecord")
        c1 = time.thread_time_ns()
        _check(drv.cuEventSynchronize(end), "cuEventSynchronize")
        t1 = time.perf_counter_ns()
        if i >= 10:  # warm-up left out
            cpu.append((c1 - c0) / 1e3)
            wall.append((t1 - t0) / 1e3)
            gpu.append(float(_check(drv.cuEventElapsedTime(start, end), "elapsed")) * 1e3)
    for ev in (start, end):
        drv.cuEventDestroy(ev)
    return {
        "cpu_us": statistics.median(cpu),
        "gpu_us": statistics.median(gpu),
        "wall_us": statistics.median(wall),
    }


def ways(
    ctx: GpuContext, pipe: GpuPipeline, shape: tuple[int, int, int], dst: int
) -> tuple[dict[str, Callable[[int], None]], Callable[[], None]]:
    """The ways a frame of ``shape`` reaches the kernel, each as ``enqueue(ring index)``; and
    what frees their buffers."""
    drv = _driver()
    rng = np.random.default_rng(0)
    nbytes = int(np.prod(shape))
    messages = [rng.integers(0, 256, size=shape, dtype=np.uint8) for _ in range(RING)]
    # A client's segment: page-aligned memory the daemon registers (here: numpy's, registered).
    segment = np.zeros(RING * nbytes + 4096, np.uint8)
    base = (-segment.ctypes.data) % 4096
    slots = segment[base : base + RING * nbytes].reshape(RING, *shape)
    slots[:] = np.stack(messages)
    seg_dev = ctx.register_host(int(slots.ctypes.data), slots.nbytes)
    pinned = ctx.host_alloc(nbytes)
    staging = pinned.array.reshape(shape)
    device = ctx.alloc(nbytes, zero=False)
    geometry = letterbox_geometry(shape[1], shape[0], SIZE)

    def pre(src: int) -> None:
        pipe.pre(src, shape, "BGR", geometry, dst, input_scale=SCALE)

    def pageable(i: int) -> None:
        frame = messages[i]
        _check(drv.cuMemcpyHtoDAsync(device.ptr, frame.ctypes.data, nbytes, pipe.stream), "h2d")
        pre(device.ptr)

    def pinned_dma(i: int) -> None:
        np.copyto(staging, messages[i])
        _check(drv.cuMemcpyHtoDAsync(device.ptr, pinned.host_ptr, nbytes, pipe.stream), "h2d")
        pre(device.ptr)

    def pinned_in_place(i: int) -> None:
        np.copyto(staging, messages[i])
        pre(pinned.device_ptr)

    def registered_dma(i: int) -> None:
        host = int(slots[i].ctypes.data)
        _check(drv.cuMemcpyHtoDAsync(device.ptr, host, nbytes, pipe.stream), "h2d")
        pre(device.ptr)

    def registered_in_place(i: int) -> None:
        pre(seg_dev + i * nbytes)

    found = {
        "pageable DMA": pageable,
        "pinned DMA": pinned_dma,
        "pinned in place": pinned_in_place,
        "registered DMA": registered_dma,
        "registered in place": registered_in_place,
    }

    def free() -> None:
        ctx.unregister_host(int(slots.ctypes.data))
        device.free()
        pinned.free()

    return found, free


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=400)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx, results = open_gpu()
    results["frames_per_trial"] = args.frames
    pitch = hwc4_layout(3, SIZE, SIZE, 1)[0]
    dst = ctx.alloc(SIZE * pitch * 4)
    pipe = GpuPipeline(ctx, (SIZE, SIZE), [HeadSpec(18, 2, 2, 8)], program(ANCHORS[:1], 18))
    for label, shape in SHAPES.items():
        enqueues, free = ways(ctx, pipe, shape, dst.ptr)
        trials: dict[str, list[dict[str, float]]] = {name: [] for name in enqueues}
        for _ in range(args.trials):
            for name, enqueue in enqueues.items():
                trials[name].append(measure(ctx, pipe, enqueue, args.frames))
        table = {}
        for name, rows in trials.items():
            table[name] = {
                key: [round(statistics.median(v), 1), round(min(v), 1), round(max(v), 1)]
                for key in rows[0]
                for v in [[r[key] for r in rows]]
            }
        results[label] = table
        free()
        print(f"{label} ({int(np.prod(shape))} B), median [min, max] over trials, us per frame:")
        for name, row in table.items():
            cells = "  ".join(f"{k} {v[0]:8.1f} [{v[1]:.1f}, {v[2]:.1f}]" for k, v in row.items())
            print(f"  {name:20s} {cells}")
    pipe.close()
    dst.free()
    text = json.dumps(results, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
