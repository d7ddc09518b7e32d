"""The DLA executor: one per DLA core that runs as a Python engine of the native data plane (a
numeric core, pre/post-processing on the CPU, fault injection), owning its core handle (an
emulated core or a cuDLA one, ``dlad.devices.factory.open_core``) and serving one model at
batch 1, back to back.

Each :class:`Slot` owns one set of I/O buffers and one fence; the plane runs one engine thread a
slot (:class:`dlad.engines.python.DlaFrames`), so while the core executes one slot's task,
another slot pre- or post-processes — the core's own "hardware" thread serialises execution, as
a DLA does. :meth:`DlaExecutor.run_frame`, per frame, on the calling thread:

1. pre-process: letterbox → quantise to ``DLA_HWC4`` int8 (one array) → copy into the slot's
   input buffer;
2. submit the task with a signal fence and sleep until the core reaches it (a failed task still
   signals its fence; a fence never reached is a hang);
3. post-process as the model family the loadable names does (``dlad.families``: unpack
   ``CHW16``/``CHW32`` heads → decode → NMS → boxes in the original image's pixels);
4. read the task's status (a failed one's sticky error is read and cleared: DEVICE_FAILED).

The slots' threads pre/post-process at most ``[pre_post] threads`` frames at once between them
(``lanes``), and sleep on the core outside that bound. DLA cores whose frames need no Python
(timing cores, cuDLA cores) are the plane's own engines, with their GPU chain where the GPU
pre/post-processes (``dlad/native/chain_engine.hpp``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
import numpy as np
import structlog

from dlad.devices.base import CudlaStatus, DlaError, Task
from dlad.devices.dram import SharedDram
from dlad.devices.emulated import FaultConfig
from dlad.devices.factory import open_core
from dlad.errors import DeviceFailed
from dlad.executors.base import Executor, Outcome, Request
from dlad.families import family_for
from dlad.imaging.post import unpack_head
from dlad.imaging.pre import Letterbox, letterbox_frame, letterbox_geometry, quantize_hwc4
from dlad.loadable import DataType, Loadable
from dlad.protocol import MAX_DET

if TYPE_CHECKING:
    from dlad.gpu.service import GpuService, GpuSlot

__all__ = ["DlaExecutor", "Slot"]

_NO_DETECTIONS = np.zeros((0, 6), np.float32)
_NO_DETECTIONS.flags.writeable = False

log = structlog.get_logger("dlad.executors.dla")


@dataclass(eq=False)
class Slot:
    """One set of the core's I/O buffers and the fence its tasks signal; ``gpu`` is its CUDA
    side (pre/post kernels fenced to the task) where the GPU pre/post-processes."""

    inputs: tuple[Any, ...]  # the same tuples every task: the core checks their layout once
    outputs: tuple[Any, ...]
    fence: Any
    gpu: GpuSlot | None = None


class DlaExecutor(Executor):
    """One DLA core (emulated or cuDLA) serving one model (see the module docstring).

    Args:
        name: the device's name (``dla0``).
        core: the DLA core index.
        model: the model it serves.
        loadable_path: the loadable built for ``core``.
        loadable: its parsed header (anchors, strides, scales).
        capacity: its queue bound in the plane.
        mode, latency_us, threads, faults, task_timeout_ms, dram: the emulated core's settings
            (``dram``: the DRAM it shares with the emulated Orin's other engines, or None).
        backend, cudla_loadable: ``emulated``, ``cudla`` or ``auto`` and the TensorRT loadable
            a cudla core runs (:func:`dlad.devices.factory.open_core`).
        pre_post: run pre/post-processing (off: the benchmark's "daemon path only" mode, where
            the reply carries no detections).
        lanes: bounds the frames the slots' threads pre/post-process at once, across every DLA
            executor that shares it (None: ``threads`` of this executor's own).
        gpu: pre/post-process as CUDA kernels fenced to the core's tasks (None: numpy).
    """

    kind = "dla"

    def __init__(
        self,
        name: str,
        core: int,
        *,
        model: str,
        loadable_path: str,
        loadable: Loadable,
        capacity: int = 4,
        mode: Literal["numeric", "timing"],
        latency_us: float | None,
        threads: int,
        faults: FaultConfig | None,
        task_timeout_ms: float,
        pre_post: bool = True,
        slots: int = 2,
        gpu: GpuService | None = None,
        backend: str = "emulated",
        cudla_loadable: str | None = None,
        dram: SharedDram | None = None,
        lanes: threading.BoundedSemaphore | None = None,
    ) -> None:
        super().__init__(
            name,
            core=core,
            models=frozenset([model]),
            capacity=capacity,
            service_us=latency_us if latency_us is not None else loadable.latency_us,
        )
        self.loadable = loadable
        self.pre_post = pre_post
        self.family = family_for(loadable.family)  # the config checked the name
        self.gpu = gpu if pre_post and self.family.cuda else None  # no CUDA decode: numpy
        self.dla, self.module = open_core(
            backend,
            core,
            loadable_path,
            loadable,
            cudla_loadable=cudla_loadable,
            mode=mode,
            latency_us=latency_us,
            threads=threads,
            faults=faults,
            dram=dram,
            allocator=None if self.gpu is None else self.gpu.host_array,
            cudla_options=None if self.gpu is None else self.gpu.cudla_options(),
        )
        self.dla.set_task_timeout(max(1, math.ceil(task_timeout_ms)))
        self.slots = [self._make_slot() for _ in range(slots)]
        self.lanes = lanes if lanes is not None else threading.BoundedSemaphore(max(threads, 1))
        # A fence the core never reaches (the core enforces the task timeout, so this is a
        # lost signal, not a slow task) frees its thread after this long.
        self._fence_timeout_s = 2 * task_timeout_ms / 1e3 + 1.0

    def _make_slot(self) -> Slot:
        slot = Slot(
            inputs=tuple(self.dla.alloc_buffer(d) for d in self.module.inputs),
            outputs=tuple(self.dla.alloc_buffer(d) for d in self.module.outputs),
            fence=self.dla.create_fence(),
        )
        if self.gpu is not None:  # mapped words (emulated) or NvSci imports (cudla)
            try:
                slot.gpu = self.gpu.slot_for(
                    self.dla, self.loadable, slot.inputs, slot.outputs, max_det=MAX_DET
                )
            except DlaError as exc:  # a core that cannot take a GPU-signalled fence: numpy
                log.warning("gpu_pre_post_unavailable", device=self.name, reason=str(exc))
                self.gpu = None
        return slot

    def close(self) -> None:
        self.dla.close(force=True)

    async def warm_up(self) -> float:
        """Run one task on the first slot's (zeroed) buffers before serving, so the first
        request does not pay for the core's lazy set-up (readiness waits for this).

        Returns its device time in µs. Raises DeviceFailed when the task fails.
        """
        try:
            handle = await anyio.to_thread.run_sync(self._task, self.slots[0])
        except DlaError as exc:
            self.warm, self.warm_error = "failed", str(exc)
            raise DeviceFailed(f"{self.name}: warm-up task could not be submitted: {exc}") from exc
        if handle.status is not CudlaStatus.SUCCESS:
            sticky = self.dla.last_error()
            self.warm, self.warm_error = "failed", f"task status {sticky.name}"
            raise DeviceFailed(f"{self.name}: warm-up task failed ({sticky.name})")
        self.warm = "ok"
        return float(handle.timing.actual_us) if handle.timing is not None else 0.0

    def run_frame(self, job_id: int, work: Request, slot: Slot) -> Outcome:
        """One frame on ``slot`` from pre-processing to detections, on the calling thread (an
        engine thread of the native plane), its failure counted: with pre/post-processing off,
        the task alone (no detections)."""
        if slot.gpu is not None:
            out, handle = self._run_chain(job_id, work, slot, slot.gpu)
        else:
            out, handle = self._run_job(job_id, work, slot)
        if isinstance(out.error, DeviceFailed):  # not submitted, or its fence was lost
            self.failed(out.error)
        elif self._settle(out, handle):  # a failed task's outputs were not read
            self.succeeded()
        return out

    def _run_job(self, job_id: int, work: Request, slot: Slot) -> tuple[Outcome, Any]:
        """A frame from pre-processing to detections, on an engine thread: returns its outcome
        (times and detections; the task's status is read by the caller) and the task's handle
        (None when it was not submitted, ``out.error`` saying why)."""
        out = Outcome(job_id, self.name, detections=None if self.pre_post else _NO_DETECTIONS)
        t0 = time.monotonic_ns()
        out.queue_us = (t0 - work.received_ns) / 1e3
        geometry = None
        if self.pre_post:
            with self.lanes:
                geometry = self._pre(work, slot.inputs[0])
        t1 = time.monotonic_ns()
        out.pre_us = (t1 - t0) / 1e3
        reached = threading.Event()
        try:
            handle, fence, target = self._submit_now(slot)
        except DlaError as exc:
            out.error = DeviceFailed(f"{self.name}: {exc}")
            return out, None
        fence.on_reached(target, reached.set)
        if not reached.wait(self._fence_timeout_s):
            out.hung = True
            out.error = DeviceFailed(
                f"{self.name}: the task's fence was not reached in {self._fence_timeout_s:g} s"
            )
            return out, None
        t2 = time.monotonic_ns()
        if handle.status is not CudlaStatus.SUCCESS or geometry is None:
            return out, handle
        with self.lanes:
            out.detections = self._post(work, slot.outputs, geometry)
        out.post_us = (time.monotonic_ns() - t2) / 1e3
        return out, handle

    def _run_chain(
        self, job_id: int, work: Request, slot: Slot, gpu: GpuSlot
    ) -> tuple[Outcome, Any]:
        """A frame as one chain queued at once on the slot's CUDA stream, fenced to the core's
        task (upload → pre kernel → the GPU signals ``ready`` → the task → ``done`` → post
        kernels), then waited for on the calling thread: the CPU never waits between pre and
        post. ``pre_us`` is submission to task start, ``post_us`` task end to result."""
        out = Outcome(job_id, self.name)
        t0 = time.monotonic_ns()
        image = np.ascontiguousarray(work.image)
        geometry = letterbox_geometry(*work.size, self.loadable.image_size)
        pipe, service = gpu.pipeline, self.gpu
        try:
            in_place = service is not None and service.read_frames_in_place
            at = service.frame_device_ptr(image) if in_place and service is not None else None
            if at is not None:
                src = at  # a shared-memory frame, read where the client wrote it
            elif service is not None and service.stage_frames:
                src = pipe.stage(image)  # one CPU copy into pinned memory the kernel reads
            else:
                src = pipe.upload(image)  # DMA from a registered segment, else staged
            int8 = self.module.inputs[0].data_type == DataType.INT8
            scale = self.loadable.input_scale if int8 else None
            pipe.pre(src, image.shape, work.pixel_format, geometry,
                     gpu.input_ptr, input_scale=scale, colour=work.colour)  # fmt: skip
            handle = gpu.chain_task(self.dla, self.module, slot.inputs, slot.outputs)
            pipe.post(gpu.head_ptrs, [geometry], conf_threshold=work.conf,
                      iou_threshold=work.iou, max_det=work.max_det)  # fmt: skip
        except DlaError as exc:
            out.error = DeviceFailed(f"{self.name}: {exc}")
            return out, None
        (result,) = pipe.synchronize()
        t_end = time.monotonic_ns()
        if handle.timing is not None:
            out.pre_us = (handle.timing.start_ns - t0) / 1e3
            out.post_us = (t_end - handle.timing.end_ns) / 1e3
        if handle.status is CudlaStatus.SUCCESS:
            if result.overflow:  # more candidates than the GPU stores: the reference decides
                log.warning("gpu_candidates_overflow", device=self.name, found=result.found)
                out.detections = self._post(work, slot.outputs, geometry)
            else:
                out.detections = result.detections
        return out, handle

    def _settle(self, out: Outcome, handle: Any) -> bool:
        """Copy the ended task's timing into ``out``; for a failed task read (and clear) the
        core's sticky error, as cuDLA wants, and set ``out.error``. Returns whether it
        succeeded."""
        timing = handle.timing
        if timing is not None:
            out.start_ns, out.end_ns = timing.start_ns, timing.end_ns
            out.device_us = timing.actual_us
            self.stats.busy_ns += timing.end_ns - timing.start_ns
        status = handle.status
        if status is CudlaStatus.SUCCESS:
            return True
        sticky = self.dla.last_error()
        out.hung = sticky is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
        out.error = self.failed(
            DeviceFailed(
                f"{self.name}: task failed: {getattr(status, 'c_name', status)} ({sticky.name})"
            )
        )
        return False

    def _submit_now(self, slot: Slot) -> tuple[Any, Any, int]:
        """Submit the slot's task, signalling the next value of its fence: (the task's handle,
        the fence, that value). Raises DlaError."""
        fence = slot.fence
        target = fence.value + 1
        handle = self.dla.submit(
            Task(self.module, slot.inputs, slot.outputs, signal=((fence, target),))
        )
        return handle, fence, target

    def _task(self, slot: Slot) -> Any:
        """Submit the slot's task and wait for its fence (the warm-up's): its handle. Raises
        DlaError, and DeviceFailed where the fence is not reached in time."""
        reached = threading.Event()
        handle, fence, target = self._submit_now(slot)
        fence.on_reached(target, reached.set)
        if not reached.wait(self._fence_timeout_s):
            raise DeviceFailed(
                f"{self.name}: the task's fence was not reached in {self._fence_timeout_s:g} s"
            )
        return handle

    def _pre(self, work: Request, buffer: Any) -> Letterbox:
        size = self.loadable.image_size
        canvas, geometry = letterbox_frame(
            work.image,
            work.pixel_format,
            (size[0], size[1]),
            work.colour,
        )
        q = quantize_hwc4(canvas, self.loadable.input_scale)
        np.copyto(buffer.raw, q.reshape(-1).view(np.uint8))
        return geometry

    def _post(self, work: Request, outputs: Sequence[Any], geometry: Letterbox) -> np.ndarray:
        heads = [
            unpack_head(buf.array, d.c, d.h, d.w, d.scale if d.data_type == DataType.INT8 else None)
            for d, buf in zip(self.module.outputs, outputs, strict=True)
        ]
        return self.family.postprocess(
            heads, self.loadable, geometry, conf=work.conf, iou=work.iou, max_det=work.max_det
        )
