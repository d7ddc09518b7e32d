"""The emulated DLA core: the device interface of :mod:`dlad.devices.base` in software.

A product backend, not a test double: it is what dlad serves on where there is no Orin. Each
:class:`EmulatedDlaCore` owns a "hardware" thread that runs its tasks one at a time in submission
order, so DLA0 and DLA1 overlap for real and the numerics of one core never hold up the other.
A task

1. reaches the head of the queue (its timeout starts) and waits until its wait fences are reached;
2. computes: ``numeric`` mode runs :class:`~dlad.devices.int8_engine.Int8Engine` from the input
   buffer's ``DLA_HWC4`` bytes into the output buffers' ``CHW16`` / ``CHW32`` bytes; ``timing``
   mode does no math and copies a fixed, valid pattern of the right format into the outputs;
3. takes the modelled latency in total (the loadable's ``latency_us`` unless overridden): it sleeps
   what the computation left, or takes the computation's own time if that is longer;
4. records its status and :class:`~dlad.devices.base.TaskTiming`, makes a failure the core's sticky
   error, then signals its fences, so a waiter always wakes and then reads the status.

Faults are drawn per task from a seeded generator (:class:`FaultConfig`): an error ends the task
with ``error_status`` after its latency (outputs untouched); a hang ends it only when the task
timeout fires, with ``DLA_ERR_ENGINE_TIMEOUT``. ``docs/devices.md`` says what is modelled and what
is faked. onnxruntime is imported only when a numeric-mode core loads a loadable.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import math
import mmap
import random
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import numpy as np
import numpy.typing as npt
import structlog

from dlad.devices.base import (
    DEFAULT_TASK_TIMEOUT_MS,
    MAX_LAYOUTS,
    MAX_TASK_TIMEOUT_MS,
    Buffer,
    CudlaStatus,
    DlaError,
    FenceCore,
    Layouts,
    LoadableSource,
    Task,
    TaskTiming,
    check_fence_pairs,
    check_task_layout,
    fence_value,
    is_int_in,
    run_fence_callback,
)
from dlad.devices.dram import SharedDram, Transfer
from dlad.devices.int8_engine import Int8Engine, Int8EngineError, engine_for_loadable
from dlad.loadable import (
    DataType,
    Loadable,
    LoadableCoreError,
    LoadableError,
    LoadableVersionError,
    TensorDescriptor,
    TensorFormat,
    read_loadable,
)

__all__ = [
    "ABORTED_STATUS",
    "DEFAULT_QUEUE_DEPTH",
    "EmulatedBuffer",
    "EmulatedDlaCore",
    "EmulatedFence",
    "EmulatedModule",
    "EmulatedTaskHandle",
    "FaultConfig",
    "Mode",
]

Mode = Literal["numeric", "timing"]
DEFAULT_QUEUE_DEPTH: Final = 64
"""Tasks a core holds (queued and running) before :meth:`EmulatedDlaCore.submit` refuses."""
ABORTED_STATUS: Final = CudlaStatus.ERROR_INVALID_DEVICE
"""The status of tasks ended by ``close(force=True)``: their core handle is gone."""
_MAX_VALUE: Final = 1 << 64
_NS_PER_US: Final = 1_000
_PR_SET_NAME: Final = 15  # prctl(2): name the calling thread
_INVALID: Final = CudlaStatus.ERROR_INVALID_PARAM
_LOAD_ERRORS: Final = (  # first match wins: the subclasses come before LoadableError
    (LoadableCoreError, CudlaStatus.ERROR_INVALID_MODULE),
    (LoadableVersionError, CudlaStatus.ERROR_INCOMPATIBLE_DLA_SW_VERSION),
    (LoadableError, CudlaStatus.ERROR_INVALID_MODULE),
    (OSError, CudlaStatus.ERROR_OS),
)

_log = structlog.get_logger(__name__)


def _is_number(value: object, low: float, high: float) -> bool:
    """``value`` is a real number (not a bool) in ``[low, high]`` and finite."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low <= value <= high
    )


