"""The plane's engines behind its one interface (dlad/native/engine.hpp): a Python engine's
contract (python_engine.hpp), dynamic batches formed by the plane, and failures answered per job.

A Python engine here is a plain function the plane calls on the engine's own threads; its
replies must carry what the function returned (detections, pre/post times, the device's span),
and every way it can fail must cost its jobs one typed reply each and the plane nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from dlad import protocol
from dlad.errors import Status
from dlad.native_plane import EventKind, Health, HealthEvent, PlaneDevice
from dlad.protocol import InferRequest
from tests.dlad.test_metrics import wait_for
from tests.dlad.test_native_plane import Rig

pytestmark = [
    pytest.mark.timeout(120),
]

Batch = list[tuple[int, "memoryview | None", tuple[Any, ...]]]


class Recorder:
    """A Python engine's work: one detection a frame, (sum of its pixels, h, w, its pixel
    format's code, conf, max_det); each batch it ran recorded; held while ``gate`` is clear."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        _GATES.append(self.gate)
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, batch: Batch) -> tuple[int, int, Sequence[tuple[Any, ...]]]:
        self.entered.set()
        assert self.gate.wait(60)
        with self.lock:
            self.batches.append([job for job, _, _ in batch])
        results = []
        for _, pixels, (h, w, fmt, _colour, conf, _iou, max_det) in batch:
            assert pixels is not None
            total = float(np.frombuffer(pixels, np.uint8).sum())
            row = np.array([[total, h, w, fmt, conf or -1.0, max_det or -1]], np.float32)
            results.append((0, "", row, 11, 22))
        return 1_000, 5_000, results


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def _rig(run: Any, health: Health | None = None, **device: Any) -> Rig:
    # deadlines far off: a job held behind a gated engine must not expire under load
    return Rig(
        [PlaneDevice("py0", 4_000.0, capacity=32, run=run, **device)],
        default_deadline_ms=600_000.0,
        health=health or Health(),
    )


_GATES: list[threading.Event] = []  # every Recorder's, opened before its plane closes


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for gate in _GATES:  # a test that failed holding an engine must not hold its close
        gate.set()
    _GATES.clear()
    for r in made:
        r.close()


def test_a_python_engine_answers_with_what_it_returned(recorder: Recorder, rigs: list[Rig]) -> None:
    rig = _rig(recorder, slots=1)
    rigs.append(rig)
    image = np.arange(6 * 4, dtype=np.uint8).reshape(6, 4)  # a 4 x 4 NV12 frame
    rig.client.send_multipart(protocol.encode(
        InferRequest(id=3, model="demo", image=image, format="NV12", conf=0.5, max_det=7)
    ))  # fmt: skip
    r = rig.reply()
    assert (r.id, r.status, r.device) == (3, Status.OK, "py0")
    assert r.detections is not None
    np.testing.assert_array_equal(
        r.detections, [[float(image.sum()), 4, 4, 3, 0.5, 7]]
    )  # the frame's own pixels (all its bytes), format and settings reached the engine
    assert (r.timing.pre_us, r.timing.post_us) == (11, 22)
    assert (r.timing.start_ns, r.timing.end_ns, r.timing.device_us) == (1_000, 5_000, 4)
    rig.infer(4)  # no settings: the plane resolves the model's ([models.*]'s defaults here)
    r = rig.reply()
    assert r.detections is not None
    assert r.detections[0, 4:].tolist() == [0.25, 300]


def test_the_plane_learns_what_a_frame_costs_the_host(rigs: list[Rig]) -> None:
    """A Python engine whose call spends 2 ms of its thread's CPU a frame: the device's
    learned host cost a frame (what placement reads when the host is saturated) is at least
    that, and it starts at 0 before any frame."""

    def burn(batch: Batch) -> tuple[int, int, list[tuple[Any, ...]]]:
        until = time.thread_time_ns() + 2_000_000 * len(batch)
        while time.thread_time_ns() < until:
            pass
        return 1_000, 5_000, [(0, "", None, None, None) for _ in batch]

    rig = _rig(burn, slots=1)
    rigs.append(rig)
    assert [d.host_us for d in rig.plane.state()[0]] == [0.0]
    for rid in range(3):
        rig.infer(rid)
        assert rig.reply().status == Status.OK
    assert rig.plane.state()[0][0].host_us >= 2_000.0


def test_the_plane_batches_what_queued_while_the_engine_was_busy(
    recorder: Recorder, rigs: list[Rig]
) -> None:
    rig = _rig(recorder, slots=1, kind="gpu", max_batch=4, curve_us={4: 9_000.0})
    rigs.append(rig)
    recorder.gate.clear()
    rig.infer(0)
    assert recorder.entered.wait(20)  # the first batch runs, held: the rest queue
    for rid in range(1, 10):
        rig.infer(rid)
    wait_for(lambda: rig.plane.state()[1] == 9)
    recorder.gate.set()
    replies = [rig.reply() for _ in range(10)]
    assert sorted(r.id for r in replies) == list(range(10))
    assert {r.status for r in replies} == {Status.OK}
    sizes = [len(b) for b in recorder.batches]
    assert sizes[0] == 1
    assert max(sizes) == 4  # full batches of what waited
    assert all(1 <= s <= 4 for s in sizes)
    assert sum(sizes) == 10


