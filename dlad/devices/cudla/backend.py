"""The cudla backend: a DLA core driven through cuDLA standalone mode, NvSciBuf and NvSciSync
(implements the Protocols of :mod:`dlad.devices.base`).

One :class:`CudlaDlaCore` is one ``cudlaDevHandle`` opened with ``CUDLA_STANDALONE`` on DLA
core N, with its own NvSciBuf / NvSciSync modules and CPU wait context:

* ``load`` reads a TensorRT DLA standalone loadable into ``cudlaModuleLoadFromMemory`` (one
  module per handle) and reads its I/O descriptors with ``cudlaModuleGetAttributes``;
* ``alloc_buffer`` allocates a CPU-mapped NvSciBuf raw buffer of the descriptor's size and
  imports it with ``cudlaImportExternalMemory`` (its address must be 32-byte aligned);
* ``create_fence`` reconciles and allocates an NvSciSync object (recipe B of
  ``docs/reference/cudla.md`` §4.7): ``signaller="dla"`` (the default) is signalled by this core's
  tasks and waited on by the CPU and by DLA tasks; ``signaller="cpu"`` is signalled by the CPU
  (``NvSciSyncObjSignal``) and waited on by DLA tasks; ``signaller="gpu"`` (recipe A) is
  signalled by a CUDA stream (``cudaSignalExternalSemaphoresAsync``, through
  :meth:`CudlaFence_.signal_from_gpu`) and waited on by DLA tasks. Each is imported with
  ``cudlaImportExternalSemaphore`` into each core whose tasks use it;
* ``submit`` builds a ``cudlaTask`` (outputs before inputs), its pre-fences and at most one EOF
  fence, and calls ``cudlaSubmitTask`` with a NULL stream and, because only this object submits
  to its handle and under its own lock, ``CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE``; every ctypes array
  and fence the task points at is kept until its EOF fence is reached;
* a completion thread per core waits on each task's EOF fence in order (``NvSciSyncFenceWait``
  with the CPU wait context), calls ``cudlaGetLastError``, records the task's status and timing,
  then moves the dlad fence, whose waiters and callbacks wake exactly as on the emulated core;
* ``close`` releases everything in the documented order (§4.7 step 8): buffers
  (``cudlaMemUnregister``, ``NvSciBufObjFree``, attribute lists), sync objects (fences cleared,
  ``cudlaMemUnregister``, ``NvSciSyncObjFree``, lists), ``cudlaModuleUnload``,
  ``cudlaDestroyDevice``, then the NvSci modules.

dlad fences are counters whose values callers choose; a cuDLA fence is a (syncpoint, threshold)
snapshot that exists only once its signaller is submitted. So (cuDLA's shape, which the emulated
core does not enforce): a task may wait on a DLA-signalled fence value only once it is reached or
promised by a task already submitted; a CPU-signalled fence can be waited on at any future value
(``NvSciSyncFenceUpdateFence``, or only the next value where that symbol is missing) and moves by
one ``NvSciSyncObjSignal`` per unit; a task signals only DLA-signalled fences of its own core; a
task without a signal fence signals the core's internal completion fence, because cuDLA reports
completion only through a fence.

Deterministic-semaphore mode (older JetPack/DriveOS, §4.7 step 7): ``semaphores="deterministic"``
sets ``RequireDeterministicFences`` on the waiter lists, passes NULL EOF fences and computes each
EOF fence with ``NvSciSyncFenceUpdateFence``; ``"auto"`` (the default) uses syncpoints unless
``cudlaImportExternalSemaphore`` refuses them, then switches to deterministic semaphores.

The pieces live in their own modules, re-exported here: :mod:`~dlad.devices.cudla.modules`
(:class:`CudlaModule`, loading and the I/O descriptors), :mod:`~dlad.devices.cudla.memory`
(:class:`CudlaBuffer`, NvSciBuf allocation and import) and :mod:`~dlad.devices.cudla.fences`
(:class:`CudlaFence_`, its NvSciSync object, value, signals and waits). This module owns the core:
the handle, fence creation and import, task submission, the completion thread and teardown.

Only the standard library, numpy, structlog and dlad's own modules are imported.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from ctypes import POINTER, byref, c_uint64, c_void_p, cast, pointer
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import structlog

from dlad.devices.base import (
    DEFAULT_TASK_TIMEOUT_MS,
    MAX_TASK_TIMEOUT_MS,
    CudlaStatus,
    DlaError,
    Layouts,
    LoadableSource,
    Task,
    TaskTiming,
    check_fence_pairs,
    check_task_layout,
    is_int_in,
    run_fence_callback,
)
from dlad.devices.cudla.abi import (
    CudlaFence,
    CudlaMode,
    CudlaTask,
    DevAttribute,
    DevAttributeType,
    ExternalSemaphoreHandleDesc,
    FenceType,
    Libraries,
    NvSciSyncFence,
    SignalEvents,
    SubmitFlags,
    WaitEvents,
    load_libraries,
)
from dlad.devices.cudla.fences import (
    MAX_CPU_SIGNAL_STEP,
    CudlaFence_,
    Signaller,
)
from dlad.devices.cudla.memory import BUFFER_ALIGN, CUDLA_ALIGN, CudlaBuffer, import_buffer
from dlad.devices.cudla.modules import (
    CudlaModule,
    descriptor_from_c,
    descriptor_to_c,
    load_module,
)
from dlad.devices.cudla.nvsci import NvSciSession, check_cudla
from dlad.loadable import TensorDescriptor

if TYPE_CHECKING:
    from dlad.native_plane import CudlaFunctions, PlaneCudla

__all__ = [
    "ABORTED_STATUS",
    "BUFFER_ALIGN",
    "CUDLA_ALIGN",
    "DEFAULT_QUEUE_DEPTH",
    "MAX_CPU_SIGNAL_STEP",
    "CudlaBuffer",
    "CudlaDlaCore",
    "CudlaFence_",
    "CudlaModule",
    "CudlaTaskHandle",
    "Semaphores",
    "Signaller",
    "descriptor_from_c",
    "descriptor_to_c",
]

Semaphores = Literal["auto", "syncpoint", "deterministic"]
DEFAULT_QUEUE_DEPTH: Final = 64
"""Tasks a core holds (queued and running) before :meth:`CudlaDlaCore.submit` refuses."""
ABORTED_STATUS: Final = CudlaStatus.ERROR_INVALID_DEVICE
"""The status of tasks abandoned by ``close(force=True)``."""
_INVALID: Final = CudlaStatus.ERROR_INVALID_PARAM

_log = structlog.get_logger(__name__)


# ----------------------------------------------------------------------------- objects


@dataclass(eq=False)
class CudlaTaskHandle:
    """A submitted task (implements ``TaskHandle``). The completion thread sets ``timing`` and
    then ``status`` before it moves the task's fence."""

    id: int
    task: Task = field(repr=False)
    submit_ns: int = field(repr=False)
    status: CudlaStatus | None = None
    timing: TaskTiming | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Record:
    """A task in flight and everything its ``cudlaTask`` points at (kept until it ends)."""

    handle: CudlaTaskHandle
    fence: CudlaFence_
    value: int
    eof: NvSciSyncFence
    keep: list[Any]
    prefences: list[NvSciSyncFence]
    waits: tuple[tuple[CudlaFence_, int], ...]
    aborted: bool = False