class EmulatedFence(FenceCore):
    """A syncpoint-like fence: an integer that only grows (implements ``SyncObject``).

    Any core's tasks may wait on it or signal it; the CPU signals it with :meth:`signal`. A value
    a submitted task will signal is reserved at submission, so any later signal must exceed it;
    when signallers finish out of order the value stays at the highest.
    """

    def __init__(self, name: str = "fence") -> None:
        super().__init__()
        self.name = name
        self._promised = 0
        self.advanced_ns = 0  # time.monotonic_ns() of the last rise of the value

    def __repr__(self) -> str:
        return f"<EmulatedFence {self.name} value={self._value}>"

    def signal(self, value: int) -> None:
        """Set the value from the CPU. Raises DlaError (``ERROR_INVALID_PARAM``) unless
        ``value`` exceeds the current value and every value a submitted task will signal."""
        target = fence_value(value, "NvSciSyncObjSignal")
        self._reserve(target, "NvSciSyncObjSignal")
        self._advance(target)

    def _reserve(self, value: int, call: str) -> None:
        with self._lock:
            floor = max(self._value, self._promised)
            if value <= floor:
                raise DlaError(
                    _INVALID, call, f"{self.name}: {value} is not above {floor} (values only grow)"
                )
            self._promised = value

    def _advance(self, value: int) -> None:
        """Raise the value to ``value`` (never lower it) and run the callbacks now due."""
        with self._cond:
            if value > self._value:
                self._value = value
                self.advanced_ns = time.monotonic_ns()
            due = self._due_locked()
        for callback in due:  # outside the lock: a callback may use this fence again
            run_fence_callback(callback)


def _is_fence(fence: object) -> bool:
    return isinstance(fence, EmulatedFence)


