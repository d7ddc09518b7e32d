"""The GPU as the daemon's pre/post-processing engine: one context, one fence poller, pinned
buffers the emulated DLA cores and the GPU share, and one :class:`GpuSlot` per worker slot.

:func:`select_backend` makes the start-up choice (logged): CUDA kernels where the probe finds a
usable GPU, else the numpy reference on CPU threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
import structlog

from dlad.gpu.driver import GpuContext, GpuProbe, HostBuffer, probe
from dlad.gpu.fences import FencePoller, MappedFence
from dlad.gpu.prepost import GpuPipeline, HeadSpec
from dlad.imaging.pre import letterbox_geometry
from dlad.loadable import DataType, Loadable

__all__ = ["GpuService", "GpuSlot", "select_backend"]

log = structlog.get_logger("dlad.gpu")


def select_backend(
    requested: Literal["auto", "cpu", "cuda"], gpu_configured: bool
) -> tuple[Literal["cpu", "cuda"], GpuProbe | None]:
    """The pre/post backend to use: ``cuda`` when asked for (or ``auto``) and the probe finds
    a GPU, else ``cpu``. Raises RuntimeError when ``cuda`` was required and no GPU is usable."""
    if requested == "cpu" or not gpu_configured:
        return "cpu", None
    found = probe()
    if found.available:
        return "cuda", found
    if requested == "cuda":
        raise RuntimeError(f"pre_post.backend = 'cuda' but {found.describe()}")
    return "cpu", found


@dataclass(eq=False)
class GpuSlot:
    """One worker slot's GPU resources: its stream (in ``pipeline``), the fence the GPU signals
    when the DLA input is ready (``ready``) and the fence the DLA task signals (``done``)."""

    pipeline: GpuPipeline
    ready: MappedFence
    done: MappedFence
    input_ptr: int
    head_ptrs: list[int] = field(default_factory=list)


class GpuService:
    """Owns the GPU context and everything allocated from it; :meth:`close` frees it all.

    Raises CudaError (from :class:`GpuContext`) when the GPU cannot be opened or the kernels do
    not build.
    """

    def __init__(self, device_index: int = 0, cache_dir: Path | None = None) -> None:
        self.ctx = GpuContext(device_index, cache_dir)
        self.poller = FencePoller()
        self._lock = threading.Lock()
        self._host: dict[int, HostBuffer] = {}
        self._slots: list[GpuSlot] = []

    def host_array(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """``nbytes`` of zeroed, pinned, GPU-mapped host memory (an emulated core's allocator)."""
        buf = self.ctx.host_alloc(nbytes)
        with self._lock:
            self._host[buf.host_ptr] = buf
        return buf.array

    def device_ptr(self, array: npt.NDArray[np.uint8]) -> int:
        """The GPU address of an array from :meth:`host_array`. Raises KeyError otherwise."""
        with self._lock:
            return self._host[array.ctypes.data].device_ptr

    def slot(
        self,
        loadable: Loadable,
        input_array: npt.NDArray[np.uint8],
        output_arrays: list[npt.NDArray[np.uint8]],
        max_det: int,
    ) -> GpuSlot:
        """GPU resources for one worker slot whose DLA buffers come from :meth:`host_array`.
        Every kernel runs once here (a frame on zeroed buffers, no fence waits): with CUDA's
        lazy module loading, the first launch of a kernel behind a blocked stream wait would
        hang the launching thread."""
        heads = [
            HeadSpec(d.c, d.h, d.w, s, d.scale if d.data_type == DataType.INT8 else None)
            for d, s in zip(loadable.outputs, loadable.strides, strict=True)
        ]
        h, w = loadable.image_size
        pipeline = GpuPipeline(self.ctx, (h, w), heads, loadable.anchors_px, max_det=max_det)
        slot = GpuSlot(
            pipeline,
            MappedFence(self.ctx, self.poller, "gpu-ready"),
            MappedFence(self.ctx, self.poller, "dla-done"),
            self.device_ptr(input_array),
            [self.device_ptr(a) for a in output_arrays],
        )
        self._warm_up(slot, loadable)
        with self._lock:
            self._slots.append(slot)
        return slot

    def _warm_up(self, slot: GpuSlot, loadable: Loadable) -> None:
        p = slot.pipeline
        image = np.zeros((2, 2, 3), np.uint8)
        geometry = letterbox_geometry(2, 2, loadable.image_size)
        h, w = loadable.image_size
        scratch = self.ctx.alloc(h * (w + 16) * 32)  # fits both input layouts
        try:
            src = p.upload(image)
            p.pre(src, image.shape, "RGB", geometry, scratch.ptr, input_scale=1.0)
            p.pre(src, image.shape, "RGB", geometry, scratch.ptr, input_scale=None)
            p.post(slot.head_ptrs, [geometry], max_det=min(1, p.max_det))
            p.synchronize()
        finally:
            scratch.free()

    def close(self) -> None:
        """Stop the poller and free every slot, fence and buffer (streams drained first)."""
        self.poller.close()
        with self._lock:
            slots, self._slots = self._slots, []
            host, self._host = self._host, {}
        for s in slots:
            s.pipeline.close()
            s.ready.free()
            s.done.free()
        for buf in host.values():
            buf.free()
        self.ctx.close()
