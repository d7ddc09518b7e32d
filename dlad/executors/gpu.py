"""The GPU executor: the same logical model as the DLA cores, run in dynamic batches.

It is a Python engine of the native data plane (:class:`dlad.engines.python.GpuBatches`): the
plane forms each batch (up to ``max_batch`` jobs of its model, a partial batch waiting at most
``max_queue_delay_us`` and never past the point where a full one could still meet its earliest
deadline) and calls :meth:`GpuExecutor.run_batch` on one of its ``slots`` engine threads, so one
batch is pre- or post-processed while another runs on the engine, which takes one batch at a
time. Per batch, on the calling thread:

1. pre-process every frame: letterbox → quantise to ``DLA_HWC4`` int8;
2. run the batch on the engine (the emulated Orin GPU, ``dlad/devices/emulated_gpu.py``; torch
   or TensorRT on a real GPU): one head set per frame, and the batch's time;
3. post-process every frame as the model family its loadable names does; one outcome per job,
   keyed by job id, all with the batch's device time.

**On the GPU** (the daemon has a ``GpuService``: ``[pre_post] backend`` cuda, or auto with CUDA
present, and the engine offers device-side I/O: ``TorchGpu`` on CUDA), a batch never leaves the
device between pre- and post-processing (:class:`CudaBatches`). Each slot owns a batch-sized
``GpuPipeline`` (its stream) and a device copy of its batch's heads; per batch the slot's
engine thread queues, holding the executor's device lock so that one batch at a time writes the
engine's input::

    pipeline stream: wait until the engine's last batch has read its input
        → per frame: upload → pre kernel (letterbox + quantise into the engine's input, frame b)
        → event pre_done
    engine stream:   wait pre_done → the batch's CUDA graph (the program, then its heads as
        fp16 CHW16) → copy the batch's heads to the slot's copy → event done
    pipeline stream: wait done → decode + NMS for the batch → copy results → event

and then sleeps on the last event.
One ``post`` covers the batch when every frame asks the same ``conf``/``iou``/``max_det``; else
each frame is posted on its own (at its offset in the heads), one after the other. A frame whose
candidates overflow the GPU's store gets the numpy reference on its heads, copied back. The slot
copies its heads so that the next batch may run on the engine while this one is post-processed.
``pre_us`` is then batch start to engine start and ``post_us`` engine end to results, as the host
saw them (the engine's span placed on the host clock through CUDA events: its end is the moment
the results were seen, less the GPU time from engine end to result copy); ``device_us`` the
engine's GPU time. Every batch size's kernels and graphs run at warm-up (CUDA's lazy
loading would otherwise stall the first batch of each size). The emulated engine (no device I/O)
and hosts without CUDA take the numpy path above.

A batch that fails fails each of its jobs with DEVICE_FAILED and counts as one failed task.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import numpy as np
import numpy.typing as npt
import structlog

from dlad.devices.emulated_gpu import GpuBatchTiming
from dlad.errors import DeviceFailed
from dlad.executors.base import Executor, Outcome, Request
from dlad.families import family_for, post_program
from dlad.gpu.driver import CudaError, DeviceBuffer, _check, _driver
from dlad.gpu.prepost import GpuPipeline, HeadSpec, PostResult, engine_heads
from dlad.imaging.post import unpack_head
from dlad.imaging.pre import Letterbox, letterbox_frame, letterbox_geometry, quantize_hwc4
from dlad.loadable import Loadable
from dlad.protocol import MAX_DET

if TYPE_CHECKING:
    from dlad.gpu.service import GpuService

__all__ = [
    "CudaBatchResult",
    "CudaBatches",
    "DeviceBatch",
    "DeviceIoEngine",
    "GpuEngine",
    "GpuExecutor",
    "QueuedBatch",
    "device_io_engine",
]

log = structlog.get_logger("dlad.executors.gpu")


class GpuEngine(Protocol):
    """What the GPU executor runs a batch on (``EmulatedGpu``, ``TorchGpu``, ``TensorRtGpu``).
    The executor owns it: its :meth:`close` (idempotent) is called when the executor closes."""

    max_batch: int
    curve_us: dict[int, float]

    def run(
        self, frames: Sequence[npt.NDArray[np.int8]]
    ) -> tuple[list[list[npt.NDArray[np.float32]]], GpuBatchTiming]: ...

    def close(self) -> None: ...


class DeviceBatch(Protocol):
    """A batch queued with :meth:`DeviceIoEngine.run_device`."""

    size: int

    def timing(self, end_ns: int | None = None) -> GpuBatchTiming:
        """Its GPU times once done (waits), the span ending at ``end_ns`` on the host clock."""
        ...


class DeviceIoEngine(GpuEngine, Protocol):
    """A :class:`GpuEngine` whose batches can stay on the GPU (``TorchGpu`` on CUDA,
    ``TensorRtGpu`` built with layout kernels; see the torch module's docstring for the contract
    of each member)."""

    device: str

    @property
    def device_io(self) -> bool: ...
    @property
    def frame_bytes(self) -> int: ...
    @property
    def head_image_bytes(self) -> tuple[int, ...]: ...
    @property
    def input_ptr(self) -> int: ...
    @property
    def head_ptrs(self) -> tuple[int, ...]: ...
    @property
    def graph_execs(self) -> tuple[int, ...]: ...

    def wait_input_free(self, stream: Any) -> None: ...

    def run_device(
        self, n: int, *, after: Any, done: Any, heads_to: Sequence[int] | None = None
    ) -> DeviceBatch: ...


def device_io_engine(engine: GpuEngine) -> DeviceIoEngine | None:
    """``engine`` as a :class:`DeviceIoEngine` when it offers device-side I/O now, else None."""
    if getattr(engine, "device_io", False) is True:
        return engine  # type: ignore[return-value]  # checked just above, structurally
    return None


@dataclass(eq=False)
class _CudaSlot:
    """One executor slot's CUDA side: its pipeline (stream), the device copy of its batch's
    ``CHW16`` heads, and its events."""

    pipeline: GpuPipeline
    heads: list[DeviceBuffer]
    pre_done: Any  # its frames are in the engine's input
    engine_done: Any  # (timing) the engine has written its heads to ``heads``
    post_end: Any  # (timing) its results are in host memory
    busy: threading.Lock = field(default_factory=threading.Lock)  # one batch at a time

    def close(self) -> None:
        self.pipeline.close()  # drains the stream first
        for buf in self.heads:
            buf.free()
        drv = _driver()
        for event in (self.pre_done, self.engine_done, self.post_end):
            drv.cuEventDestroy(event)


@dataclass(eq=False)
class QueuedBatch:
    """A batch :meth:`CudaBatches.enqueue` queued, for :meth:`CudaBatches.finish`."""

    slot: _CudaSlot
    requests: Sequence[Request]
    geometries: list[Letterbox]
    batch: DeviceBatch
    uniform: bool
    locked_us: float


@dataclass(frozen=True)
class CudaBatchResult:
    """One batch's results: ``detections`` per frame (``[N, 6]`` float32, source pixels),
    ``timing`` the engine's (on the host clock, see the module docstring), ``overflowed`` the
    frames (indices) that took the numpy reference, ``locked_us`` how long queueing held the
    device lock (the host's serial part of a batch), ``done_ns`` when the results were
    complete."""

    detections: list[npt.NDArray[np.float32]]
    timing: GpuBatchTiming
    overflowed: tuple[int, ...]
    locked_us: float
    done_ns: int


class CudaBatches:
    """The GPU executor's CUDA path (module docstring): pre-processing kernels into the engine's
    input, the engine, post-processing kernels on its heads, without a host round trip.

    Args:
        engine: an engine with device-side I/O on the service's device.
        loadable: the model's loadable (input size and scale, heads, model family).
        service: the daemon's GPU service (context and kernels).
        max_batch: the largest batch (<= the engine's).
        slots: independent slots (one batch each at a time).
        cand_capacity: candidates the GPU stores per image (``GpuPipeline``'s; a frame that
            finds more takes the numpy reference).

    Raises ValueError when the engine's input or heads are not the layouts the kernels
    write and read, CudaError when allocation fails (nothing is kept). Thread-safe: any thread
    may queue a batch on a free slot.
    """

    def __init__(
        self,
        engine: DeviceIoEngine,
        loadable: Loadable,
        service: GpuService,
        *,
        max_batch: int,
        slots: int = 2,
        cand_capacity: int = 1 << 17,
    ) -> None:
        specs = engine_heads(loadable, engine.frame_bytes, engine.head_image_bytes)
        if not 1 <= max_batch <= engine.max_batch:
            raise ValueError(f"max_batch must be 1..{engine.max_batch}, got {max_batch}")
        self.engine = engine
        self.loadable = loadable
        self.ctx = service.ctx
        self.max_image_bytes = service.max_image_bytes
        self.max_batch = max_batch
        self.family = family_for(loadable.family)
        self._lock = threading.Lock()  # one batch at a time writes the engine's input
        self._slots: list[_CudaSlot] = []
        try:
            for _ in range(slots):
                self._slots.append(self._slot(specs, cand_capacity))
        except BaseException:
            self.close()
            raise

    def _slot(self, specs: Sequence[HeadSpec], cand_capacity: int) -> _CudaSlot:
        ctx = self.ctx
        pipeline = GpuPipeline(
            ctx,
            self.loadable.image_size,
            specs,
            post_program(self.loadable),
            batch=self.max_batch,
            max_det=MAX_DET,
            cand_capacity=cand_capacity,
            max_image_bytes=self.max_image_bytes,
        )
        heads: list[DeviceBuffer] = []
        try:
            heads.extend(ctx.alloc(self.max_batch * spec.nbytes) for spec in specs)
            return _CudaSlot(
                pipeline, heads, ctx.event(), ctx.event(timing=True), ctx.event(timing=True)
            )
        except BaseException:
            pipeline.close()
            for buf in heads:
                buf.free()
            raise

    @property
    def slots(self) -> int:
        """How many slots it has."""
        return len(self._slots)

    def close(self) -> None:
        """Free every slot (streams drained first); idempotent."""
        slots, self._slots = self._slots, []
        for slot in slots:
            slot.close()

    # ------------------------------------------------------------------------------ a batch

    def process(self, slot: int, requests: Sequence[Request]) -> CudaBatchResult:
        """Run one batch on ``slot`` and wait for it (:meth:`enqueue` then :meth:`finish`)."""
        return self.finish(self.enqueue(slot, requests))

    def enqueue(self, slot: int, requests: Sequence[Request]) -> QueuedBatch:
        """Queue a batch of 1..``max_batch`` requests on ``slot`` (which must have no batch in
        flight: its :meth:`finish` returned); returns it for :meth:`finish`. Blocks only while
        another batch is being queued. Raises ValueError for a bad batch or image, CudaError
        (and the engine's errors) from the GPU."""
        n = len(requests)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a batch holds 1..{self.max_batch} frames, got {n}")
        s = self._slots[slot]
        if not s.busy.acquire(blocking=False):
            raise RuntimeError(f"slot {slot} has a batch in flight")
        try:
            images = [np.ascontiguousarray(r.image) for r in requests]
            size = self.loadable.image_size
            geometries = [letterbox_geometry(*r.size, size) for r in requests]
            uniform = len({(r.conf, r.iou, r.max_det) for r in requests}) == 1
            p, engine = s.pipeline, self.engine
            with self._lock:
                t0 = time.monotonic_ns()
                engine.wait_input_free(p.stream)
                base = engine.input_ptr
                for b, (image, r, g) in enumerate(zip(images, requests, geometries, strict=True)):
                    src = p.upload(image)
                    p.pre(
                        src,
                        image.shape,
                        r.pixel_format,
                        g,
                        base + b * engine.frame_bytes,
                        input_scale=self.loadable.input_scale,
                        colour=r.colour,
                    )
                p.record(s.pre_done)
                batch = engine.run_device(
                    n, after=s.pre_done, done=s.engine_done, heads_to=[h.ptr for h in s.heads]
                )
                locked_us = (time.monotonic_ns() - t0) / 1e3
            _check(_driver().cuStreamWaitEvent(p.stream, s.engine_done, 0), "cuStreamWaitEvent")
            queued = QueuedBatch(s, requests, geometries, batch, uniform, locked_us)
            self._post(queued, 0)
            return queued
        except BaseException:
            s.busy.release()
            raise

    def _post(self, q: QueuedBatch, b: int) -> None:
        """Queue the post-processing of the whole batch (``uniform``) or of frame ``b``."""
        p, r = q.slot.pipeline, q.requests[b]
        sizes = self.engine.head_image_bytes
        n = len(q.requests) if q.uniform else 1
        p.post(
            [h.ptr + b * nbytes for h, nbytes in zip(q.slot.heads, sizes, strict=True)],
            q.geometries[b : b + n],
            conf_threshold=r.conf,
            iou_threshold=r.iou,
            max_det=r.max_det,
            head_image_bytes=sizes,
        )
        if b + n == len(q.requests):
            p.record(q.slot.post_end)

    def finish(self, q: QueuedBatch) -> CudaBatchResult:
        """Wait for a batch :meth:`enqueue` queued (the worker thread sleeps on an event),
        posting its frames one by one when their settings differ, and return its results.
        Raises CudaError (a failed stream poisons the context) and the model family's errors."""
        s = q.slot
        try:
            self.ctx.make_current()
            results: list[PostResult] = list(s.pipeline.synchronize())
            for b in range(len(results), len(q.requests)):  # settings differ: frame by frame
                self._post(q, b)
                results.extend(s.pipeline.synchronize())
            drv = _driver()
            _check(drv.cuEventSynchronize(s.post_end), "cuEventSynchronize")
            seen_ns = time.monotonic_ns()
            tail_ms = _check(drv.cuEventElapsedTime(s.engine_done, s.post_end), "elapsed")
            timing = q.batch.timing(seen_ns - round(float(tail_ms) * 1e6))
            dets: list[npt.NDArray[np.float32]] = []
            overflowed: list[int] = []
            for b, (result, r, g) in enumerate(zip(results, q.requests, q.geometries, strict=True)):
                if result.overflow:  # more candidates than the GPU stores: the reference decides
                    log.warning("gpu_candidates_overflow", found=result.found)
                    overflowed.append(b)
                    dets.append(self._numpy_post(s, b, r, g))
                else:
                    dets.append(result.detections)
            done_ns = time.monotonic_ns()
            return CudaBatchResult(dets, timing, tuple(overflowed), q.locked_us, done_ns)
        finally:
            s.busy.release()

    def heads(self, slot: int, b: int) -> list[npt.NDArray[np.float16]]:
        """Frame ``b`` of ``slot``'s last batch: its ``CHW16`` fp16 heads ``[C/16, H, W, 16]``
        copied to the host (valid until the slot's next batch). Raises CudaError."""
        return self._host_heads(self._slots[slot], b)

    def _host_heads(self, s: _CudaSlot, b: int) -> list[npt.NDArray[np.float16]]:
        self.ctx.make_current()
        out = []
        for d, buf, nbytes in zip(
            self.loadable.outputs, s.heads, self.engine.head_image_bytes, strict=True
        ):
            host = np.empty((-(-d.c // 16), d.h, d.w, 16), np.float16)
            _check(_driver().cuMemcpyDtoH(host.ctypes.data, buf.ptr + b * nbytes, nbytes), "DtoH")
            out.append(host)
        return out

    def _numpy_post(
        self, s: _CudaSlot, b: int, r: Request, g: Letterbox
    ) -> npt.NDArray[np.float32]:
        heads = [
            unpack_head(h, d.c, d.h, d.w, None)
            for d, h in zip(self.loadable.outputs, self._host_heads(s, b), strict=True)
        ]
        return self.family.postprocess(
            heads, self.loadable, g, conf=r.conf, iou=r.iou, max_det=r.max_det
        )

    def warm_up(self) -> float:
        """Run every slot's kernels and graphs once, for every batch size and for frame-by-frame
        posts (no first batch stalls on CUDA's lazy loading or a graph capture); returns the
        last batch of 1's engine µs. Raises as :meth:`process` does."""
        blank = np.zeros((2, 2, 3), np.uint8)

        def request(conf: float) -> Request:
            return Request(blank, "RGB", conf, 0.45, MAX_DET, 0, "")

        actual_us = 0.0
        for slot in range(self.slots):
            for n in range(self.max_batch, 0, -1):
                for _ in range(2):  # the post graph with its settings copy, then without
                    actual_us = self.process(slot, [request(0.25)] * n).timing.actual_us
            if self.max_batch > 1:  # every frame's own graph, at its offset
                self.process(slot, [request(0.25 + 0.01 * (b % 2)) for b in range(self.max_batch)])
        return actual_us


class GpuExecutor(Executor):
    """The GPU serving one model in batches (see the module docstring).

    Args:
        name: the device's name (``gpu``).
        model: the model it serves.
        loadable: the model's loadable (input size and scale, head geometry, model family).
        engine: what runs the batches; its ``curve_us`` seeds the plane's estimates.
        capacity: its queue bound in the plane.
        max_batch: the largest batch it takes (<= the engine's).
        max_queue_delay_us: how long a partial batch may wait to fill.
        pre_post: run pre/post-processing (off: zero frames in, no detections out).
        slots: batches in flight at once (module docstring).
        gpu: the daemon's GPU service: pre/post-processing on the GPU (:class:`CudaBatches`)
            when the engine offers device-side I/O on its device; None, or an engine without
            it: numpy on CPU threads. ``backend`` says which (``"cuda"``/``"cpu"``).
    """

    kind = "gpu"

    def __init__(
        self,
        name: str,
        *,
        model: str,
        loadable: Loadable,
        engine: GpuEngine,
        capacity: int,
        max_batch: int,
        max_queue_delay_us: float,
        pre_post: bool = True,
        slots: int = 2,
        gpu: GpuService | None = None,
    ) -> None:
        if not 1 <= max_batch <= engine.max_batch:
            raise ValueError(f"max_batch must be 1..{engine.max_batch}, got {max_batch}")
        super().__init__(
            name,
            core=None,
            models=frozenset([model]),
            capacity=capacity,
            service_us=engine.curve_us[1],
        )
        self.max_batch = max_batch
        self.max_queue_delay_us = max_queue_delay_us
        self.batch_service_us = {b: t for b, t in engine.curve_us.items() if b <= max_batch}
        self.loadable = loadable
        self.engine = engine
        self.pre_post = pre_post
        self.family = family_for(loadable.family)
        self._slots = slots
        inp = loadable.inputs[0]
        self._blank = quantize_hwc4(
            np.zeros((*loadable.image_size, inp.c), np.uint8), loadable.input_scale
        )
        self.cuda: CudaBatches | None = self._cuda_batches(gpu) if pre_post else None
        self.backend = "cuda" if self.cuda is not None else "cpu"

    @property
    def slots(self) -> int:
        """Batches in flight at once."""
        return self._slots

    def _cuda_batches(self, gpu: GpuService | None) -> CudaBatches | None:
        """The CUDA path, or None (logged why) where it cannot run."""
        io = device_io_engine(self.engine)
        reason = ""
        if gpu is None:
            return None  # no GPU pre/post in this daemon: nothing to say
        if io is None:
            reason = "the engine has no device-side I/O"
        elif not self.family.cuda:
            reason = f"no CUDA decode for model family {self.family.name!r}"
        elif io.device != f"cuda:{int(gpu.ctx.device)}":
            reason = f"the engine runs on {io.device}, the pre/post kernels on GPU {gpu.ctx.device}"
        else:
            try:
                cuda = CudaBatches(
                    io, self.loadable, gpu, max_batch=self.max_batch, slots=self._slots
                )
            except (CudaError, ValueError) as exc:
                reason = str(exc)
            else:
                log.info("gpu_pre_post", device=self.name, backend="cuda", slots=cuda.slots)
                return cuda
        log.warning("gpu_pre_post_unavailable", device=self.name, reason=reason)
        return None

    def close(self) -> None:
        """Free the CUDA path's slots, then the engine (idempotent)."""
        if self.cuda is not None:
            self.cuda.close()
        self.engine.close()

    async def warm_up(self) -> float:
        """One batch before serving (on the CUDA path: every batch size's kernels and graphs,
        every slot); returns a batch of 1's device µs. Raises DeviceFailed when it fails."""
        try:
            if self.cuda is not None:
                return await anyio.to_thread.run_sync(self._warm_cuda, self.cuda)
            _, timing = await anyio.to_thread.run_sync(self.engine.run, [self._blank])
        except Exception as exc:  # the engine's errors share no base class
            self.warm, self.warm_error = "failed", str(exc)
            raise DeviceFailed(f"{self.name}: warm-up batch failed: {exc}") from exc
        self.warm = "ok"
        return timing.actual_us

    def _warm_cuda(self, cuda: CudaBatches) -> float:
        actual_us = cuda.warm_up()
        self.warm = "ok"
        return actual_us

    def run_batch(
        self, job_ids: Sequence[int], requests: Sequence[Request], slot: int = 0
    ) -> list[Outcome]:
        """A batch on the calling thread (slot ``slot``'s engine thread of the native plane),
        its failure counted: on the CUDA path (:class:`CudaBatches`) the whole chain on the
        GPU; else numpy pre/post-processing frame by frame around the engine's run, or none
        with pre/post-processing off."""
        if self.cuda is not None:
            return self._run_cuda(self.cuda, slot, job_ids, requests)
        t0 = time.monotonic_ns()
        prepared: list[tuple[npt.NDArray[np.int8], Letterbox | None]]
        if self.pre_post:
            prepared = [self._pre(r) for r in requests]
        else:
            prepared = [(self._blank, None) for _ in requests]
        t1 = time.monotonic_ns()
        try:
            heads, timing = self.engine.run([frame for frame, _ in prepared])
        except Exception as exc:  # noqa: BLE001 (any engine error fails this batch only)
            return self._failed(job_ids, exc)
        t2 = time.monotonic_ns()
        if self.pre_post:
            items = zip(requests, heads, prepared, strict=True)
            dets = [self._post((r, h, g)) for r, h, (_, g) in items]
        else:
            dets = [np.zeros((0, 6), np.float32) for _ in requests]
        t3 = time.monotonic_ns()
        return self._ran(job_ids, dets, timing, pre_us=(t1 - t0) / 1e3, post_us=(t3 - t2) / 1e3)

    def _run_cuda(
        self, cuda: CudaBatches, slot: int, job_ids: Sequence[int], requests: Sequence[Request]
    ) -> list[Outcome]:
        t0 = time.monotonic_ns()
        try:
            result = cuda.process(slot, requests)
        except Exception as exc:  # noqa: BLE001 (any CUDA or engine error fails this batch only)
            return self._failed(job_ids, exc)
        timing = result.timing
        pre_us = max(timing.start_ns - t0, 0) / 1e3
        post_us = max(result.done_ns - timing.end_ns, 0) / 1e3
        return self._ran(job_ids, result.detections, timing, pre_us=pre_us, post_us=post_us)

    def _failed(self, job_ids: Sequence[int], exc: Exception) -> list[Outcome]:
        n = len(job_ids)
        error = self.failed(DeviceFailed(f"{self.name}: batch of {n} failed: {exc}"))
        return [Outcome(i, self.name, error=error) for i in job_ids]

    def _ran(
        self,
        job_ids: Sequence[int],
        detections: Sequence[npt.NDArray[np.float32]],
        timing: GpuBatchTiming,
        *,
        pre_us: float,
        post_us: float,
    ) -> list[Outcome]:
        self.succeeded()
        self.stats.busy_ns += timing.end_ns - timing.start_ns
        return [
            Outcome(i, self.name, detections=d, pre_us=pre_us, device_us=timing.actual_us,
                    post_us=post_us, start_ns=timing.start_ns, end_ns=timing.end_ns)
            for i, d in zip(job_ids, detections, strict=True)
        ]  # fmt: skip

    def _pre(self, work: Request) -> tuple[npt.NDArray[np.int8], Letterbox]:
        size = self.loadable.image_size
        canvas, geometry = letterbox_frame(
            work.image,
            work.pixel_format,
            (size[0], size[1]),
            work.colour,
        )
        return quantize_hwc4(canvas, self.loadable.input_scale), geometry

    def _post(
        self, item: tuple[Request, Sequence[npt.NDArray[np.float32]], Any]
    ) -> npt.NDArray[np.float32]:
        work, frame_heads, geometry = item
        return self.family.postprocess(
            frame_heads,
            self.loadable,
            geometry,
            conf=work.conf,
            iou=work.iou,
            max_det=work.max_det,
        )
