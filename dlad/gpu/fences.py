"""Fences shared by the emulated DLA cores and CUDA streams.

On an Orin the GPU and the DLA meet at NvSciSync objects: the GPU signals the fence a DLA task
waits on, the DLA signals the fence a CUDA stream waits on, and no CPU thread sits in between
(``docs/reference/cudla.md`` §4.7 recipe A). Emulated, the meeting point is a 32-bit word of pinned,
device-mapped host memory, which is what an NvSciSync *deterministic semaphore* is:

* DLA → GPU: a :class:`MappedFence` publishes every value it reaches into its word; a stream
  waits on it with ``cuStreamWaitValue32`` (``>=``, wrap-safe).
* GPU → DLA: a stream writes the word with ``cuStreamWriteValue32`` and records a blocking-sync
  event behind it (:meth:`MappedFence.gpu_signal`); the fence's waiter thread sleeps on that
  event (the GPU's interrupt, standing in for the syncpoint interrupt) and advances the fence,
  which wakes the emulated core's task that waits on it. A word written by other means (a
  stream the daemon did not queue, the CPU) can instead be watched by the :class:`FencePoller`,
  which polls.

A :class:`MappedFence` is an :class:`~dlad.devices.emulated.EmulatedFence`, so emulated cores
accept it in any task.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from dlad.devices.emulated import EmulatedFence, name_os_thread
from dlad.gpu.driver import GpuContext, _driver

if TYPE_CHECKING:
    from dlad.gpu.prepost import GpuPipeline

__all__ = ["FencePoller", "MappedFence"]

log = structlog.get_logger("dlad.gpu.fences")

_MASK = 0xFFFFFFFF


def word_reached(word: int, value: int) -> bool:
    """Whether a 32-bit fence word has reached ``value`` (wrap-safe, as ``CU_STREAM_WAIT_VALUE_GEQ``
    compares: the signed 32-bit difference is ``>= 0``)."""
    return ((int(word) - value) & _MASK) < 0x80000000


class MappedFence(EmulatedFence):
    """An emulated fence mirrored into a 32-bit word the GPU can wait on and write.

    ``device_ptr`` is the word's address for stream memory operations. Values are the fence's
    64-bit values; the word holds their low 32 bits (waits compare wrap-safe, so values may grow
    without bound as long as no waiter is 2**31 behind).
    """

    def __init__(self, ctx: GpuContext, poller: FencePoller, name: str = "gpu-fence") -> None:
        super().__init__(name)
        self._ctx = ctx
        self._memory = ctx.host_alloc(64)
        self._word = self._memory.array[:4].view(np.uint32)
        self.device_ptr = self._memory.device_ptr
        self._poller = poller
        self._events: queue.SimpleQueue[tuple[Any, int] | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        # Events the waiter has seen fire, for the next signals (one per frame otherwise: a
        # create and a destroy each).
        self._spare: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @property
    def host_ptr(self) -> int:
        """The word's host address (the native plane's emulated core polls and writes it)."""
        return self._memory.host_ptr

    @property
    def word(self) -> int:
        """The word's current contents."""
        return int(self._word[0])

    def _advance(self, value: int) -> None:
        with self._cond:  # publish before waking anyone: a GPU waiter must see it too
            self._word[0] = max(self._value, value) & _MASK
        super()._advance(value)

    def next_value(self) -> int:
        """The lowest value a new signal may use: above the value and every promise."""
        with self._cond:
            return max(self._value, self._promised) + 1

    def expect_gpu_signal(self, value: int, call: str = "cuStreamWriteValue32") -> None:
        """Reserve ``value`` for a GPU write queued (or about to be queued) on a stream, and have
        the poller advance the fence once the word shows it. Raises DlaError unless ``value`` is
        above the fence's value and promises (values only grow)."""
        self._reserve(value, call)
        self._poller.watch(self, value)

    def gpu_signal(self, pipeline: GpuPipeline, value: int) -> None:
        """Queue on ``pipeline``'s stream the write of ``value`` (once the work queued before it
        is done) and a blocking-sync event behind it; the fence's waiter thread advances the
        fence when the event fires. Raises DlaError unless ``value`` is above the fence's value
        and promises; CudaError when queueing fails."""
        self._reserve(value, "cuStreamWriteValue32")
        pipeline.signal(self.device_ptr, value)
        try:
            event = self._spare.get_nowait()
        except queue.Empty:
            event = self._ctx.event(blocking=True)
        pipeline.record(event)  # recorded before the waiter can wait on it
        if self._waiter is None:
            self._waiter = threading.Thread(
                target=self._wait_events, name=f"dlad-{self.name}-waiter", daemon=True
            )
            self._waiter.start()
        self._events.put((event, value))

    def _wait_events(self) -> None:
        # The emulated core's hardware: a DLA waits on the GPU's fence in silicon.
        name_os_thread("fwait-emulated")
        drv = _driver()
        self._ctx.make_current()
        while (item := self._events.get()) is not None:
            event, value = item
            err = drv.cuEventSynchronize(event)[0]
            if int(err) != 0:  # the stream failed: release the task anyway, it will fail too
                log.error("gpu_fence_event_failed", fence=self.name, error=str(err))
                drv.cuEventDestroy(event)
            else:
                self._spare.put(event)
            self._advance(value)

    def free(self) -> None:
        """Stop the waiter and release the word's memory (no stream may still use it)."""
        if self._waiter is not None:
            self._events.put(None)
            self._waiter.join()
            self._waiter = None
        while not self._spare.empty():  # the waiter has stopped: nothing adds to it now
            _driver().cuEventDestroy(self._spare.get_nowait())
        self._memory.free()


class FencePoller:
    """One thread that advances :class:`MappedFence` s whose words the GPU wrote.

    It sleeps on a condition while nothing is expected; while something is, it checks the
    words, spinning with ``sleep(0)`` for ``spin_s`` after the last progress and then every
    ``interval_s`` (the added latency is in docs/BENCHMARKS.md).
    """

    def __init__(self, *, spin_s: float = 0.0005, interval_s: float = 0.00005) -> None:
        self._cond = threading.Condition()
        self._pending: list[tuple[MappedFence, int]] = []
        self._stop = False
        self._spin_s = spin_s
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="dlad-fence-poller", daemon=True)
        self._thread.start()

    def watch(self, fence: MappedFence, value: int) -> None:
        """Advance ``fence`` to ``value`` once its word reaches ``value``."""
        with self._cond:
            if self._stop:
                raise RuntimeError("the fence poller is closed")
            self._pending.append((fence, value))
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread (pending fences are left as they are); idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    @staticmethod
    def _advance_all(done: list[tuple[MappedFence, int]]) -> None:
        for fence, value in done:
            fence._advance(value)  # fence callbacks log their own failures

    def _run(self) -> None:
        # The emulated core's hardware too (the syncpoint interrupt's stand-in).
        name_os_thread("fence-emulated")
        last_progress = time.monotonic()
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                    last_progress = time.monotonic()
                if self._stop:
                    return
                pending = list(self._pending)
            done = [(f, v) for f, v in pending if word_reached(f.word, v)]
            if done:
                with self._cond:
                    for item in done:
                        self._pending.remove(item)
                self._advance_all(done)
                last_progress = time.monotonic()
                continue
            idle = time.monotonic() - last_progress
            time.sleep(0 if idle < self._spin_s else self._interval_s)
