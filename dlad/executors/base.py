"""The executor seam: what the native data plane's Python engines run.

An executor owns one engine's Python side (its device handles, buffers, faults and DRAM; the
GPU's engine), and its per-frame code: ``DlaExecutor.run_frame`` (one frame on a DLA core from
pre-processing to detections) and ``GpuExecutor.run_batch`` (a batch on the GPU's engine). The
plane's Python engines (:mod:`dlad.engines.python`) call that code on the plane's own threads;
the plane keeps the queues, deadlines, placement and health. A frame goes down as a
:class:`Request` (what to compute, nothing about who asked) and comes back as an
:class:`Outcome` keyed by the plane's job id.

:class:`Executor` holds what every engine shares (identity, the models it serves, its warm-up
and counters); ``dlad/executors/dla.py`` is the DLA core's, ``dlad/executors/gpu.py`` the GPU's.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np

from dlad.errors import DeviceFailed
from dlad.protocol import PixelFormat, frame_size

__all__ = [
    "UNHEALTHY_AFTER",
    "Executor",
    "ExecutorStats",
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
    """What one frame asks of an engine: the image (a view of the bytes the plane holds), its
    pixel format (one of :data:`dlad.protocol.PIXEL_FORMATS`, a YUV frame with its ``colour``
    code) and the detection settings."""

    image: np.ndarray
    pixel_format: PixelFormat
    conf: float
    iou: float
    max_det: int
    received_ns: int  # monotonic ns when the engine was handed it
    model: str
    colour: int = 0

    @property
    def size(self) -> tuple[int, int]:
        """The frame's ``(width, height)`` in pixels."""
        height, width = frame_size(self.pixel_format, self.image.shape)
        return width, height


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


@dataclass(slots=True)
class ExecutorStats:
    completed: int = 0
    failed: int = 0
    busy_ns: int = 0
    consecutive_failures: int = 0
    last_failure: str = ""


class Executor(abc.ABC):
    """One engine's Python side, serving one or more models for the native plane.

    Attributes:
        name: the device's name (``dla0``), as replies, STATUS and metrics name it.
        kind: ``"dla"`` or ``"gpu"``.
        core: the DLA core index, or None for other kinds.
        models: the models it serves.
        capacity: the bound of its queue in the plane.
        service_us: its first service-time estimate for placement (learned online after).
        max_batch: the most jobs it takes at once (1: no batching).
        stats, warm: counters, and whether its warm-up ran (``pending``/``ok``/``failed``).

    The per-frame code runs on the plane's engine threads; warm-up and close on the daemon's.
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

    # ------------------------------------------------------------------ what each engine does
    @abc.abstractmethod
    async def warm_up(self) -> float:
        """Run one task before serving, so the first request does not pay the engine's lazy
        set-up; sets :attr:`warm`. Returns its device time in µs; raises DeviceFailed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (idempotent; after the plane that calls it has closed)."""

    # ------------------------------------------------------------------ shared

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