# ----------------------------------------------------------------------------- the core


class CudlaDlaCore:
    """One DLA core in cuDLA standalone mode (implements ``DlaCore``); construction opens it.

    Args:
        core: DLA core index (``cudlaCreateDevice``'s device; else DlaError
            ``ERROR_INVALID_DEVICE``).
        libs: the loaded libraries; None loads them (:func:`~dlad.devices.cudla.abi.load_libraries`,
            which raises :class:`~dlad.devices.cudla.abi.CudlaLibraryError`).
        semaphores: ``"auto"``, ``"syncpoint"`` or ``"deterministic"`` (see the module docstring).
        queue_depth: tasks held before submit refuses.
        wait_grace_ms: how long past the task timeout the completion thread waits for an EOF
            fence before it ends the task itself with ``DLA_ERR_ENGINE_TIMEOUT``.
        skip_lock: pass ``CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE`` (legal: one submitter per handle).
        gpu_uuid: the GPU's UUID, added to every buffer's attributes (``GpuId``) so CUDA can
            import them (GPU post-processing); None for CPU-only use.
        extra_waiter: called with the handle of an extra NvSciSync attribute list for every
            DLA-signalled fence, to fill it for another waiter (CUDA:
            :func:`~dlad.devices.cudla.cuda_interop.fill_wait_attributes`).
        gpu_signaller: called with the handle of the signaller's NvSciSync attribute list of
            every ``signaller="gpu"`` fence, to fill it for CUDA
            (:func:`~dlad.devices.cudla.cuda_interop.fill_signal_attributes`); without it such
            fences are refused.

    Raises DlaError naming the call that failed (everything opened so far is released), and
    ValueError for bad arguments.
    """

    def __init__(
        self,
        core: int,
        *,
        libs: Libraries | None = None,
        semaphores: Semaphores = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        wait_grace_ms: int = 2_000,
        skip_lock: bool = True,
        gpu_uuid: bytes | None = None,
        extra_waiter: Callable[[int], None] | None = None,
        gpu_signaller: Callable[[int], None] | None = None,
    ) -> None:
        if not is_int_in(core, 0, 1 << 63):
            raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, "cudlaCreateDevice", f"core {core!r}")
        if semaphores not in ("auto", "syncpoint", "deterministic"):
            raise ValueError(f"semaphores must be auto, syncpoint or deterministic: {semaphores!r}")
        for name, value in (("queue_depth", queue_depth), ("wait_grace_ms", wait_grace_ms)):
            if not is_int_in(value, 1, 1 << 31):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if gpu_uuid is not None and len(gpu_uuid) != 16:
            raise ValueError("gpu_uuid must be 16 bytes")
        self._core = int(core)
        self.libs = libs if libs is not None else load_libraries()
        self._semaphores: Semaphores = semaphores
        self._queue_depth = queue_depth
        self._grace_ms = wait_grace_ms
        self._flags = int(SubmitFlags.SKIP_LOCK_ACQUIRE) if skip_lock else 0
        self._gpu_uuid = gpu_uuid
        self._extra_waiter = extra_waiter
        self._gpu_signaller = gpu_signaller
        self._close_hooks: list[Callable[[], object]] = []
        self._cv = threading.Condition(threading.Lock())
        self._layouts: Layouts = {}  # the task layouts accepted (check_task_layout)
        self._pending: collections.deque[_Record] = collections.deque()
        self._buffers: list[CudlaBuffer] = []
        self._fences: list[CudlaFence_] = []
        self._foreign: list[tuple[CudlaFence_, Any]] = []
        self._module: CudlaModule | None = None
        self._sticky = CudlaStatus.SUCCESS
        self._in_flight = 0
        self._ids = itertools.count(1)
        self._timeout_ms = DEFAULT_TASK_TIMEOUT_MS
        self._last_end_ns = 0
        self._stopping = False
        self._closed = False
        self._dev = c_void_p()
        self.nvsci = NvSciSession(self.libs)
        try:
            check_cudla(
                self.libs.cudlaCreateDevice(self._core, byref(self._dev), CudlaMode.STANDALONE),
                "cudlaCreateDevice", f"DLA core {self._core}",
            )  # fmt: skip
            self._completion = self._new_fence("dla", f"dla{self._core}-completion")
        except DlaError:
            self._teardown()
            raise
        self._thread = threading.Thread(
            target=self._complete, name=f"cudla-dla{self._core}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"<CudlaDlaCore dla{self._core} in_flight={self._in_flight}>"

    def __enter__(self) -> CudlaDlaCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)

    @property
    def core(self) -> int:
        """The DLA core index."""
        return self._core

    @property
    def in_flight(self) -> int:
        """Tasks submitted and not yet ended."""
        return self._in_flight

    @property
    def thread(self) -> threading.Thread:
        """The completion thread (fence callbacks of this core's tasks run on it)."""
        return self._thread

    @property
    def cuda_linked(self) -> bool:
        """Whether CUDA can import this core's buffers and fences (opened with ``gpu_uuid``,
        ``extra_waiter`` and ``gpu_signaller``)."""
        return None not in (self._gpu_uuid, self._extra_waiter, self._gpu_signaller)

    def add_close_hook(self, hook: Callable[[], object]) -> None:
        """Call ``hook()`` in :meth:`close` once no task is in flight and before anything is
        released (CUDA imports of this core's objects are destroyed there, §4.7 step 8). A
        hook's exception is logged; the release goes on."""
        with self._cv:
            self._close_hooks.append(hook)

    @property
    def semaphores(self) -> Semaphores:
        """The semaphore mode in use (``auto`` until the first fence decided it)."""
        return self._semaphores

    def _enter(self, call: str) -> None:
        """Refuse calls on a closed core, and every call while an error is sticky (lock held)."""
        if self._stopping:
            raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, call, "the core is closed")
        if self._sticky is not CudlaStatus.SUCCESS:
            raise DlaError(self._sticky, call, "an earlier task failed; read last_error()")

    # ------------------------------------------------------------------ module

    def load(
        self, loadable: LoadableSource, *, scales: Mapping[str, float] | None = None
    ) -> CudlaModule:
        """Load a TensorRT DLA standalone loadable (bytes or a path) built for this core.

        ``scales`` gives INT8 tensors' scales by name (cuDLA does not report them). Raises
        DlaError: ``ERROR_UNSUPPORTED_OPERATION`` if a module is loaded, ``ERROR_OS`` for an
        unreadable file, ``ERROR_INVALID_MODULE`` for descriptors dlad cannot use, and whatever
        ``cudlaModuleLoadFromMemory`` / ``cudlaModuleGetAttributes`` return.
        """
        call = "cudlaModuleLoadFromMemory"
        with self._cv:
            self._enter(call)
            if self._module is not None:
                raise DlaError(
                    CudlaStatus.ERROR_UNSUPPORTED_OPERATION, call, "one module per core handle"
                )
        module = load_module(
            loadable, libs=self.libs, dev=self._dev, core=self._core, scales=scales
        )
        with self._cv:
            self._module = module
        return module

    # ------------------------------------------------------------------ buffers

    def alloc_buffer(self, descriptor: TensorDescriptor) -> CudlaBuffer:
        """A zeroed NvSciBuf buffer of ``descriptor.size`` bytes imported into this core.

        Raises DlaError: ``ERROR_INVALID_PARAM`` for anything but a TensorDescriptor its layout
        fills exactly; ``ERROR_INVALID_ADDRESS`` for a CPU mapping not 32-byte aligned; the
        NvSci or cuDLA failure otherwise (nothing stays allocated).
        """
        call = "cudlaImportExternalMemory"
        with self._cv:
            self._enter(call)
        buf = import_buffer(
            descriptor, owner=self, libs=self.libs, nvsci=self.nvsci, dev=self._dev,
            gpu_uuid=self._gpu_uuid,
        )  # fmt: skip
        with self._cv:
            self._buffers.append(buf)
        return buf

    # ------------------------------------------------------------------ fences

    def create_fence(self, name: str | None = None, *, signaller: Signaller = "dla") -> CudlaFence_:
        """A new fence at value 0: ``signaller="dla"`` for this core's tasks to signal (the CPU
        and any core's tasks wait), ``"cpu"`` for the CPU to signal (tasks wait), ``"gpu"`` for
        a CUDA stream to signal (tasks wait; syncpoint mode only). Raises DlaError naming the
        NvSci or cuDLA call that failed (``ERROR_UNSUPPORTED_OPERATION`` for ``"gpu"`` on a
        core opened without ``gpu_signaller`` or in deterministic-semaphore mode); ValueError
        for another signaller."""
        if signaller not in ("dla", "cpu", "gpu"):
            raise ValueError(f"signaller must be 'dla', 'cpu' or 'gpu', got {signaller!r}")
        with self._cv:
            self._enter("cudlaImportExternalSemaphore")
        return self._new_fence(signaller, name or f"dla{self._core}-{signaller}-fence")

    def _new_fence(self, signaller: Signaller, name: str) -> CudlaFence_:
        mode = self._semaphores
        try:
            fence = self._build_fence(signaller, name, deterministic=mode == "deterministic")
        except DlaError as exc:
            refused = exc.call == "cudlaImportExternalSemaphore" and exc.status in (
                CudlaStatus.ERROR_UNSUPPORTED_OPERATION, CudlaStatus.ERROR_NVSCI,
            )  # fmt: skip
            if mode != "auto" or not refused:
                raise
            _log.warning("cudla_deterministic_semaphores", core=self._core, reason=str(exc))
            fence = self._build_fence(signaller, name, deterministic=True)
            self._semaphores = "deterministic"
        else:
            if mode == "auto":
                self._semaphores = "syncpoint"
        with self._cv:
            self._fences.append(fence)
        return fence

    def _build_fence(self, signaller: Signaller, name: str, *, deterministic: bool) -> CudlaFence_:
        fence = CudlaFence_(self, signaller, name)
        fence.deterministic = deterministic
        try:
            fence._allocate(gpu_signaller=self._gpu_signaller, extra_waiter=self._extra_waiter)
            self._import(fence)
            fence._prime()
        except DlaError:
            self._free_fence(fence)
            raise
        return fence

    def _import(self, fence: CudlaFence_) -> Any:
        """cuDLA's registered pointer for ``fence`` on this core (imported once)."""
        key = id(self)
        if key not in fence.registered:
            desc = ExternalSemaphoreHandleDesc(c_void_p(fence.alloc.obj))
            registered = POINTER(c_uint64)()
            check_cudla(
                self.libs.cudlaImportExternalSemaphore(
                    self._dev, byref(desc), byref(registered), 0
                ),
                "cudlaImportExternalSemaphore", fence.name,
            )  # fmt: skip
            fence.registered[key] = registered
            if fence.owner is not self:
                self._foreign.append((fence, registered))
        return fence.registered[key]

    def _free_fence(self, fence: CudlaFence_) -> None:
        fence._release()
        registered = fence.registered.pop(id(self), None)
        if registered is not None:
            self.libs.cudlaMemUnregister(self._dev, registered)
        self.nvsci.free_sync(fence.alloc)

    # ------------------------------------------------------------------ settings, errors

    def set_task_timeout(self, ms: int) -> None:
        """``cudlaSetTaskTimeoutInMs`` where this release has it; the completion thread also
        ends a task whose EOF fence is not reached ``ms`` + the grace after it reached the head
        of the queue. Raises DlaError ``ERROR_INVALID_PARAM`` unless ``1 <= ms <= 1000000``."""
        call = "cudlaSetTaskTimeoutInMs"
        with self._cv:
            self._enter(call)
            if not is_int_in(ms, 1, MAX_TASK_TIMEOUT_MS + 1):
                raise DlaError(_INVALID, call, f"timeout {ms!r} ms")
            if self.libs.has(call):
                check_cudla(self.libs.cudlaSetTaskTimeoutInMs(self._dev, int(ms)), call)
            self._timeout_ms = int(ms)

    def last_error(self) -> CudlaStatus:
        """The most recent failed task's status (from ``cudlaGetLastError`` after its fence),
        or SUCCESS; reading clears it. Raises DlaError ``ERROR_INVALID_DEVICE`` once closed."""
        with self._cv:
            if self._stopping:
                raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, "cudlaGetLastError", "closed")
            status, self._sticky = self._sticky, CudlaStatus.SUCCESS
            return status

    def device_version(self) -> int:
        """``cudlaDeviceGetAttribute(CUDLA_DEVICE_VERSION)``."""
        attr = DevAttribute()
        check_cudla(
            self.libs.cudlaDeviceGetAttribute(
                self._dev, DevAttributeType.DEVICE_VERSION, byref(attr)
            ),
            "cudlaDeviceGetAttribute",
        )  # fmt: skip
        return int(attr.deviceVersion)

    # ------------------------------------------------------------------ tasks

    def submit(self, task: Task) -> CudlaTaskHandle:
        """Queue ``task`` on the DLA (``cudlaSubmitTask``); returns at once.

        Raises DlaError, queueing and reserving nothing: ``ERROR_INVALID_MODULE`` for a module
        not loaded on this core; ``ERROR_INVALID_ADDRESS`` for a buffer not allocated on it;
        ``ERROR_INVALID_PARAM`` for a wrong buffer count or size, too many events, a fence of
        another backend, a wait cuDLA cannot be given (see the module docstring), a signal
        fence that is not a DLA-signalled fence of this core or a value not above its promises;
        ``ERROR_OUT_OF_RESOURCES`` when ``queue_depth`` tasks are held; and what cuDLA returns.
        """
        call = "cudlaSubmitTask"
        checked: object = task
        if not isinstance(checked, Task):
            raise DlaError(_INVALID, call, f"not a Task: {checked!r}")
        with self._cv:
            self._enter(call)
            module = self._module
            check_task_layout(
                task, module, owner=self, buffer_type=CudlaBuffer, core=self._core, call=call,
                accepted=self._layouts,
            )  # fmt: skip
            assert module is not None  # checked: the task's module is the loaded one
            check_fence_pairs(
                task,
                lambda f: isinstance(f, CudlaFence_) and f.owner.libs.paths == self.libs.paths,
                "(CudlaFence, value) of this driver",
                call,
            )
            if task.signal:
                fence, value = task.signal[0]
                assert isinstance(fence, CudlaFence_)
                if fence.owner is not self or fence.signaller != "dla":
                    raise DlaError(
                        _INVALID, call, f"{fence.name}: a task signals only DLA fences of its core"
                    )
                value = int(value)
            else:
                fence, value = self._completion, self._completion._promised + 1
            if self._in_flight >= self._queue_depth:
                raise DlaError(
                    CudlaStatus.ERROR_OUT_OF_RESOURCES, call, f"{self._queue_depth} tasks held"
                )
            previous = fence._reserve(value, call)
            prefences: list[NvSciSyncFence] = []
            try:
                record = self._submit_locked(task, module, fence, value, prefences, call)
            except BaseException:
                fence._unreserve(previous)
                for f in prefences:
                    self.nvsci.clear(f)
                raise
            self._pending.append(record)
            self._in_flight += 1
            self._cv.notify_all()
        return record.handle

    def _submit_locked(  # noqa: PLR0917 (one private call site)
        self, task: Task, module: CudlaModule, fence: CudlaFence_, value: int,
        prefences: list[NvSciSyncFence], call: str,
    ) -> _Record:  # fmt: skip
        keep: list[Any] = []
        waits = tuple((f, int(v)) for f, v in task.wait if isinstance(f, CudlaFence_))
        cfences = []
        for wait_fence, wait_value in waits:
            assert isinstance(wait_fence, CudlaFence_)
            pre = wait_fence._prefence(wait_value, call)
            if pre is None:
                continue  # already reached: cuDLA need not wait
            prefences.append(pre)
            self._import(wait_fence)  # the waiting handle imports the object too
            cfences.append(
                CudlaFence(c_void_p(cast(pointer(pre), c_void_p).value), FenceType.NVSCISYNC_FENCE)
            )
        wait_events = None
        if cfences:
            array = (CudlaFence * len(cfences))(*cfences)
            wait_events = WaitEvents(cast(array, POINTER(CudlaFence)), len(cfences))
            keep += [array, wait_events]
        eof = NvSciSyncFence()
        registered = fence.registered[id(self)]
        raw_next = fence._raw_base + 1
        if fence.deterministic:  # dlad computes the EOF fence; cuDLA is given none
            self.nvsci.update(fence.alloc.obj, fence._fence_id, raw_next, eof)
            eof_ptr = None
        else:
            eof_ptr = cast(pointer(eof), c_void_p).value
        eof_array = (CudlaFence * 1)(CudlaFence(eof_ptr, FenceType.NVSCISYNC_FENCE))
        dev_ptrs = (POINTER(c_uint64) * 1)(registered)
        signal_events = SignalEvents(
            cast(dev_ptrs, POINTER(POINTER(c_uint64))), cast(eof_array, POINTER(CudlaFence)), 1
        )
        ins = (POINTER(c_uint64) * len(task.inputs))(*(b.registered for b in task.inputs))  # type: ignore[attr-defined]
        outs = (POINTER(c_uint64) * len(task.outputs))(*(b.registered for b in task.outputs))  # type: ignore[attr-defined]
        ctask = CudlaTask(
            c_void_p(module.handle), cast(outs, POINTER(POINTER(c_uint64))), len(task.outputs),
            len(task.inputs), cast(ins, POINTER(POINTER(c_uint64))),
            pointer(wait_events) if wait_events is not None else None, pointer(signal_events),
        )  # fmt: skip
        keep += [eof_array, dev_ptrs, signal_events, ins, outs, ctask]
        handle = CudlaTaskHandle(next(self._ids), task, time.monotonic_ns())
        status = self.libs.cudlaSubmitTask(self._dev, byref(ctask), 1, None, self._flags)
        if status != 0:
            if fence.deterministic:
                self.nvsci.clear(eof)
            check_cudla(status, call)
        if fence.deterministic:
            fence._raw_base = raw_next
        fence._record(value, eof)
        return _Record(handle, fence, value, eof, keep, prefences, waits)

    # ------------------------------------------------------------------ the native plane

    def plane_functions(self) -> CudlaFunctions:
        """The addresses of the functions the native data plane calls for this core
        (``dlad/native/cudla_engine.hpp``), in the libraries this core loaded."""
        from dlad.native_plane import CudlaFunctions  # noqa: PLC0415 (the plane's types)

        libs = self.libs
        address = [
            int(cast(getattr(libs, name), c_void_p).value or 0)
            for name in ("cudlaSubmitTask", "cudlaGetLastError", "NvSciSyncFenceWait",
                         "NvSciSyncFenceClear")
        ]  # fmt: skip
        return CudlaFunctions(*address)

    def plane_core(
        self, slots: Sequence[tuple[Sequence[CudlaBuffer], Sequence[CudlaBuffer], CudlaFence_]]
    ) -> PlaneCudla:
        """This core as an engine of the native data plane: its
        handle, module, CPU wait context, submit flags and how long an EOF fence is waited for
        (the task timeout and the grace), and for each slot ``(inputs, outputs, fence)`` the
        registered pointers of its buffers and of the DLA-signalled fence its tasks signal.
        From then on only the plane submits to this core, until the plane is closed; then
        :meth:`close` as usual.

        Raises DlaError: ``ERROR_INVALID_MODULE`` with no module loaded;
        ``ERROR_UNSUPPORTED_OPERATION`` in deterministic-semaphore mode (the plane takes the
        EOF fences cuDLA fills; dlad computes none there); ``ERROR_INVALID_PARAM`` for a slot
        whose buffers are not this core's in the module's shapes, or whose fence is not a
        DLA-signalled fence of this core.
        """
        from dlad.native_plane import PlaneCudla, PlaneCudlaSlot  # noqa: PLC0415

        call = "cudlaSubmitTask"
        with self._cv:
            self._enter(call)
            module = self._module
        if module is None:
            raise DlaError(CudlaStatus.ERROR_INVALID_MODULE, call, "no module is loaded")
        if self._semaphores == "deterministic":
            raise DlaError(
                CudlaStatus.ERROR_UNSUPPORTED_OPERATION, call,
                "the native data plane needs syncpoint fences; this core uses deterministic "
                "semaphores (it serves as a Python engine instead)",
            )  # fmt: skip
        made = []
        for inputs, outputs, fence in slots:
            ok = (
                [b.descriptor for b in inputs] == list(module.inputs)
                and [b.descriptor for b in outputs] == list(module.outputs)
                and all(b.owner is self for b in (*inputs, *outputs))
            )  # fmt: skip
            if not ok:
                raise DlaError(_INVALID, call, "a slot's buffers are not this core's module's")
            if fence.owner is not self or fence.signaller != "dla":
                raise DlaError(_INVALID, call, f"{fence.name}: not a DLA fence of this core")
            made.append(
                PlaneCudlaSlot(
                    inputs=tuple(_address(b.registered) for b in inputs),
                    outputs=tuple(_address(b.registered) for b in outputs),
                    signal=_address(fence.registered[id(self)]),
                )
            )
        return PlaneCudla(
            device=int(self._dev.value or 0),
            module=int(module.handle),
            wait_context=int(self.nvsci.cpu_wait.value or 0),
            flags=self._flags,
            timeout_us=(self._timeout_ms + self._grace_ms) * 1000,
            slots=tuple(made),
        )

    # ------------------------------------------------------------------ completion

    def _complete(self) -> None:
        carried = CudlaStatus.SUCCESS  # a failure that may have been the next task's
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if not self._pending:
                    return
                record = self._pending[0]
                timeout_us = (self._timeout_ms + self._grace_ms) * 1000
            try:
                status = self._await(record, timeout_us)
                if status is CudlaStatus.SUCCESS:
                    status = carried
                carried = CudlaStatus.SUCCESS
                # cuDLA's error is the handle's, not a task's: where the next task had also
                # ended when this one's was read, the failure may be either's, and both are
                # failed (a failed frame must not be answered OK). The next task is looked up
                # after the read: one submitted while this one ran may have ended before it.
                with self._cv:
                    after = self._pending[1] if len(self._pending) > 1 else None
                failed = status is not CudlaStatus.SUCCESS
                if failed and after is not None and self.nvsci.wait(after.eof, 0):
                    carried = status
            except Exception:  # noqa: BLE001 (a bug must fail one task, not wedge the core)
                _log.exception("cudla_completion_failed", core=self._core, task=record.handle.id)
                status = CudlaStatus.ERROR_UNKNOWN
            self._finish(record, status)

    def _await(self, record: _Record, timeout_us: int) -> CudlaStatus:
        if not self.nvsci.wait(record.eof, timeout_us):
            _log.error("cudla_eof_timeout", core=self._core, task=record.handle.id)
            return CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
        status = self.libs.cudlaGetLastError(self._dev)
        try:
            return CudlaStatus(status)
        except ValueError:
            return CudlaStatus.ERROR_UNKNOWN

    def _finish(self, record: _Record, status: CudlaStatus) -> None:
        handle = record.handle
        if status is CudlaStatus.SUCCESS:
            for fence, value in record.waits:  # no CPU waits on a CUDA-signalled fence
                if fence.signaller == "gpu":
                    fence._advance(value)
            # The DLA passed these pre-fences; another core's completion thread may not have
            # recorded that yet. Let it, so the start estimate below is never before them.
            for fence, value in record.waits:
                fence.wait(value, self._grace_ms / 1000)
        end = time.monotonic_ns()
        start = max(
            handle.submit_ns, self._last_end_ns,
            *(f._reached_ns(v) for f, v in record.waits),
        )  # fmt: skip
        start = min(start, end)
        self._last_end_ns = end
        if record.aborted:
            status = ABORTED_STATUS
        handle.timing = TaskTiming(handle.submit_ns, start, end)
        handle.status = status
        for nvsci_fence in (record.eof, *record.prefences):
            self.nvsci.clear(nvsci_fence)
        with self._cv:
            self._pending.popleft()
            if status is not CudlaStatus.SUCCESS:
                self._sticky = status
            self._in_flight -= 1
            self._cv.notify_all()
        record.fence._advance(record.value)

    # ------------------------------------------------------------------ shutdown

    def close(self, *, force: bool = False) -> None:
        """Release everything in the documented order and destroy the handle; idempotent.

        Raises DlaError ``DLA_ERR_PROCESSOR_BUSY`` while tasks are in flight unless ``force``;
        a DLA task cannot be aborted, so ``force`` signals the CPU fences the unfinished tasks
        wait on, waits for the DLA to end them (each bounded by the task timeout) and reports
        them with :data:`ABORTED_STATUS`. ``ERROR_UNSUPPORTED_OPERATION`` from the completion
        thread (a fence callback). A failure while releasing is raised after everything else
        was released.
        """
        call = "cudlaDestroyDevice"
        if threading.current_thread() is self._thread:
            raise DlaError(CudlaStatus.ERROR_UNSUPPORTED_OPERATION, call, "from the core thread")
        with self._cv:
            if self._closed:
                return
            if self._in_flight and not force:
                raise DlaError(
                    CudlaStatus.DLA_ERR_PROCESSOR_BUSY, call, f"{self._in_flight} tasks in flight"
                )
            self._stopping = True
            pending = list(self._pending)
            for record in pending:
                record.aborted = True
            self._cv.notify_all()
        for record in pending:  # release the CPU gates so the hardware drains
            for fence, value in record.waits:
                if fence.signaller == "cpu" and fence.value < value and fence.alloc.obj:
                    try:
                        fence.signal(value)
                    except DlaError:
                        _log.exception("cudla_close_gate_failed", fence=fence.name)
        self._thread.join()
        self._closed = True
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            run_fence_callback(hook)  # logs a failure: the core's objects are released regardless
        self._teardown()

    def _teardown(self) -> None:
        """§4.7 step 8: buffers, sync objects, module, device, NvSci modules."""
        errors: list[DlaError] = []

        def attempt(fn: Callable[[], None]) -> None:
            try:
                fn()
            except DlaError as exc:
                errors.append(exc)

        libs, dev = self.libs, self._dev

        def unregister(registered: Any) -> None:
            check_cudla(libs.cudlaMemUnregister(dev, registered), "cudlaMemUnregister")

        for buf in self._buffers:
            attempt(functools.partial(unregister, buf.registered))
            self.nvsci.free_buffer(buf.alloc)
        self._buffers.clear()
        for fence, registered in self._foreign:
            fence.registered.pop(id(self), None)
            attempt(functools.partial(unregister, registered))
        self._foreign.clear()
        for fence in self._fences:
            fence._release()
            registered = fence.registered.pop(id(self), None)
            if registered is not None:
                attempt(functools.partial(unregister, registered))
            self.nvsci.free_sync(fence.alloc)
        self._fences.clear()
        if self._module is not None:
            handle = self._module.handle
            attempt(
                lambda: check_cudla(
                    libs.cudlaModuleUnload(c_void_p(handle), 0), "cudlaModuleUnload"
                )
            )
            self._module = None
        if dev.value:
            attempt(lambda: check_cudla(libs.cudlaDestroyDevice(dev), "cudlaDestroyDevice"))
            self._dev = c_void_p()
        self.nvsci.close()
        if errors:
            raise errors[0]


def _address(pointer: Any) -> int:
    """The address a ctypes pointer holds (a registered pointer cuDLA returned)."""
    return int(cast(pointer, c_void_p).value or 0)