@dataclass(frozen=True, eq=False)
class EmulatedBuffer:
    """Page-aligned, zeroed host memory for one tensor (implements ``Buffer``): ``raw`` is the
    ``descriptor.size`` bytes, ``array`` the same memory typed and shaped by the descriptor."""

    descriptor: TensorDescriptor
    raw: npt.NDArray[np.uint8] = field(repr=False)
    array: npt.NDArray[Any] = field(repr=False)
    owner: EmulatedDlaCore = field(repr=False)

    @classmethod
    def allocate(cls, owner: EmulatedDlaCore, descriptor: TensorDescriptor) -> EmulatedBuffer:
        """Raises MemoryError or ValueError when numpy cannot allocate the bytes."""
        if owner.allocator is not None:  # e.g. pinned memory a GPU also maps (dlad.gpu)
            raw = owner.allocator(descriptor.size)[: descriptor.size]
        else:
            # Over-allocate and slice so the bytes start on a page, as an NvSciBuf object's do
            # (cuDLA needs 32-byte alignment, the CUDA sample asks for 512).
            backing = np.zeros(descriptor.size + mmap.PAGESIZE, dtype=np.uint8)
            start = -backing.ctypes.data % mmap.PAGESIZE
            raw = backing[start : start + descriptor.size]
        array = raw.view(descriptor.numpy_dtype).reshape(descriptor.buffer_shape)
        return cls(descriptor, raw, array, owner)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (``top -H``, ``/proc/<pid>/task/*/comm``;
    15 bytes at most), so that an emulated engine's "hardware" time can be told from the
    daemon's own (``bench/daemon_throughput.py``). A no-op where the OS has no such call."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _image(buf: EmulatedBuffer, desc: TensorDescriptor) -> npt.NDArray[Any]:
    """Image 0 of ``buf`` laid out by ``desc``: the hardware reads a buffer through the loaded
    module's descriptor, whatever descriptor the buffer was allocated for."""
    image: npt.NDArray[Any] = (
        buf.raw[: desc.size].view(desc.numpy_dtype).reshape(desc.buffer_shape)[0]
    )
    return image


def timing_pattern(desc: TensorDescriptor) -> npt.NDArray[Any]:
    """Timing-mode contents of one output image: deterministic per tensor name, finite, in the
    range of real head logits (objectness mostly far below threshold, a few boxes above), and
    zero in the padding, as the DLA writes it."""
    shape = desc.buffer_shape[1:]
    rng = np.random.default_rng(zlib.crc32(desc.name.encode("utf-8")))
    values: npt.NDArray[np.float32] = rng.normal(-6.0, 2.0, size=shape).astype(np.float32)
    if desc.tensor_format == TensorFormat.DLA_LINEAR:  # [C][H][W'], rows padded
        values[..., desc.w :] = 0.0
    else:  # CHWx [G][H][W][x]: channel g * x + k sits at [g, :, :, k]
        vec = shape[-1]
        channel = np.arange(shape[0])[:, None, None, None] * vec + np.arange(vec)
        values = np.where(channel < desc.c, values, np.float32(0.0))
    if desc.data_type == DataType.INT8:
        scale = desc.scale if desc.scale is not None else 1.0
        q: npt.NDArray[np.int8] = np.clip(np.rint(values / scale), -128, 127).astype(np.int8)
        return q
    fp16: npt.NDArray[Any] = values.astype(desc.numpy_dtype)
    return fp16


@dataclass(frozen=True, eq=False)
class EmulatedModule:
    """A loadable loaded on an emulated core (implements ``Module``). ``engine`` is the INT8
    engine in numeric mode (else None), ``patterns`` the timing-mode outputs (else empty)."""

    core: int
    inputs: tuple[TensorDescriptor, ...]
    outputs: tuple[TensorDescriptor, ...]
    loadable: Loadable = field(repr=False)
    engine: Int8Engine | None = field(repr=False)
    patterns: tuple[npt.NDArray[Any], ...] = field(repr=False)


@dataclass(eq=False)
class EmulatedTaskHandle:
    """A submitted task (implements ``TaskHandle``). The core's thread sets ``timing`` and then
    ``status`` before it signals the task's fences; nothing else writes them."""

    id: int
    task: Task = field(repr=False)
    submit_ns: int = field(repr=False)
    status: CudlaStatus | None = None
    timing: TaskTiming | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Per-task fault injection: a task fails with probability ``error_rate`` (status
    ``error_status``) or hangs until its timeout with probability ``hang_rate``. Draws come from
    ``random.Random(seed)``, one per task in task order, so a seed replays the same faults
    (``None``: a fresh seed from the OS). Raises ValueError for rates outside [0, 1] or summing
    above 1, a seed that is not an int or None, or a success status."""

    error_rate: float = 0.0
    hang_rate: float = 0.0
    seed: int | None = 0
    error_status: CudlaStatus = CudlaStatus.DLA_ERR_DATA_MISMATCH

    def __post_init__(self) -> None:
        for name in ("error_rate", "hang_rate"):
            if not _is_number(getattr(self, name), 0.0, 1.0):
                raise ValueError(f"{name} must be a number in [0, 1], got {getattr(self, name)!r}")
        if self.error_rate + self.hang_rate > 1:
            raise ValueError("error_rate + hang_rate must be at most 1")
        if self.seed is not None and not is_int_in(self.seed, -(1 << 63), 1 << 63):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        status = CudlaStatus(self.error_status)  # ValueError for a value cuDLA does not have
        if status is CudlaStatus.SUCCESS:
            raise ValueError("error_status must be a failure status")
        object.__setattr__(self, "error_status", status)


_Outcome = Literal["done", "expired", "aborted"]


class EmulatedDlaCore:
    """One emulated DLA core (implements ``DlaCore``); construction opens it (as
    ``cudlaCreateDevice``) and starts its thread. Use it as a context manager or call
    :meth:`close` to stop the thread.

    Args:
        core: DLA core index, 0 or 1 (else DlaError ``ERROR_INVALID_DEVICE``).
        mode: ``"numeric"`` (INT8 engine) or ``"timing"`` (no math, patterned outputs).
        latency_us: modelled latency of one task; None: the loadable's ``latency_us``.
        threads: onnxruntime intra-op threads of the numeric engine.
        faults: fault injection, or None.
        clock: monotonic nanoseconds for timestamps and the latency budget; it must advance
            with real time, because waits are real.
        queue_depth: tasks held (queued and running) before submit refuses.
        allocator: returns ``n`` zeroed, page-aligned bytes (a uint8 array) for each buffer;
            None: numpy memory. The daemon passes pinned, GPU-mapped memory when the GPU does
            pre/post-processing, as an Orin's NvSciBuf buffers are shared with its GPU.
        dram: the DRAM this core shares with the emulated Orin's other engines (its tasks
            take longer while they run: ``dlad/devices/dram.py``), or None (alone). It must
            run on ``clock``.

    Raises ValueError for a bad mode, latency, thread count, queue depth or faults.
    """

    def __init__(
        self,
        core: int,
        *,
        mode: Mode = "numeric",
        latency_us: float | None = None,
        threads: int = 1,
        faults: FaultConfig | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        allocator: Callable[[int], npt.NDArray[np.uint8]] | None = None,
        dram: SharedDram | None = None,
    ) -> None:
        if not is_int_in(core, 0, 2):
            raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, "cudlaCreateDevice", f"core {core!r}")
        if mode not in ("numeric", "timing"):
            raise ValueError(f"mode must be 'numeric' or 'timing', got {mode!r}")
        if latency_us is not None and not _is_number(latency_us, 0.0, math.inf):
            raise ValueError(f"latency_us must be None or finite and >= 0, got {latency_us!r}")
        for name, value in (("threads", threads), ("queue_depth", queue_depth)):
            if not is_int_in(value, 1, 1 << 31):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        checked: object = faults
        if checked is not None and not isinstance(checked, FaultConfig):
            raise ValueError(f"faults must be a FaultConfig or None, got {checked!r}")
        self._core = int(core)
        self.mode: Mode = mode
        self._latency_override = None if latency_us is None else float(latency_us)
        self._threads = threads
        self._faults = faults
        self._rng = random.Random(faults.seed if faults else 0)
        self._clock = clock
        self._queue_depth = queue_depth
        self.allocator = allocator
        self._dram = dram
        self._lock = threading.Lock()  # ``with self._lock`` where nothing waits or wakes
        self._cv = threading.Condition(self._lock)
        self._layouts: Layouts = {}  # the task layouts accepted (check_task_layout)
        # (outputs, module) -> their images (the core thread's own, _output_images)
        self._images: dict[tuple[int, int], tuple[object, object, list[npt.NDArray[Any]]]] = {}
        # Guarded by _cv (single reads elsewhere are fine under the GIL):
        self._queue: collections.deque[EmulatedTaskHandle] = collections.deque()
        self._in_flight = 0
        self._free_at = 0  # when the last task ended in the model (the clock's ns)
        self._idle = False  # the thread waits for a task (a submission must wake it)
        self._ids = itertools.count(1)
        self._module: EmulatedModule | None = None
        self._loading = False
        self._sticky = CudlaStatus.SUCCESS
        self._timeout_ns = DEFAULT_TASK_TIMEOUT_MS * 1_000_000
        self._stopping = False
        self._abort = False
        self._closed = False
        # Daemon only so that a core nobody closed cannot hang interpreter exit; the core owns
        # the thread and close() joins it.
        self._thread = threading.Thread(target=self._run, name=f"dla{core}-emulated", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<EmulatedDlaCore dla{self._core} {self.mode} in_flight={self._in_flight}>"

    def __enter__(self) -> EmulatedDlaCore:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Leaving on an exception must not mask it with "tasks in flight".
        self.close(force=exc_type is not None)

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
        """The core's "hardware" thread; its tasks' fence callbacks run on it."""
        return self._thread

    def _enter(self, call: str) -> None:
        """What every core call checks first; the caller holds ``_cv``."""
        if self._stopping:
            raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, call, f"DLA{self._core} is closed")
        if self._sticky is not CudlaStatus.SUCCESS:
            raise DlaError(self._sticky, call, "an earlier task failed; read it with last_error()")

    # ------------------------------------------------------------------ loading

    def load(self, loadable: LoadableSource) -> EmulatedModule:
        """Load an emulated loadable (its bytes or its path) built for this core.

        Raises DlaError: ``ERROR_UNSUPPORTED_OPERATION`` for a second load (one module per core
        handle) or, in numeric mode, a layout the INT8 engine does not compute (more than one
        input, batch above 1, an input other than int8 ``DLA_HWC4``, ``DLA_LINEAR`` outputs);
        ``ERROR_INVALID_MODULE`` for a corrupt loadable, one built for the other core, or a graph
        the engine cannot run; ``ERROR_INCOMPATIBLE_DLA_SW_VERSION`` for an unknown format
        version; ``ERROR_OS`` when the file cannot be read.
        """
        call = "cudlaModuleLoadFromMemory"
        with self._cv:
            self._enter(call)
            if self._module is not None or self._loading:
                why = "one module per core handle, as cuDLA"
                raise DlaError(CudlaStatus.ERROR_UNSUPPORTED_OPERATION, call, why)
            self._loading = True  # parsing and building the engine run outside the lock
        module: EmulatedModule | None = None
        try:
            parsed = self._read(loadable, call)
            engine = self._engine(parsed, call) if self.mode == "numeric" else None
            patterns = () if engine else tuple(timing_pattern(d) for d in parsed.outputs)
            module = EmulatedModule(
                self._core, parsed.inputs, parsed.outputs, parsed, engine, patterns
            )
        finally:
            with self._cv:
                self._loading = False
                if not self._stopping:  # else a close() meanwhile has released the core
                    self._module = module
        return module

    def _read(self, source: LoadableSource, call: str) -> Loadable:
        try:
            return read_loadable(source, expect_core=self._core)
        except (LoadableError, OSError) as exc:
            status = next(s for kind, s in _LOAD_ERRORS if isinstance(exc, kind))
            raise DlaError(status, call, str(exc)) from exc

    def _engine(self, loadable: Loadable, call: str) -> Int8Engine:
        inp = loadable.inputs[0]
        unsupported = {
            f"{len(loadable.inputs)} inputs": len(loadable.inputs) != 1,
            f"batch {inp.n}": inp.n != 1,
            f"a {inp.data_type.name} {inp.tensor_format.name} input": (
                (inp.tensor_format, inp.data_type) != (TensorFormat.DLA_HWC4, DataType.INT8)
            ),
            "DLA_LINEAR outputs": any(
                d.tensor_format == TensorFormat.DLA_LINEAR for d in loadable.outputs
            ),
        }
        if any(unsupported.values()):
            why = ", ".join(what for what, bad in unsupported.items() if bad)
            raise DlaError(CudlaStatus.ERROR_UNSUPPORTED_OPERATION, call, f"numeric mode: {why}")
        try:
            engine = engine_for_loadable(loadable, threads=self._threads)
        except Int8EngineError as exc:
            raise DlaError(CudlaStatus.ERROR_INVALID_MODULE, call, str(exc)) from exc
        k = engine.kernel
        _log.info(
            "int8_kernel_path", core=f"dla{self._core}", operands=k.operands, exact=k.exact,
            runtime=k.runtime, cpu=k.cpu, reason=k.reason,
        )  # fmt: skip
        return engine

    # ------------------------------------------------------------------ resources

    def alloc_buffer(self, descriptor: TensorDescriptor) -> EmulatedBuffer:
        """A zeroed, page-aligned buffer for ``descriptor``.

        Raises DlaError: ``ERROR_INVALID_PARAM`` for anything but a TensorDescriptor of positive
        size that its layout fills exactly; ``ERROR_OUT_OF_RESOURCES`` when the memory cannot
        be allocated.
        """
        call = "cudlaImportExternalMemory"
        with self._cv:
            self._enter(call)
        desc: object = descriptor
        if not isinstance(desc, TensorDescriptor) or desc.size < 1:
            raise DlaError(_INVALID, call, f"not a tensor descriptor of positive size: {desc!r}")
        try:
            fits = math.prod(desc.buffer_shape) * desc.numpy_dtype.itemsize
        except ValueError as exc:  # a data type without a numpy dtype
            raise DlaError(_INVALID, call, str(exc)) from exc
        if fits != desc.size:
            raise DlaError(
                _INVALID, call, f"{desc.name}: {desc.buffer_shape} is {fits} B, size {desc.size}"
            )
        try:
            return EmulatedBuffer.allocate(self, desc)
        except (MemoryError, ValueError) as exc:  # numpy: too big for memory / for an array
            raise DlaError(CudlaStatus.ERROR_OUT_OF_RESOURCES, call, str(exc)) from exc

    def create_fence(self, name: str | None = None) -> EmulatedFence:
        """A new fence at value 0, usable by any emulated core's tasks and by the CPU."""
        with self._cv:
            self._enter("cudlaImportExternalSemaphore")
        return EmulatedFence(name or f"dla{self._core}-fence")

    def set_task_timeout(self, ms: int) -> None:
        """Timeout of the tasks that reach the head of the queue from now on. Raises DlaError
        ``ERROR_INVALID_PARAM`` unless ``1 <= ms <= MAX_TASK_TIMEOUT_MS``."""
        call = "cudlaSetTaskTimeoutInMs"
        with self._cv:
            self._enter(call)
            if not is_int_in(ms, 1, MAX_TASK_TIMEOUT_MS + 1):
                raise DlaError(_INVALID, call, f"timeout {ms!r} ms")
            self._timeout_ns = ms * 1_000_000

    def last_error(self) -> CudlaStatus:
        """The most recent failed task's status, or SUCCESS; reading clears it. Raises DlaError
        ``ERROR_INVALID_DEVICE`` on a closed core."""
        with self._cv:
            if self._stopping:
                raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, "cudlaGetLastError", "closed")
            status, self._sticky = self._sticky, CudlaStatus.SUCCESS
            return status

    # ------------------------------------------------------------------ tasks

    def submit(self, task: Task) -> EmulatedTaskHandle:
        """Queue ``task`` behind those already submitted; returns at once.

        Raises DlaError, queueing and reserving nothing: ``ERROR_INVALID_MODULE`` for a module
        not loaded on this core; ``ERROR_INVALID_ADDRESS`` for a buffer not allocated on it;
        ``ERROR_INVALID_PARAM`` for a wrong buffer count, a buffer smaller than its tensor, more
        than ``MAX_WAIT_EVENTS`` waits or ``MAX_SIGNAL_EVENTS`` signals, a fence of another
        backend, or a signal value not above the fence's value and promises;
        ``ERROR_OUT_OF_RESOURCES`` when ``queue_depth`` tasks are held.
        """
        call = "cudlaSubmitTask"
        checked: object = task
        if not isinstance(checked, Task):
            raise DlaError(_INVALID, call, f"not a Task: {checked!r}")
        with self._lock:
            self._enter(call)
            check_task_layout(
                task,
                self._module,
                owner=self,
                buffer_type=EmulatedBuffer,
                core=self._core,
                call=call,
                accepted=self._layouts,
            )
            check_fence_pairs(task, _is_fence, "(EmulatedFence, value)", call)
            if self._in_flight >= self._queue_depth:
                raise DlaError(
                    CudlaStatus.ERROR_OUT_OF_RESOURCES, call, f"{self._queue_depth} tasks held"
                )
            for fence, value in task.signal:  # last: nothing else can fail after a reservation
                cast("EmulatedFence", fence)._reserve(int(value), call)
            handle = EmulatedTaskHandle(next(self._ids), task, self._clock())
            self._queue.append(handle)
            self._in_flight += 1
            if self._idle:  # a busy thread takes the queue's next task when it is done
                self._cv.notify_all()
        return handle

    def close(self, *, force: bool = False) -> None:
        """Stop the core's thread and release the module; idempotent.

        Without ``force`` it raises DlaError ``DLA_ERR_PROCESSOR_BUSY`` while tasks are in
        flight (wait for the last task's fence first). With ``force`` the running task stops at
        its next wait and every unfinished task ends with :data:`ABORTED_STATUS`, its fences
        signalled. Raises DlaError ``ERROR_UNSUPPORTED_OPERATION`` when called from the core's
        own thread (a fence callback), which it would have to join.
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
            self._abort = force
            self._cv.notify_all()
        if force and self._dram is not None:
            self._dram.wake()  # a task waiting out its DRAM-shared time sees the abort
        self._thread.join()
        with self._cv:
            left = list(self._queue)
            self._queue.clear()
        for handle in left:
            now = self._clock()
            self._finish(handle, ABORTED_STATUS, TaskTiming(handle.submit_ns, now, now))
        with self._cv:
            self._module = None
            self._closed = True

    # ------------------------------------------------------------------ the hardware thread

    def _run(self) -> None:
        name_os_thread(f"dla{self._core}-emulated")
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._idle = True
                    self._cv.wait()
                self._idle = False
                if self._abort or not self._queue:
                    return  # close() ends whatever is left
                handle = self._queue.popleft()
            try:
                self._execute(handle)
            except Exception:  # noqa: BLE001 (a bug must fail one task, not wedge the core)
                _log.exception("emulated_task_crashed", core=self._core, task=handle.id)
                if handle.status is None:
                    now = self._clock()
                    timing = TaskTiming(handle.submit_ns, now, now)
                    self._finish(handle, CudlaStatus.ERROR_UNKNOWN, timing)

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _wait_until(self, ready: Callable[[], bool], deadline_ns: int) -> _Outcome:
        """Sleep on the core's condition until ``ready()``, the deadline or a forced close."""
        with self._cv:
            while not ready():
                if self._abort:
                    return "aborted"
                remaining = deadline_ns - self._clock()
                if remaining <= 0:
                    return "expired"
                self._cv.wait(remaining / 1e9)
            return "done"

    def _fences_rose(self, task: Task) -> int:
        """When the last of ``task``'s wait fences rose (on this core's clock: its default,
        the fences'; with another clock, now)."""
        if not task.wait:
            return 0
        if self._clock is not time.monotonic_ns:
            return self._clock()
        return max(cast("EmulatedFence", f).advanced_ns for f, _ in task.wait)

    def _draw_fault(self) -> Literal["none", "error", "hang"]:
        if self._faults is None:
            return "none"
        u = self._rng.random()
        if u < self._faults.error_rate:
            return "error"
        return "hang" if u < self._faults.error_rate + self._faults.hang_rate else "none"

    def _execute(self, handle: EmulatedTaskHandle) -> None:
        task = handle.task
        module = cast("EmulatedModule", task.module)  # submit checked it is this core's
        fault = self._draw_fault()  # one draw per task in task order: a seed replays it
        deadline = self._clock() + self._timeout_ns
        for fence, value in task.wait:
            fence.on_reached(value, self._notify)
        outcome = self._wait_until(lambda: all(f.reached(v) for f, v in task.wait), deadline)
        ready = self._clock()
        # The engine's time is the model's, not the host thread's: a task queued behind another
        # starts when that one ended in the model, or when its last fence rose if later, so a
        # thread woken late does not stretch the engine's throughput.
        start = min(ready, max(handle.submit_ns, self._free_at, self._fences_rose(task)))
        override = self._latency_override
        modelled = module.loadable.latency_us if override is None else override
        status, compute_ns = CudlaStatus.SUCCESS, 0
        if outcome == "done" and fault == "hang":
            outcome = self._wait_until(lambda: False, deadline)
        elif outcome == "done":
            # The modelled latency is the task's work alone; sharing the DRAM stretches it.
            dram = self._dram
            ahead = ready - start  # modelled work already done before this thread got here
            transfer = None if dram is None else dram.begin("dla", modelled * 1e3 - ahead)
            try:
                if fault == "error":
                    status = (
                        self._faults.error_status if self._faults else CudlaStatus.ERROR_UNKNOWN
                    )
                else:
                    status = self._compute(module, task)
                    compute_ns = self._clock() - ready
                # Wait out the modelled time; a computation longer than it sets the time.
                outcome = self._wait_work(start, modelled, deadline, dram, transfer)
            finally:
                if dram is not None and transfer is not None:
                    dram.finish(transfer)
        if outcome == "expired":
            status = CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
        elif outcome == "aborted":
            status = ABORTED_STATUS
        end = self._clock()
        if outcome == "done":
            # when the work ended in the model (the thread wakes some time after that)
            if dram is not None and transfer is not None and transfer.done_ns is not None:
                end = min(end, max(transfer.done_ns, start + compute_ns))
            elif dram is None:
                end = min(end, start + max(round(modelled * _NS_PER_US), compute_ns))
        self._free_at = end
        timing = TaskTiming(handle.submit_ns, start, end, modelled, compute_ns / 1e3)
        self._finish(handle, status, timing)

    def _wait_work(
        self,
        start: int,
        modelled_us: float,
        deadline: int,
        dram: SharedDram | None,
        transfer: Transfer | None,
    ) -> _Outcome:
        if dram is None or transfer is None:
            end = start + round(modelled_us * _NS_PER_US)
            if self._wait_until(lambda: False, min(end, deadline)) == "aborted":
                return "aborted"
            return "expired" if end > deadline or self._clock() > deadline else "done"
        waited = dram.wait(transfer, deadline, stop=lambda: self._abort)
        return "aborted" if waited == "stopped" else waited

    def _compute(self, module: EmulatedModule, task: Task) -> CudlaStatus:
        outs = self._output_images(module, task.outputs)
        if module.engine is None:
            for out, pattern in zip(outs, module.patterns, strict=True):
                np.copyto(out, pattern)
            return CudlaStatus.SUCCESS
        image = _image(cast("EmulatedBuffer", task.inputs[0]), module.inputs[0])
        try:
            module.engine.run(image, out=outs)
        except Int8EngineError:
            _log.exception("emulated_task_failed", core=self._core)
            return CudlaStatus.ERROR_UNKNOWN
        return CudlaStatus.SUCCESS

    def _output_images(
        self, module: EmulatedModule, outputs: Sequence[Buffer]
    ) -> list[npt.NDArray[Any]]:
        """Image 0 of each output buffer, laid out by ``module``, remembered per tuple of
        buffers (a slot binds the same tuple every task): what the core thread runs between
        tasks it runs holding the GIL, and the daemon's event loop may be waiting for it."""
        key = (id(outputs), id(module))
        seen = self._images.get(key)
        if seen is not None and seen[0] is outputs and seen[1] is module:
            return seen[2]
        # submit checked that every buffer is an EmulatedBuffer of this core.
        outs = [
            _image(cast("EmulatedBuffer", b), d)
            for b, d in zip(outputs, module.outputs, strict=True)
        ]
        if len(self._images) >= MAX_LAYOUTS:
            self._images.clear()
        self._images[key] = (outputs, module, outs)
        return outs

    def _finish(self, handle: EmulatedTaskHandle, status: CudlaStatus, timing: TaskTiming) -> None:
        # Status, timing, the sticky error and the in-flight count are all settled before the
        # fences move, so a consumer woken by a fence sees the final state and may close().
        handle.timing = timing
        handle.status = status
        with self._cv:
            if status is not CudlaStatus.SUCCESS:
                self._sticky = status
            self._in_flight -= 1
            self._cv.notify_all()
        for fence, value in handle.task.signal:  # submit checked they are EmulatedFences
            cast("EmulatedFence", fence)._advance(int(value))
