"""The cudla backend's fences: :class:`CudlaFence_`, an NvSciSync object used as a dlad fence
(implements ``SyncObject`` of :mod:`dlad.devices.base`).

This module owns a fence's NvSciSync object (reconciled and allocated for its signaller, recipes
A and B of ``docs/reference/cudla.md`` §4.7, and primed with its fence id and raw counter base), its
value and promises, the ``NvSciSyncFence`` snapshots handed to DLA tasks and CUDA streams (kept
until their value is reached), CPU signalling (``NvSciSyncObjSignal``), GPU signalling and waits
(:meth:`CudlaFence_.signal_from_gpu`, :meth:`CudlaFence_.wait_from_gpu`), CPU waits and
callbacks. The core that creates a fence (:class:`~dlad.devices.cudla.backend.CudlaDlaCore`)
imports it into its cuDLA handle, moves it from its completion thread and frees it; which values
a task may wait on and who may signal is in :mod:`dlad.devices.cudla.backend`'s docstring.

Only the standard library, numpy, structlog and dlad's own modules are imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from ctypes import c_void_p, cast, pointer
from typing import TYPE_CHECKING, Any, Final, Literal

import structlog

from dlad.devices.base import CudlaStatus, DlaError, FenceCore, fence_value, run_fence_callback
from dlad.devices.cudla.abi import NvSciSyncAccessPerm, NvSciSyncFence, SyncAttrFlags
from dlad.devices.cudla.nvsci import SyncAllocation

if TYPE_CHECKING:
    from dlad.devices.cudla.backend import CudlaDlaCore

__all__ = ["MAX_CPU_SIGNAL_STEP", "CudlaFence_", "Signaller"]

Signaller = Literal["dla", "cpu", "gpu"]
MAX_CPU_SIGNAL_STEP: Final = 1 << 20
"""A CPU fence moves by one ``NvSciSyncObjSignal`` per unit; larger jumps are refused."""
_MAX_VALUE: Final = 1 << 64
_INVALID: Final = CudlaStatus.ERROR_INVALID_PARAM

_log = structlog.get_logger(__name__)


class CudlaFence_(FenceCore):
    """An NvSciSync object used as a dlad fence (implements ``SyncObject``); see the module
    docstring of :mod:`dlad.devices.cudla.backend` for which values a task may wait on and who
    may signal.

    The value is what dlad has seen reached: a task's EOF fence observed by the completion
    thread, or a CPU signal. Raises DlaError like the emulated fence: ``ERROR_INVALID_PARAM``
    for a bad value, ``ERROR_UNSUPPORTED_OPERATION`` for a CPU signal of a DLA-signalled fence.
    """

    def __init__(self, owner: CudlaDlaCore, signaller: Signaller, name: str) -> None:
        super().__init__()
        self.owner = owner
        self.signaller = signaller
        self.name = name
        self.alloc = SyncAllocation()
        self.registered: dict[int, Any] = {}  # id(core) -> POINTER(c_uint64)
        self.deterministic = False
        self._promised = 0
        self._reached_at: list[tuple[int, int]] = [(0, 0)]  # (value, monotonic ns)
        self._records: list[tuple[int, NvSciSyncFence]] = []  # dla: promised value -> EOF fence
        self._fence_id = 0
        self._raw_base = 0  # cpu: raw counter = base + value; dla deterministic: last raw
        self._held: list[tuple[int, NvSciSyncFence]] = []  # fences handed to CUDA waits

    def __repr__(self) -> str:
        return f"<CudlaFence {self.name} {self.signaller} value={self._value}>"

    @property
    def nvsci_object(self) -> int:
        """The ``NvSciSyncObj`` (for a CUDA import)."""
        return self.alloc.obj

    def next_value(self) -> int:
        """The lowest value a new signal may use: above the value and every promise."""
        with self._cond:
            return max(self._value, self._promised) + 1

    def signal_from_gpu(self, value: int, queue_signal: Callable[[int], None]) -> None:
        """Promise ``value`` to a GPU signal of this ``signaller="gpu"`` fence: a fresh
        ``NvSciSyncFence`` is passed (by address) to ``queue_signal``, which must queue
        ``cudaSignalExternalSemaphoresAsync`` with it (CUDA fills it in); tasks that wait on
        ``value`` then wait on that fence, which is kept until ``value`` is reached. The value
        moves once a DLA task that waited on it ends successfully (the DLA passed it).

        Raises DlaError: ``ERROR_UNSUPPORTED_OPERATION`` for a fence of another signaller,
        ``ERROR_INVALID_PARAM`` unless ``value`` is above the value and every promise,
        ``ERROR_INVALID_DEVICE`` once freed; and whatever ``queue_signal`` raises (the
        promise is then withdrawn).
        """
        call = "cudaSignalExternalSemaphoresAsync"
        target = self._signal_target(value, "gpu", call)
        if not self.alloc.obj:
            raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, call, f"{self.name}: freed")
        previous = self._reserve(target, call)
        fence = NvSciSyncFence()
        try:
            queue_signal(cast(pointer(fence), c_void_p).value or 0)
        except BaseException:
            self._unreserve(previous)
            self.owner.nvsci.clear(fence)
            raise
        with self._cond:
            self._records.append((target, fence))

    def wait_from_gpu(self, value: int, queue_wait: Callable[[int], None]) -> bool:
        """Have a CUDA stream wait for ``value``: ``queue_wait`` gets the address of an
        ``NvSciSyncFence`` reached with ``value`` (a DLA fence's EOF fence, once the task that
        signals it is submitted) and must queue ``cudaWaitExternalSemaphoresAsync`` with it;
        the fence is kept until ``value`` is reached. Returns False (and calls nothing) when
        ``value`` is reached already. Raises DlaError as a task's wait would (``value`` neither
        reached nor promised) and whatever ``queue_wait`` raises.
        """
        fence = self._prefence(fence_value(value, "cudaWaitExternalSemaphoresAsync"),
                               "cudaWaitExternalSemaphoresAsync")  # fmt: skip
        if fence is None:
            return False
        try:
            queue_wait(cast(pointer(fence), c_void_p).value or 0)
        except BaseException:
            self.owner.nvsci.clear(fence)
            raise
        with self._cond:
            if self._value < value:
                self._held.append((int(value), fence))
                return True
        self.owner.nvsci.clear(fence)  # reached meanwhile: _advance will not see it
        return True

    def signal(self, value: int) -> None:
        """Signal from the CPU: ``value - self.value`` calls of ``NvSciSyncObjSignal``.

        Raises DlaError: ``ERROR_UNSUPPORTED_OPERATION`` for a DLA-signalled fence;
        ``ERROR_INVALID_PARAM`` unless ``value`` is above the current value by at most
        :data:`MAX_CPU_SIGNAL_STEP`; ``ERROR_INVALID_DEVICE`` once its core is closed.
        """
        call = "NvSciSyncObjSignal"
        target = self._signal_target(value, "cpu", call)
        with self._cond:
            if not self.alloc.obj:
                raise DlaError(CudlaStatus.ERROR_INVALID_DEVICE, call, f"{self.name}: freed")
            if not 0 < target - self._value <= MAX_CPU_SIGNAL_STEP:
                raise DlaError(
                    _INVALID, call,
                    f"{self.name}: {value} is not above {self._value} by 1..{MAX_CPU_SIGNAL_STEP}",
                )  # fmt: skip
            for _ in range(target - self._value):
                self.owner.nvsci.signal(self.alloc.obj)
        self._advance(target)

    # ------------------------------------------------------------------ backend side

    def _signal_target(self, value: int, signaller: Signaller, call: str) -> int:
        """``value`` checked as a fence value, for a signal only ``signaller`` may give.
        Raises DlaError: ``ERROR_INVALID_PARAM`` for a bad value,
        ``ERROR_UNSUPPORTED_OPERATION`` for a fence of another signaller."""
        target = fence_value(value, call)
        if self.signaller != signaller:
            raise DlaError(
                CudlaStatus.ERROR_UNSUPPORTED_OPERATION, call,
                f"{self.name} is signalled by {self.signaller}; "
                f"use create_fence(signaller='{signaller}')",
            )  # fmt: skip
        return target

    def _allocate(
        self,
        *,
        gpu_signaller: Callable[[int], None] | None,
        extra_waiter: Callable[[int], None] | None,
    ) -> None:
        """Reconcile and allocate the NvSciSync object for this fence's signaller (recipe A for
        ``"gpu"``, B otherwise; ``docs/reference/cudla.md`` §4.7), its waiters' lists deterministic
        when :attr:`deterministic` is set. Raises DlaError naming the call that failed
        (``ERROR_UNSUPPORTED_OPERATION`` for a CUDA signaller without ``gpu_signaller`` or with
        deterministic semaphores); the caller frees what was allocated."""
        nvsci, libs, name, alloc = self.owner.nvsci, self.owner.libs, self.name, self.alloc
        deterministic, signaller = self.deterministic, self.signaller
        if deterministic and not (
            libs.has("NvSciSyncFenceUpdateFence") and libs.has("NvSciSyncFenceExtractFence")
        ):
            raise DlaError(
                CudlaStatus.ERROR_UNSUPPORTED_OPERATION, "NvSciSyncFenceUpdateFence",
                "deterministic semaphores need NvSciSyncFenceUpdateFence and "
                "NvSciSyncFenceExtractFence, which this NvSciSync lacks",
            )  # fmt: skip
        if signaller == "gpu":
            # dlad computes no fences for a CUDA signaller: CUDA fills them in at each
            # signal, which deterministic semaphores (§4.7 step 7) would need dlad to do.
            if deterministic or gpu_signaller is None:
                why = "deterministic semaphores" if deterministic else "no gpu_signaller"
                raise DlaError(
                    CudlaStatus.ERROR_UNSUPPORTED_OPERATION, "NvSciSyncAttrListReconcile",
                    f"{name}: a CUDA-signalled fence is not available here ({why})",
                )  # fmt: skip
            signal = nvsci.sync_list(alloc)
            gpu_signaller(int(signal.value or 0))
            waiters = [nvsci.cudla_list(alloc, SyncAttrFlags.WAIT)]
        elif signaller == "dla":
            signal = nvsci.cudla_list(alloc, SyncAttrFlags.SIGNAL | SyncAttrFlags.WAIT)
            waiters = [nvsci.cpu_list(alloc, NvSciSyncAccessPerm.WAIT_ONLY)]
            if extra_waiter is not None:
                extra = nvsci.sync_list(alloc)
                extra_waiter(int(extra.value or 0))
                waiters.append(extra)
        else:
            signal = nvsci.cpu_list(alloc, NvSciSyncAccessPerm.SIGNAL_ONLY)
            waiters = [nvsci.cudla_list(alloc, SyncAttrFlags.WAIT)]
        if deterministic:
            for handle in waiters:
                nvsci.require_deterministic(handle)
        nvsci.reconcile_and_alloc(alloc, [signal, *waiters])

    def _prime(self) -> None:
        """Learn the fence id and raw counter base that fences of future values are built from."""
        nvsci, libs = self.owner.nvsci, self.owner.libs
        if not libs.has("NvSciSyncFenceExtractFence"):
            return
        probe = NvSciSyncFence()
        try:
            if self.signaller == "cpu":
                nvsci.generate_fence(self.alloc.obj, probe)  # reached by the next signal
                self._fence_id, raw_next = nvsci.extract(probe)
                self._raw_base = raw_next - 1
            elif self.deterministic:  # §4.7 step 7: prime from (0, 0), then extract
                nvsci.update(self.alloc.obj, 0, 0, probe)
                self._fence_id, self._raw_base = nvsci.extract(probe)
        finally:
            nvsci.clear(probe)

    def _reached_ns(self, value: int) -> int:
        with self._cond:
            for reached, at in self._reached_at:
                if reached >= value:
                    return at
        return 0

    def _advance(self, value: int) -> None:
        """Raise the value to ``value``, release the EOF fences now reached, run callbacks."""
        done: list[NvSciSyncFence] = []
        with self._cond:
            if value > self._value:
                self._value = value
                self._reached_at.append((value, time.monotonic_ns()))
                del self._reached_at[:-64]  # only recent values are asked about
            while self._records and self._records[0][0] <= self._value:
                done.append(self._records.pop(0)[1])
            done += [f for v, f in self._held if v <= self._value]
            self._held = [(v, f) for v, f in self._held if v > self._value]
            due = self._due_locked()
        for fence in done:
            self.owner.nvsci.clear(fence)
        for callback in due:
            run_fence_callback(callback)

    def _reserve(self, value: int, call: str) -> int:
        """Promise ``value`` to a task; returns the previous promise (to undo a refused
        submission with :meth:`_unreserve`)."""
        with self._cond:
            floor = max(self._value, self._promised)
            if value <= floor:
                raise DlaError(
                    _INVALID, call, f"{self.name}: {value} is not above {floor} (values only grow)"
                )
            previous, self._promised = self._promised, value
            return previous

    def _unreserve(self, previous: int) -> None:
        with self._cond:
            self._promised = previous

    def _record(self, value: int, eof: NvSciSyncFence) -> None:
        copy = NvSciSyncFence()
        self.owner.nvsci.dup(eof, copy)
        with self._cond:
            self._records.append((value, copy))

    def _prefence(self, value: int, call: str) -> NvSciSyncFence | None:
        """A new NvSciSyncFence reached when ``value`` is (the caller clears it), or None when
        ``value`` is already reached. Raises DlaError when cuDLA cannot be given one."""
        nvsci = self.owner.nvsci
        fence = NvSciSyncFence()
        with self._cond:
            if self._value >= value:
                return None
            if self.signaller in ("dla", "gpu"):
                for promised, eof in self._records:
                    if promised >= value:
                        nvsci.dup(eof, fence)
                        return fence
                raise DlaError(
                    _INVALID, call,
                    f"{self.name}: value {value} is neither reached nor promised by a submitted "
                    "signaller; cuDLA takes a pre-fence only once its signaller is submitted",
                )  # fmt: skip
            if self.owner.libs.has("NvSciSyncFenceUpdateFence") and self._fence_id:
                nvsci.update(self.alloc.obj, self._fence_id, self._raw_base + value, fence)
                return fence
            if value == self._value + 1:
                nvsci.generate_fence(self.alloc.obj, fence)
                return fence
        raise DlaError(
            CudlaStatus.ERROR_UNSUPPORTED_OPERATION, "NvSciSyncFenceUpdateFence",
            f"{self.name}: waiting on {value} (not the next value) needs NvSciSyncFenceUpdateFence",
        )  # fmt: skip

    def _release(self) -> None:
        """Clear the EOF fences still held (teardown)."""
        with self._cond:
            records, self._records = self._records, []
            held, self._held = self._held, []
        for _, fence in (*records, *held):
            self.owner.nvsci.clear(fence)
