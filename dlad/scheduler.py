"""Admission, queues, deadlines, priorities, per-stream freshness and placement.

The scheduler is a plain, synchronous object owned by the event loop (one owner: it is never
touched from a device thread). Device workers ask it for their next job; the frontend admits
requests into it. It never blocks and never grows without bound:

- **Admission** places a job on one device's bounded queue, or refuses it at once with
  :class:`~dlad.errors.Overloaded` (every queue that could take it is full) — "full" is an
  answer, never growth.
- **Placement** is by earliest estimated completion over the devices that hold the job's model:
  ``now + backlog(device) + service(device)``, where a device's service time is learned online
  (an exponentially weighted mean of measured device times, seeded from the loadable's modelled
  latency) and its backlog is the estimated work queued and in flight. A faster or idler device
  therefore gets more of the load, and two equal DLA cores share it evenly.
- **Order** within a device queue: higher priority first, then earlier deadline, then arrival.
- **Deadlines** are checked when a job is dispatched: a job whose deadline has passed is never
  executed; it comes back as expired (the daemon answers DEADLINE_EXCEEDED). Expired jobs are
  also swept from the queues by :meth:`Scheduler.expire`, so they do not hold queue slots.
- **Streams**: a new frame of a camera stream supersedes the stream's frames still queued
  ("latest frame wins"); the superseded ones come back as cancelled.
- **Cancel** removes a queued job (a job already on a device runs to completion).

Every admitted job leaves the scheduler exactly once, through exactly one of: dispatch
(:meth:`next_job`), expiry, cancellation (explicit or superseded), or :meth:`drain`. The
property tests in ``tests/dlad/test_scheduler.py`` check this and the bounds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dlad.errors import NotFound, Overloaded

P = TypeVar("P")
Clock = Callable[[], int]
"""Monotonic nanoseconds (``time.monotonic_ns`` in the daemon; a virtual clock in tests)."""


@dataclass(eq=False)
class Job(Generic[P]):
    """One admitted request. ``id`` is unique within the daemon (not the client's request id,
    which is unique only per connection); ``payload`` is the daemon's and never looked into."""

    id: int
    model: str
    deadline_ns: int
    payload: P
    priority: int = 0
    stream: str | None = None
    admitted_ns: int = 0
    device: str = ""
    estimate_ns: int = 0
    _seq: int = 0


@dataclass
class _Device:
    name: str
    models: frozenset[str]
    capacity: int
    service_ns: float
    # (-priority, deadline, arrival sequence, job id); entries of removed jobs are skipped
    # lazily and compacted away when they outnumber the live ones.
    heap: list[tuple[int, int, int, int]] = field(default_factory=list)
    depth: int = 0
    queued_work_ns: int = 0
    running: dict[int, tuple[int, int]] = field(default_factory=dict)  # job id -> (start, est)
    completed: int = 0


@dataclass(frozen=True)
class DeviceSnapshot:
    """What STATUS reports about one device's queue."""

    name: str
    queue_depth: int
    capacity: int
    in_flight: int
    service_time_us: float
    completed: int


