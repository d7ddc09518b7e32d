"""The scheduler's C++ core (``dlad/native/``) behind :class:`dlad.scheduler.Scheduler`'s interface.

:class:`NativeScheduler` makes the same decisions as the Python scheduler, to the last bit of
every estimate (``tests/dlad/test_native_scheduler.py`` drives both through random operation
sequences and requires the same answers and state). The core holds jobs by id and what placement
reads of them; this wrapper keeps the queued :class:`~dlad.scheduler.Job` objects, sets on them
what the core decided (device, admission time, estimate), and raises the Python scheduler's
errors with its words.

The core is built by ``pip install`` where a C++ compiler is found (``setup.py``); :func:`available`
says whether it was, and :func:`make_scheduler` picks it or the Python scheduler
(``[scheduler] core``).
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeAlias

from dlad.errors import DeviceFailed, NotFound, Overloaded
from dlad.scheduler import (
    Batch,
    Clock,
    DeviceSnapshot,
    Job,
    P,
    Policy,
    Scheduler,
    already_queued,
    check_alpha_policy,
    no_device_serves,
    no_healthy_device,
    not_queued,
    queues_full,
    seed_curve,
)

if TYPE_CHECKING:
    from dlad import _native

Core = Literal["auto", "native", "python"]
"""``[scheduler] core``: the C++ core where it was built (``auto``), the C++ core or an error
(``native``), the Python scheduler (``python``)."""
CORES: Final[tuple[Core, ...]] = ("auto", "native", "python")

_OK, _NOT_FOUND, _DEVICE_FAILED, _OVERLOADED, _DUPLICATE = range(5)  # dlad::Refusal


def _load() -> Any:
    try:
        return importlib.import_module("dlad._native")
    except ImportError:
        return None


_NATIVE: Final = _load()


def available() -> bool:
    """Whether this install has the C++ core (``pip install`` found a C++ compiler)."""
    return _NATIVE is not None


class NativeUnavailable(RuntimeError):
    """``[scheduler] core = "native"`` on an install built without a C++ compiler."""


class NativeScheduler(Generic[P]):
    """:class:`dlad.scheduler.Scheduler` (same arguments, methods and errors) on the C++ core."""

    def __init__(
        self,
        clock: Clock,
        *,
        alpha: float = 0.2,
        policy: Policy = "latency",
        interference: Mapping[tuple[str, str], float] | None = None,
        pins: Mapping[str, str] | None = None,
    ) -> None:
        if _NATIVE is None:
            raise NativeUnavailable("dlad was installed without its C++ scheduler core")
        check_alpha_policy(alpha, policy)
        self._clock = clock
        terms = [(victim, aggressor, k) for (victim, aggressor), k in (interference or {}).items()]
        self._core: _native.Scheduler = _NATIVE.Scheduler(alpha, policy, terms, dict(pins or {}))
        self._jobs: dict[int, Job[P]] = {}  # queued only
        self._names: set[str] = set()

    @property
    def policy(self) -> Policy:
        return self._core.policy  # type: ignore[return-value]  # one of POLICIES

    @policy.setter
    def policy(self, policy: Policy) -> None:
        check_alpha_policy(1.0, policy)
        self._core.policy = policy

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
        """See :meth:`dlad.scheduler.Scheduler.add_device`."""
        if name in self._names:
            raise ValueError(f"device {name!r} registered twice")
        known = seed_curve(name, capacity, service_us, max_batch, batch_service_us)
        self._core.add_device(name, sorted(set(models)), capacity, max_batch, known, tier, kind)
        self._names.add(name)

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self._core.models())

    def _placed(self, job: Job[P], placed: tuple[str, int, int, int]) -> None:
        job.device, job.admitted_ns, job.estimate_ns, job._seq = placed
        self._jobs[job.id] = job

    def admit(self, job: Job[P], *, avoid: Collection[str] = ()) -> list[Job[P]]:
        """See :meth:`dlad.scheduler.Scheduler.admit`."""
        code, placed, detail, full = self._core.admit(
            job.id, job.model, job.deadline_ns, job.priority, job.stream, job.owner,
            list(avoid), self._clock(),
        )  # fmt: skip
        if code == _OK:
            superseded = [self._jobs.pop(i) for i in detail]
            self._placed(job, placed)
            return superseded
        if code == _NOT_FOUND:
            raise NotFound(no_device_serves(job.model), request_id=job.id)
        if code == _DEVICE_FAILED:
            raise DeviceFailed(no_healthy_device(job.model, detail), request_id=job.id)
        if code == _OVERLOADED:
            raise Overloaded(queues_full(job.model, full), request_id=job.id)
        raise ValueError(already_queued(job.id))

    def displace_for(self, job: Job[P]) -> Job[P] | None:
        """See :meth:`dlad.scheduler.Scheduler.displace_for`."""
        victim = self._core.displace_for(
            job.id, job.model, job.deadline_ns, job.priority, job.stream, job.owner
        )
        return None if victim is None else self._jobs.pop(victim)

    def pinned(self, stream: str, owner: str = "") -> str | None:
        return self._core.pinned(stream, owner)

    def next_job(self, device: str) -> tuple[Job[P] | None, list[Job[P]]]:
        """See :meth:`dlad.scheduler.Scheduler.next_job`."""
        head, expired = self._core.next_job(device, self._clock())
        pop = self._jobs.pop
        return (None if head is None else pop(head)), [pop(i) for i in expired]

    def next_batch(
        self, device: str, *, max_batch: int | None = None, max_queue_delay_us: float = 0.0
    ) -> Batch[P]:
        """See :meth:`dlad.scheduler.Scheduler.next_batch`."""
        jobs, expired, wait = self._core.next_batch(
            device, max_batch, max_queue_delay_us, self._clock()
        )
        pop = self._jobs.pop
        return Batch([pop(i) for i in jobs], [pop(i) for i in expired], wait)

    def finished(self, device: str, job: Job[P], device_us: float | None) -> None:
        self._core.finished(device, job.id, device_us)

    def finished_batch(self, device: str, jobs: Sequence[Job[P]], device_us: float | None) -> None:
        self._core.finished_batch(device, [j.id for j in jobs], device_us)

    def set_available(self, device: str, available: bool) -> list[Job[P]]:
        """See :meth:`dlad.scheduler.Scheduler.set_available`."""
        return [self._jobs.pop(i) for i in self._core.set_available(device, available)]

    def available(self, device: str) -> bool:
        return self._core.available(device)

    def admit_probe(self, device: str, job: Job[P]) -> None:
        """See :meth:`dlad.scheduler.Scheduler.admit_probe`."""
        try:
            placed = self._core.admit_probe(
                device, job.id, job.model, job.deadline_ns, job.priority, job.owner, self._clock()
            )
        except KeyError:  # an unknown device: the probe was no stream's frame already
            job.stream = None
            raise
        if placed is None:
            raise ValueError(already_queued(job.id))
        job.stream = None
        self._placed(job, placed)

    def expire(self) -> list[Job[P]]:
        return [self._jobs.pop(i) for i in self._core.expire(self._clock())]

    def earliest_deadline(self) -> int | None:
        return self._core.earliest_deadline()

    def cancel(self, request_id: int) -> Job[P]:
        """See :meth:`dlad.scheduler.Scheduler.cancel`."""
        if not self._core.cancel(request_id):
            raise NotFound(not_queued(request_id), request_id=request_id)
        return self._jobs.pop(request_id)

    def drain(self) -> list[Job[P]]:
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

    def snapshot(self) -> Sequence[DeviceSnapshot]:
        return [DeviceSnapshot(*s) for s in self._core.snapshot()]


Scheduling: TypeAlias = "Scheduler[P] | NativeScheduler[P]"
"""What the daemon's modules hold: either implementation (the same methods and decisions)."""


def make_scheduler(
    core: Core,
    clock: Clock,
    *,
    alpha: float = 0.2,
    policy: Policy = "latency",
    interference: Mapping[tuple[str, str], float] | None = None,
    pins: Mapping[str, str] | None = None,
) -> Scheduling[Any]:
    """The scheduler ``core`` names: ``native`` (raises :class:`NativeUnavailable` where it was
    not built), ``python``, or ``auto`` (native where built)."""
    if core not in CORES:
        raise ValueError(f"core must be one of {', '.join(CORES)}, got {core!r}")
    kwargs = {"alpha": alpha, "policy": policy, "interference": interference, "pins": pins}
    if core == "native" or (core == "auto" and available()):
        return NativeScheduler(clock, **kwargs)  # type: ignore[arg-type]
    return Scheduler(clock, **kwargs)  # type: ignore[arg-type]
