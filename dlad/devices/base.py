"""The device interface: what dlad asks of a DLA core, shaped by cuDLA standalone mode.

Every DLA backend (the emulated core in :mod:`dlad.devices.emulated`, the ctypes cuDLA + NvSci
binding in :mod:`dlad.devices.cudla`) implements these :class:`typing.Protocol` s, and the
scheduler is written against them only. The life of a core, and the cuDLA call behind each step
(``docs/devices.md`` has the full table)::

    open core N                    cudlaCreateDevice(N, CUDLA_STANDALONE)   (the constructor)
    core.load(loadable) -> Module  cudlaModuleLoadFromMemory (one module per core handle)
    module.inputs / .outputs       cudlaModuleGetAttributes(*_TENSOR_DESCRIPTORS)
    core.alloc_buffer(desc)        NvSciBufObjAlloc + cudlaImportExternalMemory
    core.create_fence()            NvSciSyncObjAlloc + cudlaImportExternalSemaphore
    core.submit(Task(...))         cudlaSubmitTask (returns at once; completion = signal fence)
    fence.wait / .on_reached       NvSciSyncFenceWait / a notifier for an event loop
    core.last_error()              cudlaGetLastError (sticky until read)
    core.set_task_timeout(ms)      cudlaSetTaskTimeoutInMs
    core.close()                   cudlaModuleUnload, cudlaMemUnregister, cudlaDestroyDevice

Fences are syncpoint-like counters: a value only grows, a waiter waits for "value >= v". A task
names the values it waits for and the value it signals when it ends, successful or not; a
consumer woken by a fence reads the task's status (or :meth:`DlaCore.last_error`) to learn
which. Every failure of a core call is a :class:`DlaError` carrying the ``cudlaStatus`` value and
the name of the cuDLA (or NvSci) call it stands for.

Only the standard library, numpy, structlog and :mod:`dlad.loadable` are imported.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt
import structlog

from dlad.loadable import TensorDescriptor

__all__ = [
    "DEFAULT_TASK_TIMEOUT_MS",
    "MAX_SIGNAL_EVENTS",
    "MAX_TASK_TIMEOUT_MS",
    "MAX_WAIT_EVENTS",
    "Buffer",
    "CudlaStatus",
    "DlaCore",
    "DlaError",
    "FenceCore",
    "FenceValue",
    "LoadableSource",
    "Module",
    "SyncObject",
    "Task",
    "TaskHandle",
    "TaskTiming",
    "fence_value",
    "is_int_in",
    "run_fence_callback",
]

DEFAULT_TASK_TIMEOUT_MS: Final = 30_000
"""cuDLA's task timeout until ``cudlaSetTaskTimeoutInMs`` changes it (30 s)."""
MAX_TASK_TIMEOUT_MS: Final = 1_000_000
"""``cudlaSetTaskTimeoutInMs`` refuses 0 and anything above 1000 s."""
MAX_WAIT_EVENTS: Final = 29
"""cuDLA takes at most 29 pre-fences per task."""
MAX_SIGNAL_EVENTS: Final = 1
"""cuDLA signals at most one syncpoint per task; dlad's fences are syncpoint-like."""


class CudlaStatus(enum.IntEnum):
    """``cudlaStatus``, with cuDLA's values (``docs/reference/cudla.md`` §4.3)."""

    SUCCESS = 0
    ERROR_INVALID_PARAM = 1
    ERROR_OUT_OF_RESOURCES = 2
    ERROR_CREATION_FAILED = 3
    ERROR_INVALID_ADDRESS = 4
    ERROR_OS = 5
    ERROR_CUDA = 6
    ERROR_UMD = 7
    ERROR_INVALID_DEVICE = 8
    ERROR_INVALID_ATTRIBUTE = 9
    ERROR_INCOMPATIBLE_DLA_SW_VERSION = 10
    ERROR_MEMORY_REGISTERED = 11
    ERROR_INVALID_MODULE = 12
    ERROR_UNSUPPORTED_OPERATION = 13
    ERROR_NVSCI = 14
    ERROR_DRIVER_NOT_FOUND = 15
    DLA_ERR_INVALID_INPUT = 0x40000001
    DLA_ERR_INVALID_PRE_ACTION = 0x40000002
    DLA_ERR_NO_MEM = 0x40000003
    DLA_ERR_PROCESSOR_BUSY = 0x40000004
    DLA_ERR_TASK_STATUS_MISMATCH = 0x40000005
    DLA_ERR_ENGINE_TIMEOUT = 0x40000006
    DLA_ERR_DATA_MISMATCH = 0x40000007
    ERROR_UNKNOWN = 0x7FFFFFFF

    @property
    def c_name(self) -> str:
        """The C enumerator: ``cudlaSuccess``, ``cudlaErrorInvalidParam``,
        ``cudlaErrorDlaErrEngineTimeout``, ..."""
        if self is CudlaStatus.SUCCESS:
            return "cudlaSuccess"
        words = self.name.split("_")
        if words[:2] == ["DLA", "ERR"]:
            words = ["ERROR", "DLA", "ERR", *words[2:]]
        spelled = {"NVSCI": "NvSci", "SW": "SW", "DLA": "Dla", "UMD": "Umd", "OS": "Os"}
        return "cudla" + "".join(spelled.get(w, w.capitalize()) for w in words)


