"""The layout kernels of ``kernels.cu``: between the layouts dlad's pre/post kernels speak
(int8 ``DLA_HWC4`` frames in, fp16 ``CHW16`` heads out) and a TensorRT GPU engine's linear NCHW
tensors. ``dlad/devices/tensorrt_gpu.py`` captures them around the engine, one CUDA graph per
batch size, so that the native plane launches a TensorRT batch exactly as it launches the torch
engine's.

Their numpy specification: :func:`hwc4_to_nchw` is ``TensorRtGpu.run``'s host step (``q *
np.float32(scale)``, then the engine's type); :func:`dlad.imaging.post.pack_chw16` of the heads
cast to fp16 is the other.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dlad.gpu.driver import GpuContext, _driver, launch

__all__ = ["GpuLayouts", "LayoutKernels", "LayoutParams", "hwc4_to_nchw"]


class LayoutParams(ctypes.Structure):
    """Mirror of ``struct LayoutParams`` in kernels.cu."""

    _fields_ = [
        ("src", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("c", ctypes.c_int),
        ("h", ctypes.c_int),
        ("w", ctypes.c_int),
        ("pitch_px", ctypes.c_int),
        ("half", ctypes.c_int),
        ("scale", ctypes.c_float),
    ]


class LayoutKernels(Protocol):
    """The two layout steps, queued on a stream of the device (``device_index``); each raises
    an error of its implementation's when the launch fails."""

    device_index: int

    def to_nchw(
        self, stream: int, src: int, dst: int, *, n: int, c: int, h: int, w: int,
        pitch_px: int, scale: float, half: bool,
    ) -> None:  # fmt: skip
        """``n`` int8 ``DLA_HWC4`` frames ``[h][pitch_px][4]`` at ``src`` -> linear
        ``[n][c][h][w]`` at ``dst`` (fp16 if ``half``, else fp32), each value ``q * scale``."""
        ...

    def to_chw16(
        self, stream: int, src: int, dst: int, *, n: int, c: int, h: int, w: int, half: bool
    ) -> None:
        """Linear ``[n][c][h][w]`` at ``src`` (fp16 if ``half``, else fp32) -> fp16 ``CHW16``
        ``[n][ceil(c/16)][h][w][16]`` at ``dst``, padding lanes zero."""
        ...


class GpuLayouts:
    """:class:`LayoutKernels` on a :class:`GpuContext`'s compiled module (the GPU service's):
    launches with ``cuLaunchKernel`` on any stream of its device. Raises CudaError."""

    def __init__(self, ctx: GpuContext) -> None:
        self.ctx = ctx
        self.device_index = int(ctx.device)

    def to_nchw(
        self, stream: int, src: int, dst: int, *, n: int, c: int, h: int, w: int,
        pitch_px: int, scale: float, half: bool,
    ) -> None:  # fmt: skip
        params = LayoutParams(src, dst, n, c, h, w, pitch_px, int(half), scale)
        self._launch("layout_hwc4_nchw", (-(-w // 32), h, n), params, stream)

    def to_chw16(
        self, stream: int, src: int, dst: int, *, n: int, c: int, h: int, w: int, half: bool
    ) -> None:
        params = LayoutParams(src, dst, n, c, h, w, 0, int(half), 0.0)
        self._launch("layout_nchw_chw16", (-(-w // 32), h, n * -(-c // 16)), params, stream)

    def _launch(
        self, name: str, grid: tuple[int, int, int], params: LayoutParams, stream: int
    ) -> None:
        self.ctx.make_current()
        handle: Any = _driver().CUstream(int(stream))
        launch(self.ctx.kernels[name], grid, (32, 1, 1), params, handle)


def hwc4_to_nchw(
    frames: npt.NDArray[np.int8],
    c: int,
    w: int,
    scale: float,
    dtype: npt.DTypeLike,
    *,
    out: npt.NDArray[Any] | None = None,
) -> npt.NDArray[Any]:
    """The numpy specification of ``layout_hwc4_nchw``: int8 ``[n, H, W', 4]`` frames ->
    ``[n, c, H, w]`` of ``dtype``, float32 products ``q * scale`` cast (nearest even); written
    into ``out`` (of that dtype and shape) where given."""
    products = np.moveaxis(frames[:, :, :w, :c], 3, 1) * np.float32(scale)
    if out is None:
        return products.astype(dtype, order="C")
    out[...] = products  # the same cast, into the caller's buffer
    return out
