"""Admission, queues, deadlines, priorities, per-stream freshness, placement and batches.

The scheduler is a plain, synchronous object owned by the event loop (one owner: it is never
touched from a device thread). Executors ask it for their next job, or their next batch; the
frontend admits requests into it. It never blocks and never grows without bound:

- **Admission** places a job on one device's bounded queue, or refuses it at once with
  :class:`~dlad.errors.Overloaded` (every queue that could take it is full) — "full" is an
  answer, never growth.
- **Placement** estimates, for each device that holds the job's model, when the job would finish
  there: ``now + in flight(device) + work(queued + this job)``. The policy then picks:
  ``latency``, the earliest — or, where the devices slow each other (``interference``: the Orin's
  shared DRAM), among those that meet the job's deadline, the one where the job's completion plus
  the delay it inflicts on the jobs of the other devices is least, so a busy GPU is not slowed by
  DLA work it could have done itself; ``throughput``, the lowest *tier* (the DLA cores before the
  GPU) among the devices estimated to finish by the job's deadline, earliest first, and the
  earliest overall when none would; ``static``, a stream's frames all go to the device the stream
  was pinned to at its first frame (its device in ``pins``, as configured by hand, else the device
  with the fewest pinned streams per unit of speed; a full queue there is OVERLOADED, it does not
  spill), other frames as ``latency``.
- **Service time.** A device's service time is a function of the batch size, seeded at
  registration (a DLA: its modelled latency at batch 1; a GPU: a batch curve) and learned online
  from completions (an exponentially weighted mean per batch size; sizes never seen are
  interpolated). The queued work of a batching device counts its queue in batches of its
  ``max_batch``. A faster, idler or better-batching device therefore gets more of the load, and two
  equal DLA cores share it evenly.
- **Order** within a device queue: higher priority first, then earlier deadline, then arrival.
- **Batches** (:meth:`next_batch`): up to ``max_batch`` jobs of one model, in queue order. A
  partial batch waits for more jobs at most ``max_queue_delay_us`` after its first job was
  admitted, and never past the point where a full batch could still finish by the earliest
  deadline in it; until then the executor is told when to come back.
- **Deadlines** are checked when a job is dispatched: a job whose deadline has passed is never
  executed; it comes back as expired (the daemon answers DEADLINE_EXCEEDED). Expired jobs are
  also swept from the queues by :meth:`Scheduler.expire`, so they do not hold queue slots.
- **Streams**: a new frame of a camera stream supersedes the stream's frame still queued
  ("latest frame wins"); the superseded one comes back as cancelled.
- **Cancel** removes a queued job (a job already on a device runs to completion).

Every admitted job leaves the scheduler exactly once, through exactly one of: dispatch
(:meth:`next_job` / :meth:`next_batch`), expiry, cancellation (explicit or superseded), or
:meth:`drain`. The property tests in ``tests/dlad/test_scheduler.py`` check this and the bounds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, Literal, TypeVar

from dlad.curves import interpolate
from dlad.errors import DeviceFailed, NotFound, Overloaded

P = TypeVar("P")
Clock = Callable[[], int]
"""Monotonic nanoseconds (``time.monotonic_ns`` in the daemon; a virtual clock in tests)."""
Policy = Literal["throughput", "latency", "static"]
"""How a job's device is chosen (the module docstring; ``[scheduler] policy``)."""
POLICIES: Final[tuple[Policy, ...]] = ("throughput", "latency", "static")
MAX_PINNED_STREAMS: Final = 4096
"""``static`` remembers this many streams' devices, forgetting the least recently seen."""


