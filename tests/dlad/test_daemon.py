"""The daemon in-process on real tcp loopback sockets: round trip, both cores, overload,
deadlines, cancel, bad input and drain — every request answered exactly once."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import Status
from dlad.models import DEMO
from tests.dlad.serving import serve_in_thread

pytestmark = pytest.mark.timeout(60)

CONFIG = """
[daemon]
drain_timeout_s = 5.0
default_deadline_ms = 5000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
cheap_requests_per_s = 100000.0  # the tests poll STATUS
[devices.dla0]
kind = "dla"
core = 0
queue_depth = {depth}
mode = "{mode}"
latency_us = {latency}
task_timeout_ms = 2000.0
{faults0}
[devices.dla1]
kind = "dla"
core = 1
queue_depth = {depth}
mode = "{mode}"
latency_us = {latency}
task_timeout_ms = 2000.0
{faults1}
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
{scheduler}
"""


@contextmanager
def running(
    tmp_path: Path,
    *,
    mode: str = "timing",
    latency: float = 2000.0,
    depth: int = 4,
    error_rate: float = 0.0,
    scheduler: str = "",
) -> Iterator[tuple[Daemon, str]]:
    cfg = tmp_path / "dlad.toml"
    faults = {
        f"faults{core}": (
            f"[devices.dla{core}.faults]\nerror_rate = {error_rate}\nseed = {core + 1}"
            if error_rate
            else ""
        )
        for core in (0, 1)
    }
    cfg.write_text(
        CONFIG.format(mode=mode, latency=latency, depth=depth, scheduler=scheduler, **faults)
    )
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as endpoint:
        yield daemon, endpoint


@contextmanager
def dealer(endpoint: str) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def recv(sock: zmq.Socket) -> protocol.Reply:
    assert sock.poll(20_000), "no reply within 20 s"
    return protocol.decode_reply(sock.recv_multipart())


IMAGE = np.ascontiguousarray(np.asarray(Image.open(DEMO / "images" / "000001.jpg").convert("RGB")))


def test_round_trip_detections_match_prep(tmp_path: Path) -> None:
    import json

    expected = json.loads((DEMO / "expected_detections.json").read_text())["images"]["000001.jpg"]
    with running(tmp_path, mode="numeric", latency=500.0) as (_, ep), dealer(ep) as sock:
        sock.send_multipart(protocol.encode(protocol.InferRequest(7, "demo", IMAGE)), copy=False)
        reply = recv(sock)
    assert isinstance(reply, protocol.InferReply)
    assert reply.status == Status.OK, reply.message
    assert reply.id == 7
    assert reply.device in ("dla0", "dla1")
    np.testing.assert_allclose(
        reply.detections, np.asarray(expected["emulated_int8"], np.float32), atol=2e-3
    )
    assert reply.timing.total_us >= reply.timing.device_us > 0


def test_hand_pinned_streams_run_where_the_config_pins_them(tmp_path: Path) -> None:
    pins = '[scheduler]\npolicy = "static"\npins = { cam0 = "dla1", cam1 = "dla0" }'
    with running(tmp_path, scheduler=pins) as (_, ep), dealer(ep) as sock:
        for i in range(6):
            stream = f"cam{i % 2}"
            request = protocol.InferRequest(i, "demo", IMAGE, stream=stream)
            sock.send_multipart(protocol.encode(request), copy=False)
            reply = recv(sock)
            assert isinstance(reply, protocol.InferReply)
            assert (reply.status, reply.device) == (Status.OK, {"cam0": "dla1"}.get(stream, "dla0"))


def test_both_cores_under_load_and_every_request_answered_once(tmp_path: Path) -> None:
    n = 60
    with running(tmp_path, latency=3000.0, depth=4) as (_, ep), dealer(ep) as sock:
        for i in range(n):
            sock.send_multipart(
                protocol.encode(protocol.InferRequest(i, "demo", IMAGE)), copy=False
            )
        replies = [recv(sock) for _ in range(n)]
    ids = Counter(r.id for r in replies)
    assert set(ids) == set(range(n))
    assert all(c == 1 for c in ids.values())
    statuses = Counter(r.status for r in replies)
    assert statuses[Status.OK] > 0
    assert statuses[Status.OVERLOADED] > 0  # 60 at once into 2 x 4 queue slots: full is an answer
    assert set(statuses) <= {Status.OK, Status.OVERLOADED}
    devices = Counter(r.device for r in replies if r.status == Status.OK)
    assert devices["dla0"] > 0
    assert devices["dla1"] > 0


def test_deadline_expiry_and_cancel(tmp_path: Path) -> None:
    # 1 s tasks: 102 is still queued when its CANCEL arrives, however slow the machine
    with running(tmp_path, latency=1_000_000.0, depth=8) as (_, ep), dealer(ep) as sock:
        for i in range(8):  # 4 start at once (2 cores x 2 slots, 1 s each), 4 wait
            sock.send_multipart(
                protocol.encode(protocol.InferRequest(i, "demo", IMAGE, deadline_ms=20)), copy=False
            )
        sock.send_multipart(protocol.encode(protocol.InferRequest(100, "demo", IMAGE)), copy=False)
        sock.send_multipart(protocol.encode(protocol.InferRequest(101, "demo", IMAGE)), copy=False)
        sock.send_multipart(protocol.encode(protocol.InferRequest(102, "demo", IMAGE)), copy=False)
        sock.send_multipart(protocol.encode(protocol.CancelRequest(102)))
        replies = [recv(sock) for _ in range(12)]
    by = {(type(r).__name__, r.id): r for r in replies}
    assert len(by) == 12
    expired = [r for r in replies if r.status == Status.DEADLINE_EXCEEDED]
    assert len(expired) >= 4  # those queued behind 1 s tasks with a 20 ms budget
    assert by[("CancelReply", 102)].status == Status.OK
    assert by[("InferReply", 102)].status == Status.CANCELLED
    # Expired while queued: it never ran, so no device is named (replies once named the
    # device whose queue it waited in).
    assert all(r.device is None for r in expired if r.timing.start_ns is None)


def test_cancel_of_a_running_request_quotes_the_clients_id(tmp_path: Path) -> None:
    with running(tmp_path, latency=1_000_000.0, depth=4) as (_, ep), dealer(ep) as sock:
        sock.send_multipart(protocol.encode(protocol.InferRequest(777, "demo", IMAGE)))
        while (
            _status(sock, 1)["devices"][0]["in_flight"]
            + _status(sock, 2)["devices"][1]["in_flight"]
            < 1
        ):
            pass
        sock.send_multipart(protocol.encode(protocol.CancelRequest(777)))
        reply = recv(sock)
        assert (reply.id, reply.status) == (777, Status.NOT_FOUND)
        assert "request 777 is already running" in reply.message
        report = _status(sock, 3)
        assert report["limits"]["max_in_flight_per_client"] == 256  # what a client may send


@pytest.mark.parametrize(
    ("frames", "status"),
    [
        ([b"\xc1garbage"], Status.BAD_REQUEST),
        ([protocol.encode(protocol.StatusRequest(1))[0][:-1]], Status.BAD_REQUEST),
    ],
)
def test_bad_input_gets_typed_status_and_daemon_stays_up(
    tmp_path: Path, frames: list[bytes], status: Status
) -> None:
    with running(tmp_path) as (_, ep), dealer(ep) as sock:
        sock.send_multipart(frames)
        assert recv(sock).status == status
        sock.send_multipart(protocol.encode(protocol.InferRequest(1, "nope", IMAGE)), copy=False)
        assert recv(sock).status == Status.NOT_FOUND
        sock.send_multipart(protocol.encode(protocol.InferRequest(2, "demo", IMAGE)), copy=False)
        assert recv(sock).status == Status.OK


def test_injected_device_faults_answered_device_failed(tmp_path: Path) -> None:
    n = 40
    with running(tmp_path, latency=500.0, depth=64, error_rate=0.3) as (_, ep), dealer(ep) as sock:
        for i in range(n):
            sock.send_multipart(
                protocol.encode(protocol.InferRequest(i, "demo", IMAGE)), copy=False
            )
        replies = [recv(sock) for _ in range(n)]
        # the daemon is still serving after the faults
        sock.send_multipart(protocol.encode(protocol.StatusRequest(99)))
        status = recv(sock)
    assert sorted(int(r.id or 0) for r in replies) == list(range(n))
    statuses = Counter(r.status for r in replies)
    assert statuses[Status.DEVICE_FAILED] > 0
    assert statuses[Status.OK] > 0
    assert set(statuses) == {Status.OK, Status.DEVICE_FAILED}
    assert status.status == Status.OK


def test_drain_finishes_in_flight_and_refuses_new(tmp_path: Path) -> None:
    with running(tmp_path, latency=100_000.0, depth=8) as (daemon, ep), dealer(ep) as sock:
        for i in range(10):  # 4 start (2 cores x 2 slots), 6 queue
            sock.send_multipart(
                protocol.encode(protocol.InferRequest(i, "demo", IMAGE)), copy=False
            )
        sock.send_multipart(protocol.encode(protocol.StatusRequest(50)))
        assert recv(sock).id == 50  # every INFER above was received before draining starts
        daemon.stop_threadsafe()
        sock.send_multipart(protocol.encode(protocol.InferRequest(20, "demo", IMAGE)), copy=False)
        replies = [recv(sock) for _ in range(11)]
    by_id = {r.id: r.status for r in replies}
    assert set(by_id) == set(range(10)) | {20}
    assert by_id[20] == Status.SHUTTING_DOWN
    assert Counter(by_id.values())[Status.OK] >= 4  # the ones on a device finished
    assert set(by_id.values()) == {Status.OK, Status.SHUTTING_DOWN}


_VALID = protocol.encode(protocol.InferRequest(1, "demo", IMAGE))


def test_after_the_drain_the_daemon_answers_until_the_socket_closes(tmp_path: Path) -> None:
    """The adversarial test's window: requests that arrived after the drain finished and before
    the socket closed got no reply. Now the frontend goes on answering (SHUTTING_DOWN)."""
    cfg = tmp_path / "dlad.toml"
    text = CONFIG.format(mode="timing", latency=500.0, depth=4, scheduler="", faults0="",
                         faults1="")  # fmt: skip
    cfg.write_text(text.replace("[daemon]\n", "[daemon]\nclose_linger_ms = 3000.0\n"))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        daemon.stop_threadsafe()
        assert daemon.lingering.wait(30)  # drained: nothing left in flight
        for i in range(5):
            sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", IMAGE)))
        sock.send_multipart(protocol.encode(protocol.StatusRequest(9)))
        replies = [recv(sock) for _ in range(6)]
    assert [r.status for r in replies] == [Status.SHUTTING_DOWN] * 5 + [Status.OK]
    assert replies[-1].report["state"] == "DRAINING"


def test_everything_read_during_shutdown_is_answered(tmp_path: Path) -> None:
    """A client sends without waiting from before the stop until the daemon has closed: every
    message the daemon read got a reply that reached the client, INFERs in the last window
    SHUTTING_DOWN; only messages sent after the close go unanswered (nobody read them)."""
    import threading

    sent = 0
    got: list[protocol.Reply] = []
    closed, serving = threading.Event(), threading.Event()
    with running(tmp_path, latency=2000.0, depth=8) as (daemon, ep), dealer(ep) as sock:

        def flood() -> None:
            nonlocal sent
            while not closed.is_set():
                # Without blocking: once the daemon has closed, the DEALER's queue fills and a
                # blocking send would wait forever, never seeing ``closed``.
                try:
                    sock.send_multipart(
                        protocol.encode(protocol.InferRequest(sent, "demo", IMAGE)), zmq.NOBLOCK
                    )
                except zmq.Again:
                    sock.poll(10, zmq.POLLOUT)
                else:
                    sent += 1
                while sock.poll(0):
                    got.append(protocol.decode_reply(sock.recv_multipart()))
                if len(got) >= 20:
                    serving.set()

        sender = threading.Thread(target=flood)
        sender.start()
        assert serving.wait(60)  # serving for a while first
        daemon.stop_threadsafe()
        assert daemon.stopped.wait(60)
        closed.set()
        sender.join()
        # What the linger delivered after the flood stopped: the daemon has stopped, so its
        # count of replies is final; wait for that many (a reply lost would time out here).
        while len(got) < daemon.counters.replied and sock.poll(60_000):
            got.append(protocol.decode_reply(sock.recv_multipart()))
    counters = daemon.counters
    assert counters.received == counters.replied == len(got)
    assert len({r.id for r in got}) == len(got)  # one reply each
    assert Counter(r.status for r in got)[Status.SHUTTING_DOWN] > 0
    assert sent >= len(got)


def _mutations() -> st.SearchStrategy[list[bytes]]:
    header = bytes(_VALID[0])
    payload = bytes(_VALID[1])
    return st.one_of(
        st.lists(st.binary(max_size=64), min_size=1, max_size=3),  # garbage frames
        st.builds(lambda cut: [header[:cut], payload], st.integers(0, len(header) - 1)),
        st.builds(lambda extra: [header, payload[: len(payload) - extra]], st.integers(1, 50)),
        st.builds(lambda extra: [header, payload + b"\\0" * extra], st.integers(1, 50)),
        st.just([header]),  # no payload frame
        st.just([header, payload, b"extra"]),
        st.builds(
            lambda key, value: [
                msgpack.packb({**msgpack.unpackb(header), key: value}),
                payload,
            ],
            st.sampled_from(
                ["v", "kind", "id", "model", "image", "priority", "deadline_ms", "conf"]
            ),
            st.one_of(
                st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.floats()
            ),
        ),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=_mutations())
def test_malformed_messages_get_a_typed_reply_and_the_daemon_stays_up(
    shared_daemon: str, frames: list[bytes]
) -> None:
    with dealer(shared_daemon) as sock:
        sock.send_multipart(frames)
        reply = recv(sock)
        assert reply.status in {Status.OK, Status.BAD_REQUEST, Status.NOT_FOUND}
        sock.send_multipart(protocol.encode(protocol.StatusRequest(7)))
        assert recv(sock).status == Status.OK  # still up, still answering


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running(tmp_path_factory.mktemp("shared"), latency=200.0, depth=16) as (_, ep):
        yield ep


def test_failures_are_logged_with_request_context(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs, running(tmp_path) as (_, ep), dealer(ep) as sock:
        sock.send_multipart([b"\xc1"])
        assert recv(sock).status == Status.BAD_REQUEST
        sock.send_multipart(protocol.encode(protocol.InferRequest(41, "nope", IMAGE)), copy=False)
        assert recv(sock).status == Status.NOT_FOUND
    bad = [e for e in logs if e["event"] == "bad_request"]
    assert bad
    assert "client" in bad[0]


def test_a_kilobyte_nested_a_thousand_deep_is_refused_and_the_daemon_stays_up(
    shared_daemon: str,
) -> None:
    """The adversarial test's crash: a 992-byte STATUS whose id nests ~1,000 levels deep made
    the refusal's repr recurse past Python's limit and the receive loop die."""
    deep = b"\x83\xa1v\x01\xa4kind\x03\xa2id" + b"\x91" * 980 + b"\x90"
    assert len(deep) < 1000
    with dealer(shared_daemon) as sock:
        sock.send_multipart([deep])
        reply = recv(sock)
        assert (reply.status, reply.id) == (Status.BAD_REQUEST, None)
        assert "nests deeper" in reply.message
        sock.send_multipart(protocol.encode(protocol.StatusRequest(8)))
        assert recv(sock).status == Status.OK


def test_a_bug_on_the_request_path_answers_internal_and_the_daemon_stays_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs, running(tmp_path) as (daemon, ep), dealer(ep) as sock:
        healthy = daemon.frontend._status

        def broken(load: bool) -> dict[str, Any]:
            raise KeyError("a bug")

        monkeypatch.setattr(daemon.frontend, "_status", broken)
        sock.send_multipart(protocol.encode(protocol.StatusRequest(12)))
        reply = recv(sock)
        assert (type(reply), reply.status, reply.id) == (
            protocol.StatusReply, Status.INTERNAL, 12,
        )  # fmt: skip
        assert "KeyError" in reply.message
        monkeypatch.setattr(daemon.frontend, "_status", healthy)
        sock.send_multipart(protocol.encode(protocol.InferRequest(13, "demo", IMAGE)), copy=False)
        assert recv(sock).status == Status.OK  # the receive loop lived on
    (line,) = [e for e in logs if e["event"] == "internal_error"]
    assert (line["request_id"], bool(line["client"])) == (12, True)


def _header(**changes: object) -> bytes:
    h = msgpack.unpackb(bytes(protocol.encode(protocol.InferRequest(5, "demo", IMAGE))[0]))
    for key, value in changes.items():
        if key.startswith("image."):
            h["image"][key.split(".", 1)[1]] = value
        else:
            h[key] = value
    return msgpack.packb(h)


@pytest.mark.parametrize(
    ("frames", "field"),
    [
        ([_header(kind=9), IMAGE.tobytes()], "kind"),
        ([_header(v=2), IMAGE.tobytes()], "v"),
        ([_header(**{"image.dtype": "float32"}), IMAGE.tobytes()], "dtype"),
        ([_header(**{"image.height": IMAGE.shape[0] + 1}), IMAGE.tobytes()], "payload"),
        ([_header(**{"image.width": 5000, "image.height": 1}), bytes(5000 * 3)], "width"),
        ([_header(), IMAGE.tobytes() + IMAGE.tobytes()], "payload"),
    ],
    ids=["unknown-kind", "wrong-version", "non-uint8", "size-mismatch", "too-wide", "oversized"],
)
def test_each_bad_input_is_bad_request(shared_daemon: str, frames: list[bytes], field: str) -> None:
    with dealer(shared_daemon) as sock:
        sock.send_multipart(frames)
        reply = recv(sock)
        assert reply.status == Status.BAD_REQUEST, reply
        assert field in reply.message, reply.message  # the message names what was wrong
        sock.send_multipart(protocol.encode(protocol.InferRequest(6, "demo", IMAGE)), copy=False)
        assert recv(sock).status == Status.OK


# ----------------------------------------------------------------------- STATUS tells the truth
ONE_CORE = """
[daemon]
drain_timeout_s = 5.0
default_deadline_ms = 20000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
cheap_requests_per_s = 100000.0  # the tests poll STATUS
[metrics]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 8
mode = "timing"
latency_us = {latency}
task_timeout_ms = 10000.0
{faults}
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def _status(sock: zmq.Socket, request_id: int) -> dict[str, Any]:
    sock.send_multipart(protocol.encode(protocol.StatusRequest(request_id)))
    reply = recv(sock)
    assert isinstance(reply, protocol.StatusReply)
    assert reply.report is not None
    return dict(reply.report)


