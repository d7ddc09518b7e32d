"""Metrics and health: the exposition parses with prometheus_client's own parser and counts what
the daemon answered; /health/ready flips as devices load and warm and when the daemon drains;
/health/live flips when the event loop is blocked; STATUS carries the load figures on request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import ProtocolError, Status
from dlad.metrics import _LATENCIES, LATENCY_BUCKETS, DeviceSample, Metrics, MetricsServer

pytestmark = pytest.mark.timeout(60)

CONFIG = """
[daemon]
drain_timeout_s = 10.0
default_deadline_ms = 10000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[pre_post]
enabled = false
[metrics]
enabled = true
heartbeat_s = 0.05
live_timeout_s = {live_timeout}
load_window_s = 5.0
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 4
mode = "timing"
latency_us = {latency}
task_timeout_ms = 5000.0
[devices.dla1]
kind = "dla"
core = 1
queue_depth = 4
mode = "timing"
latency_us = {latency}
task_timeout_ms = 5000.0
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""
IMAGE = np.zeros((32, 32, 3), np.uint8)


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll a state predicate until it holds (fails the test at ``timeout``)."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "state not reached in time"
        time.sleep(0.01)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as err:
        with err:
            return int(err.code), bytes(err.read())


@contextmanager
def serving(
    tmp_path: Path, *, latency: float = 2000.0, live_timeout: float = 0.5
) -> Iterator[Daemon]:
    """A daemon on its own thread with metrics on a free port; yields as soon as its metrics
    server is up and its socket bound (devices may still be loading or warming)."""
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(CONFIG.format(latency=latency, live_timeout=live_timeout))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"], metrics_port=0)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            anyio.run(daemon.serve)
        except BaseException as exc:  # noqa: BLE001 (re-raised by the test via `errors`)
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    server = daemon.metrics_server
    assert server is not None

    def started() -> bool:
        assert not errors, errors
        try:
            return server.port > 0 and bool(daemon.bound)
        except RuntimeError:
            return False

    try:
        wait_for(started)
        yield daemon
    finally:
        daemon.stop_threadsafe()
        thread.join(30)
        assert not thread.is_alive()
        assert not errors, errors


def url(daemon: Daemon, path: str) -> str:
    assert daemon.metrics_server is not None
    return daemon.metrics_server.url + path


@contextmanager
def dealer(endpoint: str) -> Iterator[zmq.Socket[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def recv(sock: zmq.Socket[Any]) -> protocol.Reply:
    assert sock.poll(20_000), "no reply"
    return protocol.decode_reply(sock.recv_multipart())


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample_value(fams: dict[str, Any], family: str, suffix: str = "", **labels: str) -> float:
    total = 0.0
    for s in fams[family].samples:
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


# ------------------------------------------------------------------------------ Metrics alone


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["dla0", "dla1", "gpu"]),
                          st.floats(0, 30, allow_nan=False),
                          st.sampled_from([0.0005, 0.002, 0.1, 10.0, 11.0])),
                max_size=40))  # fmt: skip
