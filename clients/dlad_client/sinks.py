"""Where a camera rig's results go (:class:`dlad_client.cameras.CameraRig`'s ``sinks``).

An event is one answered frame as plain values (``CameraRig.event``): ``camera``, ``frame``,
``pts_s``, ``latency_ms`` and :meth:`dlad_client.Result.to_dict`'s fields. Each sink reads its
events from a bounded queue the rig fills without waiting (a sink that is slow or down drops
events there, counted, and never holds a camera's frames), and may pass fewer on:

* ``max_per_s``: at most this many events a second for each camera (the rest counted in
  :attr:`Sink.limited`);
* ``only_detections``: only frames with a detection; ``classes``: only these class names, the
  other detections taken out of the event (a frame left without any is not passed on).

Sinks: :class:`JsonLinesSink` (stdout or a file), :class:`MqttSink` (an MQTT broker, a topic a
camera; ``aiomqtt``, reconnecting) and :class:`WebhookSink` (an HTTP POST of each event as JSON;
``httpx``).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
from collections.abc import Sequence
from typing import IO, Any, Final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

__all__ = ["JsonLinesSink", "MqttSink", "Sink", "WebhookSink"]

Events = MemoryObjectReceiveStream[dict[str, Any]]
RECONNECT_S: Final = (0.5, 10.0)


def _dumps(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))


class Sink:
    """Where events go: :meth:`run` reads them from ``events`` until the stream ends. A sink
    that fails raises; the rig notes why and drops its events from then on."""

    name: str = "sink"

    def __init__(
        self, *, max_per_s: float | None = None, only_detections: bool = False,
        classes: Sequence[str] | None = None,
    ) -> None:  # fmt: skip
        if max_per_s is not None and not max_per_s > 0:
            raise ValueError(f"max_per_s must be > 0, got {max_per_s!r}")
        self.max_per_s, self.only_detections = max_per_s, only_detections
        self.classes = None if classes is None else frozenset(classes)
        self.limited = 0  # events over max_per_s
        self.filtered = 0  # events without the detections asked for
        self.sent = 0
        self.failed = 0  # events the sink could not deliver (it goes on)
        self._next_ns: dict[str, int] = {}

    def accept(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event as this sink passes it on, or None (filtered, or over the rate)."""
        if self.classes is not None:
            kept = [d for d in event["detections"] if d["class_name"] in self.classes]
            event = event | {"detections": kept}
        if (self.only_detections or self.classes is not None) and not event["detections"]:
            self.filtered += 1
            return None
        if self.max_per_s is not None:
            now, camera = time.monotonic_ns(), event["camera"]
            if now < self._next_ns.get(camera, 0):
                self.limited += 1
                return None
            self._next_ns[camera] = now + round(1e9 / self.max_per_s)
        return event

    async def run(self, events: Events) -> None:
        raise NotImplementedError


class JsonLinesSink(Sink):
    """One JSON object a line, to ``stream`` (stdout by default), flushed each line."""

    name = "json"

    def __init__(self, stream: IO[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream = stream

    async def run(self, events: Events) -> None:
        out = self.stream or sys.stdout
        async with events:
            async for event in events:
                passed = self.accept(event)
                if passed is not None:
                    out.write(_dumps(passed) + "\n")
                    out.flush()
                    self.sent += 1


class MqttSink(Sink):
    """Each event as JSON to an MQTT broker (``mqtt://[user:password@]host[:port]``, or
    ``mqtts://`` over TLS), on ``topic`` with ``{camera}`` replaced by the camera's name, at
    ``qos``. A broker that is down or drops the connection is reconnected to (0.5 s, doubling
    to 10 s); events meanwhile wait in the rig's bounded queue, and beyond it are dropped."""

    name = "mqtt"

    def __init__(
        self, url: str, *, topic: str = "dlad/{camera}", qos: int = 0, retain: bool = False,
        client_id: str | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ValueError(f"an MQTT broker is mqtt://host[:port] or mqtts://..., got {url!r}")
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
        try:
            topic.format(camera="x")
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"topic may name {{camera}} only, got {topic!r}") from None
        self.host, self.tls = parts.hostname, parts.scheme == "mqtts"
        self.port = parts.port or (8883 if self.tls else 1883)
        self.username, self.password = parts.username, parts.password
        self.topic, self.qos, self.retain, self.client_id = topic, qos, retain, client_id
        self.connects = 0
        self.error = ""

    async def run(self, events: Events) -> None:
        import aiomqtt  # noqa: PLC0415

        backoff = RECONNECT_S[0]
        pending: dict[str, Any] | None = None  # the event a dropped connection did not take
        async with events:
            while True:
                try:
                    async with aiomqtt.Client(
                        self.host, self.port, username=self.username, password=self.password,
                        identifier=self.client_id, tls_params=aiomqtt.TLSParameters() if self.tls
                        else None,
                    ) as client:  # fmt: skip
                        self.connects += 1
                        backoff = RECONNECT_S[0]
                        while True:
                            if pending is None:
                                pending = self.accept(await events.receive())
                                if pending is None:
                                    continue
                            await client.publish(
                                self.topic.format(camera=pending["camera"]), _dumps(pending),
                                qos=self.qos, retain=self.retain,
                            )  # fmt: skip
                            self.sent += 1
                            pending = None
                except anyio.EndOfStream:
                    return
                except aiomqtt.MqttError as exc:
                    self.error = str(exc)
                    await anyio.sleep(backoff)
                    backoff = min(2 * backoff, RECONNECT_S[1])


class WebhookSink(Sink):
    """Each event POSTed as JSON to ``url`` (``{camera}`` in it replaced), within
    ``timeout_s``; an event the server does not take (an error status, a timeout, no server)
    is counted in :attr:`failed` and the sink goes on."""

    name = "webhook"

    def __init__(
        self, url: str, *, timeout_s: float = 2.0, headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"a webhook is an http:// or https:// URL, got {url!r}")
        self.url, self.timeout_s, self.headers = url, timeout_s, dict(headers or {})
        self.error = ""

    async def run(self, events: Events) -> None:
        import httpx  # noqa: PLC0415

        async with events, httpx.AsyncClient(timeout=self.timeout_s) as http:
            async for event in events:
                passed = self.accept(event)
                if passed is None:
                    continue
                url = self.url.replace("{camera}", urllib.parse.quote(passed["camera"], safe=""))
                try:
                    reply = await http.post(url, content=_dumps(passed), headers={
                        "content-type": "application/json", **self.headers})  # fmt: skip
                    reply.raise_for_status()
                except httpx.HTTPError as exc:
                    self.failed += 1
                    self.error = f"{type(exc).__name__}: {exc}"
                else:
                    self.sent += 1