def _one_core(tmp_path: Path, latency: float, faults: str = "") -> Daemon:
    cfg = tmp_path / "one.toml"
    cfg.write_text(ONE_CORE.format(latency=latency, faults=faults))
    return Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])


def _seed_ok_then_fail3_then_ok() -> int:
    """A fault seed whose draws (one per task, fail below 0.5) pass the warm-up task, fail the
    next three and pass the fifth and sixth."""
    want = [False, True, True, True, False, False]
    for seed in range(10_000):
        rng = random.Random(seed)
        if [rng.random() < 0.5 for _ in want] == want:
            return seed
    raise AssertionError("no such seed below 10000")


def test_status_health_follows_consecutive_failures(tmp_path: Path) -> None:
    seed = _seed_ok_then_fail3_then_ok()
    faults = (
        f"[devices.dla0.faults]\nerror_rate = 0.5\nseed = {seed}\n[health]\nquarantine_after = 0"
    )
    daemon = _one_core(tmp_path, 500.0, faults)
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        (dev,) = _status(sock, 1)["devices"]
        assert (dev["healthy"], dev["kind"]) == (True, "dla")
        statuses = []
        for i in range(3):  # one at a time: tasks 1, 2, 3 of the core fail
            sock.send_multipart(protocol.encode(protocol.InferRequest(10 + i, "demo", IMAGE)))
            statuses.append(recv(sock).status)
            if i < 2:
                assert _status(sock, 20 + i)["devices"][0]["healthy"] is True
        assert statuses == [Status.DEVICE_FAILED] * 3
        (dev,) = _status(sock, 30)["devices"]
        assert dev["healthy"] is False
        assert dev["failed"] == 3
        assert "3 consecutive tasks failed" in daemon.executors["dla0"].health()[1]
        ready, detail = daemon.metrics.ready()  # /health/ready says the same
        assert not ready
        assert detail["devices"]["dla0"] == "failed"
        sock.send_multipart(protocol.encode(protocol.InferRequest(40, "demo", IMAGE)))
        assert recv(sock).status == Status.OK  # the fifth task passes: healthy again
        assert _status(sock, 41)["devices"][0]["healthy"] is True
        assert daemon.metrics.ready()[0]


