"""The DLA executor: one per DLA core, owning its core handle (an emulated core or a cuDLA one,
``dlad.devices.factory.open_core``), serving one model at batch 1, back to back.

It runs ``slots`` identical loops (default 2) on the event loop. Each :class:`Slot` owns one set
of I/O buffers and one fence, so while the core executes one slot's task, another slot pre- or
post-processes — the core's own "hardware" thread serialises execution, as a DLA does. Per job:

1. take the next job from the scheduler (expired jobs skipped there are answered
   DEADLINE_EXCEEDED and never run);
2. hand the job to a worker thread, which runs it to the end:
   a. pre-process: letterbox → quantise to ``DLA_HWC4`` int8 (one array) → copy into the
      slot's input buffer;
   b. submit the task with a signal fence and sleep until the core reaches it (a failed task
      still signals its fence);
   c. post-process with the decoder the loadable names (``dlad.imaging.decoders``; YOLOv5:
      unpack ``CHW16``/``CHW32`` heads → decode → NMS → boxes in the original image's pixels);
3. back on the loop, read the task's status (a failed one's sticky error is read and cleared:
   DEVICE_FAILED) and report the outcome, keyed by the job's id.

A job crosses between the loop and a thread twice (out and back), whatever its stages; the
slots' threads pre/post-process at most ``[pre_post] threads`` frames at once between them
(``lanes``), and sleep on the core outside that bound. The event loop only moves small objects;
image math runs on threads, numerics on the core.

With a GPU (``gpu`` given), step 2 becomes one chain queued at once, from the loop (the calls
only enqueue work), on the slot's CUDA stream and fenced to the DLA task (``dlad.gpu``): upload
→ pre kernel → the GPU signals the slot's ``ready`` fence → the task (waiting on ``ready``) runs
and signals ``done`` → the stream waits on ``done`` → post kernels, which write the results to
pinned host memory. The slot's own thread (:class:`dlad.waiter.Waiter`: one hand-over each way,
about half of ``anyio.to_thread``'s CPU) waits for the chain's end; the CPU never waits between
pre and post. ``pre_us`` is then
submission to task start and ``post_us`` task end to result, both as seen by the host.
"""

from __future__ import annotations

import asyncio
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
from dlad.errors import DeadlineExceeded, DeviceFailed, InternalError
from dlad.executors.base import Executor, OnOutcome, Outcome, Request, pipeline_us
from dlad.imaging.decoders import decoder_for
from dlad.imaging.post import unpack_head
from dlad.imaging.pre import Letterbox, letterbox, letterbox_geometry, quantize_hwc4, to_rgb
from dlad.loadable import DataType, Loadable
from dlad.native_scheduler import Scheduling
from dlad.protocol import MAX_DET
from dlad.scheduler import Job
from dlad.waiter import Waiter

if TYPE_CHECKING:
    from dlad.gpu.service import GpuService, GpuSlot

__all__ = ["DlaExecutor", "Slot"]

_NO_DETECTIONS = np.zeros((0, 6), np.float32)
_NO_DETECTIONS.flags.writeable = False

log = structlog.get_logger("dlad.executors.dla")


@dataclass(eq=False)
class Slot:
    """One set of the core's I/O buffers and the fence its tasks signal; ``gpu`` is its CUDA
    side (pre/post kernels fenced to the task) where the GPU does pre/post-processing."""

    inputs: tuple[Any, ...]  # the same tuples every task: the core checks their layout once
    outputs: tuple[Any, ...]
    fence: Any
    gpu: GpuSlot | None = None
    waiter: Waiter | None = None  # with ``gpu``: the thread that sleeps until a chain's end


