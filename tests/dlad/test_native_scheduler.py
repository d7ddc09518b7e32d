"""The scheduler's C++ core makes the Python scheduler's decisions, to the last bit.

Random engine pools (DLA cores and a batching GPU, DRAM interference, hand pins) under every
policy, and random operation sequences on them: admissions from several owners and streams,
retries that avoid a device, fair-share displacement, dispatch by job and by batch, completions
that teach the estimates (and failures), quarantine, health probes, cancels, expiry, time passing
and a final drain. Both schedulers get the same calls on the same virtual clock; every answer,
every error's type and words, every field the scheduler sets on a job and every snapshot (each
estimate compared as the exact float) must be equal after every step.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dlad import native_scheduler
from dlad.devices.dram import ORIN_DRAM_K
from dlad.errors import DladError
from dlad.native_scheduler import NativeScheduler, NativeUnavailable, make_scheduler
from dlad.scheduler import POLICIES, Job, Policy, Scheduler

needs_core = pytest.mark.skipif(
    not native_scheduler.available(), reason="dlad was installed without a C++ compiler"
)


def test_the_core_is_built_wherever_a_compiler_is() -> None:
    """CI has a C++ compiler, so the core's tests cannot skip there unnoticed."""
    if shutil.which("c++") or shutil.which("g++"):
        assert native_scheduler.available()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


@dataclass
class Pool:
    """The engines both schedulers get."""

    policy: Policy
    contention: float
    dla: list[tuple[int, float]]  # (capacity, service µs) per DLA core
    gpu: tuple[int, int, dict[int, float]] | None  # (capacity, max batch, curve µs) or none
    pins: dict[str, str] = field(default_factory=dict)

    def build(self, cls: type[Any], clock: Clock) -> Any:
        interference = {k: v * self.contention for k, v in ORIN_DRAM_K.items()}
        s = cls(clock, policy=self.policy, interference=interference, pins=self.pins, alpha=0.25)
        for i, (cap, us) in enumerate(self.dla):
            s.add_device(
                f"dla{i}", ["m", "k"] if i else ["m"], capacity=cap, service_us=us, kind="dla"
            )
        if self.gpu is not None:
            cap, batch, curve = self.gpu
            s.add_device(
                "gpu",
                ["m", "g"],
                capacity=cap,
                service_us=curve[1],
                max_batch=batch,
                batch_service_us=curve,
                tier=1,
                kind="gpu",
            )
        return s


@st.composite
def pools(draw: st.DrawFn) -> Pool:
    policy = draw(st.sampled_from(POLICIES))
    dla = draw(st.lists(st.tuples(st.integers(1, 4), st.floats(500, 5000)), min_size=1, max_size=3))
    gpu = None
    if draw(st.booleans()):
        batch = draw(st.sampled_from([1, 2, 4, 8]))
        one = draw(st.floats(200, 3000))
        curve = {1: one}
        for b in (2, 4, 8):
            if b <= batch and draw(st.booleans()):
                curve[b] = one * b * draw(st.floats(0.3, 1.0))
        gpu = (draw(st.integers(1, 8)), batch, curve)
    pins = {}
    if policy == "static":
        pins = draw(
            st.dictionaries(
                st.sampled_from(["s0", "s1"]), st.sampled_from(["dla0", "dla1", "gpu", "nowhere"])
            )
        )
    return Pool(policy, draw(st.sampled_from([0.0, 1.0, 3.0])), dla, gpu, pins)


DEVICES = ["dla0", "dla1", "dla2", "gpu"]
# Times on a coarse grid too, so deadlines fall exactly on the clock as often as not.
ns = st.one_of(st.integers(1, 20_000_000), st.integers(1, 6).map(lambda k: k * 1_000_000))
admit = st.tuples(
    st.just("admit"),
    st.sampled_from(["m", "m", "k", "g", "x"]),
    st.integers(-1, 3),
    ns,
    st.sampled_from([None, None, "s0", "s1", "s2"]),
    st.sampled_from(["a", "b", "c"]),
    st.lists(st.sampled_from(DEVICES), max_size=2, unique=True),
)
op = st.one_of(
    admit,
    admit,  # admissions outnumber the rest, so queues fill and fair shares are tested
    admit,
    st.tuples(st.just("again"), st.integers(0, 40)),  # a duplicate id
    st.tuples(
        st.just("next"),
        st.sampled_from(DEVICES),
        st.sampled_from([None, 1, 2, 3]),
        st.sampled_from([0.0, 500.0, 3000.0]),
    ),
    st.tuples(st.just("finish"), st.integers(0, 40), st.one_of(st.none(), st.floats(-10, 40_000))),
    st.tuples(st.just("tick"), ns),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("avail"), st.sampled_from(DEVICES), st.booleans()),
    st.tuples(st.just("probe"), st.sampled_from(DEVICES)),
)


