"""The GPU as the daemon's pre/post-processing engine: one context, one fence poller, pinned
buffers the emulated DLA cores and the GPU share, and one :class:`GpuSlot` per worker slot
(:meth:`GpuService.slot_for` builds it for either backend: mapped words for an emulated core,
NvSci objects imported into CUDA for a cudla core, see :mod:`dlad.gpu.links`).

:func:`select_backend` makes the start-up choice (logged): CUDA kernels where the probe finds a
usable GPU, else the numpy reference on CPU threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
import structlog

from dlad.devices.base import Buffer, DlaCore, Module, Task, TaskHandle
from dlad.devices.cudla import cuda_interop
from dlad.families import post_program
from dlad.gpu.driver import (
    CudaError,
    GpuContext,
    GpuProbe,
    HostBuffer,
    _check,
    _driver,
    probe,
)
from dlad.gpu.fences import FencePoller, MappedFence
from dlad.gpu.links import (
    CudlaFenceLink,
    CudlaInterop,
    GpuFenceLink,
    MappedFenceLink,
    link_cudla_slot,
)
from dlad.gpu.prepost import GpuPipeline, HeadSpec, engine_heads
from dlad.imaging.pre import letterbox_geometry
from dlad.loadable import DataType, Loadable

if TYPE_CHECKING:
    from dlad.devices.cudla.backend import CudlaBuffer, CudlaDlaCore
    from dlad.executors.gpu import DeviceIoEngine
    from dlad.native_plane import PlaneGpu

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
    when the DLA input is ready (``ready``) and the fence the DLA task signals (``done``), the
    device addresses of the DLA buffers, and how the stream reaches each fence (``ready_link``,
    ``done_link``; by default the :class:`MappedFence` word operations). ``ready``/``done`` are
    the core's fences: :class:`MappedFence` on emulated cores, cudla fences (``interop`` then
    holds their CUDA imports) on cudla cores.
    """

    pipeline: GpuPipeline
    ready: Any  # MappedFence (emulated core) or CudlaFence_ (cudla core): the core's fence type
    done: Any
    input_ptr: int
    head_ptrs: list[int] = field(default_factory=list)
    ready_link: GpuFenceLink | None = None
    done_link: GpuFenceLink | None = None
    interop: CudlaInterop | None = None

    def __post_init__(self) -> None:
        if self.ready_link is None:
            self.ready_link = MappedFenceLink(self.ready)
        if self.done_link is None:
            self.done_link = MappedFenceLink(self.done)

    def _links(self) -> tuple[GpuFenceLink, GpuFenceLink]:
        if self.ready_link is None or self.done_link is None:  # __post_init__ sets both
            raise RuntimeError("GpuSlot without fence links")
        return self.ready_link, self.done_link

    def chain_task(
        self, core: DlaCore, module: Module, inputs: Sequence[Buffer], outputs: Sequence[Buffer]
    ) -> TaskHandle:
        """Queue one frame's fence chain after the pre-processing already on the stream: the
        GPU signals ``ready = n``; the DLA task (waiting ``ready >= n``, signalling
        ``done = m``) is submitted; the stream waits ``done >= m``. Post-processing queued
        afterwards reads the task's outputs. Returns the task's handle. Raises DlaError (from
        the fences or ``core.submit``) and CudaError / CudaInteropError (from the stream)."""
        ready_link, done_link = self._links()
        ready = ready_link.next_value()
        ready_link.gpu_signal(self.pipeline, ready)
        done = done_link.next_value()
        handle = core.submit(
            Task(
                module,
                tuple(inputs),
                tuple(outputs),
                wait=((self.ready, ready),),
                signal=((self.done, done),),
            )
        )
        done_link.gpu_wait(self.pipeline, done)
        return handle

    def release_fences(self) -> None:
        """Free the links' resources and destroy the CUDA imports (the stream must no longer
        use them; idempotent for imports)."""
        ready_link, done_link = self._links()
        ready_link.release()
        done_link.release()
        if self.interop is not None:
            self.interop.release()


