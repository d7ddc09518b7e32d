"""The executor seam: the one interface between the scheduler and the engines.

The daemon's layers go one way::

    frontend (socket, decoding, who asked)  →  scheduler (policy: queues, deadlines, placement)
        →  executors (one per engine: its device handles, buffers, streams, fences)  →  devices

A job goes down by its id with a :class:`Request` payload, which says what to compute and nothing
about who asked; an executor's result comes back up as an :class:`Outcome` keyed by that id, and
only the frontend maps it back to a client. An executor pulls its work from the scheduler when it
has a free slot (one job; a batch, for an executor that batches) and reports every job it took,
expired ones included, exactly once.

:class:`Executor` holds what every engine shares (identity, the models it serves, its queue bound
for the scheduler, health and counters); ``dlad/executors/dla.py`` is the DLA core's.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np

from dlad.errors import DeviceFailed

__all__ = [
    "UNHEALTHY_AFTER",
    "Executor",
    "ExecutorStats",
    "OnOutcome",
    "Outcome",
    "Request",
    "WarmState",
    "failing_words",
]

UNHEALTHY_AFTER: Final = 3
"""Consecutive failed tasks after which an executor reports itself unhealthy (until one
succeeds)."""

WarmState = Literal["pending", "ok", "failed"]


def failing_words(failures: int, last: str) -> str:
    """Why an engine whose last ``failures`` tasks all failed is unhealthy (STATUS, the log)."""
    return f"{failures} consecutive tasks failed; last: {last}"


@dataclass(slots=True)
class Request:
    """What one job asks of an engine (the scheduler's job payload): the image as received (a
    zero-copy view of the wire frame), its pixel format and the detection settings."""

    image: np.ndarray
    pixel_format: str
    conf: float
    iou: float
    max_det: int
    received_ns: int  # monotonic ns when the frontend received it
    model: str


@dataclass(slots=True)
class Outcome:
    """The result of one job, keyed by the job's id; ``error`` is set instead of ``detections``
    when it failed (a :class:`~dlad.errors.DladError`, or any exception for a bug)."""

    job_id: int
    device: str
    detections: np.ndarray | None = None
    error: Exception | None = None
    queue_us: float = 0.0
    pre_us: float = 0.0
    device_us: float = 0.0
    post_us: float = 0.0
    start_ns: int = 0
    end_ns: int = 0
    hung: bool = False  # the engine did not finish the task in its timeout (a hang, not an error)


OnOutcome = Callable[[Outcome], Awaitable[None]]


@dataclass(slots=True)
class ExecutorStats:
    completed: int = 0
    failed: int = 0
    busy_ns: int = 0
    consecutive_failures: int = 0
    last_failure: str = ""


def pipeline_us(pre_us: float, device_us: float, post_us: float, slots: int) -> float:
    """What one task (or batch) costs an executor's throughput, for the scheduler to learn:
    ``slots`` loops each pre-process, run (one at a time on the engine) and post-process, so
    the engine is the bottleneck, or, when pre/post-processing takes longer, the loops are:
    ``max(device, (pre + device + post) / slots)``."""
    return max(device_us, (pre_us + device_us + post_us) / max(slots, 1))


class Executor(abc.ABC):
    """One engine serving one or more models for the scheduler.

    Attributes:
        name: the device's name (``dla0``), as replies, STATUS and metrics name it.
        kind: ``"dla"`` or ``"gpu"``.
        core: the DLA core index, or None for other kinds.
        models: the models it serves.
        capacity: the bound of its queue in the scheduler.
        service_us: its first service-time estimate for placement (learned online after).
        max_batch: the most jobs it takes at once (1: no batching).
        stats, warm: counters, and whether its warm-up ran (``pending``/``ok``/``failed``).

    Everything is called on the daemon's event loop.
    """

    kind: str = ""
    max_batch: int = 1

    def __init__(
        self,
        name: str,
        *,
        core: int | None,
        models: frozenset[str],
        capacity: int,
        service_us: float,
    ) -> None:
        self.name = name
        self.core = core
        self.models = models
        self.capacity = capacity
        self.service_us = service_us
        self.stats = ExecutorStats()
        self.warm: WarmState = "pending"
        self.warm_error = ""
        self._wake = asyncio.Event()  # set on every admit: the loop's own, not anyio's wrapper

    # ------------------------------------------------------------------ what each engine does
    @abc.abstractmethod
    async def warm_up(self) -> float:
        """Run one task before serving, so the first request does not pay the engine's lazy
        set-up; sets :attr:`warm`. Returns its device time in µs; raises DeviceFailed."""

    @abc.abstractmethod
    async def run(self, on_outcome: OnOutcome) -> None:
        """Serve jobs until cancelled, reporting each through ``on_outcome``; the engine is
        released on the way out."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine when :meth:`run` never took it over (idempotent)."""

    # ------------------------------------------------------------------ shared
    def wake(self) -> None:
        """A job was queued for this executor."""
        self._wake.set()

    async def wait_for_work(self) -> None:
        """Sleep until the next :meth:`wake`. Call it only after the scheduler had nothing for
        this executor: a wake from before then is stale, its job already taken."""
        self._wake.clear()
        await self._wake.wait()

    def health(self) -> tuple[bool, str]:
        """Whether the engine serves well, and why not: its warm-up has not run or failed, or
        its last :data:`UNHEALTHY_AFTER` tasks or more all failed (a success clears that)."""
        if self.warm == "pending":
            return False, "warming up"
        if self.warm == "failed":
            return False, f"warm-up failed: {self.warm_error}"
        n = self.stats.consecutive_failures
        if n >= UNHEALTHY_AFTER:
            return False, failing_words(n, self.stats.last_failure)
        return True, "ok"

    def failed(self, error: DeviceFailed) -> DeviceFailed:
        """Count a failed task; returns ``error`` for the outcome."""
        self.stats.failed += 1
        self.stats.consecutive_failures += 1
        self.stats.last_failure = error.message
        return error

    def succeeded(self) -> None:
        """Count a successful task."""
        self.stats.completed += 1
        self.stats.consecutive_failures = 0