class Scheduler(Generic[P]):
    """Bounded per-device queues with deadline-aware, priority-ordered dispatch.

    Args:
        clock: monotonic nanoseconds.
        alpha: weight of a new measurement in the service-time estimate (0 < alpha <= 1).
    """

    def __init__(self, clock: Clock, *, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._clock = clock
        self._alpha = alpha
        self._devices: dict[str, _Device] = {}
        self._jobs: dict[int, Job[P]] = {}  # queued only
        self._streams: dict[str, int] = {}  # stream -> queued job id
        self._seq = itertools.count()

    # ------------------------------------------------------------------------ configuration
    def add_device(
        self, name: str, models: Iterable[str], *, capacity: int, service_us: float
    ) -> None:
        """Register a device that serves ``models`` with a queue of ``capacity`` jobs.

        Raises:
            ValueError: a duplicate name, a capacity below 1 or a non-positive service time.
        """
        if name in self._devices:
            raise ValueError(f"device {name!r} registered twice")
        if capacity < 1 or not service_us > 0:
            raise ValueError(f"{name}: capacity must be >= 1 and service_us > 0")
        self._devices[name] = _Device(name, frozenset(models), capacity, service_us * 1e3)

    @property
    def models(self) -> frozenset[str]:
        return frozenset().union(*(d.models for d in self._devices.values()))

    # ------------------------------------------------------------------------ admission
    def admit(self, job: Job[P]) -> list[Job[P]]:
        """Queue ``job`` on the device with the earliest estimated completion.

        Returns the jobs it superseded (queued frames of the same stream), which the caller
        answers as cancelled. A refused job supersedes nothing: the stream's queued frame stays.

        Raises:
            NotFound: no device holds ``job.model``.
            Overloaded: every device holding the model has a full queue.
            ValueError: ``job.id`` is already queued.
        """
        if job.id in self._jobs:
            raise ValueError(f"request id {job.id} is already queued")
        candidates = [d for d in self._devices.values() if job.model in d.models]
        if not candidates:
            raise NotFound(f"no device serves model {job.model!r}", request_id=job.id)
        now = self._clock()
        # The stream's queued frame (if any) is superseded only once the new one is sure to be
        # admitted: a refused new frame leaves the old one queued, to be answered as usual.
        old = self._jobs.get(self._streams[job.stream]) if job.stream in self._streams else None

        def free(d: _Device) -> int:
            return d.capacity - d.depth + (old is not None and old.device == d.name)

        open_ = [d for d in candidates if free(d) > 0]
        if not open_:
            raise Overloaded(
                f"all queues for model {job.model!r} are full "
                f"({', '.join(f'{d.name} {d.depth}/{d.capacity}' for d in candidates)})",
                request_id=job.id,
            )
        superseded: list[Job[P]] = []
        if old is not None:
            self._remove(old.id)
            superseded.append(old)
        best = min(open_, key=lambda d: (self._completion(d, now), d.name))
        job.device = best.name
        job.admitted_ns = now
        job.estimate_ns = int(best.service_ns)
        job._seq = next(self._seq)
        heapq.heappush(best.heap, (-job.priority, job.deadline_ns, job._seq, job.id))
        best.depth += 1
        best.queued_work_ns += job.estimate_ns
        self._jobs[job.id] = job
        if job.stream is not None:
            self._streams[job.stream] = job.id
        return superseded

    def _completion(self, d: _Device, now: int) -> float:
        remaining = sum(max(start + est - now, 0) for start, est in d.running.values())
        return remaining + d.queued_work_ns + d.service_ns

    # ------------------------------------------------------------------------ dispatch
    def next_job(self, device: str) -> tuple[Job[P] | None, list[Job[P]]]:
        """The next job for ``device`` to run now, and the expired jobs skipped on the way.

        A returned job counts as in flight on ``device`` until :meth:`finished`.
        """
        d = self._devices[device]
        now = self._clock()
        expired: list[Job[P]] = []
        while d.heap:
            _, deadline, seq, job_id = heapq.heappop(d.heap)
            job = self._jobs.get(job_id)
            if job is None or job._seq != seq:
                continue  # removed while queued
            self._take(job)
            if deadline <= now:
                expired.append(job)
                continue
            d.running[job.id] = (now, job.estimate_ns)
            return job, expired
        return None, expired

    def finished(self, device: str, job: Job[P], device_us: float | None) -> None:
        """``job`` left ``device``; ``device_us`` (None on failure) updates the estimate."""
        d = self._devices[device]
        d.running.pop(job.id, None)
        if device_us is not None and device_us > 0:
            d.service_ns += self._alpha * (device_us * 1e3 - d.service_ns)
            d.completed += 1

    def expire(self) -> list[Job[P]]:
        """Remove and return every queued job whose deadline has passed."""
        now = self._clock()
        gone = [j for j in self._jobs.values() if j.deadline_ns <= now]
        for job in gone:
            self._remove(job.id)
        return gone

    def earliest_deadline(self) -> int | None:
        """The nearest deadline of any queued job (for the expiry timer), or None."""
        return min((j.deadline_ns for j in self._jobs.values()), default=None)

    def cancel(self, request_id: int) -> Job[P]:
        """Remove a queued job and return it.

        Raises:
            NotFound: the id is not queued (unknown, already running or already answered).
        """
        job = self._remove(request_id)
        if job is None:
            raise NotFound(f"request {request_id} is not queued", request_id=request_id)
        return job

    def drain(self) -> list[Job[P]]:
        """Remove and return every queued job (shutdown: they are answered SHUTTING_DOWN)."""
        jobs = list(self._jobs.values())
        for job in jobs:
            self._remove(job.id)
        return jobs

    # ------------------------------------------------------------------------ state
    def queued(self, device: str | None = None) -> int:
        if device is None:
            return len(self._jobs)
        return self._devices[device].depth

    def streams_waiting(self) -> int:
        """Camera streams with a frame queued (each holds at most one: latest frame wins)."""
        return len(self._streams)

    def in_flight(self, device: str) -> int:
        return len(self._devices[device].running)

    def snapshot(self) -> Sequence[DeviceSnapshot]:
        return [
            DeviceSnapshot(
                d.name, d.depth, d.capacity, len(d.running), d.service_ns / 1e3, d.completed
            )
            for d in self._devices.values()
        ]

    def _remove(self, job_id: int) -> Job[P] | None:
        job = self._jobs.get(job_id)
        if job is None:
            return None
        d = self._take(job)
        # Compact when stale entries dominate, so the heap stays O(capacity).
        if len(d.heap) > 2 * d.capacity:
            d.heap = [e for e in d.heap if e[3] in self._jobs and self._jobs[e[3]]._seq == e[2]]
            heapq.heapify(d.heap)
        return job

    def _take(self, job: Job[P]) -> _Device:
        """Account for ``job`` leaving its queue (its heap entry, if any, goes stale)."""
        d = self._devices[job.device]
        d.depth -= 1
        d.queued_work_ns -= job.estimate_ns
        del self._jobs[job.id]
        if job.stream is not None and self._streams.get(job.stream) == job.id:
            del self._streams[job.stream]
        return d