def test_the_next_batch_is_formed_when_the_engine_frees_not_when_a_slot_does(
    recorder: Recorder, rigs: list[Rig]
) -> None:
    """One frame runs on a busy engine of two slots; three more arrive meanwhile. The second
    slot must not take the first of them alone the moment it arrives: the next batch is formed
    when the engine is expected to free (its curve says an hour) or frees, so all three run at
    once."""
    rig = _rig(recorder, slots=2, kind="gpu", max_batch=4,
               curve_us=dict.fromkeys(range(1, 5), 3_600e6))  # fmt: skip
    rigs.append(rig)
    recorder.gate.clear()
    rig.infer(0)
    assert recorder.entered.wait(20)
    for rid in (1, 2, 3):
        rig.infer(rid)
    wait_for(lambda: rig.plane.state()[1] == 3)  # queued, not taken by the free slot
    recorder.gate.set()
    replies = [rig.reply() for _ in range(4)]
    assert sorted(r.id for r in replies) == [0, 1, 2, 3]
    assert {r.status for r in replies} == {Status.OK}
    assert recorder.batches == [[recorder.batches[0][0]], sorted(recorder.batches[1])]
    assert [len(b) for b in recorder.batches] == [1, 3]


@pytest.mark.parametrize(
    ("result", "status", "words"),
    [
        ((1, "task failed: lost", None, None, None), Status.DEVICE_FAILED, "py0: task failed"),
        ((3, "hung", None, None, None), Status.DEVICE_FAILED, "py0: hung"),
        ((4, "a bug", None, None, None), Status.INTERNAL, "py0: a bug"),
        ((0, "", np.zeros((1, 5), np.float32), None, None), Status.INTERNAL, "malformed"),
        ((0, "", np.zeros((6, 2), np.float32).T, None, None), Status.INTERNAL, "malformed"),
        ((9, "", None, None, None), Status.INTERNAL, "malformed result: no failure 9"),
        ((0, ""), Status.INTERNAL, "a result is 5 items"),
        (ValueError("no such tensor"), Status.INTERNAL, "the engine raised ValueError"),
        ("not a tuple", Status.INTERNAL, "malformed"),
    ],
)
def test_an_engine_that_fails_costs_its_job_one_typed_reply(
    rigs: list[Rig], result: Any, status: Status, words: str
) -> None:
    calls = 0

    def run(batch: Batch) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:  # the plane goes on serving after the failure
            return 0, 1_000, [(0, "", None, None, None)] * len(batch)
        if isinstance(result, Exception):
            raise result
        if isinstance(result, str):
            return result
        return 0, 1_000, [result]

    rig = _rig(run, slots=1, health=Health(quarantine_after=0))  # a hang would quarantine
    rigs.append(rig)
    rig.infer(1)
    r = rig.reply()
    assert r.status is status
    assert words in r.message
    rig.infer(2)
    assert rig.reply().status is Status.OK
    (state,) = rig.plane.state()[0]
    failed = 1 if status is Status.DEVICE_FAILED else 0
    assert (state.failed, state.failing) == (failed, 0)  # the next frame went through
    assert rig.plane.pending == 0


def test_a_run_that_returns_too_few_results_fails_the_batch(rigs: list[Rig]) -> None:
    rig = _rig(lambda batch: (0, 1, []), slots=1)
    rigs.append(rig)
    rig.infer(1)
    r = rig.reply()
    assert r.status is Status.INTERNAL
    assert "one result per job: 1 jobs, 0 results" in r.message


def test_close_waits_for_the_call_running_and_answers_its_job(
    recorder: Recorder, rigs: list[Rig]
) -> None:
    rig = _rig(recorder, slots=2)
    recorder.gate.clear()
    rig.infer(1)
    assert recorder.entered.wait(20)
    closer = threading.Thread(target=rig.plane.close)
    closer.start()
    wait_for(lambda: rig.plane.draining)
    r = rig.reply()  # the drain's end answers what still runs
    assert (r.id, r.status) == (1, Status.SHUTTING_DOWN)
    assert closer.is_alive()  # the engine waits for its call
    recorder.gate.set()
    closer.join(60)
    assert not closer.is_alive()
    assert recorder.batches == [[0]]  # it ran to its end; its late report went nowhere
    for d in rig.dealers:
        d.close(0)
    rig.router.close(0)
    rig.ctx.term()