# The scheduler's checks and its refusals' words, shared with the C++ core's wrapper
# (dlad/native_scheduler.py), so both implementations answer a client alike.
def check_alpha_policy(alpha: float, policy: str) -> None:
    """Raises ValueError for an ``alpha`` outside (0, 1] or an unknown ``policy``."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def seed_curve(
    name: str,
    capacity: int,
    service_us: float,
    max_batch: int,
    batch_service_us: Mapping[int, float] | None,
) -> dict[int, float]:
    """A device's first service-time curve in ns by batch size (``add_device``'s arguments);
    raises ValueError for a capacity or max_batch below 1, a non-positive time or batch size."""
    curve = {
        1: float(service_us),
        **{int(b): float(t) for b, t in (batch_service_us or {}).items()},
    }
    if capacity < 1 or max_batch < 1 or not all(t > 0 for t in curve.values()):
        raise ValueError(f"{name}: capacity and max_batch must be >= 1, service times > 0")
    if not all(b >= 1 for b in curve):
        raise ValueError(f"{name}: batch sizes must be >= 1")
    return {b: t * 1e3 for b, t in curve.items()}


def no_device_serves(model: str) -> str:
    return f"no device serves model {model!r}"


def no_healthy_device(model: str, devices: Iterable[tuple[str, bool]]) -> str:
    """``devices``: each device serving ``model``, and whether the retry avoided it."""
    why = ", ".join(f"{n} {'failed it' if avoided else 'quarantined'}" for n, avoided in devices)
    return f"no healthy device serves model {model!r} now ({why})"


def queues_full(model: str, queues: Iterable[tuple[str, int, int]]) -> str:
    """``queues``: (device, depth, capacity) of each device that could have taken the job."""
    return (f"all queues for model {model!r} are full "
            f"({', '.join(f'{n} {depth}/{cap}' for n, depth, cap in queues)})")  # fmt: skip


def already_queued(job_id: int) -> str:
    return f"request id {job_id} is already queued"


def not_queued(request_id: int) -> str:
    return f"request {request_id} is not queued"


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
    owner: str = ""  # who asked (the frontend's client identity): streams and shares are per owner
    admitted_ns: int = 0
    device: str = ""
    estimate_ns: int = 0
    _seq: int = 0


@dataclass(frozen=True)
class Batch(Generic[P]):
    """What :meth:`Scheduler.next_batch` hands an executor.

    ``jobs``: run these now, as one batch (empty: nothing to run yet). ``expired``: jobs whose
    deadline passed while queued, to be answered as such. ``wait_until_ns``: when ``jobs`` is
    empty but a partial batch is waiting to fill, the monotonic time to ask again (a new job
    for the device may make it sooner); None when nothing is queued.
    """

    jobs: list[Job[P]]
    expired: list[Job[P]]
    wait_until_ns: int | None = None


LEARN_CLAMP: Final = 4.0
"""The most one service-time sample counts for, as a multiple of the current estimate."""


@dataclass
class _Curve:
    """Service time (ns) by batch size: seeded, then learned per size; others interpolated.
    ``known`` always holds batch size 1 (the hot path reads ``known[1]`` directly)."""

    known: dict[int, float]
    alpha: float

    def __call__(self, size: int) -> float:
        known = self.known.get(size)  # a size seen or seeded (a DLA's 1: every call)
        return known if known is not None else interpolate(self.known, size)

    def learn(self, size: int, measured_ns: float) -> None:
        """Move the estimate at ``size`` toward ``measured_ns``; a sample beyond
        :data:`LEARN_CLAMP` times the estimate (either way) counts as that much, so that one
        outlier (a cold cache, a worker thread spawned) cannot make a device look so slow that
        it never gets the frame that would correct it."""
        old = self.known.get(size)
        if old is None:
            old = interpolate(self.known, size)
        sample = min(max(measured_ns, old / LEARN_CLAMP), old * LEARN_CLAMP)
        self.known[size] = old + self.alpha * (sample - old)


@dataclass
class _Device:
    name: str
    models: frozenset[str]
    capacity: int
    max_batch: int
    curve: _Curve
    tier: int = 0
    kind: str = ""
    pinned: int = 0  # streams pinned to it (policy static)
    available: bool = True  # in placement (False: quarantined, see set_available)
    fail_rate: float = 0.0  # exponentially weighted fraction of its tasks that failed
    # (-priority, deadline, arrival sequence, job id); entries of removed jobs are skipped
    # lazily and compacted away when they outnumber the live ones.
    heap: list[tuple[int, int, int, int]] = field(default_factory=list)
    depth: int = 0
    running: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # id -> start, est, task
    completed: int = 0
    batches: list[int] = field(default_factory=list)  # [i]: batches of i + 1 jobs that ran
    seed: _Curve = field(init=False)  # the registered (modelled or measured) curve, not learned

    def __post_init__(self) -> None:
        self.batches = [0] * self.max_batch
        self.seed = _Curve(dict(self.curve.known), self.curve.alpha)

    def work_ns(self, jobs: int, curve: _Curve | None = None) -> float:
        """The estimated time to serve ``jobs`` queued jobs in batches of ``max_batch`` (on the
        learned curve, or ``curve``)."""
        if jobs <= 0:
            return 0.0
        c = curve or self.curve
        if self.max_batch == 1:
            return jobs * c.known[1]
        full, rest = divmod(jobs, self.max_batch)
        return full * c(self.max_batch) + (c(rest) if rest else 0.0)


@dataclass(frozen=True)
class DeviceSnapshot:
    """What STATUS reports about one device's queue."""

    name: str
    queue_depth: int
    capacity: int
    in_flight: int
    service_time_us: float  # at batch 1
    completed: int
    max_batch: int = 1
    batches: tuple[int, ...] = ()  # [i]: batches of i + 1 jobs that ran (since start)
    available: bool = True  # False while quarantined (out of placement)


