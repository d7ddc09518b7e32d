"""The rig's sinks against real servers on loopback: an MQTT broker (``amqtt``, an asyncio
broker from the package registry, or Debian's ``mosquitto`` where it is installed) and an HTTP
server; their filters and rate limit; a broker that is down, then up."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiomqtt
import anyio
import pytest

from dlad_client.sinks import JsonLinesSink, MqttSink, Sink, WebhookSink
from tests.clients.waiting import until

pytestmark = pytest.mark.timeout(60)


def _event(camera: str, frame: int, classes: tuple[str, ...] = ("person",)) -> dict[str, Any]:
    dets = [{"box": [1.0, 2.0, 3.0, 4.0], "score": 0.9, "class_id": i, "class_name": name}
            for i, name in enumerate(classes)]  # fmt: skip
    return {"camera": camera, "frame": frame, "pts_s": frame / 30, "latency_ms": 5.0,
            "request_id": frame + 1, "device": "dla0", "timing": {},
            "detections": dets}  # fmt: skip


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _feed(sink: Sink, events: list[dict[str, Any]]) -> None:
    """Run ``sink`` on ``events`` until it has read them all and the stream has ended."""
    send, receive = anyio.create_memory_object_stream[dict[str, Any]](len(events) + 1)
    for event in events:
        send.send_nowait(event)
    send.close()  # the sink reads what is queued, then the end
    await sink.run(receive)


# ------------------------------------------------------------------------------ filters


def test_a_sink_passes_what_its_filters_keep() -> None:
    sink = Sink(classes=["car"])
    assert sink.accept(_event("a", 0, ("person",))) is None
    kept = sink.accept(_event("a", 1, ("person", "car")))
    assert kept is not None
    assert [d["class_name"] for d in kept["detections"]] == ["car"]
    assert sink.filtered == 1
    only = Sink(only_detections=True)
    assert only.accept(_event("a", 0, ())) is None
    assert only.accept(_event("a", 1)) is not None


def test_max_per_s_is_per_camera() -> None:
    sink = Sink(max_per_s=1.0)
    assert sink.accept(_event("a", 0)) is not None
    assert sink.accept(_event("b", 0)) is not None  # another camera has its own budget
    assert sink.accept(_event("a", 1)) is None  # the same second
    assert sink.limited == 1


@pytest.mark.parametrize(
    ("kind", "url"),
    [("mqtt", "http://x"), ("mqtt", "mqtt://"), ("webhook", "ftp://x"), ("webhook", "x")],
)
def test_a_bad_url_is_a_value_error(kind: str, url: str) -> None:
    with pytest.raises(ValueError, match="got"):
        (MqttSink if kind == "mqtt" else WebhookSink)(url)


def test_json_lines_are_one_object_each(tmp_path: Any) -> None:
    out = (tmp_path / "events.jsonl").open("w")
    anyio.run(_feed, JsonLinesSink(out), [_event("a", i) for i in range(3)])
    out.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["frame"] for line in lines] == [0, 1, 2]


# ------------------------------------------------------------------------------ MQTT


@asynccontextmanager
async def broker(port: int) -> AsyncIterator[str]:
    """An MQTT broker on loopback: mosquitto where Debian's is installed, else amqtt."""
    if shutil.which("mosquitto"):
        async with await anyio.open_process(["mosquitto", "-p", str(port)]) as proc:
            await until(lambda: _listening(port))
            yield f"mqtt://127.0.0.1:{port}"
            proc.terminate()
        return
    from amqtt.broker import Broker

    server = Broker({
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    })  # fmt: skip
    await server.start()
    try:
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        await server.shutdown()


async def _collect(port: int, want: int, into: list[tuple[str, dict[str, Any]]],
                   ready: anyio.Event) -> None:  # fmt: skip
    async with aiomqtt.Client("127.0.0.1", port) as sub:
        await sub.subscribe("dlad/#", qos=1)
        ready.set()
        async for message in sub.messages:
            into.append((str(message.topic), json.loads(bytes(message.payload))))
            if len(into) == want:
                return


def test_each_event_is_published_on_its_cameras_topic() -> None:
    port = _free_port()
    got: list[tuple[str, dict[str, Any]]] = []

    async def go() -> MqttSink:
        async with broker(port) as url:
            ready = anyio.Event()
            sink = MqttSink(url, qos=1)
            events = [_event(c, i) for i in range(3) for c in ("front", "back")]
            async with anyio.create_task_group() as tg:
                tg.start_soon(_collect, port, len(events), got, ready)
                await ready.wait()
                await _feed(sink, events)
            return sink

    sink = anyio.run(go)
    assert sink.sent == 6
    assert sorted((t, e["frame"]) for t, e in got) == sorted(
        (f"dlad/{c}", i) for i in range(3) for c in ("front", "back")
    )
    assert got[0][1]["detections"][0]["class_name"] == "person"


def test_a_broker_that_is_down_is_connected_to_once_it_is_up() -> None:
    """Events wait in the queue while the broker is down; once it is up the sink connects and
    sends them (none is lost while the queue has room)."""
    port = _free_port()
    got: list[tuple[str, dict[str, Any]]] = []

    async def go() -> MqttSink:
        sink = MqttSink(f"mqtt://127.0.0.1:{port}", qos=1)
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](16)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sink.run, receive)
            for i in range(4):
                send.send_nowait(_event("cam", i))
            await until(lambda: bool(sink.error))  # it tried, and the broker is not there
            assert sink.connects == 0
            async with broker(port):
                ready = anyio.Event()
                tg.start_soon(_collect, port, 4, got, ready)
                await until(lambda: len(got) == 4)
            await send.aclose()
        return sink

    sink = anyio.run(go)
    assert sink.connects >= 1
    assert sorted(e["frame"] for _, e in got) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------ webhooks


@contextmanager
def http_server(fail_every: int = 0) -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """A local HTTP server taking POSTs: (its URL, what it received); ``fail_every``: every
    n-th POST answered 500."""
    received: list[tuple[str, Any]] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with lock:
                received.append((self.path, body))
                n = len(received)
            self.send_response(500 if fail_every and n % fail_every == 0 else 204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_each_event_is_posted_and_a_refusal_is_counted() -> None:
    with http_server(fail_every=3) as (url, received):
        sink = WebhookSink(url + "/hook/{camera}")
        anyio.run(_feed, sink, [_event("front door", i) for i in range(6)])
    assert [body["frame"] for _, body in received] == list(range(6))
    assert {path for path, _ in received} == {"/hook/front%20door"}
    assert (sink.sent, sink.failed) == (4, 2)
    assert "500" in sink.error


def test_a_webhook_with_no_server_fails_each_event_and_goes_on() -> None:
    sink = WebhookSink(f"http://127.0.0.1:{_free_port()}/", timeout_s=1.0)
    anyio.run(_feed, sink, [_event("a", i) for i in range(3)])
    assert (sink.sent, sink.failed) == (0, 3)