class GpuService:
    """Owns the GPU context and everything allocated from it; :meth:`close` frees it all.
    ``frames``: how a DLA slot's pre kernel reaches a frame (``[pre_post] gpu_frames``; see
    :attr:`read_frames_in_place` and :attr:`stage_frames`).

    Raises CudaError (from :class:`GpuContext`) when the GPU cannot be opened or the kernels do
    not build.
    """

    def __init__(
        self,
        device_index: int = 0,
        cache_dir: Path | None = None,
        *,
        max_image_bytes: int = 0,
        frames: Literal["auto", "in-place", "copy"] = "auto",
    ) -> None:
        self.ctx = GpuContext(device_index, cache_dir)
        self.max_image_bytes = max_image_bytes
        """What each pipeline allocates for uploads at creation (0: they grow on demand; see
        :class:`~dlad.gpu.prepost.GpuPipeline`). The daemon sets the largest image it admits."""
        self.poller = FencePoller()
        self._lock = threading.Lock()
        self._host: dict[int, HostBuffer] = {}
        self._slots: list[GpuSlot] = []
        self._pipelines: list[GpuPipeline] = []  # the GPU engines' (plane_batches)
        self._frames: dict[int, tuple[int, int]] = {}  # host base -> (bytes, device address)
        # How a DLA slot's pre kernel reaches a frame ([pre_post] gpu_frames; measured in
        # docs/BENCHMARKS.md §9.8): "auto" reads a registered frame in place on any GPU (one
        # driver call fewer), and stages a frame from a message only on an integrated GPU,
        # whose "device memory" is the same DRAM: a discrete GPU copies it faster by DMA, at
        # the same CPU cost as the CPU's own copy.
        self.read_frames_in_place = frames != "copy"
        """A registered shared-memory frame is read where the client wrote it; else it is
        DMA-copied to device memory first (no CPU copy either way)."""
        self.stage_frames = frames == "in-place" or (frames == "auto" and self.ctx.integrated)
        """A frame from a message is copied by the CPU into the slot's pinned buffer, which the
        pre kernel reads in place (:meth:`GpuPipeline.stage`); else the driver stages it into
        a DMA to device memory."""

    def register_frames(self, address: int, nbytes: int) -> None:
        """Register a client's shared-memory segment (mapped by ``dlad.shm``) with the GPU, so
        that its frames reach the pre-processing kernel without a CPU copy. A segment that
        cannot be registered is logged and its frames staged as usual."""
        try:
            dev = self.ctx.register_host(address, nbytes)
        except CudaError as exc:
            log.warning("shm_gpu_register_failed", bytes=nbytes, reason=str(exc))
            return
        with self._lock:
            self._frames[address] = (nbytes, dev)

    def unregister_frames(self, address: int) -> None:
        """Undo :meth:`register_frames` (the segment's frames are all answered)."""
        with self._lock:
            known = self._frames.pop(address, None)
        if known is not None:
            try:
                self.ctx.unregister_host(address)
            except CudaError as exc:  # the context is going: nothing left to read it
                log.warning("shm_gpu_unregister_failed", reason=str(exc))

    def frame_device_ptr(self, image: npt.NDArray[np.uint8]) -> int | None:
        """The GPU address of ``image`` if it lies in a registered segment, else None."""
        if not self._frames:
            return None
        at = int(image.ctypes.data)
        with self._lock:
            for base, (nbytes, dev) in self._frames.items():
                if base <= at and at + image.nbytes <= base + nbytes:
                    return dev + (at - base)
        return None

    def segment_device(self, address: int) -> int:
        """The GPU address of the segment :meth:`register_frames` registered at ``address``,
        or 0 where none is."""
        with self._lock:
            known = self._frames.get(address)
        return 0 if known is None else known[1]

    def plane_gpu(
        self,
        loadable: Loadable,
        slots: int,
        *,
        cudla: Sequence[GpuSlot] = (),
    ) -> PlaneGpu:
        """GPU pre/post for a core of the native plane: ``slots``
        slots as :meth:`slot` makes them for an emulated core (zeroed DLA buffers from
        :meth:`host_array`, kernels warmed up), or a cuDLA core's slots from :meth:`cudla_slot`
        (``cudla``; ``slots`` is then their number), handed over as handles and addresses.
        Everything stays this service's (a cuDLA slot's imports its core's), freed by
        :meth:`close`, which must come after the plane's close. Raises ValueError where a frame
        could overflow the GPU's candidate store (the plane has no numpy fallback), CudaError
        from the driver."""
        from dlad.devices.emulated import timing_pattern  # noqa: PLC0415
        from dlad.native_plane import PlaneGpu, PlaneGpuSlot  # noqa: PLC0415 (plane types)
        from dlad.protocol import MAX_DET  # noqa: PLC0415

        made = []
        for i in range(len(cudla) if cudla else slots):
            hosts: tuple[int, ...] = ()
            if cudla:
                slot = cudla[i]
            else:
                inputs = self.host_array(loadable.inputs[0].size)
                outputs = [self.host_array(d.size) for d in loadable.outputs]
                hosts = tuple(int(a.ctypes.data) for a in outputs)
                slot = self.slot(loadable, inputs, outputs, max_det=MAX_DET)
            if not slot.pipeline.candidate_capacity_holds:
                raise ValueError(
                    f"a frame of the model can give more candidates than the GPU's store holds "
                    f"({slot.pipeline.cand_capacity}): pre/post-process it on the CPU "
                    f'([pre_post] backend = "cpu")'
                )
            handles = slot.pipeline.plane_handles(slot.head_ptrs)
            ready, done = slot.ready_link, slot.done_link
            if isinstance(ready, CudlaFenceLink) and isinstance(done, CudlaFenceLink):
                # a cuDLA core's NvSciSync objects, imported as external semaphores
                fences: dict[str, int] = {
                    "ready": 0, "ready_device": 0, "done": 0, "done_device": 0,
                    # int() of a cudaExternalSemaphore_t: the driver's CUexternalSemaphore
                    "ready_semaphore": int(ready.semaphore),
                    "done_semaphore": int(done.semaphore),
                }  # fmt: skip
            else:
                fences = {
                    "ready": slot.ready.host_ptr, "ready_device": slot.ready.device_ptr,
                    "done": slot.done.host_ptr, "done_device": slot.done.device_ptr,
                }  # fmt: skip
            made.append(PlaneGpuSlot(input=slot.input_ptr, outputs=hosts, **fences, **handles))
        int8 = loadable.inputs[0].data_type == DataType.INT8
        kernel = self.ctx.kernels["pre_hwc4_i8" if int8 else "pre_chw16_f16"]
        return PlaneGpu(
            context=int(self.ctx.context),
            pre_kernel=int(kernel.function),
            int8=int8,
            input_scale=float(np.float32(loadable.input_scale)) if int8 else 1.0,
            canvas=(int(loadable.image_size[0]), int(loadable.image_size[1])),
            max_det=MAX_DET,
            slots=tuple(made),
            # an emulated core's timing-mode outputs, as EmulatedDlaCore writes them
            patterns=() if cudla else tuple(timing_pattern(d).tobytes() for d in loadable.outputs),
        )

    def plane_batches(
        self,
        engine: DeviceIoEngine,
        loadable: Loadable,
        slots: int,
        max_batch: int,
    ) -> tuple[PlaneGpu, tuple[int, ...]]:
        """The GPU's inference for the native plane (``dlad/native/gpu_batch_engine.hpp``):
        ``engine``'s CUDA graphs for batches of 1..``max_batch``, and, for each of ``slots``
        slots and each frame ``b`` of its batch, a pipeline whose pre kernel writes frame ``b``
        of the engine's input and whose post graphs read image ``b`` of its ``CHW16`` heads
        (kernels warmed up), all queued on one stream (the first pipeline's). The plane then
        owns the engine's input and heads: nothing may run a batch on the engine itself
        afterwards.
        Everything stays this service's, freed by :meth:`close` after the plane's close.
        Raises ValueError where the engine's input or heads are not the layouts the kernels
        write and read, it has no graph per batch size, or a frame could overflow the GPU's
        candidate store; CudaError from the driver."""
        from dlad.native_plane import PlaneGpu, PlaneGpuSlot  # noqa: PLC0415 (plane types)
        from dlad.protocol import MAX_DET  # noqa: PLC0415

        h, w = loadable.image_size
        sizes = tuple(engine.head_image_bytes)
        heads = engine_heads(loadable, engine.frame_bytes, sizes)
        graphs = tuple(engine.graph_execs)
        if not 1 <= max_batch <= len(graphs) or not all(graphs[:max_batch]):
            raise ValueError(f"the engine has graphs for batches of 1..{len(graphs)}, "
                             f"{max_batch} wanted")  # fmt: skip
        made: list[PlaneGpuSlot] = []
        stream: int | None = None
        for _ in range(slots):
            for b in range(max_batch):
                pipeline = GpuPipeline(
                    self.ctx, (h, w), heads, post_program(loadable), max_det=MAX_DET,
                    max_image_bytes=self.max_image_bytes, staging=self.stage_frames,
                )  # fmt: skip
                with self._lock:
                    self._pipelines.append(pipeline)
                if not pipeline.candidate_capacity_holds:
                    raise ValueError(
                        f"a frame of the model can give more candidates than the GPU's store holds "
                        f"({pipeline.cand_capacity}): pre/post-process it on the CPU "
                        f'([pre_post] backend = "cpu")'
                    )
                head_ptrs = [p + b * n for p, n in zip(engine.head_ptrs, sizes, strict=True)]
                self._warm_pipeline(pipeline, head_ptrs, loadable)
                handles = pipeline.plane_handles(head_ptrs)
                if stream is None:
                    stream = handles["stream"]
                handles["stream"] = stream  # one stream orders every batch's work
                made.append(PlaneGpuSlot(
                    input=engine.input_ptr + b * engine.frame_bytes,
                    ready=0, ready_device=0, done=0, done_device=0, outputs=(), **handles,
                ))  # fmt: skip
        gpu = PlaneGpu(
            context=int(self.ctx.context),
            pre_kernel=int(self.ctx.kernels["pre_hwc4_i8"].function),  # the engine's int8 input
            int8=True,
            input_scale=float(np.float32(loadable.input_scale)),
            canvas=(int(h), int(w)),
            max_det=MAX_DET,
            slots=tuple(made),
        )
        return gpu, graphs[:max_batch]

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
        pipeline = self._pipeline(loadable, max_det)
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

    def slot_for(
        self,
        core: DlaCore,
        loadable: Loadable,
        inputs: Sequence[Any],
        outputs: Sequence[Any],
        max_det: int,
    ) -> GpuSlot:
        """The slot for ``core``'s backend: :meth:`cudla_slot` for a cudla core, else
        :meth:`slot` on buffers from :meth:`host_array` (emulated). Raises as those do."""
        from dlad.devices.cudla.backend import CudlaDlaCore  # noqa: PLC0415 (ctypes binding)

        if isinstance(core, CudlaDlaCore):
            return self.cudla_slot(core, loadable, inputs, outputs, max_det)
        return self.slot(loadable, inputs[0].raw, [b.raw for b in outputs], max_det)

    def cudla_options(self) -> dict[str, Any]:
        """The :class:`~dlad.devices.cudla.backend.CudlaDlaCore` keyword arguments that let
        this GPU import the core's buffers (``gpu_uuid``) and fences (CUDA's waiter and
        signaller attribute lists). Raises CudaError when the device's UUID cannot be read."""
        drv = _driver()
        uuid = _check(drv.cuDeviceGetUuid(self.ctx.device), "cuDeviceGetUuid")
        index = int(self.ctx.device)

        def waiter(attr_list: int) -> None:
            cuda_interop.fill_wait_attributes(attr_list, index)

        def signaller(attr_list: int) -> None:
            cuda_interop.fill_signal_attributes(attr_list, index)

        return {"gpu_uuid": bytes(uuid.bytes), "extra_waiter": waiter, "gpu_signaller": signaller}

    def cudla_slot(
        self,
        core: CudlaDlaCore,
        loadable: Loadable,
        inputs: Sequence[CudlaBuffer],
        outputs: Sequence[CudlaBuffer],
        max_det: int,
    ) -> GpuSlot:
        """GPU resources for one worker slot of a cudla core opened with
        :meth:`cudla_options`: its NvSciBuf buffers and two NvSciSync fences imported into CUDA
        (:func:`~dlad.gpu.links.link_cudla_slot`), kernels warmed up as in :meth:`slot`. Raises
        ValueError, DlaError, CudaError or CudaInteropError (nothing of the slot is kept)."""
        pipeline = self._pipeline(loadable, max_det)
        try:
            slot = link_cudla_slot(
                core, pipeline, inputs, outputs, make_current=self.ctx.make_current
            )
        except BaseException:
            pipeline.close()
            raise
        try:
            self._warm_up(slot, loadable)
        except BaseException:
            pipeline.close()
            slot.release_fences()
            raise
        with self._lock:
            self._slots.append(slot)
        return slot

    def _pipeline(self, loadable: Loadable, max_det: int) -> GpuPipeline:
        heads = [
            HeadSpec(d.c, d.h, d.w, s, d.scale if d.data_type == DataType.INT8 else None)
            for d, s in zip(loadable.outputs, loadable.strides, strict=True)
        ]
        h, w = loadable.image_size
        return GpuPipeline(
            self.ctx, (h, w), heads, post_program(loadable), max_det=max_det,
            max_image_bytes=self.max_image_bytes, staging=self.stage_frames,
        )  # fmt: skip

    def _warm_up(self, slot: GpuSlot, loadable: Loadable) -> None:
        self._warm_pipeline(slot.pipeline, slot.head_ptrs, loadable)

    def _warm_pipeline(self, p: GpuPipeline, head_ptrs: Sequence[int], loadable: Loadable) -> None:
        image = np.zeros((2, 2, 3), np.uint8)
        geometry = letterbox_geometry(2, 2, loadable.image_size)
        h, w = loadable.image_size
        scratch = self.ctx.alloc(h * (w + 16) * 32)  # fits both input layouts
        try:
            src = p.stage(image) if self.stage_frames else p.upload(image)
            p.pre(src, image.shape, "RGB", geometry, scratch.ptr, input_scale=1.0)
            p.pre(src, image.shape, "RGB", geometry, scratch.ptr, input_scale=None)
            for _ in range(2):  # the frame's graph with its settings copy, then without
                p.post(head_ptrs, [geometry], max_det=min(1, p.max_det))
                p.synchronize()
        finally:
            scratch.free()

    def close(self) -> None:
        """Stop the poller and free every slot, fence and buffer (streams drained first)."""
        self.poller.close()
        with self._lock:
            slots, self._slots = self._slots, []
            pipelines, self._pipelines = self._pipelines, []
            host, self._host = self._host, {}
            frames = list(self._frames)
        for s in slots:
            s.pipeline.close()
            s.release_fences()
        for pipeline in pipelines:
            pipeline.close()
        for buf in host.values():
            buf.free()
        for address in frames:
            self.unregister_frames(address)
        self.ctx.close()