class DlaError(Exception):
    """A DLA core call failed.

    Attributes:
        status: the ``cudlaStatus`` the call returned (never ``SUCCESS``).
        call: the cuDLA or NvSci function the failed call stands for, e.g. ``cudlaSubmitTask``.
        detail: a human-readable explanation (may be empty).
    """

    def __init__(self, status: CudlaStatus, call: str, detail: str = "") -> None:
        status = CudlaStatus(status)
        if status is CudlaStatus.SUCCESS:
            raise ValueError("a DlaError needs a failure status, not cudlaSuccess")
        self.status = status
        self.call = call
        self.detail = detail
        text = f"{call}: {status.c_name} ({int(status):#x})"
        super().__init__(f"{text}: {detail}" if detail else text)


@dataclass(frozen=True, slots=True)
class TaskTiming:
    """When one task ran, in the core's clock (nanoseconds, monotonic).

    ``submit_ns``: :meth:`DlaCore.submit` accepted it; ``start_ns``: its wait fences were
    reached and it began to execute; ``end_ns``: it finished, just before its fences were
    signalled. ``modelled_us`` is the latency the backend modelled (``None`` on real hardware),
    ``compute_us`` the host time spent producing the outputs (``None`` on real hardware).
    """

    submit_ns: int
    start_ns: int
    end_ns: int
    modelled_us: float | None = None
    compute_us: float | None = None

    @property
    def actual_us(self) -> float:
        """The task's execution time, ``end_ns - start_ns``, in microseconds."""
        return (self.end_ns - self.start_ns) / 1e3

    @property
    def queued_us(self) -> float:
        """Time from submission to start (queue and wait fences), in microseconds."""
        return (self.start_ns - self.submit_ns) / 1e3


class Buffer(Protocol):
    """A task I/O buffer allocated for one core (NvSciBuf on target, host memory elsewhere).

    It holds at least ``descriptor.size`` bytes; a task reads and writes them through the
    module's descriptor of the tensor it is bound to.
    """

    @property
    def descriptor(self) -> TensorDescriptor:
        """The descriptor the buffer was allocated for."""
        ...

    @property
    def raw(self) -> npt.NDArray[np.uint8]:
        """A writeable, C-contiguous 1-D view of the ``descriptor.size`` bytes."""
        ...

    @property
    def array(self) -> npt.NDArray[Any]:
        """The same bytes as ``descriptor.numpy_dtype`` of shape ``descriptor.buffer_shape``."""
        ...


