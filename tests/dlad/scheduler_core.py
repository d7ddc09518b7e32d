"""The tests' handle on the scheduler's C++ core (``dlad._native.Scheduler``, ``dlad/native/``).

The core holds jobs by id and is told the time at every call. :class:`Scheduler` keeps the queued
:class:`Job` objects and sets on each what the core decided (device, admission time, place in
arrival order), reads the time from the test's clock, and raises the core's refusals as
:mod:`dlad.errors` exceptions. Test code: the daemon drives the core its own way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

from dlad import _native
from dlad.errors import DeviceFailed, NotFound, Overloaded

Policy = Literal["throughput", "latency", "static"]
POLICIES: Final[tuple[Policy, ...]] = ("throughput", "latency", "static")
LEARN_CLAMP: Final = 4.0
"""The most one service-time sample counts for, times the estimate (``kLearnClamp``)."""

_REFUSED: Final = {1: NotFound, 2: DeviceFailed, 3: Overloaded}  # dlad::Refusal; 4: a queued id


@dataclass(eq=False)
class Job:
    """A request; ``device``, ``admitted_ns`` and ``seq`` (arrival order) are set when queued."""

    id: int
    model: str
    deadline_ns: int
    priority: int = 0
    stream: str | None = None
    owner: str = ""
    device: str = ""
    admitted_ns: int = 0
    seq: int = 0


class Batch(NamedTuple):
    """Run ``jobs`` now; answer ``expired``; with no jobs, ask again at ``wait_until_ns``."""

    jobs: list[Job]
    expired: list[Job]
    wait_until_ns: int | None


class DeviceSnapshot(NamedTuple):
    name: str
    queue_depth: int
    capacity: int
    in_flight: int
    service_time_us: float  # at batch 1
    completed: int
    max_batch: int
    batches: tuple[int, ...]  # [i]: batches of i + 1 jobs that ran
    available: bool
    host_us: float  # host CPU a frame, learned (0: none yet)
    resource: str  # the host resource its frames use


class Scheduler:
    """The core on ``clock`` (monotonic ns). ``interference``: (victim kind, aggressor kind) ->
    k; ``pins``: stream -> device, for the ``static`` policy."""

    def __init__(
        self,
        clock: Callable[[], int],
        *,
        alpha: float = 0.2,
        policy: Policy = "latency",
        interference: Mapping[tuple[str, str], float] | None = None,
        pins: Mapping[str, str] | None = None,
    ) -> None:
        self._clock = clock
        terms = [(victim, aggressor, k) for (victim, aggressor), k in (interference or {}).items()]
        self._core = _native.Scheduler(alpha, policy, terms, dict(pins or {}))
        self._jobs: dict[int, Job] = {}  # queued

    def add_device(
        self,
        name: str,
        models: Iterable[str],
        *,
        capacity: int,
        service_us: float,
        max_batch: int = 1,
        batch_service_us: Mapping[int, float] | None = None,
        tier: int = 0,
        kind: str = "",
    ) -> None:
        """``service_us`` at batch 1 and ``batch_service_us`` (size -> µs) seed its curve."""
        known = {b: t * 1e3 for b, t in {1: service_us, **(batch_service_us or {})}.items()}
        self._core.add_device(name, sorted(set(models)), capacity, max_batch, known, tier, kind)

    def _queue(self, job: Job, placed: tuple[str, int, int, int]) -> None:
        job.device, job.admitted_ns, _, job.seq = placed
        self._jobs[job.id] = job

    def admit(self, job: Job, *, avoid: Collection[str] = ()) -> list[Job]:
        """Queues ``job``; returns the queued frame of its stream that it superseded, if any.
        Raises NotFound, DeviceFailed or Overloaded, and ValueError for an id queued already."""
        code, placed, detail, full = self._core.admit(
            job.id, job.model, job.deadline_ns, job.priority, job.stream, job.owner,
            list(avoid), self._clock(),
        )  # fmt: skip
        if code == 0:
            superseded = [self._jobs.pop(i) for i in detail]
            self._queue(job, placed)
            return superseded
        if code in _REFUSED:  # with the devices quarantined or avoided, or full
            raise _REFUSED[code](f"model {job.model!r}: {detail or full}", request_id=job.id)
        raise ValueError(f"request id {job.id} is already queued")

    def displace_for(self, job: Job) -> Job | None:
        """Removes and returns the queued job that ``job`` takes the place of (fair shares)."""
        victim = self._core.displace_for(
            job.id, job.model, job.deadline_ns, job.priority, job.stream, job.owner
        )
        return None if victim is None else self._jobs.pop(victim)

    def pinned(self, stream: str, owner: str = "") -> str | None:
        return self._core.pinned(stream, owner)

    def next_job(self, device: str) -> tuple[Job | None, list[Job]]:
        head, expired = self._core.next_job(device, self._clock())
        pop = self._jobs.pop
        return (None if head is None else pop(head)), [pop(i) for i in expired]

    def next_batch(
        self, device: str, *, max_batch: int | None = None, max_queue_delay_us: float = 0.0
    ) -> Batch:
        jobs, expired, wait = self._core.next_batch(
            device, max_batch, max_queue_delay_us, self._clock()
        )
        pop = self._jobs.pop
        return Batch([pop(i) for i in jobs], [pop(i) for i in expired], wait)

    def finished(self, device: str, job: Job, device_us: float | None) -> None:
        self._core.finished(device, job.id, device_us)

    def finished_batch(self, device: str, jobs: Sequence[Job], device_us: float | None) -> None:
        self._core.finished_batch(device, [j.id for j in jobs], device_us)

    def set_resource(self, device: str, resource: str) -> None:
        self._core.set_resource(device, resource)

    def host(self, device: str, frames: int, host_us: float) -> None:
        """``host_us`` of host CPU went into ``frames`` frames of ``device``."""
        self._core.host(device, frames, host_us * 1e3)

    def set_load(self, resource: str, fraction: float) -> None:
        self._core.set_load(resource, fraction)

    def set_available(self, device: str, available: bool) -> list[Job]:
        return [self._jobs.pop(i) for i in self._core.set_available(device, available)]

    def available(self, device: str) -> bool:
        return self._core.available(device)

    def admit_probe(self, device: str, job: Job) -> None:
        """Queues ``job`` on ``device`` whatever its availability or queue (a health probe)."""
        job.stream = None
        placed = self._core.admit_probe(
            device, job.id, job.model, job.deadline_ns, job.priority, job.owner, self._clock()
        )
        if placed is None:
            raise ValueError(f"request id {job.id} is already queued")
        self._queue(job, placed)

    def expire(self) -> list[Job]:
        return [self._jobs.pop(i) for i in self._core.expire(self._clock())]

    def earliest_deadline(self) -> int | None:
        return self._core.earliest_deadline()

    def cancel(self, request_id: int) -> Job:
        if not self._core.cancel(request_id):
            raise NotFound(f"request {request_id} is not queued", request_id=request_id)
        return self._jobs.pop(request_id)

    def drain(self) -> list[Job]:
        return [self._jobs.pop(i) for i in self._core.drain()]

    def queued(self, device: str | None = None) -> int:
        return self._core.queued(device)

    def has_queued(self, stream: str | None, owner: str = "") -> bool:
        return self._core.has_queued(stream, owner)

    def streams_waiting(self) -> int:
        return self._core.streams_waiting()

    def in_flight(self, device: str) -> int:
        return self._core.in_flight(device)

    def service_us(self, device: str, batch: int = 1) -> float:
        return self._core.service_us(device, batch)

    def snapshot(self) -> list[DeviceSnapshot]:
        return [DeviceSnapshot(*s) for s in self._core.snapshot()]