class Scheduler(Generic[P]):
    """Bounded per-device queues with deadline-aware, priority-ordered dispatch and batches.

    Args:
        clock: monotonic nanoseconds.
        alpha: weight of a new measurement in the service-time estimates (0 < alpha <= 1).
        policy: how a job's device is chosen (the module docstring).
        interference: ``(victim kind, aggressor kind) -> k``: while a device of the aggressor's
            kind runs, one of the victim's runs ``k`` slower (the SoC's shared DRAM; the daemon
            passes ``dlad.devices.dram``'s coefficients times ``[soc] dram_contention``). The
            ``latency`` policy then weighs what a job delays on the other devices.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        alpha: float = 0.2,
        policy: Policy = "latency",
        interference: Mapping[tuple[str, str], float] | None = None,
        pins: Mapping[str, str] | None = None,
    ) -> None:
        check_alpha_policy(alpha, policy)
        self._clock = clock
        self._alpha = alpha
        self.policy: Policy = policy
        self._interference = {k: v for k, v in (interference or {}).items() if v > 0}
        self._pins: OrderedDict[tuple[str, str], str] = OrderedDict()  # (owner, stream) -> device
        self._by_hand = dict(pins or {})  # stream -> device, as configured (policy static)
        self._devices: dict[str, _Device] = {}
        self._serving: dict[str, list[_Device]] = {}  # model -> the devices holding it
        # device -> (each other device, interference[its kind, this one's kind]) where above 0
        self._victims: dict[str, list[tuple[_Device, float]]] = {}
        self._jobs: dict[int, Job[P]] = {}  # queued only
        self._streams: dict[tuple[str, str], int] = {}  # (owner, stream) -> queued job id
        self._owned: Counter[str] = Counter()  # owner -> jobs queued
        self._seq = itertools.count()
        self._tasks = itertools.count()
        self._out = 0  # devices out of placement (set_available)

    # ------------------------------------------------------------------------ configuration
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
        """Register a device that serves ``models`` with a queue of ``capacity`` jobs, taking
        batches of up to ``max_batch``; ``service_us`` is its first estimate at batch 1 and
        ``batch_service_us`` (batch size -> µs) at other sizes. The ``throughput`` policy
        prefers lower ``tier`` s (the daemon: 0 for a DLA core, 1 for the GPU); ``kind``
        (``dla``, ``gpu``) keys the ``interference`` coefficients.

        Raises:
            ValueError: a duplicate name, a capacity or max_batch below 1, or a non-positive
                service time.
        """
        if name in self._devices:
            raise ValueError(f"device {name!r} registered twice")
        known = seed_curve(name, capacity, service_us, max_batch, batch_service_us)
        self._devices[name] = _Device(
            name, frozenset(models), capacity, max_batch, _Curve(known, self._alpha), tier, kind
        )
        # What admission reads for every job, kept as the devices are registered.
        devices = list(self._devices.values())
        self._serving = {m: [d for d in devices if m in d.models] for m in self.models}
        self._victims = {
            d.name: [(e, k) for e in devices if e is not d
                     and (k := self._interference.get((e.kind, d.kind), 0.0)) > 0]
            for d in devices
        }  # fmt: skip

    @property
    def models(self) -> frozenset[str]:
        return frozenset().union(*(d.models for d in self._devices.values()))

    # ------------------------------------------------------------------------ admission
    def admit(self, job: Job[P], *, avoid: Collection[str] = ()) -> list[Job[P]]:
        """Queue ``job`` on the device with the earliest estimated completion.

        Returns the jobs it superseded (queued frames of the same stream), which the caller
        answers as cancelled. A refused job supersedes nothing: the stream's queued frame stays.

        Devices out of placement (:meth:`set_available`) and those named in ``avoid`` (a retry
        avoids the device that failed it) are not considered.

        Raises:
            NotFound: no device holds ``job.model``.
            DeviceFailed: every device holding it is quarantined or avoided.
            Overloaded: every device that could take it has a full queue.
            ValueError: ``job.id`` is already queued.
        """
        if job.id in self._jobs:
            raise ValueError(already_queued(job.id))
        serving = self._serving.get(job.model)
        if not serving:
            raise NotFound(no_device_serves(job.model), request_id=job.id)
        if avoid or self._out:
            candidates = [d for d in serving if d.available and d.name not in avoid]
        else:
            candidates = serving  # every device in placement (admission's common case)
        if not candidates:
            raise DeviceFailed(
                no_healthy_device(job.model, [(d.name, d.name in avoid) for d in serving]),
                request_id=job.id,
            )
        key = None if job.stream is None else (job.owner, job.stream)
        if self.policy == "static" and key is not None:
            candidates = [self._pinned(key, candidates)]
        now = self._clock()
        # The stream's queued frame (if any) is superseded only once the new one is sure to be
        # admitted: a refused new frame leaves the old one queued, to be answered as usual.
        old = self._jobs.get(self._streams[key]) if key in self._streams else None
        # a device's free places (the superseded frame's place counts as free)
        gone = None if old is None else old.device
        open_ = [d for d in candidates if d.capacity - d.depth + (d.name == gone) > 0]
        if not open_:
            raise Overloaded(
                queues_full(job.model, [(d.name, d.depth, d.capacity) for d in candidates]),
                request_id=job.id,
            )
        superseded: list[Job[P]] = []
        if old is not None:
            self._remove(old.id)
            superseded.append(old)
        self._enqueue(self._choose(job, open_, now), job, now)
        if key is not None:
            self._streams[key] = job.id
        return superseded

    def displace_for(self, job: Job[P]) -> Job[P] | None:
        """Fair shares when the queues are full (``admit`` raised Overloaded for ``job``): the
        newest queued job of the owner holding the most queued jobs, if that owner holds at
        least two more than ``job``'s and the job waits, at no higher priority, where ``job``
        could go. It is removed and returned (the caller answers it OVERLOADED and admits
        ``job``); None when the queues are shared fairly already."""
        places = {d.name for d in self._devices.values() if job.model in d.models and d.available}
        if not places:
            return None
        if self.policy == "static" and job.stream is not None:
            places &= {
                self._pinned((job.owner, job.stream), [self._devices[n] for n in places]).name
            }
        mine = self._owned.get(job.owner, 0)
        victim: Job[P] | None = None
        for other in self._jobs.values():
            held = self._owned[other.owner]
            if (other.device in places and other.priority <= job.priority and other.id >= 0
                    and held >= mine + 2 and (victim is None
                    or (held, other._seq) > (self._owned[victim.owner], victim._seq))):  # fmt: skip
                victim = other
        if victim is not None:
            self._remove(victim.id)
        return victim

    def pinned(self, stream: str, owner: str = "") -> str | None:
        """The device ``owner``'s ``stream`` is pinned to (policy ``static``), or None."""
        return self._pins.get((owner, stream))

    def _choose(self, job: Job[P], open_: Sequence[_Device], now: int) -> _Device:
        # Each device's work in flight, read once (the interference term reads the others').
        flying = self._devices.values() if self._interference else open_
        left = {d.name: self._in_flight_ns(d, now) for d in flying}
        policy, interference = self.policy, bool(self._interference)
        best: _Device | None = None
        best_key: tuple[bool | float | int | str, ...] = ()
        for d in open_:
            # A device whose tasks fail needs 1 / (1 - f) attempts a success: it must not win
            # frames because failing is quick.
            end = (left[d.name] + d.work_ns(d.depth + 1)) / (1 - min(d.fail_rate, 0.95))
            late = now + end > job.deadline_ns
            if policy == "throughput":
                key: tuple[bool | float | int | str, ...] = (late, d.tier, end, d.name)
            elif not interference:
                key = (end, d.name)
            else:
                key = (late, end + self._induced_ns(d, left), d.name)
            if best is None or key < best_key:
                best, best_key = d, key
        assert best is not None  # open_ is never empty
        return best

    def _induced_ns(self, d: _Device, left: Mapping[str, float]) -> float:
        """How much a job placed on ``d`` delays the jobs of the other devices, summed: while
        ``d`` runs the extra time the job costs it, each other device with work outstanding runs
        ``interference[its kind, d's kind]`` slower, which pushes back every job it holds
        (first order: the overlap times the coefficient, per job held). The extra time is on
        ``d``'s registered curve (the engine's modelled or measured work), not the learned one:
        what an emulated core spends computing on the host beyond its model contends for no
        DRAM. ``left``: each device's work in flight (:meth:`_in_flight_ns`)."""
        if d.max_batch == 1:  # a job more is one task more
            extra = d.seed.known[1]
        else:
            extra = d.work_ns(d.depth + 1, d.seed) - d.work_ns(d.depth, d.seed)
        total = 0.0
        for e, k in self._victims[d.name]:
            held = e.depth + len(e.running)
            if held:  # until e's current work is done
                queued = e.depth * e.curve.known[1] if e.max_batch == 1 else e.work_ns(e.depth)
                total += held * k * min(extra, left[e.name] + queued)
        return total

    def _pinned(self, stream: tuple[str, str], candidates: Sequence[_Device]) -> _Device:
        """The device ``stream`` is pinned to (pinned now if new, or if its device no longer
        serves the model): its device in ``pins`` if that serves the model, else the fewest
        pinned streams per unit of speed (batches/s at its ``max_batch``)."""
        name = self._pins.get(stream)
        if name is not None and any(d.name == name for d in candidates):
            self._pins.move_to_end(stream)
            return self._devices[name]

        def load(d: _Device) -> float:
            return (d.pinned + 1) * d.curve(d.max_batch) / d.max_batch

        by_hand = [d for d in candidates if d.name == self._by_hand.get(stream[1])]
        chosen = by_hand[0] if by_hand else min(candidates, key=lambda d: (load(d), d.name))
        if name is not None:
            self._devices[name].pinned -= 1
        self._pins[stream] = chosen.name
        self._pins.move_to_end(stream)
        chosen.pinned += 1
        while len(self._pins) > MAX_PINNED_STREAMS:
            _, forgotten = self._pins.popitem(last=False)
            self._devices[forgotten].pinned -= 1
        return chosen

    @staticmethod
    def _in_flight_ns(d: _Device, now: int) -> float:
        """How long from ``now`` until ``d``'s tasks in flight are estimated done (a batch's
        jobs share one task). A job admitted to ``d`` would finish this plus the queue's work
        and its own, in batches, later."""
        if d.max_batch > 1:
            tasks = {task: start + est for start, est, task in d.running.values()}
            return sum(max(end - now, 0) for end in tasks.values())
        left = 0  # a job a task: no task to count once
        for start, est, _ in d.running.values():
            if start + est > now:
                left += start + est - now
        return left

    # ------------------------------------------------------------------------ dispatch
    def next_job(self, device: str) -> tuple[Job[P] | None, list[Job[P]]]:
        """The next job for ``device`` to run now, and the expired jobs skipped on the way.

        A returned job counts as in flight on ``device`` until :meth:`finished`.
        """
        return self._pop(self._devices[device], self._clock())

    def _pop(self, d: _Device, now: int) -> tuple[Job[P] | None, list[Job[P]]]:
        """The head of ``d``'s queue, now in flight, and the expired jobs before it (the DLAs'
        hot path: no batch to assemble)."""
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
            d.running[job.id] = (now, int(d.curve.known[1]), next(self._tasks))
            return job, expired
        return None, expired

    def next_batch(
        self, device: str, *, max_batch: int | None = None, max_queue_delay_us: float = 0.0
    ) -> Batch[P]:
        """The next batch for ``device`` (see :class:`Batch` and the module docstring).

        ``max_batch`` defaults to the device's. Jobs returned count as in flight on ``device``
        until :meth:`finished`. Raises KeyError for an unknown device, ValueError for
        ``max_batch`` below 1 or a negative delay.
        """
        d = self._devices[device]
        size = d.max_batch if max_batch is None else max_batch
        if size < 1 or max_queue_delay_us < 0:
            raise ValueError("max_batch must be >= 1 and max_queue_delay_us >= 0")
        now = self._clock()
        if size == 1:
            head, stale = self._pop(d, now)
            return Batch([] if head is None else [head], stale, None)
        expired: list[Job[P]] = []
        live: list[Job[P]] = []
        for _, deadline, seq, job_id in sorted(d.heap):
            job = self._jobs.get(job_id)
            if job is None or job._seq != seq:
                continue  # removed while queued
            if deadline <= now:
                self._take(job)
                expired.append(job)
            else:
                live.append(job)
        d.heap = [(-j.priority, j.deadline_ns, j._seq, j.id) for j in live]  # sorted: a heap
        if not live:
            return Batch([], expired, None)
        head = live[0]
        chosen = [j for j in live if j.model == head.model][:size]
        if len(chosen) < size:
            full_ns = d.curve(size)
            latest = min(head.admitted_ns + int(max_queue_delay_us * 1e3),
                         *(int(j.deadline_ns - full_ns) for j in chosen))  # fmt: skip
            if now < latest:
                return Batch([], expired, latest)
        task = next(self._tasks)
        est = int(d.curve(len(chosen)))
        for job in chosen:
            self._take(job)
            d.running[job.id] = (now, est, task)
        taken = {j.id for j in chosen}
        d.heap = [e for e in d.heap if e[3] not in taken]
        return Batch(chosen, expired, None)

    def finished(self, device: str, job: Job[P], device_us: float | None) -> None:
        """``job`` left ``device``; ``device_us`` (None on failure) updates the estimate."""
        d = self._devices[device]
        d.running.pop(job.id, None)
        self._learn(d, 1, device_us)

    def finished_batch(self, device: str, jobs: Sequence[Job[P]], device_us: float | None) -> None:
        """A batch left ``device``; ``device_us`` (its device time, None on failure) updates the
        estimate at its size."""
        d = self._devices[device]
        for job in jobs:
            d.running.pop(job.id, None)
        if jobs:
            self._learn(d, len(jobs), device_us)

    def _learn(self, d: _Device, size: int, device_us: float | None) -> None:
        """A task of ``size`` jobs ended on ``d`` (``device_us``: its device time, None if it
        failed): the failure rate, the curve at ``size`` and the counts."""
        d.fail_rate += self._alpha * (float(device_us is None) - d.fail_rate)
        if device_us is not None and device_us > 0:
            d.curve.learn(size, device_us * 1e3)
            d.completed += size
            d.batches[min(size, d.max_batch) - 1] += 1

    def set_available(self, device: str, available: bool) -> list[Job[P]]:
        """Take ``device`` out of placement (quarantine) or put it back. Taking it out removes
        and returns its queued jobs, in queue order, for the caller to place elsewhere (its
        in-flight jobs finish or fail as they will); streams pinned to it are pinned afresh at
        their next frame."""
        d = self._devices[device]
        if d.available != available:
            self._out += -1 if available else 1
        d.available = available
        if available:
            return []
        queued = sorted(
            (j for j in self._jobs.values() if j.device == device),
            key=lambda j: (-j.priority, j.deadline_ns, j._seq),
        )
        for job in queued:
            self._remove(job.id)
        return queued

    def available(self, device: str) -> bool:
        """Whether ``device`` is in placement."""
        return self._devices[device].available

    def admit_probe(self, device: str, job: Job[P]) -> None:
        """Queue ``job`` on ``device`` whatever its availability or queue (a health probe of a
        quarantined device: nothing else reaches it)."""
        if job.id in self._jobs:
            raise ValueError(already_queued(job.id))
        job.stream = None
        self._enqueue(self._devices[device], job, self._clock())

    def _enqueue(self, d: _Device, job: Job[P], now: int) -> None:
        """Put ``job`` on ``d``'s queue."""
        job.device = d.name
        job.admitted_ns = now
        job.estimate_ns = int(d.curve.known[1])
        job._seq = next(self._seq)
        heapq.heappush(d.heap, (-job.priority, job.deadline_ns, job._seq, job.id))
        d.depth += 1
        self._jobs[job.id] = job
        self._owned[job.owner] += 1

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
            raise NotFound(not_queued(request_id), request_id=request_id)
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

    def has_queued(self, stream: str | None, owner: str = "") -> bool:
        """Whether ``owner``'s ``stream`` has a frame queued (False for None)."""
        return stream is not None and (owner, stream) in self._streams

    def streams_waiting(self) -> int:
        """Camera streams with a frame queued (each holds at most one: latest frame wins)."""
        return len(self._streams)

    def in_flight(self, device: str) -> int:
        return len(self._devices[device].running)

    def service_us(self, device: str, batch: int = 1) -> float:
        """The current service-time estimate of ``device`` at batch size ``batch``."""
        return self._devices[device].curve(batch) / 1e3

    def snapshot(self) -> Sequence[DeviceSnapshot]:
        return [
            DeviceSnapshot(
                d.name,
                d.depth,
                d.capacity,
                len(d.running),
                d.curve(1) / 1e3,
                d.completed,
                d.max_batch,
                tuple(d.batches),
                d.available,
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
        del self._jobs[job.id]
        self._owned[job.owner] -= 1
        if not self._owned[job.owner]:
            del self._owned[job.owner]
        key = None if job.stream is None else (job.owner, job.stream)
        if key is not None and self._streams.get(key) == job.id:
            del self._streams[key]
        return d