class SyncObject(Protocol):
    """A fence with a monotonically increasing value (a syncpoint; NvSciSync on target).

    A value is reached once the fence's value is ``>=`` it. Values are integers in
    ``[0, 2**64)``; a new fence is at 0. Value errors raise :class:`DlaError` with
    ``ERROR_INVALID_PARAM``.
    """

    @property
    def value(self) -> int:
        """The current value."""
        ...

    def signal(self, value: int) -> None:
        """Signal from the CPU: set the value to ``value``.

        Raises DlaError (``ERROR_INVALID_PARAM``) unless ``value`` is above the current value
        and above every value a submitted task has promised to signal.
        """
        ...

    def reached(self, value: int) -> bool:
        """Whether the fence's value is ``>= value``."""
        ...

    def wait(self, value: int, timeout: float | None = None) -> bool:
        """Block until ``value`` is reached or ``timeout`` seconds pass (None: no limit).
        Returns whether it was reached."""
        ...

    def on_reached(self, value: int, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once ``value`` is reached: now, in the calling thread, if it
        already is; else in the thread that signals it (a core's own thread for a task's fence).

        Callbacks must be quick and must not block; an event loop hops over with a thread-safe
        call (``loop.call_soon_threadsafe(future.set_result, None)``). An exception from a
        callback is logged and does not reach the signaller.
        """
        ...


FenceValue = tuple[SyncObject, int]
"""A fence and a value of it: waited for (``Task.wait``) or signalled (``Task.signal``)."""
LoadableSource = bytes | bytearray | memoryview | str | os.PathLike[str]
"""A loadable's bytes, or the path of its file."""


class Module(Protocol):
    """A loadable loaded on one core (``cudlaModule``)."""

    @property
    def core(self) -> int:
        """The DLA core it is loaded on."""
        ...

    @property
    def inputs(self) -> tuple[TensorDescriptor, ...]:
        """Input tensor descriptors, in the order a task's ``inputs`` binds buffers."""
        ...

    @property
    def outputs(self) -> tuple[TensorDescriptor, ...]:
        """Output tensor descriptors, in the order a task's ``outputs`` binds buffers."""
        ...


@dataclass(frozen=True, slots=True)
class Task:
    """One inference on a core (``cudlaTask``): the buffers to bind, in the module's tensor
    order, the fence values to wait for before starting and the fence value to signal at the
    end. Sequences are stored as tuples; the core validates the rest at submission."""

    module: Module
    inputs: Sequence[Buffer]
    outputs: Sequence[Buffer]
    wait: Sequence[FenceValue] = ()
    signal: Sequence[FenceValue] = ()

    def __post_init__(self) -> None:
        # A tuple is kept as it is (its identity too: check_task_layout remembers it). Four
        # plain tests, not a loop over the names: a slot builds a Task every frame.
        if type(self.inputs) is not tuple:
            object.__setattr__(self, "inputs", tuple(self.inputs))
        if type(self.outputs) is not tuple:
            object.__setattr__(self, "outputs", tuple(self.outputs))
        if type(self.wait) is not tuple:
            object.__setattr__(self, "wait", tuple(self.wait))
        if type(self.signal) is not tuple:
            object.__setattr__(self, "signal", tuple(self.signal))


class TaskHandle(Protocol):
    """What :meth:`DlaCore.submit` returns. ``status`` and ``timing`` are final once the task's
    signal fence is reached (they are set before it is signalled)."""

    @property
    def id(self) -> int:
        """Submission number on its core, from 1, in submission order."""
        ...

    @property
    def status(self) -> CudlaStatus | None:
        """``None`` while the task is queued or running, then how it ended."""
        ...

    @property
    def timing(self) -> TaskTiming | None:
        """``None`` until the task ended."""
        ...


class DlaCore(Protocol):
    """One open DLA core (``cudlaDevHandle`` in standalone mode).

    Tasks run one at a time in submission order. An asynchronous task failure makes the core's
    error *sticky*: every later call except :meth:`last_error` and :meth:`close` raises a
    :class:`DlaError` with that status, without doing anything, until :meth:`last_error` reads
    it. Every call on a closed core raises ``ERROR_INVALID_DEVICE``.
    """

    @property
    def core(self) -> int:
        """The DLA core index, 0 or 1."""
        ...

    @property
    def in_flight(self) -> int:
        """Tasks submitted and not yet ended."""
        ...

    def load(self, loadable: LoadableSource) -> Module:
        """Load a loadable built for this core. One module per core handle: a second load
        raises. Raises DlaError (``ERROR_INVALID_MODULE``, ``ERROR_UNSUPPORTED_OPERATION``, ...)."""
        ...

    def alloc_buffer(self, descriptor: TensorDescriptor) -> Buffer:
        """A zeroed buffer of ``descriptor.size`` bytes usable by this core's tasks."""
        ...

    def create_fence(self) -> SyncObject:
        """A new fence at value 0, which this core's tasks can wait on and signal."""
        ...

    def submit(self, task: Task) -> TaskHandle:
        """Queue ``task``; returns at once. Raises DlaError for a task this core cannot run
        (foreign module or buffer, wrong buffer count or size, a bad fence value, too many
        events, a full queue)."""
        ...

    def last_error(self) -> CudlaStatus:
        """The error of the most recent failed task, or ``SUCCESS``; reading clears it."""
        ...

    def set_task_timeout(self, ms: int) -> None:
        """A task that has not ended ``ms`` milliseconds after it reached the head of the
        queue ends with ``DLA_ERR_ENGINE_TIMEOUT``. ``1 <= ms <= MAX_TASK_TIMEOUT_MS``."""
        ...

    def close(self, *, force: bool = False) -> None:
        """Release the module, buffers and fences and the core itself; idempotent.

        Raises DlaError (``DLA_ERR_PROCESSOR_BUSY``) while tasks are in flight unless
        ``force``, which ends them with ``ERROR_INVALID_DEVICE`` and signals their fences.
        """
        ...


# ----------------------------------------------------------------------- backends' helpers

_FENCE_VALUE_END: Final = 1 << 64
_log = structlog.get_logger("dlad.devices")


def is_int_in(value: object, low: int, high: int) -> bool:
    """``value`` is an int (a numpy integer too, never a bool) in ``[low, high)``."""
    return (
        isinstance(value, (int, np.integer))
        and not isinstance(value, bool)
        and low <= int(value) < high
    )


def fence_value(value: object, call: str) -> int:
    """``value`` as a fence value. Raises DlaError (``ERROR_INVALID_PARAM``, naming ``call``)
    unless it is an int in ``[0, 2**64)``."""
    if type(value) is int and 0 <= value < _FENCE_VALUE_END:  # the common case, at once
        return value
    if not is_int_in(value, 0, _FENCE_VALUE_END):
        raise DlaError(
            CudlaStatus.ERROR_INVALID_PARAM,
            call,
            f"fence value {value!r} is not an int in [0, 2**64)",
        )
    assert isinstance(value, (int, np.integer))  # narrowing: checked just above
    return int(value)


def run_fence_callback(callback: Callable[[], object]) -> None:
    """Run a fence's ``on_reached`` callback; its exception is logged, never raised, because a
    consumer's bug must not stop the thread that signals the fence."""
    try:
        callback()
    except Exception:  # noqa: BLE001 (see the docstring)
        _log.exception("fence_callback_failed", callback=repr(callback))


class FenceCore:
    """What every fence backend shares: a value that only grows (``_value``, guarded by
    ``_lock``, the lock of ``_cond``), threads waiting on the condition, and ``on_reached``
    callbacks, which whoever advances the value runs outside the lock. Backends add how a value
    is reached and promised.
    """

    def __init__(self) -> None:
        # ``with self._lock`` where nothing waits or wakes: a Condition's ``with`` runs Python.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._value = 0
        self._order = itertools.count()  # FIFO among callbacks of one value
        self._callbacks: list[tuple[int, int, Callable[[], object]]] = []  # heap by value

    @property
    def value(self) -> int:
        """The current value."""
        return self._value

    def reached(self, value: int) -> bool:
        """Whether the value is ``>= value``. Raises DlaError for a value outside uint64."""
        return self._value >= fence_value(value, "NvSciSyncFenceWait")

    def wait(self, value: int, timeout: float | None = None) -> bool:
        """Block until ``value`` is reached or ``timeout`` seconds pass; returns whether it was.
        Raises DlaError (``ERROR_INVALID_PARAM``) for a bad value or a negative timeout."""
        target = fence_value(value, "NvSciSyncFenceWait")
        if timeout is not None and not timeout >= 0:
            raise DlaError(
                CudlaStatus.ERROR_INVALID_PARAM, "NvSciSyncFenceWait", f"timeout {timeout!r}"
            )
        with self._cond:
            return self._cond.wait_for(lambda: self._value >= target, timeout)

    def on_reached(self, value: int, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once ``value`` is reached: now, in the calling thread, if it is;
        else from the thread that advances the fence (see ``SyncObject.on_reached``)."""
        target = fence_value(value, "NvSciSyncFenceWait")
        with self._lock:
            if self._value < target:
                heapq.heappush(self._callbacks, (target, next(self._order), callback))
                return
        run_fence_callback(callback)

    def _due_locked(self) -> list[Callable[[], object]]:
        """With ``_cond`` held, after raising ``_value``: pop the callbacks now due and wake the
        waiters. Run the returned callbacks after releasing the lock."""
        due: list[Callable[[], object]] = []
        while self._callbacks and self._callbacks[0][0] <= self._value:
            due.append(heapq.heappop(self._callbacks)[2])
        self._cond.notify_all()
        return due


Layouts = dict[tuple[int, int], tuple[object, Sequence[Buffer], Sequence[Buffer]]]
"""The task layouts a core has accepted (:func:`check_task_layout`'s ``accepted``): by the ids
of a task's buffer tuples, the module and the tuples themselves (held, so the ids stay theirs)."""

MAX_LAYOUTS: Final = 64
"""Layouts a core remembers as accepted (more: it forgets them all and checks afresh)."""


def check_task_layout(
    task: Task,
    module: object,
    *,
    owner: object,
    buffer_type: type,
    core: int,
    call: str,
    accepted: Layouts | None = None,
) -> None:
    """What every backend's ``submit`` checks under its lock before anything else: ``task``
    uses ``module`` (the one loaded on the core), binds one buffer of ``buffer_type`` allocated
    by ``owner`` and large enough for each tensor, and has few enough events.

    ``accepted``: the core's memory of layouts that passed. A task binding the very tuples of
    buffers a passed one bound, to the same module, is not walked again: an executor's slot
    submits its own buffers every frame. (A core's buffers live as long as the core.)

    Raises DlaError: ``ERROR_INVALID_MODULE``, ``ERROR_INVALID_ADDRESS`` (a foreign buffer) or
    ``ERROR_INVALID_PARAM`` (count, size, events), naming ``call``.
    """
    invalid = CudlaStatus.ERROR_INVALID_PARAM
    if module is None or task.module is not module:
        raise DlaError(CudlaStatus.ERROR_INVALID_MODULE, call, "module not loaded here")
    ins, outs = task.inputs, task.outputs
    seen = None if accepted is None else accepted.get((id(ins), id(outs)))
    if seen is None or seen[0] is not module or seen[1] is not ins or seen[2] is not outs:
        _check_buffers(task, owner=owner, buffer_type=buffer_type, core=core, call=call)
        if accepted is not None:
            if len(accepted) >= MAX_LAYOUTS:
                accepted.clear()
            accepted[id(ins), id(outs)] = (module, ins, outs)
    if len(task.wait) > MAX_WAIT_EVENTS or len(task.signal) > MAX_SIGNAL_EVENTS:
        why = f"{len(task.wait)} waits / {len(task.signal)} signals: too many"
        raise DlaError(invalid, call, why)


def _check_buffers(task: Task, *, owner: object, buffer_type: type, core: int, call: str) -> None:
    """:func:`check_task_layout`'s walk over the task's buffers."""
    invalid = CudlaStatus.ERROR_INVALID_PARAM
    for kind, buffers, descs in (
        ("input", task.inputs, task.module.inputs),
        ("output", task.outputs, task.module.outputs),
    ):
        if len(buffers) != len(descs):
            raise DlaError(invalid, call, f"{len(buffers)} {kind} buffers for {len(descs)}")
        for buf, desc in zip(buffers, descs, strict=True):
            if not isinstance(buf, buffer_type) or getattr(buf, "owner", None) is not owner:
                why = f"{kind} {desc.name!r}: buffer not allocated on DLA{core}"
                raise DlaError(CudlaStatus.ERROR_INVALID_ADDRESS, call, why)
            if buf.raw.size < desc.size:
                why = f"{kind} {desc.name!r}: {buf.raw.size} B for {desc.size} B"
                raise DlaError(invalid, call, why)


def check_fence_pairs(task: Task, accept: Callable[[object], bool], what: str, call: str) -> None:
    """Every wait and signal of ``task`` is a ``(fence, value)`` pair whose fence ``accept``
    takes and whose value is a fence value. Raises DlaError (``ERROR_INVALID_PARAM``) naming
    ``what`` was expected and ``call``."""
    pairs: Sequence[object] = (*task.wait, *task.signal) if task.wait else task.signal
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and accept(pair[0])):
            raise DlaError(CudlaStatus.ERROR_INVALID_PARAM, call, f"not {what}: {pair!r}")
        fence_value(pair[1], call)