class DlaExecutor(Executor):
    """One DLA core (emulated or cuDLA) serving one model (see the module docstring).

    Args:
        name: the device's name (``dla0``).
        core: the DLA core index.
        model: the model it serves.
        loadable_path: the loadable built for ``core``.
        loadable: its parsed header (anchors, strides, scales).
        scheduler: the daemon's scheduler (loop-owned), which it pulls its jobs from.
        capacity: its queue bound in the scheduler.
        mode, latency_us, threads, faults, task_timeout_ms, dram: the emulated core's settings
            (``dram``: the DRAM it shares with the emulated Orin's other engines, or None).
        backend, cudla_loadable: ``emulated``, ``cudla`` or ``auto`` and the TensorRT loadable
            a cudla core runs (:func:`dlad.devices.factory.open_core`).
        pre_post: run pre/post-processing (off: the benchmark's "daemon path only" mode, where
            the reply carries no detections).
        limiter: bounds the threads used for pre/post-processing across all workers (the GPU
            executor's; kept for the fallback path of a GPU chain).
        lanes: bounds the frames the slots' threads pre/post-process at once, across every DLA
            executor that shares it (None: ``threads`` of this executor's own).
        gpu: run pre/post-processing as CUDA kernels fenced to the DLA tasks (None: numpy).
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
        scheduler: Scheduling[Request],
        capacity: int = 4,
        mode: Literal["numeric", "timing"],
        latency_us: float | None,
        threads: int,
        faults: FaultConfig | None,
        task_timeout_ms: float,
        limiter: anyio.CapacityLimiter,
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
        self.scheduler = scheduler
        self.pre_post = pre_post
        self.limiter = limiter
        self.decoder = decoder_for(loadable.decoder)  # the config checked the name
        self.gpu = gpu if pre_post else None
        if self.gpu is not None and not self.decoder.cuda:
            log.warning("gpu_post_unavailable", device=name, decoder=self.decoder.name)
            self.gpu = None  # no CUDA kernels for this model family: pre/post on the CPU
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
        # One thread per slot runs a job to its end (it sleeps on the core, outside the lanes).
        self._slot_threads = anyio.CapacityLimiter(len(self.slots))
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
                slot.waiter = Waiter(f"{self.name}-gpu-wait")
            except DlaError as exc:
                # e.g. a cudla core in deterministic-semaphore mode, which cannot take a
                # GPU-signalled fence: this worker pre/post-processes on the CPU instead.
                log.warning("gpu_pre_post_unavailable", device=self.name, reason=str(exc))
                self.gpu = None
        return slot

    def close(self) -> None:
        for slot in self.slots:
            if slot.waiter is not None:
                slot.waiter.close()
        self.dla.close(force=True)

    async def warm_up(self) -> float:
        """Run one task on the first slot's (zeroed) buffers before serving, so the first
        request does not pay for the core's lazy set-up (readiness waits for this).

        Returns its device time in µs. Raises DeviceFailed when the task fails.
        """
        try:
            handle = await self._submit(self.slots[0])
        except DlaError as exc:
            self.warm, self.warm_error = "failed", str(exc)
            raise DeviceFailed(f"{self.name}: warm-up task could not be submitted: {exc}") from exc
        if handle.status is not CudlaStatus.SUCCESS:
            sticky = self.dla.last_error()
            self.warm, self.warm_error = "failed", f"task status {sticky.name}"
            raise DeviceFailed(f"{self.name}: warm-up task failed ({sticky.name})")
        self.warm = "ok"
        return float(handle.timing.actual_us) if handle.timing is not None else 0.0

    async def run(self, on_outcome: OnOutcome) -> None:
        """Serve jobs until cancelled; the core is closed on the way out."""
        try:
            async with anyio.create_task_group() as tg:
                for slot in self.slots:
                    tg.start_soon(self._slot_loop, slot, on_outcome)
        finally:
            self.close()

    async def _slot_loop(self, slot: Slot, on_outcome: OnOutcome) -> None:
        while True:
            job, expired = self.scheduler.next_job(self.name)
            for stale in expired:
                await on_outcome(self._expired(stale))
            if job is None:
                await self.wait_for_work()
                continue
            try:
                outcome = await self._execute(job, slot)
            except Exception as exc:  # a bug must cost one request an INTERNAL, not the daemon
                log.exception("job_failed", device=self.name)
                outcome = Outcome(job.id, self.name, error=InternalError(repr(exc)))
            self.scheduler.finished(self.name, job, self._cost_us(outcome, slot))
            await on_outcome(outcome)

    def _cost_us(self, outcome: Outcome, slot: Slot) -> float | None:
        """What the scheduler learns from ``outcome`` (None: a failure teaches nothing). On the
        CPU path the slots' pre/post-processing can be the bottleneck (:func:`pipeline_us`); on
        the GPU chain ``pre_us`` includes waiting for the core, so the task time is the cost."""
        if outcome.error is not None:
            return None
        if slot.gpu is not None:
            return outcome.device_us
        return pipeline_us(outcome.pre_us, outcome.device_us, outcome.post_us, len(self.slots))

    def _expired(self, job: Job[Request]) -> Outcome:
        return Outcome(job.id, self.name, error=DeadlineExceeded("deadline passed while queued"))

    async def _execute(self, job: Job[Request], slot: Slot) -> Outcome:
        if slot.gpu is not None and slot.waiter is not None:  # both or neither
            return await self._execute_gpu(job, slot, slot.gpu, slot.waiter)
        if not self.pre_post:
            return await self._execute_bare(job, slot)
        return await anyio.to_thread.run_sync(
            self.run_frame, job.id, job.payload, slot, limiter=self._slot_threads
        )

    def run_frame(self, job_id: int, work: Request, slot: Slot) -> Outcome:
        """One job on ``slot`` from pre-processing to detections, on the calling thread (a
        slot's worker, or an engine thread of the native plane), its failure counted: with
        pre/post-processing off, the task alone (no detections). The GPU chain is not this
        path."""
        out, handle = self._run_job(job_id, work, slot)
        if isinstance(out.error, DeviceFailed):  # not submitted, or its fence was lost
            self.failed(out.error)
        elif self._settle(out, handle):  # a failed task's outputs were not read
            self.succeeded()
        return out

    async def _execute_bare(self, job: Job[Request], slot: Slot) -> Outcome:
        """A job with pre/post-processing off (the benchmark's "daemon path only"): the task is
        submitted from the loop, and the core's fence callback is the only thread crossing."""
        out = Outcome(job.id, self.name, detections=_NO_DETECTIONS)
        out.queue_us = (time.monotonic_ns() - job.payload.received_ns) / 1e3
        try:
            handle = await self._submit(slot)
        except DlaError as exc:
            out.error = self.failed(DeviceFailed(f"{self.name}: {exc}"))
            return out
        if self._settle(out, handle):
            self.succeeded()
        return out

    def _run_job(self, job_id: int, work: Request, slot: Slot) -> tuple[Outcome, Any]:
        """A job on the CPU path, from pre-processing to detections, on a slot's worker thread:
        returns its outcome (times and detections; the task's status is read by the caller)
        and the task's handle (None when it was not submitted, ``out.error`` saying why)."""
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

    async def _execute_gpu(
        self, job: Job[Request], slot: Slot, gpu: GpuSlot, waiter: Waiter
    ) -> Outcome:
        work = job.payload
        out = Outcome(job.id, self.name)
        t0 = time.monotonic_ns()
        out.queue_us = (t0 - work.received_ns) / 1e3
        try:
            # On the loop: the chain's calls only queue work (the upload of a pageable frame
            # stages it in the driver before it returns; a registered one is read in place).
            handle, geometry = self._enqueue_gpu(work, slot, gpu)
        except DlaError as exc:
            out.error = self.failed(DeviceFailed(f"{self.name}: {exc}"))
            return out
        # Waits for the whole chain (pre, DLA, post) on the slot's own thread (one hand-over
        # each way: dlad.waiter).
        (result,) = await waiter.run(gpu.pipeline.synchronize)
        t_end = time.monotonic_ns()
        ok = self._settle(out, handle)
        if handle.timing is not None:
            out.pre_us = (handle.timing.start_ns - t0) / 1e3
            out.post_us = (t_end - handle.timing.end_ns) / 1e3
        if not ok:
            return out
        if result.overflow:  # more candidates than the GPU stores: the reference decides
            log.warning("gpu_candidates_overflow", device=self.name, found=result.found)
            out.detections = await anyio.to_thread.run_sync(
                self._post, work, slot.outputs, geometry, limiter=self.limiter
            )
        else:
            out.detections = result.detections
        self.succeeded()
        return out

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

    def _enqueue_gpu(self, work: Request, slot: Slot, gpu: GpuSlot) -> tuple[Any, Letterbox]:
        """Queue the frame's whole chain; returns the DLA task's handle and the geometry."""
        image = np.ascontiguousarray(work.image)
        h, w = image.shape[0], image.shape[1]
        geometry = letterbox_geometry(w, h, self.loadable.image_size)
        pipe = gpu.pipeline
        service = self.gpu
        in_place = service is not None and service.read_frames_in_place
        at = service.frame_device_ptr(image) if in_place and service is not None else None
        if at is not None:
            src = at  # a shared-memory frame, read where the client wrote it
        elif service is not None and service.stage_frames:
            src = pipe.stage(image)  # one CPU copy into pinned memory the kernel reads
        else:
            src = pipe.upload(image)  # DMA from a registered segment; else staged by the driver
        int8 = self.module.inputs[0].data_type == DataType.INT8
        pipe.pre(
            src,
            image.shape,
            work.pixel_format,  # type: ignore[arg-type]
            geometry,
            gpu.input_ptr,
            input_scale=self.loadable.input_scale if int8 else None,
        )
        # GPU signals ready → task (waits ready, signals done) → stream waits done
        handle = gpu.chain_task(self.dla, self.module, slot.inputs, slot.outputs)
        pipe.post(
            gpu.head_ptrs,
            [geometry],
            conf_threshold=work.conf,
            iou_threshold=work.iou,
            max_det=work.max_det,
        )
        return handle, geometry

    def _submit_now(self, slot: Slot) -> tuple[Any, Any, int]:
        """Submit the slot's task, signalling the next value of its fence: (the task's handle,
        the fence, that value). Raises DlaError."""
        fence = slot.fence
        target = fence.value + 1
        handle = self.dla.submit(
            Task(self.module, slot.inputs, slot.outputs, signal=((fence, target),))
        )
        return handle, fence, target

    async def _submit(self, slot: Slot) -> Any:
        loop = asyncio.get_running_loop()
        reached: asyncio.Future[None] = loop.create_future()

        def settle() -> None:  # on the loop
            if not reached.done():  # the waiter may have been cancelled (shutdown)
                reached.set_result(None)

        def on_reached() -> None:  # the core's thread (or this one, if already reached)
            loop.call_soon_threadsafe(settle)

        handle, fence, target = self._submit_now(slot)
        fence.on_reached(target, on_reached)
        await reached
        return handle

    def _pre(self, work: Request, buffer: Any) -> Letterbox:
        rgb = to_rgb(work.image, work.pixel_format)  # type: ignore[arg-type]
        size = self.loadable.image_size
        canvas, geometry = letterbox(rgb, (size[0], size[1]))
        q = quantize_hwc4(canvas, self.loadable.input_scale)
        np.copyto(buffer.raw, q.reshape(-1).view(np.uint8))
        return geometry

    def _post(self, work: Request, outputs: Sequence[Any], geometry: Letterbox) -> np.ndarray:
        heads = [
            unpack_head(buf.array, d.c, d.h, d.w, d.scale if d.data_type == DataType.INT8 else None)
            for d, buf in zip(self.module.outputs, outputs, strict=True)
        ]
        return self.decoder.postprocess(
            heads, self.loadable, geometry, conf=work.conf, iou=work.iou, max_det=work.max_det
        )
