"""How a worker slot's CUDA stream meets its DLA fences, whichever backend runs the DLA.

A :class:`GpuFenceLink` is one fence seen from the GPU: the stream signals it (``ready``: the
DLA input is written) or waits on it (``done``: the DLA output is written). Two kinds:

* :class:`MappedFenceLink` (emulated cores): a :class:`~dlad.gpu.fences.MappedFence`, written
  with ``cuStreamWriteValue32`` and waited on with ``cuStreamWaitValue32``;
* :class:`CudlaFenceLink` (cudla cores, ``docs/reference/cudla.md`` §4.7 recipe A): an NvSciSync
  object imported into CUDA as an external semaphore; the stream signals it with
  ``cudaSignalExternalSemaphoresAsync`` and waits on a task's EOF fence with
  ``cudaWaitExternalSemaphoresAsync``.

:func:`link_cudla_slot` imports a cudla core's NvSciBuf buffers and two NvSciSync objects into
CUDA for one slot; :class:`CudlaInterop` owns those imports and destroys them, once the stream is
drained, before the core frees the NvSci objects (the core's close hook, §4.7 step 8).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dlad.devices.cudla import cuda_interop

if TYPE_CHECKING:
    from dlad.devices.cudla.backend import CudlaBuffer, CudlaDlaCore, CudlaFence_
    from dlad.gpu.fences import MappedFence
    from dlad.gpu.prepost import GpuPipeline
    from dlad.gpu.service import GpuSlot

__all__ = [
    "CudlaFenceLink",
    "CudlaInterop",
    "GpuFenceLink",
    "MappedFenceLink",
    "link_cudla_slot",
]


class GpuFenceLink(Protocol):
    """One DLA fence as a CUDA stream uses it. ``fence`` is what DLA tasks wait on or signal."""

    @property
    def fence(self) -> Any:
        """The core's fence (a ``SyncObject`` of the core's backend)."""
        ...

    def next_value(self) -> int:
        """The lowest value a new signal may use."""
        ...

    def gpu_signal(self, pipeline: GpuPipeline, value: int) -> None:
        """Queue on ``pipeline``'s stream: the fence reaches ``value`` once the work queued
        before is done. Raises DlaError unless ``value`` is above every value and promise."""
        ...

    def gpu_wait(self, pipeline: GpuPipeline, value: int) -> None:
        """Queue on ``pipeline``'s stream: later work waits until the fence reaches ``value``.
        Raises DlaError when no signaller of ``value`` is queued or submitted yet."""
        ...

    def release(self) -> None:
        """Free what the link owns (no stream may still use it)."""
        ...


class MappedFenceLink:
    """A :class:`MappedFence` word: ``cuStreamWriteValue32`` / ``cuStreamWaitValue32``."""

    def __init__(self, fence: MappedFence) -> None:
        self._fence = fence

    @property
    def fence(self) -> MappedFence:
        """The mapped fence."""
        return self._fence

    def next_value(self) -> int:
        """See :meth:`MappedFence.next_value`."""
        return self._fence.next_value()

    def gpu_signal(self, pipeline: GpuPipeline, value: int) -> None:
        """Reserve ``value``, queue its write and the event the fence's waiter sleeps on
        (:meth:`MappedFence.gpu_signal`)."""
        self._fence.gpu_signal(pipeline, value)

    def gpu_wait(self, pipeline: GpuPipeline, value: int) -> None:
        """Wait (wrap-safe 32-bit ``>=``) on the word the DLA side publishes into."""
        pipeline.wait(self._fence.device_ptr, value)

    def release(self) -> None:
        """Free the word's memory."""
        self._fence.free()


class CudlaFenceLink:
    """A cudla NvSciSync fence imported into CUDA as ``semaphore``: ``signaller="gpu"`` fences
    are signalled by the stream, DLA-signalled fences waited on. The fences handed to CUDA are
    kept by the cudla fence until their value is reached. ``rt``: cuda-python's runtime
    (default: the installed one). The semaphore belongs to the slot's :class:`CudlaInterop`."""

    def __init__(self, fence: CudlaFence_, semaphore: Any, rt: Any = None) -> None:
        self._fence = fence
        self.semaphore = semaphore
        self._rt = rt

    @property
    def fence(self) -> CudlaFence_:
        """The cudla fence."""
        return self._fence

    def next_value(self) -> int:
        """See :meth:`CudlaFence_.next_value`."""
        return self._fence.next_value()

    def gpu_signal(self, pipeline: GpuPipeline, value: int) -> None:
        """``cudaSignalExternalSemaphoresAsync`` into a fence promised as ``value``. Raises
        DlaError (see :meth:`CudlaFence_.signal_from_gpu`) or CudaInteropError."""
        self._fence.signal_from_gpu(
            value, lambda address: pipeline.signal_external(self.semaphore, address, self._rt)
        )

    def gpu_wait(self, pipeline: GpuPipeline, value: int) -> None:
        """``cudaWaitExternalSemaphoresAsync`` on the EOF fence of the task that signals
        ``value`` (nothing when it is reached). Raises DlaError (see
        :meth:`CudlaFence_.wait_from_gpu`) or CudaInteropError."""
        self._fence.wait_from_gpu(
            value, lambda address: pipeline.wait_external(self.semaphore, address, self._rt)
        )

    def release(self) -> None:
        """Nothing: :meth:`CudlaInterop.release` destroys the semaphore."""