def test_consecutive_failures_quarantine_a_core_and_a_probe_returns_it(tmp_path: Path) -> None:
    seed = _seed_ok_then_fail3_then_ok()
    faults = (
        f"[devices.dla0.faults]\nerror_rate = 0.5\nseed = {seed}\n[health]\nquarantine_after = 3\n"
        "probe_after_s = 30.0"  # the test starts the probe itself, once it has seen the quarantine
    )
    daemon = _one_core(tmp_path, 500.0, faults)
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        for i in range(3):  # tasks 1, 2, 3 fail (nowhere else to retry them)
            sock.send_multipart(protocol.encode(protocol.InferRequest(10 + i, "demo", IMAGE)))
            assert recv(sock).status == Status.DEVICE_FAILED
        (dev,) = _status(sock, 30)["devices"]
        assert (dev["state"], dev["healthy"]) == ("quarantined", False)
        assert "3 tasks failed in a row" in dev["reason"]
        ready, detail = daemon.metrics.ready()  # no engine of the model serves: not ready
        assert (ready, detail["devices"]["dla0"]) == (False, "quarantined")
        sock.send_multipart(protocol.encode(protocol.InferRequest(40, "demo", IMAGE)))
        refused = recv(sock)  # answered at once, without a task
        assert refused.status == Status.DEVICE_FAILED
        assert "no healthy device serves model 'demo'" in refused.message

        assert daemon.probe_now("dla0")  # the rest is over
        while dev["state"] != "serving":  # the probe (task 4, which passes) returns it
            (dev,) = _status(sock, 31)["devices"]
        assert dev["healthy"] is True
        sock.send_multipart(protocol.encode(protocol.InferRequest(41, "demo", IMAGE)))
        assert recv(sock).status == Status.OK
        assert daemon.metrics.ready()[0]
        assert daemon.quarantines("dla0") == 1


