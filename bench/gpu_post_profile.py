"""Per-kernel GPU durations of one batch-1 post-processing frame (YOLOv5s at 672, the
benchmark's heads), for Nsight Compute on the H200:

    ncu --clock-control none -k regex:post_ --metrics gpu__time_duration.sum \
        python3 bench/gpu_post_profile.py [max_det]
"""

from __future__ import annotations

import sys

import numpy as np
from gpu_prepost import CONF, IOU, SIZE, yolov5s_heads  # bench/ is sys.path[0]

from dlad.families.yolov5 import ANCHORS, program
from dlad.gpu.driver import GpuContext, _check, _driver
from dlad.gpu.prepost import GpuPipeline, HeadSpec
from dlad.imaging.pre import letterbox_geometry


def main() -> None:
    max_det = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    ctx = GpuContext(0)
    _, packed = yolov5s_heads(np.random.default_rng(1))
    specs = [HeadSpec(255, SIZE // s, SIZE // s, s) for s in (8, 16, 32)]
    pipe = GpuPipeline(ctx, (SIZE, SIZE), specs, program(ANCHORS, specs[0].c))
    drv = _driver()
    ptrs = []
    for p in packed:
        b = ctx.alloc(p.nbytes, zero=False)
        _check(drv.cuMemcpyHtoD(b.ptr, np.ascontiguousarray(p).ctypes.data, p.nbytes), "h2d")
        ptrs.append(b.ptr)
    geometry = letterbox_geometry(1920, 1080, SIZE)
    for _ in range(3):
        pipe.post(ptrs, [geometry], conf_threshold=CONF, iou_threshold=IOU, max_det=max_det)
        (r,) = pipe.synchronize()
    print("kept", len(r.detections), "of", r.entered_nms)


if __name__ == "__main__":
    main()