class CudlaInterop:
    """The CUDA imports of one slot's cudla objects: external memories and semaphores.

    :meth:`release` drains ``stream`` and destroys them; it runs from the core's close hook
    (before the core frees the NvSci objects) or from the GPU service's close, whichever comes
    first. ``make_current`` binds the CUDA context on the calling thread first.
    """

    def __init__(
        self, stream: Any, rt: Any = None, make_current: Callable[[], None] | None = None
    ) -> None:
        self.stream = stream
        self.rt = rt if rt is not None else cuda_interop.runtime()
        self._make_current = make_current
        self._lock = threading.Lock()
        self.memories: list[Any] = []
        self.semaphores: list[Any] = []
        self.released = False

    def _current(self) -> None:
        if self._make_current is not None:
            self._make_current()

    def import_buffer(self, buffer: CudlaBuffer) -> int:
        """Import ``buffer``'s NvSciBuf object; returns its device address. Raises
        CudaInteropError."""
        self._current()
        ext, ptr = cuda_interop.import_buffer(
            buffer.nvsci_object, buffer.descriptor.size, rt=self.rt
        )
        with self._lock:
            self.memories.append(ext)
        return ptr

    def import_fence(self, fence: CudlaFence_) -> Any:
        """Import ``fence``'s NvSciSync object; returns the external semaphore. Raises
        CudaInteropError."""
        self._current()
        sem = cuda_interop.import_semaphore(fence.nvsci_object, rt=self.rt)
        with self._lock:
            self.semaphores.append(sem)
        return sem

    def release(self) -> None:
        """Drain the stream, then destroy the semaphores and memories (idempotent). Raises the
        first CudaInteropError after trying every destroy."""
        with self._lock:
            if self.released:
                return
            self.released = True
            sems, self.semaphores = self.semaphores, []
            mems, self.memories = self.memories, []
        self._current()
        errors: list[cuda_interop.CudaInteropError] = []
        # The stream may still wait on or signal these objects: drain it first.
        steps: list[Callable[[], None]] = [
            lambda: cuda_interop.synchronize(self.stream, rt=self.rt)
        ]
        steps += [_bind(cuda_interop.destroy_semaphore, s, self.rt) for s in sems]
        steps += [_bind(cuda_interop.destroy_memory, m, self.rt) for m in mems]
        for step in steps:
            try:
                step()
            except cuda_interop.CudaInteropError as exc:  # noqa: PERF203 (teardown, a few calls)
                errors.append(exc)
        if errors:
            raise errors[0]


def _bind(fn: Callable[..., None], obj: Any, rt: Any) -> Callable[[], None]:
    return lambda: fn(obj, rt=rt)


def link_cudla_slot(
    core: CudlaDlaCore,
    pipeline: GpuPipeline,
    inputs: Sequence[CudlaBuffer],
    outputs: Sequence[CudlaBuffer],
    *,
    rt: Any = None,
    make_current: Callable[[], None] | None = None,
) -> GpuSlot:
    """The :class:`GpuSlot` of a cudla core's worker slot (recipe A): every buffer imported
    into CUDA (``input_ptr`` is the first input's, ``head_ptrs`` the outputs'), a ``ready``
    fence the stream signals and DLA tasks wait on, and a ``done`` fence DLA tasks signal and
    the stream waits on, both imported as external semaphores. The imports are destroyed by
    the core's close hook (stream drained first) or :meth:`GpuSlot.release`.

    Raises ValueError for a core opened without CUDA's attributes
    (:meth:`~dlad.gpu.service.GpuService.cudla_options`), DlaError or CudaInteropError naming
    the call that failed (the imports made so far are destroyed).
    """
    from dlad.gpu.service import GpuSlot  # noqa: PLC0415 (service imports this module)

    if not core.cuda_linked:
        raise ValueError(
            f"DLA core {core.core} was opened without gpu_uuid, extra_waiter and gpu_signaller: "
            "open it with GpuService.cudla_options() to share its buffers and fences with CUDA"
        )
    if not inputs or not outputs:
        raise ValueError("a cudla slot needs at least one input and one output buffer")
    interop = CudlaInterop(pipeline.stream, rt, make_current)
    try:
        input_ptr = interop.import_buffer(inputs[0])
        for extra in inputs[1:]:
            interop.import_buffer(extra)
        head_ptrs = [interop.import_buffer(b) for b in outputs]
        ready = core.create_fence(f"dla{core.core}-gpu-ready", signaller="gpu")
        done = core.create_fence(f"dla{core.core}-dla-done")
        ready_sem = interop.import_fence(ready)
        done_sem = interop.import_fence(done)
    except BaseException:
        interop.release()
        raise
    core.add_close_hook(interop.release)
    return GpuSlot(
        pipeline,
        ready,
        done,
        input_ptr,
        head_ptrs,
        ready_link=CudlaFenceLink(ready, ready_sem, interop.rt),
        done_link=CudlaFenceLink(done, done_sem, interop.rt),
        interop=interop,
    )