def test_the_latency_histograms_expose_what_prometheus_clients_would(
    replies: list[tuple[str, float, float]],
) -> None:
    """dlad keeps its three latency histograms as plain counts (dlad.metrics._Latencies);
    scraped, they read as prometheus_client's own Histogram of the same values would."""
    m = Metrics("dlad", "0")
    reference = CollectorRegistry()
    hists = [Histogram(name, doc, ["model", "device"], buckets=LATENCY_BUCKETS,
                       registry=reference) for name, doc in _LATENCIES]  # fmt: skip
    for device, seconds, on_a_bound in replies:
        us = (seconds * 1e6, on_a_bound * 1e6, (seconds + on_a_bound) * 1e6)
        m.observe_reply("demo", device, Status.OK, queue_us=us[0], device_us=us[1],
                        total_us=us[2])  # fmt: skip
        for hist, value in zip(hists, us, strict=True):
            hist.labels("demo", device).observe(value / 1e6)  # as Metrics converts it
    ours = families(m.exposition().decode())
    theirs = families(generate_latest(reference).decode())
    for name, _ in _LATENCIES:
        assert ours[name].type == "histogram"

        def samples(fam: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            return {(x.name, tuple(sorted(x.labels.items()))): x.value for x in fam.samples
                    if not x.name.endswith("_created")}  # fmt: skip

        want = samples(theirs[name])
        got = samples(ours[name])
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_exposition_parses_and_counts_replies_by_model_device_and_status() -> None:
    clock = FakeClock()
    m = Metrics("d", "0.1.0", heartbeat_s=0.5, live_timeout_s=2.0, load_window_s=10.0, clock=clock)
    for i in range(10):
        m.observe_reply(
            "demo", f"dla{i % 2}", Status.OK, queue_us=100, device_us=4000, total_us=5000
        )
    m.observe_reply("demo", None, Status.OVERLOADED)
    m.observe_reply("demo", "dla1", Status.DEVICE_FAILED, total_us=700)
    m.observe_reply("", None, Status.BAD_REQUEST)
    m.tick([DeviceSample("dla0", 3, 4, 2, 0), DeviceSample("dla1", 1, 4, 1, 0)])
    fams = families(m.exposition().decode())
    ok = {
        dev: sample_value(fams, "dlad_requests", "_total", device=dev, status="OK")
        for dev in ("dla0", "dla1")
    }
    assert ok == {"dla0": 5.0, "dla1": 5.0}
    assert sample_value(fams, "dlad_requests", "_total", status="OVERLOADED", device="") == 1
    assert sample_value(fams, "dlad_requests", "_total", status="DEVICE_FAILED") == 1
    assert sample_value(fams, "dlad_requests", "_total", status="BAD_REQUEST", model="") == 1
    assert fams["dlad_requests"].type == "counter"
    for hist in ("dlad_request_queue_seconds", "dlad_request_device_seconds",
                 "dlad_request_duration_seconds"):  # fmt: skip
        assert fams[hist].type == "histogram"
        assert sample_value(fams, hist, "_count") == 10  # OK replies only
    assert sample_value(fams, "dlad_request_device_seconds", "_sum") == pytest.approx(0.04)
    assert sample_value(fams, "dlad_queue_depth", device="dla0") == 3
    assert sample_value(fams, "dlad_queue_capacity", device="dla1") == 4
    assert sample_value(fams, "dlad_device_in_flight", device="dla0") == 2
    assert sample_value(fams, "process_resident_memory_bytes") > 0
    assert "process_cpu_seconds" in fams
    assert sample_value(fams, "dlad_info", version="0.1.0", name="d") == 1


def test_busy_ratio_rates_and_percentiles_over_the_window() -> None:
    clock = FakeClock()
    m = Metrics("d", "0.1.0", heartbeat_s=1.0, live_timeout_s=2.0, load_window_s=4.0, clock=clock)
    busy = 0
    for _step in range(8):  # dla0 busy half of every second, dla1 idle
        m.tick([DeviceSample("dla0", 0, 4, 1, busy), DeviceSample("dla1", 0, 4, 0, 0)])
        for k in range(100):
            m.observe_reply("demo", "dla0", Status.OK, total_us=1000 + k)
        clock.now += 1.0
        busy += 500_000_000
    m.tick([DeviceSample("dla0", 0, 4, 1, busy), DeviceSample("dla1", 0, 4, 0, 0)])
    load = m.load_report()
    assert load["window_s"] == 4.0
    assert load["ok_rate_hz"] == pytest.approx(100.0)  # 4 seconds of 100 within the window
    assert load["p50_us"] == pytest.approx(1049.5)
    assert load["p99_us"] == pytest.approx(1098.01, abs=0.5)
    by_name = {d["name"]: d for d in load["devices"]}
    assert by_name["dla0"]["busy_ratio"] == pytest.approx(0.5)
    assert by_name["dla1"] == {"name": "dla1", "busy_ratio": 0.0, "rate_hz": 0.0, "p99_us": 0.0}
    fams = families(m.exposition().decode())
    assert sample_value(fams, "dlad_device_busy_ratio", device="dla0") == pytest.approx(0.5)
    assert sample_value(fams, "dlad_device_busy_seconds", "_total", device="dla0") == 4.0
    # the report is a valid wire value
    report_ok = protocol.StatusReply(1, Status.OK, report=_report_with(load))
    assert report_ok.report is not None
    assert report_ok.report["load"] == load


def _report_with(load: Any) -> Any:
    return {
        "name": "d", "state": "RUNNING", "live": True, "ready": True, "version": "0.1.0",
        "protocol": 1, "devices": [], "models": [],
        "queues": {"depth": 0, "capacity": 8, "streams": 0}, "load": load,
    }  # fmt: skip


def test_live_follows_the_heartbeat_and_ready_every_device() -> None:
    clock = FakeClock()
    m = Metrics("d", "0.1.0", heartbeat_s=0.5, live_timeout_s=2.0, clock=clock)
    assert m.live()[0]
    clock.now += 2.5
    live, body = m.live()
    assert not live
    assert body["last_beat_s"] == 2.5
    m.tick([])
    assert m.live()[0]
    assert not m.ready()[0]  # no device, not RUNNING
    m.daemon_state("RUNNING")
    m.device_state("dla0", "loading")
    m.device_state("dla1", "loading")
    m.device_state("dla0", "ready")
    devices = {"dla0": "ready", "dla1": "loading"}
    assert m.ready() == (False, {"ready": False, "state": "RUNNING", "devices": devices})
    m.device_state("dla1", "ready")
    assert m.ready()[0]
    m.daemon_state("DRAINING")
    assert not m.ready()[0]


def test_batches_are_counted_by_device_kind_and_size() -> None:
    clock = FakeClock()
    m = Metrics("d", "0.1.0", clock=clock)
    m.tick([DeviceSample("gpu", 0, 16, 0, 0, "gpu", (2, 0, 1)), DeviceSample("dla0", 0, 4, 0, 0,
            "dla", (5,))])  # fmt: skip
    clock.now += 0.5
    m.tick([DeviceSample("gpu", 0, 16, 0, 0, "gpu", (3, 0, 4)), DeviceSample("dla0", 0, 4, 0, 0,
            "dla", (9,))])  # fmt: skip
    fams = families(m.exposition().decode())
    batches = "dlad_device_batches"
    assert sample_value(fams, batches, "_total", device="gpu", kind="gpu", size="1") == 3
    assert sample_value(fams, batches, "_total", device="gpu", kind="gpu", size="3") == 4
    assert sample_value(fams, batches, "_total", device="gpu", size="2") == 0
    assert sample_value(fams, batches, "_total", device="dla0", kind="dla", size="1") == 9


def test_server_routes_and_closes() -> None:
    m = Metrics("d", "0.1.0")
    server = MetricsServer(m, port=0)
    with pytest.raises(RuntimeError):
        _ = server.port
    server.start()
    try:
        status, body = get(server.url + "/metrics")
        assert status == 200
        assert b"dlad_info" in body
        assert get(server.url + "/nope")[0] == 404
        status, body = get(server.url + "/health/ready")
        assert status == 503
        assert json.loads(body)["ready"] is False
    finally:
        server.close()
    server.close()  # idempotent


# ------------------------------------------------------------------------------ a real daemon


def test_ready_flips_as_devices_warm_and_when_draining(tmp_path: Path) -> None:
    # 3 s per task: the warm-up task keeps both devices "warming" long enough to be seen, and
    # the drain open for the GETs below, however loaded the machine
    with serving(tmp_path, latency=3_000_000.0) as daemon:
        status, body = get(url(daemon, "/health/ready"))
        assert status == 503
        assert set(json.loads(body)["devices"].values()) <= {"loading", "warming"}
        wait_for(lambda: get(url(daemon, "/health/ready"))[0] == 200)
        body = json.loads(get(url(daemon, "/health/ready"))[1])
        assert body == {"ready": True, "state": "RUNNING",
                        "devices": {"dla0": "ready", "dla1": "ready"}}  # fmt: skip
        with dealer(daemon.bound[0]) as sock:
            sock.send_multipart(protocol.encode(protocol.StatusRequest(1)))
            reply = recv(sock)
            assert isinstance(reply, protocol.StatusReply)
            assert reply.report is not None
            assert reply.report["ready"] is True
            # one request on a device, then drain: not ready while it finishes
            sock.send_multipart(protocol.encode(protocol.InferRequest(2, "demo", IMAGE)))
            wait_for(lambda: _in_flight(daemon))
            daemon.stop_threadsafe()
            wait_for(lambda: get(url(daemon, "/health/ready"))[0] == 503)
            assert json.loads(get(url(daemon, "/health/ready"))[1])["state"] == "DRAINING"
            assert get(url(daemon, "/health/live"))[0] == 200
            assert recv(sock).status == Status.OK  # the drain finished it


def _in_flight(daemon: Daemon) -> bool:
    fams = families(get(url(daemon, "/metrics"))[1].decode())
    return sample_value(fams, "dlad_device_in_flight") >= 1


def test_live_flips_when_the_event_loop_is_blocked(tmp_path: Path) -> None:
    with serving(tmp_path) as daemon:
        wait_for(lambda: get(url(daemon, "/health/ready"))[0] == 200)
        assert get(url(daemon, "/health/live"))[0] == 200
        loop = daemon._loop
        assert isinstance(loop, asyncio.AbstractEventLoop)
        gate = threading.Event()
        loop.call_soon_threadsafe(gate.wait, 30)  # the loop is stuck until the gate opens
        try:
            wait_for(lambda: get(url(daemon, "/health/live"))[0] == 503)
            body = json.loads(get(url(daemon, "/health/live"))[1])
            assert body["live"] is False
            assert body["last_beat_s"] > body["timeout_s"]
        finally:
            gate.set()
        wait_for(lambda: get(url(daemon, "/health/live"))[0] == 200)
        fams = families(get(url(daemon, "/metrics"))[1].decode())
        assert sample_value(fams, "dlad_event_loop_lag_seconds") >= 0.0


def test_scrape_counts_what_the_daemon_answered(tmp_path: Path) -> None:
    n = 24
    with serving(tmp_path, latency=1000.0) as daemon, dealer(daemon.bound[0]) as sock:
        wait_for(lambda: get(url(daemon, "/health/ready"))[0] == 200)
        for i in range(n):
            sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", IMAGE)))
        sock.send_multipart(protocol.encode(protocol.InferRequest(n, "nope", IMAGE)))
        replies = [recv(sock) for _ in range(n + 1)]
        statuses = [r.status for r in replies]
        sock.send_multipart(protocol.encode(protocol.StatusRequest(100, load=True)))
        status = recv(sock)
        sock.send_multipart(protocol.encode(protocol.StatusRequest(101)))
        plain = recv(sock)
        fams = families(get(url(daemon, "/metrics"))[1].decode())
    ok = statuses.count(Status.OK)
    overloaded = statuses.count(Status.OVERLOADED)
    assert ok + overloaded == n
    assert ok >= 8  # 2 queues of 4 + 2 x 2 slots take at least 8
    assert sample_value(fams, "dlad_requests", "_total", model="demo", status="OK") == ok
    assert sample_value(fams, "dlad_requests", "_total", status="OVERLOADED") == overloaded
    # an unserved model's name is the client's own: it counts under model="" (bounded series)
    assert sample_value(fams, "dlad_requests", "_total", model="", status="NOT_FOUND") == 1
    assert not [s for s in fams["dlad_requests"].samples if s.labels.get("model") == "nope"]
    assert sample_value(fams, "dlad_request_duration_seconds", "_count", model="demo") == ok
    assert sample_value(fams, "dlad_ready") == 1
    assert {s.labels["device"] for s in fams["dlad_device_ready"].samples} == {"dla0", "dla1"}
    assert isinstance(status, protocol.StatusReply)
    assert status.report is not None
    load = status.report["load"]
    assert {d["name"] for d in load["devices"]} == {"dla0", "dla1"}
    assert load["ok_rate_hz"] > 0
    assert load["p99_us"] >= load["p50_us"] > 0
    assert isinstance(plain, protocol.StatusReply)
    assert plain.report is not None
    assert "load" not in plain.report


def test_status_request_load_field_round_trips_and_is_strict() -> None:
    frames = protocol.encode(protocol.StatusRequest(3))
    assert protocol.decode_request(frames) == protocol.StatusRequest(3)
    assert b"load" not in bytes(frames[0])  # what clients older than the field send
    frames = protocol.encode(protocol.StatusRequest(3, load=True))
    assert protocol.decode_request(frames) == protocol.StatusRequest(3, load=True)
    with pytest.raises(ProtocolError, match=r"^load: must be a bool"):
        protocol.StatusRequest(3, load=1)  # type: ignore[arg-type]
    device = {"name": "dla0", "busy_ratio": 1.5, "rate_hz": 0.0, "p99_us": 0.0}
    load = {"window_s": 1.0, "rate_hz": 0.0, "ok_rate_hz": 0.0, "p50_us": 0.0, "p99_us": 0.0}
    report = _report_with(load | {"devices": [device]})
    with pytest.raises(ProtocolError, match=r"^report\.load\.devices\[0\]\.busy_ratio"):
        protocol.StatusReply(1, Status.OK, report=report)


def test_a_flood_of_half_open_connections_costs_no_threads_and_passes() -> None:
    """The adversarial test's metrics port spawned a thread per connection, and connections
    that sent part of a request stayed open for ever."""
    import socket
    import threading

    from dlad.metrics import HTTP_PENDING, HTTP_WORKERS

    m = Metrics("d", "0.1.0")
    server = MetricsServer(m, port=0, request_timeout_s=0.5)  # [metrics] request_timeout_s
    server.start()
    threads = threading.active_count()
    half_open = []
    try:
        for _ in range(3 * HTTP_PENDING):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finished
            half_open.append(s)
        assert threading.active_count() <= threads + HTTP_WORKERS
        for s in half_open:  # each one is closed by the daemon: unanswered, or timed out
            s.settimeout(60)
            assert s.recv(1) == b""
        status, _ = get(server.url + "/health/live")
        assert status in (200, 503)  # answered again
    finally:
        for s in half_open:
            s.close()
        server.close()


def test_the_probes_answer_while_hundreds_of_half_written_requests_are_held_open() -> None:
    """A slowloris attack (the adversarial test's: 500 half-written HTTP requests held open)
    timed out /metrics and the probes, and a kubelet would restart a healthy daemon. Heads are
    now read on one thread with a deadline for the whole head, and at the cap the connection
    longest at it goes: a probe's whole request is read and answered beside them."""
    import socket

    from dlad.metrics import HTTP_PENDING, HTTP_READING

    m = Metrics("d", "0.1.0")
    server = MetricsServer(m, port=0, request_timeout_s=60.0)  # the attackers are never timed out
    server.start()
    held = []
    try:
        for _ in range(HTTP_READING + 2 * HTTP_PENDING):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            held.append(s)
        for path in ("/health/live", "/metrics", "/health/live"):
            status, _ = get(server.url + path)
            assert status in (200, 503), path  # answered, not timed out or cut
    finally:
        for s in held:
            s.close()
        server.close()