def test_status_reports_a_failed_warm_up(tmp_path: Path) -> None:
    daemon = _one_core(tmp_path, 500.0, "[devices.dla0.faults]\nerror_rate = 1.0")
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        (dev,) = _status(sock, 1)["devices"]
        assert dev["healthy"] is False
        assert daemon.executors["dla0"].health()[1].startswith("warm-up failed")
        # Out of placement and probed (every probe fails here), not left serving.
        assert (dev["state"], dev["reason"][:14]) == ("quarantined", "warm-up failed")
        assert daemon.metrics.ready()[1]["devices"]["dla0"] == "quarantined"
        assert not daemon.metrics.ready()[0]


def test_status_counts_the_streams_waiting(tmp_path: Path) -> None:
    daemon = _one_core(tmp_path, 1_000_000.0)  # 1 s a task: what is queued stays queued
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        for i in range(2):  # one per slot: both slots busy for a second
            sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", IMAGE)))
        report = _status(sock, 9)
        while report["devices"][0]["in_flight"] < 2:  # the slots take them on the loop
            report = _status(sock, 9)
        for i, stream in enumerate(["a", "b", "a", "c"]):  # "a"'s second frame replaces its first
            request = protocol.InferRequest(10 + i, "demo", IMAGE, stream=stream)
            sock.send_multipart(protocol.encode(request))
        superseded = recv(sock)
        assert (superseded.id, superseded.status) == (10, Status.CANCELLED)
        report = _status(sock, 20)
        assert report["queues"]["streams"] == 3
        assert report["queues"]["depth"] == 3
        replies = [recv(sock) for _ in range(5)]
    assert sorted(int(r.id or 0) for r in replies) == [0, 1, 11, 12, 13]