def _job(j: Job[None] | None) -> tuple[Any, ...] | None:
    if j is None:
        return None
    return (j.id, j.model, j.device, j.admitted_ns, j.estimate_ns, j._seq, j.stream, j.owner)


def _jobs(js: Any) -> list[tuple[Any, ...] | None]:
    return [_job(j) for j in js]


def _call(f: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """What a call answered: ("ok", its value with each job as :func:`_job` sees it), or
    ("raised", its exception's type, words and request id)."""
    try:
        out = f(*args, **kwargs)
    except (DladError, ValueError, KeyError) as e:
        return ("raised", type(e).__name__, str(e), getattr(e, "request_id", None))
    if isinstance(out, Job):
        return ("ok", _job(out))
    if isinstance(out, list):
        return ("ok", _jobs(out))
    return ("ok", out)


def _state(s: Any, devices: list[str]) -> tuple[Any, ...]:
    snaps = [tuple(vars(d).values()) for d in s.snapshot()]
    curves = [s.service_us(d, b) for d in devices for b in (1, 2, 3, 4, 8, 9)]
    return (
        snaps,
        curves,
        s.queued(),
        s.streams_waiting(),
        s.earliest_deadline(),
        [s.in_flight(d) for d in devices],
        [s.available(d) for d in devices],
        [s.pinned(st, o) for st in ("s0", "s1", "s2") for o in "abc"],
        s.has_queued("s0", "a"),
        s.has_queued(None),
        sorted(s.models),
    )


def _run(pool: Pool, program: list[tuple[Any, ...]]) -> None:
    clock = Clock()
    py: Scheduler[None] = pool.build(Scheduler, clock)
    cc: NativeScheduler[None] = pool.build(NativeScheduler, clock)
    devices = [d.name for d in py.snapshot()]
    running: list[tuple[str, list[Job[None]], list[Job[None]]]] = []  # device, py jobs, cc jobs
    ids = iter(range(1, 10_000))
    probes = iter(range(-1, -10_000, -1))

    def both(name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls ``name`` on both with ``args`` (a job in them: a twin job for each) and
        requires the same answer, which it returns."""
        twins = [
            Job(
                a.id,
                a.model,
                a.deadline_ns,
                None,
                priority=a.priority,
                stream=a.stream,
                owner=a.owner,
            )
            if isinstance(a, Job)
            else a
            for a in args
        ]
        a = _call(getattr(py, name), *args, **kwargs)
        b = _call(getattr(cc, name), *twins, **kwargs)
        assert a == b, (name, args, kwargs)
        assert [_job(x) for x in args if isinstance(x, Job)] == [
            _job(x) for x in twins if isinstance(x, Job)
        ]
        return a

    for step in program:
        kind = step[0]
        if kind == "admit":
            _, model, prio, budget, stream, owner, avoid = step
            job = Job(
                next(ids),
                model,
                clock.now + budget,
                None,
                priority=prio,
                stream=stream,
                owner=owner,
            )
            refused = both("admit", job, avoid=avoid)[1] == "Overloaded"
            if refused and both("displace_for", job)[1] is not None:  # the frontend's fair shares
                both("admit", job)
        elif kind == "again":  # an id that may still be queued
            both("admit", Job(step[1], "m", clock.now + 10**7, None))
        elif kind == "next":
            _, device, size, delay = step
            if device not in devices:
                both("next_job", device)
                both("next_batch", device)
            elif size is None:
                (head_a, ea), (head_b, eb) = py.next_job(device), cc.next_job(device)
                assert (_job(head_a), _jobs(ea)) == (_job(head_b), _jobs(eb)), step
                if head_a is not None and head_b is not None:
                    running.append((device, [head_a], [head_b]))
            else:
                ba = py.next_batch(device, max_batch=size, max_queue_delay_us=delay)
                bb = cc.next_batch(device, max_batch=size, max_queue_delay_us=delay)
                assert (_jobs(ba.jobs), _jobs(ba.expired), ba.wait_until_ns) == (
                    _jobs(bb.jobs),
                    _jobs(bb.expired),
                    bb.wait_until_ns,
                ), step
                if ba.jobs:
                    running.append((device, ba.jobs, bb.jobs))
        elif kind == "finish" and running:
            device, ja, jb = running.pop(step[1] % len(running))
            if len(ja) == 1 and step[1] % 2:
                py.finished(device, ja[0], step[2])
                cc.finished(device, jb[0], step[2])
            else:
                py.finished_batch(device, ja, step[2])
                cc.finished_batch(device, jb, step[2])
        elif kind == "tick":
            clock.now += step[1]
        elif kind == "cancel":
            both("cancel", step[1])
        elif kind == "expire":
            both("expire")
        elif kind == "avail":
            both("set_available", step[1], step[2])
        elif kind == "probe":
            both(
                "admit_probe", step[1], Job(next(probes), "m", clock.now + 10**6, None, stream="s0")
            )
        assert _state(py, devices) == _state(cc, devices), step
    both("drain")
    assert _state(py, devices) == _state(cc, devices)


_ADMIT: tuple[Any, ...] = ("admit", "m", 0, 1_000_000, None, "a", [])  # due 1 ms from now
_DUE = [_ADMIT, _ADMIT, ("tick", 1_000_000)]  # ... and now it is due


@needs_core
@settings(max_examples=300, deadline=None)
@given(pools(), st.lists(op, max_size=80))
# the boundaries a random clock seldom hits: a job due now is expired, not run (by job, by
# batch); a job that would end exactly at its deadline is in time
@example(Pool("latency", 0.0, [(2, 1000.0)], None), [*_DUE, ("next", "dla0", None, 0.0)])
@example(
    Pool("latency", 0.0, [(2, 1000.0)], (4, 4, {1: 500.0})),
    [("admit", "g", 0, 1_000_000, None, "a", []), ("tick", 1_000_000), ("next", "gpu", 4, 0.0)],
)
@example(Pool("throughput", 0.0, [(2, 1000.0)], (2, 1, {1: 500.0})), [_ADMIT])
def test_the_core_decides_as_the_python_scheduler(
    pool: Pool, program: list[tuple[Any, ...]]
) -> None:
    _run(pool, program)


@needs_core
def test_a_long_busy_run_stays_identical() -> None:
    """Thousands of frames through an Orin-like pool: the learned estimates, after many
    updates, are still the same floats."""
    import random

    rng = random.Random(7)
    pool = Pool(
        "latency",
        1.0,
        [(8, 3820.0), (8, 3820.0)],
        (16, 8, {1: 1820.0, 2: 2910.0, 4: 4990.0, 8: 9190.0}),
    )
    program: list[tuple[Any, ...]] = []
    for _ in range(3000):
        program.append(
            (
                "admit",
                "m",
                rng.randint(0, 2),
                rng.randint(5_000_000, 40_000_000),
                rng.choice([None, "s0", "s1"]),
                rng.choice("abc"),
                [],
            )
        )
        program.append(
            ("next", rng.choice(["dla0", "dla1", "gpu"]), rng.choice([None, 4, 8]), 1000.0)
        )
        program.append(("finish", rng.randint(0, 40), rng.uniform(1000, 12000)))
        program.append(("tick", rng.randint(0, 2_000_000)))
    _run(pool, program)


@needs_core
def test_make_scheduler_picks_the_core_and_refuses_an_unknown_one() -> None:
    clock = Clock()
    assert isinstance(make_scheduler("auto", clock), NativeScheduler)
    assert isinstance(make_scheduler("native", clock), NativeScheduler)
    assert type(make_scheduler("python", clock)) is Scheduler
    with pytest.raises(ValueError, match="core must be one of"):
        make_scheduler("fast", clock)  # type: ignore[arg-type]


@needs_core
def test_without_the_core_native_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_scheduler, "_NATIVE", None)
    assert not native_scheduler.available()
    assert type(make_scheduler("auto", Clock())) is Scheduler
    with pytest.raises(NativeUnavailable, match="without its C\\+\\+ scheduler core"):
        make_scheduler("native", Clock())


@needs_core
def test_the_core_refuses_what_the_python_scheduler_refuses() -> None:
    clock = Clock()
    for cls in (Scheduler, NativeScheduler):
        with pytest.raises(ValueError, match="alpha must be in"):
            cls(clock, alpha=0.0)
        with pytest.raises(ValueError, match="policy must be one of"):
            cls(clock, policy="fastest")  # type: ignore[arg-type]
        s: Any = cls(clock)
        s.add_device("dla0", ["m"], capacity=1, service_us=1.0)
        with pytest.raises(ValueError, match="registered twice"):
            s.add_device("dla0", ["m"], capacity=1, service_us=1.0)
        with pytest.raises(ValueError, match="capacity and max_batch"):
            s.add_device("dla1", ["m"], capacity=0, service_us=1.0)
        with pytest.raises(KeyError):
            s.next_job("nowhere")
        with pytest.raises(ValueError, match="max_batch must be"):
            s.next_batch("dla0", max_batch=0)
