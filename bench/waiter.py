"""A thread of its own for a blocking call an event loop makes on every frame: the mechanism
``bench/thread_handover.py`` and ``bench/gpu_completion.py`` measure against
``anyio.to_thread.run_sync`` (docs/BENCHMARKS.md §9.6, §9.14). The daemon waits on its engines'
own threads instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from dlad.devices.emulated import name_os_thread

__all__ = ["Waiter"]

_T = TypeVar("_T")
_Item = tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]


class Waiter:
    """Runs blocking calls for the event loop on one thread of its own, in the order given.

    The thread starts with the first call and ends at :meth:`close`. A call's caller that is
    cancelled still waits for the call to return (as ``anyio.to_thread.run_sync`` does by
    default): what the call blocks on, a stream or an event, must outlive it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    async def run(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on the waiter's thread; its result, or its exception raised here. Raises
        RuntimeError once closed."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_T] = loop.create_future()
        if self._thread is None or self._closed:  # (the common case takes no lock)
            self._start()
        self._calls.put((fn, done, loop))
        try:
            return await done
        except asyncio.CancelledError:
            # Cancelled: wait, uncancellably, until the call has returned. Calls run in order,
            # so a no-op queued behind it returns after it; once closed, the thread's end is
            # the sign.
            with anyio.CancelScope(shield=True):
                await self._drained(loop)
            raise

    async def _drained(self, loop: asyncio.AbstractEventLoop) -> None:
        marker: asyncio.Future[None] = loop.create_future()
        with self._lock:
            closed = self._closed
            if not closed:
                self._calls.put((_nothing, marker, loop))
        if closed and self._thread is not None:
            await anyio.to_thread.run_sync(self._thread.join)
        elif not closed:
            await marker

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"waiter {self.name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        name_os_thread(self.name)  # the OS's name too: per-thread CPU tells it apart
        while (item := self._calls.get()) is not None:
            fn, done, loop = item
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 (handed to the caller, raised there)
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for it
                loop.call_soon_threadsafe(_settle, done, result, error)

    def close(self) -> None:
        """End the thread once the calls already given have returned (idempotent; does not
        wait)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._calls.put(None)


def _nothing() -> None:
    return None


def _settle(done: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if done.done():  # the loop is going away: nobody waits for it
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(result)
