"""Scheduler invariants under random operation sequences (virtual clock), plus placement."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlad.errors import NotFound, Overloaded
from dlad.scheduler import Job, Scheduler


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def make(
    capacities: dict[str, int], service_us: float = 1000.0
) -> tuple[Scheduler[None], FakeClock]:
    clock = FakeClock()
    s: Scheduler[None] = Scheduler(clock)
    for name, cap in capacities.items():
        s.add_device(name, ["m"], capacity=cap, service_us=service_us)
    return s, clock


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            st.integers(0, 3),
            st.integers(1, 5_000_000),
            st.sampled_from([None, "a", "b"]),
            st.sampled_from(["m", "n"]),
        ),
        st.tuples(st.just("next"), st.sampled_from(["dla0", "dla1"])),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("tick"), st.integers(0, 3_000_000)),
        st.tuples(st.just("cancel"), st.integers(0, 60)),
        st.tuples(st.just("expire")),
    ),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(ops, st.integers(1, 4), st.integers(1, 4))
def test_every_job_leaves_once_bounds_and_deadlines(
    program: list[tuple], cap0: int, cap1: int
) -> None:
    """Two devices, two models (``m`` on both, ``n`` on dla1 only), camera streams shared by
    both models, full queues, cancels, expiry and drain. ``pending`` plays the daemon's map of
    requests awaiting a reply: every admitted job leaves the scheduler exactly once (dispatch,
    expiry, cancel, supersede or drain), a refused job takes nothing with it, and after the
    running jobs finish and the queues drain nothing is left pending."""
    clock = FakeClock()
    s: Scheduler[None] = Scheduler(clock)
    s.add_device("dla0", ["m"], capacity=cap0, service_us=1000.0)
    s.add_device("dla1", ["m", "n"], capacity=cap1, service_us=1000.0)
    caps = {"dla0": cap0, "dla1": cap1}
    exits: Counter[int] = Counter()
    admitted: dict[int, Job[None]] = {}
    pending: set[int] = set()
    running: list[Job[None]] = []
    next_id = 0

    def leave(job: Job[None]) -> None:
        exits[job.id] += 1
        assert job.id in admitted

    for op in program:
        kind = op[0]
        if kind == "admit":
            _, prio, budget, stream, model = op
            job: Job[None] = Job(
                next_id, model, clock.now + budget, None, priority=prio, stream=stream
            )
            next_id += 1
            before = s.queued()
            try:
                for old in s.admit(job):
                    leave(old)
                    pending.discard(old.id)  # answered CANCELLED by the daemon
                admitted[job.id] = job
                pending.add(job.id)
            except Overloaded:
                serving = ["dla0", "dla1"] if model == "m" else ["dla1"]
                assert all(s.queued(d) == caps[d] for d in serving)
                assert s.queued() == before  # nothing superseded, nothing lost
        elif kind == "next":
            job_or_none, expired = s.next_job(op[1])
            for e in expired:
                assert e.deadline_ns <= clock.now
                leave(e)
                pending.discard(e.id)
            if job_or_none is not None:
                assert job_or_none.deadline_ns > clock.now  # never dispatched past its deadline
                assert job_or_none.device == op[1]
                assert job_or_none.model in (["m"] if op[1] == "dla0" else ["m", "n"])
                leave(job_or_none)
                running.append(job_or_none)
        elif kind == "finish" and running:
            job = running.pop(op[1] % len(running))
            s.finished(job.device, job, 900.0)
            pending.discard(job.id)
        elif kind == "tick":
            clock.now += op[1]
        elif kind == "cancel":
            with contextlib.suppress(NotFound):
                gone = s.cancel(op[1])
                leave(gone)
                pending.discard(gone.id)
        elif kind == "expire":
            for e in s.expire():
                assert e.deadline_ns <= clock.now
                leave(e)
                pending.discard(e.id)
        assert s.queued("dla0") <= cap0
        assert s.queued("dla1") <= cap1
        assert s.queued() == s.queued("dla0") + s.queued("dla1")
        assert s.queued() + len(running) == len(pending)
    for job in running:
        s.finished(job.device, job, 900.0)
        pending.discard(job.id)
    for job in s.drain():
        leave(job)
        pending.discard(job.id)
    assert s.queued() == 0
    assert not pending
    assert set(exits) == set(admitted)
    assert all(n == 1 for n in exits.values())


def test_a_refused_frame_leaves_its_streams_queued_frame() -> None:
    """The stream's old frame (model ``m`` on dla0) stays queued when its new frame (model
    ``n``, only on the full dla1) is refused: it is neither lost nor superseded."""
    clock = FakeClock()
    s: Scheduler[None] = Scheduler(clock)
    s.add_device("dla0", ["m"], capacity=2, service_us=1000.0)
    s.add_device("dla1", ["n"], capacity=1, service_us=1000.0)
    assert s.admit(Job(1, "m", 10**12, None, stream="cam")) == []
    assert s.admit(Job(2, "n", 10**12, None)) == []  # dla1 is now full
    with pytest.raises(Overloaded):
        s.admit(Job(3, "n", 10**12, None, stream="cam"))
    assert s.queued("dla0") == 1
    job, _ = s.next_job("dla0")
    assert job is not None
    assert job.id == 1
    # With room, the new frame supersedes the queued one, on whichever device serves it.
    s.admit(Job(4, "m", 10**12, None, stream="cam"))
    (old,) = s.admit(Job(5, "m", 10**12, None, stream="cam"))
    assert old.id == 4


def test_priority_then_deadline_order() -> None:
    s, _ = make({"dla0": 8})
    for i, (prio, deadline) in enumerate([(0, 50), (2, 90), (2, 60), (1, 10)]):
        s.admit(Job(i, "m", 1_000 + deadline, None, priority=prio))
    order = [s.next_job("dla0")[0].id for _ in range(4)]
    assert order == [2, 1, 3, 0]


def test_placement_balances_equal_cores_and_prefers_fast_ones() -> None:
    s, _ = make({"dla0": 100, "dla1": 100})
    for i in range(10):
        s.admit(Job(i, "m", 10**12, None))
    assert (s.queued("dla0"), s.queued("dla1")) == (5, 5)
    fast, _ = make({"dla0": 100})
    fast.add_device("dla1", ["m"], capacity=100, service_us=250.0)  # 4x faster
    for i in range(10):
        fast.admit(Job(i, "m", 10**12, None))
    assert fast.queued("dla1") == 8  # ~4:1 by estimated completion
    assert fast.queued("dla0") == 2


def test_service_estimate_learns_online() -> None:
    s, _ = make({"dla0": 4}, service_us=1000.0)
    for i in range(30):
        s.admit(Job(i, "m", 10**12, None))
        job, _ = s.next_job("dla0")
        assert job is not None
        s.finished("dla0", job, 3000.0)
    (snap,) = s.snapshot()
    assert snap.service_time_us == pytest.approx(3000.0, rel=0.01)
    assert snap.completed == 30


def test_latest_frame_wins_and_unknown_model() -> None:
    s, _ = make({"dla0": 4})
    s.admit(Job(1, "m", 10**12, None, stream="cam"))
    (old,) = s.admit(Job(2, "m", 10**12, None, stream="cam"))
    assert old.id == 1
    assert s.queued() == 1
    with pytest.raises(NotFound):
        s.admit(Job(3, "other", 10**12, None))
    with pytest.raises(NotFound):
        s.cancel(99)
