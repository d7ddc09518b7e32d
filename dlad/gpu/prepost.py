"""GPU pre- and post-processing for one model: the kernels of ``kernels.cu`` driven on one CUDA
stream per :class:`GpuPipeline` (the daemon makes one per worker slot).

Per frame, everything is queued at once and the CPU waits only at the very end::

    upload image ─▶ pre kernel ─▶ signal fence A ─▶ (DLA task: waits A, runs, signals B)
        ─▶ stream waits B ─▶ decode ─▶ select+sort ─▶ IoU mask ─▶ greedy scan ─▶ copy result
        ─▶ event

:meth:`GpuPipeline.synchronize` waits for the event (on a worker thread, never on the loop) and
returns the detections of each image, ``[N, 6]`` float32 ``x1, y1, x2, y2, score, class`` in
source-image pixels, as the model family's numpy ``postprocess`` does (``dlad.families``) with
``max_candidates = min(max_candidates, SORT_CAPACITY)``. The decode is the family's kernel
(its :class:`~dlad.families.PostProgram`); the rest is the same for every family.

Limits (stated, checked): at most ``cand_capacity`` candidates per image are stored after the
confidence test; a frame that finds more is reported as ``overflow`` and the caller runs the
numpy reference for it. At most :data:`SORT_CAPACITY` candidates enter NMS (the best ones).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from dlad import _native
from dlad.devices.cudla import cuda_interop
from dlad.families import PostProgram
from dlad.gpu.driver import (
    DeviceBuffer,
    GpuContext,
    HostBuffer,
    Kernel,
    _check,
    _driver,
    launch,
)
from dlad.imaging.post import logit_cut
from dlad.imaging.pre import Letterbox, hwc4_layout
from dlad.protocol import PIXEL_FORMATS, PixelFormat, frame_size

if TYPE_CHECKING:
    from dlad.loadable import Loadable

__all__ = [
    "MAX_ANCHORS",
    "MAX_LEVELS",
    "SORT_CAPACITY",
    "GpuPipeline",
    "HeadSpec",
    "PostResult",
    "engine_heads",
    "most_candidates",
]

MAX_LEVELS = 4
MAX_ANCHORS = 4
SORT_CAPACITY = 8192
"""Candidates entering NMS at most (``DLAD_SORT_CAPACITY`` in kernels.cu)."""
_MASK_WORDS = SORT_CAPACITY // 64
_SORT_THREADS = 1024
_SORT_SMEM = SORT_CAPACITY * (8 + 4)
_SCAN_THREADS = 1024
_SCAN_ROWS = 1024  # DLAD_SHARED_ROWS


class PreParams(ctypes.Structure):
    """Mirror of ``struct PreParams`` in kernels.cu."""

    _fields_ = [
        ("src", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("src_w", ctypes.c_int),
        ("src_h", ctypes.c_int),
        ("src_pitch", ctypes.c_int),
        ("src_fmt", ctypes.c_int),
        ("y_offset", ctypes.c_int),
        ("dst_w", ctypes.c_int),
        ("dst_h", ctypes.c_int),
        ("dst_pitch_px", ctypes.c_int),
        ("new_w", ctypes.c_int),
        ("new_h", ctypes.c_int),
        ("pad_x", ctypes.c_int),
        ("pad_y", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("input_scale", ctypes.c_float),
        ("pad_value", ctypes.c_int),
        ("ky", ctypes.c_float),
        ("rv", ctypes.c_float),
        ("gu", ctypes.c_float),
        ("gv", ctypes.c_float),
        ("bu", ctypes.c_float),
    ]


class Geometry(ctypes.Structure):
    """Mirror of ``struct Geometry`` (one image's :class:`Letterbox`)."""

    _fields_ = [
        ("scale", ctypes.c_double),
        ("pad_x", ctypes.c_int),
        ("pad_y", ctypes.c_int),
        ("src_w", ctypes.c_int),
        ("src_h", ctypes.c_int),
    ]


class PostParams(ctypes.Structure):
    """Mirror of ``struct PostParams`` in kernels.cu."""

    _fields_ = [
        ("heads", ctypes.c_void_p * MAX_LEVELS),
        ("head_image_bytes", ctypes.c_longlong * MAX_LEVELS),
        ("cands", ctypes.c_void_p),
        ("keys", ctypes.c_void_p),
        ("counts", ctypes.c_void_p),
        ("sorted", ctypes.c_void_p),
        ("mask", ctypes.c_void_p),
        ("kept_m", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("geoms", ctypes.c_void_p),
        ("frame", ctypes.c_void_p),
        ("head_scale", ctypes.c_float * MAX_LEVELS),
        ("head_h", ctypes.c_int * MAX_LEVELS),
        ("head_w", ctypes.c_int * MAX_LEVELS),
        ("head_stride", ctypes.c_int * MAX_LEVELS),
        ("level_cells", ctypes.c_int * (MAX_LEVELS + 1)),
        ("anchors", ctypes.c_float * 2 * MAX_ANCHORS * MAX_LEVELS),
        ("nl", ctypes.c_int),
        ("na", ctypes.c_int),
        ("nc", ctypes.c_int),
        ("cand_capacity", ctypes.c_int),
        ("bins", ctypes.c_int),
        ("end2end", ctypes.c_int),
    ]


class FrameParams(ctypes.Structure):
    """Mirror of ``struct FrameParams``: the per-frame settings, which the frame's graph
    copies to the GPU (so the captured kernels' own arguments never change)."""

    _fields_ = [
        ("conf", ctypes.c_float),
        ("obj_cut", ctypes.c_float),
        ("iou", ctypes.c_float),
        ("max_det", ctypes.c_int),
        ("multi_label", ctypes.c_int),
        ("max_candidates", ctypes.c_int),
        ("nms_rounds", ctypes.c_int),
        ("reserved", ctypes.c_int),
    ]


_CANDIDATE_BYTES = 24  # struct Candidate: 5 floats + int


@dataclass(frozen=True, slots=True)
class HeadSpec:
    """One detection head as the DLA writes it: ``CHW32`` int8 when ``int8_scale`` is set,
    else ``CHW16`` fp16; ``c`` channels (``na * (5 + nc)``) over ``h x w`` cells."""

    c: int
    h: int
    w: int
    stride: int
    int8_scale: float | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of one image of this head."""
        vec = 32 if self.int8_scale is not None else 16
        elem = 1 if self.int8_scale is not None else 2
        return -(-self.c // vec) * self.h * self.w * vec * elem


def engine_heads(
    loadable: Loadable, frame_bytes: int, head_image_bytes: Sequence[int]
) -> list[HeadSpec]:
    """The heads of a GPU engine with device-side I/O (``TorchGpu``), as the post kernels read
    them: fp16 ``CHW16`` of the loadable's shapes, whatever the DLA's. Raises ValueError where
    its input (``frame_bytes`` a frame) is not the int8 ``DLA_HWC4`` frame the pre kernel
    writes, or its heads (``head_image_bytes`` an image each) are not those."""
    h, w = loadable.image_size
    frame = hwc4_layout(3, h, w, 1)[2]
    if frame_bytes != frame:
        raise ValueError(f"engine frames of {frame_bytes} B, the pre kernel writes {frame}")
    specs = [HeadSpec(d.c, d.h, d.w, s)
             for d, s in zip(loadable.outputs, loadable.strides, strict=True)]  # fmt: skip
    if tuple(spec.nbytes for spec in specs) != tuple(head_image_bytes):
        raise ValueError("the engine's heads are not fp16 CHW16 of the loadable's shapes")
    return specs


@dataclass(frozen=True, slots=True)
class PostResult:
    """One image's result: ``detections`` ``[N, 6]``; ``found`` candidates passed the
    confidence test; ``overflow`` when more than the capacity did (the detections are then
    incomplete: run the numpy reference); ``entered_nms`` how many entered NMS."""

    detections: npt.NDArray[np.float32]
    found: int
    overflow: bool
    entered_nms: int


def most_candidates(program: PostProgram, heads: Sequence[HeadSpec]) -> int:
    """The most candidates a frame's decode can give with ``multi_label`` off (as the daemon
    runs): one per anchor cell, or one per class of every cell for a one-to-one head
    (``program.end2end``), which takes every class."""
    cells = sum(program.per_cell * h.h * h.w for h in heads)
    return cells * program.nc if program.end2end else cells


class GpuPipeline:
    """Pre/post-processing of one model on one CUDA stream (not thread-safe: one frame at a
    time, one owner). Buffers are sized for ``batch`` images.

    Args:
        ctx: the GPU context.
        canvas: the model input ``(height, width)``.
        heads: the model's heads, in output order.
        program: the model family's decode kernel and its parameters
            (``dlad.families.family_for(loadable.family).cuda_program(loadable)``).
        batch: images per :meth:`post` call at most.
        max_det: largest ``max_det`` a frame may ask for.
        cand_capacity: candidates stored per image after the confidence test.
        max_image_bytes: the largest image :meth:`upload` (or :meth:`stage`) takes, allocated
            now (0: grow on demand). The daemon sets it: growing frees and allocates device
            memory, which waits for the whole GPU, and a stream of another slot may be waiting
            on a DLA task that in turn waits on a fence this one's host thread would signal: a
            stall that only the DLA task's timeout ends.
        staging: frames are brought to the pre kernel by :meth:`stage` (a CPU copy into
            pinned, device-mapped host memory that the kernel reads in place), so the
            ``max_image_bytes`` are allocated there instead of in device memory.

    Raises ValueError for shapes the kernels do not take (more than 4 levels or anchors per
    level, anchors for other levels than the heads'), CudaError when allocation fails.
    """

    def __init__(
        self,
        ctx: GpuContext,
        canvas: tuple[int, int],
        heads: Sequence[HeadSpec],
        program: PostProgram,
        *,
        batch: int = 1,
        max_det: int = 300,
        cand_capacity: int = 1 << 17,
        max_image_bytes: int = 0,
        staging: bool = False,
    ) -> None:
        if not 1 <= len(heads) <= MAX_LEVELS or not 1 <= program.per_cell <= MAX_ANCHORS:
            raise ValueError(f"{len(heads)} heads of {program.per_cell} anchors: the kernels "
                             f"take 1..{MAX_LEVELS} of 1..{MAX_ANCHORS}")  # fmt: skip
        anc = program.anchors
        if anc is not None and anc.shape != (len(heads), program.per_cell, 2):
            raise ValueError(f"anchors {anc.shape} for {len(heads)} heads of {program.per_cell}")
        if program.kernel not in ctx.kernels:
            raise ValueError(f"no decode kernel {program.kernel!r} in the GPU program")
        if batch < 1 or max_det < 0 or cand_capacity < 1:
            raise ValueError("batch, cand_capacity must be >= 1 and max_det >= 0")
        self.ctx = ctx
        self.canvas = canvas
        self.heads = tuple(heads)
        self.program = program
        self.batch = batch
        self.max_det = max_det
        self.cand_capacity = cand_capacity
        ctx.make_current()
        ctx.set_max_dynamic_smem(ctx.kernels["post_select_sort"], _SORT_SMEM)
        self._scan_smem = _SCAN_ROWS * _SCAN_ROWS // 8 + 4 * max(max_det, 1)
        ctx.set_max_dynamic_smem(ctx.kernels["post_scan"], self._scan_smem)
        self.stream = ctx.stream()
        self._geq = _driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ  # looked up once
        self.done = ctx.event(blocking=True)  # the waiting thread sleeps, it does not spin
        self._image: DeviceBuffer | None = None
        self._staging: HostBuffer | None = None
        self._owned: list[DeviceBuffer | HostBuffer] = []
        self._image_fixed = max_image_bytes > 0
        self._max_image_bytes = max_image_bytes
        if self._image_fixed and staging:
            self._staging = ctx.host_alloc(max_image_bytes)
        elif self._image_fixed:
            self._image = ctx.alloc(max_image_bytes, zero=False)
        cap = batch * cand_capacity
        self._cands = self._dev(cap * _CANDIDATE_BYTES)
        self._keys = self._dev(cap * 8)
        self._counts = self._dev(batch * 4)
        self._sorted = self._dev(batch * SORT_CAPACITY * _CANDIDATE_BYTES)
        self._mask = self._dev(batch * SORT_CAPACITY * _MASK_WORDS * 8)
        self._kept_m = self._dev(batch * 4)
        self._out_floats = 4 + 6 * max_det
        # The kernels write each image's record straight into pinned, device-mapped host memory
        # (a few KB of posted writes): no copy node, and the results are in host memory when
        # the last kernel ends.
        self._out_host = self._host(batch * self._out_floats * 4)
        # Per-frame settings and geometries: written here in pinned memory, copied to the GPU
        # by the first node of the frame's graph.
        self._frame_bytes = ctypes.sizeof(FrameParams) + batch * ctypes.sizeof(Geometry)
        self._frame_host = self._host(self._frame_bytes)
        self._frame_dev = self._dev(self._frame_bytes)
        self._frame = FrameParams.from_address(self._frame_host.host_ptr)
        self._geoms = (Geometry * batch).from_address(
            self._frame_host.host_ptr + ctypes.sizeof(FrameParams)
        )
        self._graphs: dict[tuple[object, ...], tuple[object, object]] = {}
        # The settings and geometries the device copy holds (None: none yet). A frame that
        # asks for the same launches its graph without the copy node.
        self._copied: tuple[object, ...] | None = None
        self._pre_params = PreParams()
        # The last pre-processing's settings, kernel and grid (the fields are set for them).
        self._pre_key: tuple[object, ...] | None = None
        self._pre_kernel: Kernel | None = None
        self._pre_grid = (1, 1, 1)
        self._post_params = PostParams()
        self._fill_static(self._post_params)
        self._requested: list[int] = []

    def _fill_static(self, p: PostParams) -> None:
        """The fields that never change between frames (set once: ctypes writes cost µs)."""
        na, anchors = self.program.per_cell, self.program.anchors
        cells = 0
        for i, head in enumerate(self.heads):
            p.head_scale[i] = head.int8_scale or 0.0
            p.head_h[i], p.head_w[i], p.head_stride[i] = head.h, head.w, head.stride
            p.level_cells[i] = cells
            cells += na * head.h * head.w
            for a in range(na):
                if anchors is not None:
                    p.anchors[i][a][0], p.anchors[i][a][1] = anchors[i, a]
        p.level_cells[len(self.heads)] = cells
        self._cells = cells
        p.cands, p.keys, p.counts = self._cands.ptr, self._keys.ptr, self._counts.ptr
        p.sorted, p.mask, p.kept_m = self._sorted.ptr, self._mask.ptr, self._kept_m.ptr
        p.out = self._out_host.device_ptr
        p.frame = self._frame_dev.ptr
        p.geoms = self._frame_dev.ptr + ctypes.sizeof(FrameParams)
        p.nl, p.na, p.nc = len(self.heads), na, self.program.nc
        p.cand_capacity, p.bins = self.cand_capacity, self.program.bins
        p.end2end = int(self.program.end2end)

    def _dev(self, nbytes: int) -> DeviceBuffer:
        buf = self.ctx.alloc(nbytes)
        self._owned.append(buf)
        return buf

    def _host(self, nbytes: int) -> HostBuffer:
        buf = self.ctx.host_alloc(nbytes)
        self._owned.append(buf)
        return buf

    def close(self) -> None:
        """Free every buffer, the stream and the event (after the stream drains)."""
        drv = _driver()
        self.ctx.make_current()
        drv.cuStreamSynchronize(self.stream)
        for graph, graph_exec in self._graphs.values():
            drv.cuGraphExecDestroy(graph_exec)
            drv.cuGraphDestroy(graph)
        self._graphs.clear()
        for buf in self._owned:
            buf.free()
        if self._image is not None:
            self._image.free()
        if self._staging is not None:
            self._staging.free()
        drv.cuEventDestroy(self.done)
        drv.cuStreamDestroy(self.stream)

    # ------------------------------------------------------------------------- pre

    def upload(self, image: npt.NDArray[np.uint8]) -> int:
        """Queue a copy of ``image`` (C-contiguous uint8) to the pipeline's device image buffer,
        growing it when needed (never with ``max_image_bytes`` set: a larger image is then a
        ValueError); returns its device address. A pageable ``image`` is staged by the driver
        before this returns, so the caller may reuse it afterwards."""
        if image.dtype != np.uint8 or not image.flags.c_contiguous:
            raise ValueError("image must be a C-contiguous uint8 array")
        self.ctx.make_current()
        if self._image_fixed and self._image is not None and image.nbytes > self._image.nbytes:
            raise ValueError(
                f"an image of {image.nbytes} B exceeds this pipeline's {self._image.nbytes} B"
            )
        if self._image is None or self._image.nbytes < image.nbytes:
            if self._image is not None:
                _check(_driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")
                self._image.free()
            self._image = self.ctx.alloc(image.nbytes, zero=False)
        _check(
            _driver().cuMemcpyHtoDAsync(
                self._image.ptr, image.ctypes.data, image.nbytes, self.stream
            ),
            "cuMemcpyHtoDAsync",
        )
        return self._image.ptr

    def stage(self, image: npt.NDArray[np.uint8]) -> int:
        """Copy ``image`` (C-contiguous uint8) into the pipeline's pinned, device-mapped host
        buffer and return the buffer's device address, from which the pre kernel reads it in
        place: one CPU copy, no copy call to the driver. The buffer grows when needed (never
        with ``max_image_bytes`` set: a larger image is then a ValueError). The frame staged
        before must have been pre-processed (one frame at a time: a caller that waits for
        each frame's end, as a DLA slot does)."""
        if image.dtype != np.uint8 or not image.flags.c_contiguous:
            raise ValueError("image must be a C-contiguous uint8 array")
        if self._image_fixed and image.nbytes > self._max_image_bytes:
            raise ValueError(
                f"an image of {image.nbytes} B exceeds this pipeline's {self._max_image_bytes} B"
            )
        buf = self._staging
        if buf is None or buf.array.nbytes < image.nbytes:
            if buf is not None:
                _check(_driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")
                buf.free()
            size = self._max_image_bytes if self._image_fixed else image.nbytes
            buf = self._staging = self.ctx.host_alloc(size)
        np.copyto(buf.array[: image.nbytes], image.reshape(-1))
        return buf.device_ptr

    def pre(
        self,
        src_ptr: int,
        src_shape: tuple[int, ...],
        pixel_format: PixelFormat,
        geometry: Letterbox,
        dst_ptr: int,
        *,
        input_scale: float | None,
        pad_value: int = 114,
        colour: int = 0,
    ) -> None:
        """Queue letterbox + normalise of the image at ``src_ptr`` (uint8 of the numpy shape
        ``src_shape``, :func:`dlad.protocol.frame_shape`'s for ``pixel_format``; a YUV frame
        converted with ``colour``, as :func:`~dlad.imaging.pre.to_rgb` does) into ``dst_ptr``:
        int8 ``DLA_HWC4`` with ``input_scale`` (row pitch from :func:`hwc4_layout`), or fp16
        ``CHW16`` when ``input_scale`` is None.

        Raises ValueError for a shape that does not match ``pixel_format`` or ``geometry``.
        """
        p = self._pre_params
        key = (tuple(src_shape), pixel_format, geometry, dst_ptr, input_scale, pad_value, colour)
        if key == self._pre_key and self._pre_kernel is not None:  # a camera's: only src moves
            p.src = src_ptr
            launch(self._pre_kernel, self._pre_grid, (32, 8, 1), p, self.stream)
            return
        shape = tuple(src_shape)
        if pixel_format == "GRAY" and len(shape) == 2:
            shape = (*shape, 1)
        h, w = frame_size(pixel_format, shape)  # raises ValueError
        if (geometry.src_w, geometry.src_h) != (w, h):
            raise ValueError("geometry was computed for another image size")
        self._pre_key = None  # until the fields below are all written
        p.src, p.dst = src_ptr, dst_ptr
        p.src_w, p.src_h = w, h
        p.src_fmt = PIXEL_FORMATS.index(pixel_format)
        p.src_pitch = _native.row_bytes(p.src_fmt, w)
        p.ky, p.rv, p.gu, p.gv, p.bu, p.y_offset = _native.yuv_coefficients(colour)
        p.dst_w, p.dst_h = geometry.dst_w, geometry.dst_h
        p.new_w, p.new_h = geometry.new_w, geometry.new_h
        p.pad_x, p.pad_y = geometry.pad_x, geometry.pad_y
        p.scale = float(np.float32(geometry.scale))
        p.pad_value = pad_value
        if input_scale is not None:
            p.input_scale = float(np.float32(input_scale))
            p.dst_pitch_px = hwc4_layout(3, geometry.dst_h, geometry.dst_w, 1)[0]
            kernel, width = self.ctx.kernels["pre_hwc4_i8"], p.dst_pitch_px
        else:
            p.input_scale = 1.0
            p.dst_pitch_px = geometry.dst_w
            kernel, width = self.ctx.kernels["pre_chw16_f16"], geometry.dst_w
        grid = (-(-width // 32), -(-geometry.dst_h // 8), 1)
        self._pre_kernel, self._pre_grid, self._pre_key = kernel, grid, key
        launch(kernel, grid, (32, 8, 1), p, self.stream)

    # ------------------------------------------------------------------------- fences

    def signal(self, device_ptr: int, value: int) -> None:
        """Queue a write of ``value``'s low 32 bits to the fence word at ``device_ptr`` (the GPU
        signals a fence once the work queued before it is done)."""
        drv = _driver()
        _check(
            drv.cuStreamWriteValue32(self.stream, device_ptr, value & 0xFFFFFFFF, 0),
            "cuStreamWriteValue32",
        )

    def record(self, event: object) -> None:
        """Record ``event`` on the stream (it fires once the work queued before is done)."""
        _check(_driver().cuEventRecord(event, self.stream), "cuEventRecord")

    def wait(self, device_ptr: int, value: int) -> None:
        """Queue a wait until the fence word at ``device_ptr`` reaches ``value`` (wrap-safe
        32-bit ``>=``): the stream's later work starts only after the fence's producer."""
        drv = _driver()
        _check(
            drv.cuStreamWaitValue32(self.stream, device_ptr, value & 0xFFFFFFFF, self._geq),
            "cuStreamWaitValue32",
        )

    def signal_external(self, semaphore: Any, fence_address: int, rt: Any = None) -> None:
        """Queue ``cudaSignalExternalSemaphoresAsync`` of an imported NvSciSync semaphore on
        this stream; CUDA fills the ``NvSciSyncFence`` at ``fence_address`` with the fence the
        signal reaches (a DLA task's pre-fence). ``rt``: cuda-python's runtime (default: the
        installed one). Raises CudaInteropError naming the call."""
        cuda_interop.signal_fence(semaphore, fence_address, self.stream, rt=rt)

    def wait_external(self, semaphore: Any, fence_address: int, rt: Any = None) -> None:
        """Queue ``cudaWaitExternalSemaphoresAsync`` for the ``NvSciSyncFence`` at
        ``fence_address`` (a DLA task's EOF fence): the stream's later work starts only once the
        DLA reached it. Raises CudaInteropError naming the call."""
        cuda_interop.wait_fence(semaphore, fence_address, self.stream, rt=rt)

    # ------------------------------------------------------------------------- post

    def post(
        self,
        head_ptrs: Sequence[int],
        geometries: Sequence[Letterbox],
        *,
        conf_threshold: float = 0.25,
        iou_threshold: float = 0.45,
        max_det: int = 300,
        multi_label: bool = False,
        max_candidates: int = SORT_CAPACITY,
        head_image_bytes: Sequence[int] | None = None,
        nms_rounds: int = 24,
    ) -> None:
        """Queue decode → top-``max_candidates`` → NMS → back-projection for
        ``len(geometries)`` images whose heads start at ``head_ptrs`` (image ``b`` at
        ``ptr + b * head_image_bytes``, default: each head's :attr:`HeadSpec.nbytes`), the results
        written straight to pinned host memory, then the completion event (the settings are
        copied to the GPU only when they differ from the last frame's). NMS over at most 1,024
        candidates runs as a fixed point of at most ``nms_rounds`` parallel rounds, then (if it
        has not converged: a long suppression chain) as a sequential walk; both are exact.

        Raises ValueError for thresholds outside ``[0, 1)`` / ``(0, 1]``, ``max_det`` above the
        pipeline's, ``max_candidates`` outside ``1..SORT_CAPACITY``, or a batch too large.
        """
        n = len(geometries)
        if not 1 <= n <= self.batch or len(head_ptrs) != len(self.heads):
            raise ValueError(f"{n} images ({self.batch} max), {len(head_ptrs)} head pointers")
        if not (0 <= conf_threshold < 1 and 0 < iou_threshold <= 1):
            raise ValueError("conf_threshold must be in [0, 1) and iou_threshold in (0, 1]")
        if not 0 <= max_det <= self.max_det or not 1 <= max_candidates <= SORT_CAPACITY:
            raise ValueError(f"max_det must be <= {self.max_det}, max_candidates in 1..8192")
        sizes = head_image_bytes or [h.nbytes for h in self.heads]
        settings = (conf_threshold, iou_threshold, max_det, multi_label, max_candidates,
                    nms_rounds, *geometries)  # fmt: skip
        copy = settings != self._copied
        if copy:
            # The previous frame of this pipeline is done (one frame at a time), so its graph
            # no longer reads the pinned settings.
            for b, g in enumerate(geometries):
                geo = self._geoms[b]
                geo.scale, geo.pad_x, geo.pad_y, geo.src_w, geo.src_h = (
                    g.scale, g.pad_x, g.pad_y, g.src_w, g.src_h
                )  # fmt: skip
            f = self._frame
            f.conf = float(np.float32(conf_threshold))
            f.obj_cut = float(np.float32(logit_cut(conf_threshold)))
            f.iou = float(iou_threshold)
            f.max_det, f.multi_label = max_det, int(multi_label)
            f.max_candidates, f.nms_rounds = max_candidates, nms_rounds
            self._copied = None  # until the launch that copies them is queued
        key = (n, tuple(head_ptrs), tuple(sizes), copy)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(n, head_ptrs, sizes, copy=copy)
        drv = _driver()
        _check(drv.cuGraphLaunch(graph[1], self.stream), "cuGraphLaunch")
        if copy:
            self._copied = settings
        _check(drv.cuEventRecord(self.done, self.stream), "cuEventRecord")
        self._requested = [max_det] * n

    def _capture(
        self,
        n: int,
        head_ptrs: Sequence[int],
        sizes: Sequence[int],
        *,
        copy: bool = True,
        kernels: int = 4,
    ) -> tuple[object, object]:
        """Capture one frame of ``n`` images (the settings copy unless ``copy`` is false, then
        the four kernels, which write the results to host memory) as a CUDA graph: one launch
        per frame instead of five calls. ``kernels`` < 4 captures only the first ones (a
        benchmark times the stages by difference); without ``post_select_sort`` a memset resets
        the candidate counters in its place."""
        p = self._post_params
        for i, ptr in enumerate(head_ptrs):
            p.heads[i] = ptr
            p.head_image_bytes[i] = sizes[i]
        drv = _driver()
        self.ctx.make_current()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _check(drv.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            if copy:
                _check(
                    drv.cuMemcpyHtoDAsync(
                        self._frame_dev.ptr, self._frame_host.host_ptr, self._frame_bytes,
                        self.stream,
                    ),
                    "cuMemcpyHtoDAsync",
                )  # fmt: skip
            k, s, decode = self.ctx.kernels, self.stream, self.program.kernel
            stages: list[Callable[[], None]] = [
                lambda: launch(k[decode], (-(-self._cells // 256), n, 1), (256, 1, 1), p, s),
                lambda: launch(k["post_select_sort"], (n, 1, 1), (_SORT_THREADS, 1, 1), p, s,
                               _SORT_SMEM),
                lambda: launch(k["post_mask"], (2 * self.ctx.sm_count, n, 1), (256, 1, 1), p, s),
                lambda: launch(k["post_scan"], (n, 1, 1), (_SCAN_THREADS, 1, 1), p, s,
                               self._scan_smem),
            ]  # fmt: skip
            for stage in stages[:kernels]:
                stage()
            if kernels < 2:
                _check(drv.cuMemsetD32Async(self._counts.ptr, 0, n, s), "cuMemsetD32Async")
        finally:
            graph = _check(drv.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        graph_exec = _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return graph, graph_exec

    def plane_handles(self, head_ptrs: Sequence[int]) -> dict[str, int]:
        """What the native plane needs to run this pipeline's frames itself, one image at a
        time (``PlaneGpuSlot``'s fields but the slot's own: stream, image, staging,
        staging_device, image_bytes, post_copy, post_reuse, frame, out), the post graphs for
        ``head_ptrs`` captured if they are not yet. The plane then owns the pipeline's
        per-frame state: nothing may run a frame here afterwards. Raises ValueError for a
        pipeline whose image buffer grows on demand (``max_image_bytes`` 0) or of a batch
        above 1, CudaError when a capture fails."""
        if not self._image_fixed or self.batch != 1:
            raise ValueError("the plane needs a pipeline of batch 1 with a fixed image buffer")
        sizes = [h.nbytes for h in self.heads]
        graphs = []
        for copy in (True, False):
            key = (1, tuple(head_ptrs), tuple(sizes), copy)
            if key not in self._graphs:
                self._graphs[key] = self._capture(1, head_ptrs, sizes, copy=copy)
            graphs.append(int(self._graphs[key][1]))  # type: ignore[call-overload]
        staging = self._staging
        return {
            "stream": int(self.stream),
            "image": 0 if self._image is None else self._image.ptr,
            "staging": 0 if staging is None else staging.host_ptr,
            "staging_device": 0 if staging is None else staging.device_ptr,
            "image_bytes": self._max_image_bytes,
            "post_copy": graphs[0],
            "post_reuse": graphs[1],
            "frame": self._frame_host.host_ptr,
            "out": self._out_host.host_ptr,
        }

    @property
    def candidate_capacity_holds(self) -> bool:
        """Whether no frame can overflow the candidate store (:func:`most_candidates` of the
        pipeline's program and heads fit :attr:`cand_capacity`)."""
        return most_candidates(self.program, self.heads) <= self.cand_capacity

    def synchronize(self, spin_us: float = 0.0) -> list[PostResult]:
        """Block the calling thread until the queued frame is done; the results of each image.
        With ``spin_us``, first poll the frame's event for up to that long (a thread that sleeps
        on the event wakes some 10-20 µs after the GPU's interrupt: a latency-bound caller
        spends a core's time instead), then sleep. Raises CudaError when the stream failed (a
        kernel fault poisons the context)."""
        self.ctx.make_current()
        drv = _driver()
        if spin_us > 0:
            until = time.perf_counter_ns() + int(spin_us * 1e3)
            not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
            while time.perf_counter_ns() < until:
                (err,) = drv.cuEventQuery(self.done)
                if err != not_ready:
                    _check((err,), "cuEventQuery")
                    return self.results()
        _check(drv.cuEventSynchronize(self.done), "cuEventSynchronize")
        return self.results()

    def results(self) -> list[PostResult]:
        """The results of the frame last queued (valid once it is done)."""
        out: list[PostResult] = []
        if not self._requested:
            return out
        stride = 4 + 6 * self._requested[0]
        floats = self._out_host.array.view(np.float32)
        for b in range(len(self._requested)):
            rec = floats[b * stride : (b + 1) * stride]
            kept = int(rec[0])
            dets = rec[4 : 4 + 6 * kept].reshape(kept, 6).copy()
            out.append(PostResult(dets, int(rec[1]), bool(rec[2]), int(rec[3])))
        return out