class Flaky:
    """A Python engine that fails (``failure``: 1 a device's, 3 a hang) while ``failing`` is
    set, and counts its calls."""

    def __init__(self, failure: int = 1) -> None:
        self.failing = threading.Event()
        self.failing.set()
        self.failure = failure
        self.calls = 0

    def __call__(self, batch: Batch) -> tuple[int, int, Sequence[tuple[Any, ...]]]:
        self.calls += 1
        if self.failing.is_set():
            return 0, 1_000, [(self.failure, "task failed: broken", None, None, None)] * len(batch)
        return 0, 1_000, [(0, "", None, None, None)] * len(batch)


def _pool(flaky: Flaky, health: Health, **settings: Any) -> Rig:
    good = Recorder()
    return Rig(
        [
            PlaneDevice("py0", 1_000.0, slots=1, capacity=32, run=flaky),
            PlaneDevice("py1", 9_000.0, slots=1, capacity=32, run=good),  # placed second
        ],
        default_deadline_ms=600_000.0,
        health=health,
        **settings,
    )


def _events(rig: Rig, seen: list[HealthEvent], kind: EventKind) -> bool:
    seen.extend(rig.plane.events())
    return any(e.kind is kind for e in seen)


def test_failed_frames_are_retried_elsewhere_and_the_engine_quarantined_then_returned(
    rigs: list[Rig],
) -> None:
    flaky = Flaky()
    rig = _pool(flaky, Health(quarantine_after=3, probe_after_s=0.001, probe_max_s=0.002))
    rigs.append(rig)
    seen: list[HealthEvent] = []
    for rid in range(3):  # each fails on py0 (the faster), and is retried on py1
        rig.infer(rid)
        r = rig.reply()
        assert (r.id, r.status, r.device) == (rid, Status.OK, "py1")
    wait_for(lambda: _events(rig, seen, EventKind.QUARANTINED))
    retried = [e for e in seen if e.kind is EventKind.RETRIED]
    assert [(e.request_id, e.device, e.to) for e in retried] == [
        (i, "py0", "py1") for i in range(3)
    ]
    (out,) = [e for e in seen if e.kind is EventKind.QUARANTINED]
    assert (out.device, out.reason) == (
        "py0",
        "3 tasks failed in a row; last: py0: task failed: broken",
    )
    py0 = rig.plane.state()[0][0]
    assert (py0.quarantined, py0.quarantines) == (out.reason, 1)
    assert py0.failed >= 3  # the three frames, and any probe that has failed since
    wait_for(lambda: _events(rig, seen, EventKind.PROBE_FAILED))  # probed, still failing
    calls = flaky.calls
    rig.infer(10)  # out of placement: py1 serves it first time
    r = rig.reply()
    assert (r.status, r.device) == (Status.OK, "py1")
    flaky.failing.clear()
    wait_for(lambda: _events(rig, seen, EventKind.RETURNED))
    assert flaky.calls > calls  # the probe ran on py0 itself
    assert rig.plane.state()[0][0].quarantined is None
    rig.infer(11)
    assert rig.reply().device == "py0"  # back in placement
    assert rig.plane.counters()["replied"] == 5  # probes answer no one


def test_a_hang_quarantines_at_once_and_without_retry_the_failure_is_answered(
    rigs: list[Rig],
) -> None:
    rig = _pool(Flaky(failure=3), Health(quarantine_after=5, retry=False, probe_after_s=60))
    rigs.append(rig)
    seen: list[HealthEvent] = []
    rig.infer(1)
    r = rig.reply()
    assert (r.status, r.device, r.message) == (
        Status.DEVICE_FAILED, "py0", "py0: task failed: broken")  # fmt: skip
    wait_for(lambda: _events(rig, seen, EventKind.QUARANTINED))
    assert seen[-1].reason == "a task hung: py0: task failed: broken"
    assert not [e for e in seen if e.kind is EventKind.RETRIED]


def test_a_quarantine_moves_the_queued_frames_or_answers_them(rigs: list[Rig]) -> None:
    gated = Recorder()
    gated.gate.clear()
    rig = Rig(
        [PlaneDevice("py0", 1_000.0, slots=1, capacity=32, run=gated)],
        default_deadline_ms=600_000.0,
        health=Health(probe_after_s=600),
    )
    rigs.append(rig)
    rig.infer(0)
    assert gated.entered.wait(20)
    for rid in range(1, 4):
        rig.infer(rid)
    wait_for(lambda: rig.plane.state()[1] == 3)
    rig.plane.quarantine("py0", "warm-up failed: no")
    refused = sorted((rig.reply() for _ in range(3)), key=lambda r: r.id or 0)
    assert [r.id for r in refused] == [1, 2, 3]
    assert {r.status for r in refused} == {Status.DEVICE_FAILED}
    # placed again avoiding py0 (Frontend.requeue's words)
    assert refused[0].message == "no healthy device serves model 'demo' now (py0 failed it)"
    gated.gate.set()
    assert rig.reply().status is Status.OK  # what ran finishes
    with pytest.raises(KeyError):
        rig.plane.quarantine("nope", "no such engine")
