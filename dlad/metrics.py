"""Prometheus metrics, health endpoints, and the recent-load figures of STATUS.

:class:`Metrics` is owned by the daemon's event loop: the daemon reports each INFER reply
(:meth:`Metrics.observe_reply`), each device's life cycle (:meth:`Metrics.device_state`), and
every ``heartbeat_s`` a sample of its queues and devices (:meth:`Metrics.tick`), which is also the
loop's heartbeat. The loop is the only writer; the HTTP server's threads only read, through
values replaced whole (a float, a frozen :class:`Health`) and through ``prometheus_client``'s
own locks, so a scrape never touches the scheduler or a worker.

:class:`MetricsServer` serves, on its own threads (never the event loop's)::

    GET /metrics        the Prometheus text exposition of the daemon's own CollectorRegistry
    GET /health/live    200 while the loop has beaten within ``live_timeout_s``, else 503
    GET /health/ready   200 while RUNNING with every device loaded and warm (and at least one
                        not quarantined), else 503

Both health endpoints answer a small JSON object saying why. Metric names, types and labels
are listed in ``docs/metrics.md``.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import json
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Info,
    ProcessCollector,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dlad.errors import Status
from dlad.protocol import DeviceLoad, LoadStatus

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

__all__ = ["DeviceSample", "DeviceState", "Health", "Metrics", "MetricsServer"]

DeviceState = Literal["loading", "warming", "ready", "failed", "quarantined"]
"""A device's life cycle as readiness sees it: ``loading`` (core opening, loadable loading),
``warming`` (the first task running), ``ready``, ``failed`` (warm-up failed, or its last tasks
all failed while quarantine is off) or ``quarantined`` (out of placement: the plane's health
keeping)."""

LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
"""Histogram buckets in seconds: a DLA task takes ~1-10 ms, a queue wait up to the deadline."""
_MAX_SAMPLES: Final = 1 << 18
"""Bound on the replies remembered for the load window (memory stays bounded at any rate)."""


_LATENCIES: Final = (
    ("dlad_request_queue_seconds", "Receipt to dispatch to a device, of requests answered OK."),
    ("dlad_request_device_seconds", "Device execution time of requests answered OK."),
    ("dlad_request_duration_seconds",
     "Receipt to reply (end to end on the daemon) of requests answered OK."),
)  # fmt: skip
"""The three latency histograms of each OK reply, by ``model`` and ``device``: name, help."""


class _Latencies(Collector):
    """:data:`_LATENCIES` as plain bucket counts the event loop adds each OK reply to (one
    bisect a histogram), exposed as Prometheus histograms when scraped. prometheus_client's
    ``Histogram.observe`` walks its buckets in Python under a lock of its own: three of them
    were a tenth of the bytecodes the loop ran a reply (``bench/loop_opcodes.py``, BENCHMARKS
    §9.11). Safe to collect from any thread."""

    def __init__(self, bounds: Iterable[float]) -> None:
        self._bounds = tuple(sorted(float(b) for b in bounds))
        go = cast("Callable[[float], str]", floatToGoString)  # untyped: Prometheus's "le" text
        self._les = [go(b) for b in (*self._bounds, float("inf"))]
        self._lock = threading.Lock()
        # (model, device) -> per histogram [count in each bucket (the last +Inf)..., sum]
        self._series: dict[tuple[str, str], tuple[list[float], ...]] = {}

    def observe(self, model: str, device: str, queue: float, run: float, total: float) -> None:
        """One reply's figures (seconds), in :data:`_LATENCIES` order."""
        at, where = bisect.bisect_left, self._bounds  # a value's bucket: the first bound >= it
        with self._lock:  # collect() walks the series from an HTTP thread
            rows = self._series.get((model, device))
            if rows is None:
                width = len(where) + 2
                rows = self._series[model, device] = tuple([0.0] * width for _ in _LATENCIES)
            q, r, t = rows
            q[at(where, queue)] += 1
            q[-1] += queue
            r[at(where, run)] += 1
            r[-1] += run
            t[at(where, total)] += 1
            t[-1] += total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = [(key, [list(r) for r in rows]) for key, rows in self._series.items()]
        for i, (name, doc) in enumerate(_LATENCIES):
            family = HistogramMetricFamily(name, doc, labels=["model", "device"])
            for (model, device), rows in snapshot:
                counts = itertools.accumulate(rows[i][:-1])
                family.add_metric([model, device], list(zip(self._les, counts, strict=True)),
                                  rows[i][-1])  # fmt: skip
            yield family


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One device as the loop sees it at a heartbeat (cumulative counters since start)."""

    name: str
    queue_depth: int
    capacity: int
    in_flight: int
    busy_ns: int
    """Total device execution time so far, ns."""
    kind: str = ""
    """``dla`` or ``gpu``."""
    batches: tuple[int, ...] = ()
    """``[i]``: batches of ``i + 1`` jobs run so far."""


@dataclass(frozen=True, slots=True)
class Health:
    """What ``/health/ready`` reports: the daemon's state and each device's life cycle."""

    state: str = "STARTING"
    devices: Mapping[str, DeviceState] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        """RUNNING, every device ``ready`` or ``quarantined`` (out of placement while the
        others serve: the plane's health keeping) and at least one ``ready``."""
        states = self.devices.values()
        return (
            self.state == "RUNNING"
            and all(s in ("ready", "quarantined") for s in states)
            and any(s == "ready" for s in states)
        )


class Metrics:
    """The daemon's metrics and health state (see the module docstring).

    Args:
        name, version: exported as ``dlad_info``.
        heartbeat_s: the expected interval between :meth:`tick` calls (for the loop-lag gauge).
        live_timeout_s: the longest gap between beats that still counts as live.
        load_window_s: the span of the busy ratio, rates and percentiles.
        clock: monotonic seconds (a fake clock in tests).

    Every method except :meth:`live`, :meth:`ready` and :meth:`exposition` must be called on the
    event loop that owns the daemon; those three are safe from any thread.
    """

    def __init__(
        self,
        name: str,
        version: str,
        *,
        heartbeat_s: float = 0.5,
        live_timeout_s: float = 5.0,
        load_window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (heartbeat_s > 0 and live_timeout_s > heartbeat_s and load_window_s > 0):
            raise ValueError(
                "need heartbeat_s > 0, live_timeout_s > heartbeat_s, load_window_s > 0"
            )
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._live_timeout_s = live_timeout_s
        self._window_s = load_window_s
        self._started = clock()
        self._last_beat = self._started  # read by the HTTP threads: a float, replaced whole
        self._health = Health()  # read by the HTTP threads: frozen, replaced whole
        # (time, status is OK, total µs, device) of recent replies, and each device's
        # (time, cumulative busy ns) at recent heartbeats.
        self._replies: deque[tuple[float, bool, float, str]] = deque(maxlen=_MAX_SAMPLES)
        self._busy: dict[str, deque[tuple[float, int]]] = {}
        self._batches_seen: dict[str, tuple[int, ...]] = {}

        self.refresh: Callable[[], None] | None = None
        """Called before readiness is judged and before a scrape, on the caller's thread: the
        daemon brings the metrics up to its native data plane there."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(_Refresh(self))  # first: the scrape's every family sees what it did
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes
        Info("dlad", "The daemon's name and version.", registry=r).info(
            {"name": name, "version": version}
        )
        # The labelled children the hot path updates, by label values (bounded: the frontend
        # passes only configured model and device names).
        self._by_status: dict[tuple[str, str, Status], Any] = {}
        self._requests = Counter(
            "dlad_requests",
            "INFER requests answered, by model, device and reply status (the failure reason).",
            ["model", "device", "status"],
            registry=r,
        )
        self._latencies = _Latencies(LATENCY_BUCKETS)
        r.register(self._latencies)
        self._queue_depth = Gauge(
            "dlad_queue_depth", "Requests admitted and waiting for the device.", ["device"],
            registry=r,
        )  # fmt: skip
        self._queue_capacity = Gauge(
            "dlad_queue_capacity", "The device queue's bound (full: OVERLOADED).", ["device"],
            registry=r,
        )  # fmt: skip
        self._in_flight = Gauge(
            "dlad_device_in_flight", "Requests dispatched to the device and not yet answered.",
            ["device"], registry=r,
        )  # fmt: skip
        self._busy_total = Counter(
            "dlad_device_busy_seconds", "Time the device spent executing tasks.", ["device"],
            registry=r,
        )  # fmt: skip
        self._busy_ratio = Gauge(
            "dlad_device_busy_ratio",
            "Fraction of the last load window the device spent executing (0-1).",
            ["device"], registry=r,
        )  # fmt: skip
        self._batches = Counter(
            "dlad_device_batches",
            "Batches the device ran, by its kind and the batch size (a DLA core: always 1).",
            ["device", "kind", "size"], registry=r,
        )  # fmt: skip
        self._auth_refused = Counter(
            "dlad_auth_refused", "Connections refused by CURVE authentication (unknown key).",
            registry=r,
        )  # fmt: skip
        self._connections = Gauge(
            "dlad_connections", "Client connections open on the frontend's socket.", registry=r
        )
        self._connections_refused = Counter(
            "dlad_connections_refused",
            "Connections refused at the handshake: [frontend] max_connections were open.",
            registry=r,
        )  # fmt: skip
        self._dropped_replies = Counter(
            "dlad_replies_dropped",
            "Replies ZeroMQ dropped: the client's queue was full (SNDHWM) or it had gone.",
            registry=r,
        )  # fmt: skip
        self._plane_lost = Counter(
            "dlad_plane_lost",
            "What the native data plane could not hand to the event loop: a client's message "
            "still waiting when the plane ended with the loop gone, or a reply's observation.",
            ["what"], registry=r,
        )  # fmt: skip
        self._device_ready = Gauge(
            "dlad_device_ready", "1 when the device is loaded and warm, else 0.", ["device"],
            registry=r,
        )  # fmt: skip
        self._ready = Gauge(
            "dlad_ready", "1 when the daemon is RUNNING with every device ready.", registry=r
        )
        self._loop_lag = Gauge(
            "dlad_event_loop_lag_seconds",
            "How late the last heartbeat ran (a busy or blocked event loop).",
            registry=r,
        )

    # ------------------------------------------------------------------------ loop-side events
    def device_state(self, name: str, state: DeviceState) -> None:
        """Record a device's life cycle step (readiness needs every device ``ready``)."""
        self._health = Health(self._health.state, {**self._health.devices, name: state})
        self._device_ready.labels(name).set(1 if state == "ready" else 0)
        self._ready.set(1 if self._health.ready else 0)

    def daemon_state(self, state: str) -> None:
        """Record the daemon's state (``RUNNING``, ``DRAINING``, ``STOPPED``)."""
        self._health = Health(state, self._health.devices)
        self._ready.set(1 if self._health.ready else 0)

    def auth_refused(self, domain: str = "") -> None:
        """Count a connection the ZAP handler refused."""
        self._auth_refused.inc()

    def connections(self, n: int) -> None:
        """The number of open client connections."""
        self._connections.set(n)

    def connection_refused(self) -> None:
        """Count a connection refused for the cap."""
        self._connections_refused.inc()

    def reply_dropped(self, n: int = 1) -> None:
        """Count replies that could not be queued for their clients."""
        self._dropped_replies.inc(n)

    def plane_lost(self, what: str, n: int) -> None:
        """Count what the native data plane lost (``message`` or ``observation``)."""
        self._plane_lost.labels(what).inc(n)

    def observe_reply(
        self,
        model: str,
        device: str | None,
        status: Status,
        *,
        queue_us: float = 0.0,
        device_us: float = 0.0,
        total_us: float = 0.0,
    ) -> None:
        """Count one INFER reply; the histograms and percentiles take OK replies only.

        ``model`` and ``device`` are empty/None when the request never named a readable model
        or never reached a device.
        """
        dev = device or ""
        counter = self._by_status.get((model, dev, status))
        if counter is None:  # labels() is a lookup under a lock: once per combination
            counter = self._by_status[model, dev, status] = self._requests.labels(
                model, dev, status.name
            )
        counter.inc()
        ok = status == Status.OK
        if ok:
            self._latencies.observe(model, dev, queue_us / 1e6, device_us / 1e6, total_us / 1e6)
        self._replies.append((self._clock(), ok, total_us, dev))

    def tick(self, devices: Iterable[DeviceSample]) -> None:
        """The loop's heartbeat: proves liveness and samples queues and devices into gauges."""
        now = self._clock()
        self._loop_lag.set(max(now - self._last_beat - self._heartbeat_s, 0.0))
        self._last_beat = now
        horizon = now - self._window_s
        for d in devices:
            self._queue_depth.labels(d.name).set(d.queue_depth)
            self._queue_capacity.labels(d.name).set(d.capacity)
            self._in_flight.labels(d.name).set(d.in_flight)
            samples = self._busy.setdefault(d.name, deque())
            if samples:
                self._busy_total.labels(d.name).inc(max(d.busy_ns - samples[-1][1], 0) / 1e9)
            samples.append((now, d.busy_ns))
            # keep one sample at or before the horizon, so the ratio spans the whole window
            while len(samples) > 2 and samples[1][0] <= horizon:
                samples.popleft()
            self._busy_ratio.labels(d.name).set(self._busy_ratio_of(samples))
            seen = self._batches_seen.get(d.name, ())
            for i, count in enumerate(d.batches):
                new = count - (seen[i] if i < len(seen) else 0)
                if new > 0:
                    self._batches.labels(d.name, d.kind, str(i + 1)).inc(new)
            self._batches_seen[d.name] = d.batches
        while self._replies and self._replies[0][0] < horizon:
            self._replies.popleft()

    @staticmethod
    def _busy_ratio_of(samples: deque[tuple[float, int]]) -> float:
        if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
            return 0.0
        ratio = (samples[-1][1] - samples[0][1]) / 1e9 / (samples[-1][0] - samples[0][0])
        return min(max(ratio, 0.0), 1.0)

    def load_report(self) -> LoadStatus:
        """The recent-load figures of a STATUS report (``report.load``)."""
        now = self._clock()
        window = min(self._window_s, now - self._started)
        recent = [r for r in self._replies if r[0] >= now - self._window_s]
        ok = np.array([r[2] for r in recent if r[1]], dtype=np.float64)
        per = 1.0 / window if window > 0 else 0.0

        def p(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q)) if values.size else 0.0

        devices: list[DeviceLoad] = []
        for name, samples in self._busy.items():
            mine = np.array([r[2] for r in recent if r[1] and r[3] == name], dtype=np.float64)
            devices.append(
                {
                    "name": name,
                    "busy_ratio": self._busy_ratio_of(samples),
                    "rate_hz": mine.size * per,
                    "p99_us": p(mine, 99),
                }
            )
        return {
            "window_s": max(window, 0.0),
            "rate_hz": len(recent) * per,
            "ok_rate_hz": ok.size * per,
            "p50_us": p(ok, 50),
            "p99_us": p(ok, 99),
            "devices": devices,
        }

    # ------------------------------------------------------------------------ any thread
    def live(self) -> tuple[bool, dict[str, Any]]:
        """Whether the event loop beat within ``live_timeout_s``, and the age of its last beat."""
        age = self._clock() - self._last_beat
        return age <= self._live_timeout_s, {
            "live": age <= self._live_timeout_s,
            "last_beat_s": round(age, 3),
            "timeout_s": self._live_timeout_s,
        }

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether the daemon is RUNNING with every device loaded and warm (and each one's step)."""
        if self.refresh is not None:
            self.refresh()
        health = self._health
        return health.ready, {
            "ready": health.ready,
            "state": health.state,
            "devices": dict(health.devices),
        }

    def exposition(self) -> bytes:
        """The Prometheus text exposition (what ``GET /metrics`` answers)."""
        return generate_latest(self.registry)


class _Refresh(Collector):
    """Runs :attr:`Metrics.refresh` as a scrape begins; it yields no metric of its own."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        if self._metrics.refresh is not None:
            self._metrics.refresh()
        return ()


HTTP_WORKERS: Final = 4
"""Threads answering HTTP; a fixed pool, whatever the number of connections."""
HTTP_PENDING: Final = 32
"""Whole requests waiting for a worker, at most; one more is closed at once."""
HTTP_READING: Final = 256
"""Connections still sending their request's head, at most; at the cap the one that has been at
it longest is closed, so that a new connection (a probe) always gets its turn."""
HTTP_MAX_HEAD: Final = 8192
"""The largest request head read; a longer one is closed unanswered."""


class _Server(WSGIServer):
    """A WSGI server that reads every request's head on one thread, with a deadline for the whole
    head (``request_timeout_s``), and answers the whole requests on a fixed pool of
    :data:`HTTP_WORKERS` threads. A flood of connections, or of half-written requests held open,
    costs no threads and never holds a worker: a probe's request, which arrives whole, is read
    and answered beside them."""

    allow_reuse_address = True
    request_queue_size = 128  # listen(2)'s backlog: a burst of connections waits, not retries
    request_timeout_s = 2.0  # set per server (MetricsServer.start)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before binding: a bind that fails calls server_close, which shuts the pool down.
        self._pool = ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="dlad-metrics")
        self._pending = threading.BoundedSemaphore(HTTP_PENDING)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._reading: dict[socket.socket, tuple[float, bytearray, Any]] = {}  # deadline, head
        self._incoming: deque[tuple[socket.socket, Any]] = deque()
        self._heads: dict[socket.socket, bytes] = {}
        self._heads_lock = threading.Lock()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read_heads, name="dlad-metrics-read",
                                        daemon=True)  # fmt: skip
        super().__init__(*args, **kwargs)
        self._reader.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand an accepted connection to the head reader (the accept thread never reads)."""
        self._incoming.append((request, client_address))
        self._wake_w.send(b"\0")

    def _read_heads(self) -> None:
        while not self._closing.is_set():
            now = time.monotonic()
            waits = [d for d, _, _ in self._reading.values()]
            timeout = max(min(waits) - now, 0.0) if waits else None
            for key, _ in self._selector.select(timeout):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                else:
                    self._read_one(cast("socket.socket", key.fileobj))
            while self._incoming:
                self._start_reading(*self._incoming.popleft())
            now = time.monotonic()
            for sock in [k for k, (d, _, _) in self._reading.items() if d <= now]:
                self._drop(sock)  # its head took longer than request_timeout_s

    def _start_reading(self, sock: socket.socket, address: Any) -> None:
        if len(self._reading) >= HTTP_READING:  # the longest at it goes, the newest gets a turn
            self._drop(min(self._reading, key=lambda k: self._reading[k][0]))
        sock.setblocking(False)
        self._reading[sock] = (time.monotonic() + self.request_timeout_s, bytearray(), address)
        self._selector.register(sock, selectors.EVENT_READ)

    def _read_one(self, sock: socket.socket) -> None:
        _, head, address = self._reading[sock]
        try:
            chunk = sock.recv(HTTP_MAX_HEAD)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        head += chunk
        if not chunk or len(head) > HTTP_MAX_HEAD:
            self._drop(sock)  # gone, or a head no probe sends
        elif b"\r\n\r\n" in head:
            self._selector.unregister(sock)
            del self._reading[sock]
            if not self._pending.acquire(blocking=False):
                self.shutdown_request(sock)  # too many whole requests at once: closed unanswered
                return
            sock.setblocking(True)
            sock.settimeout(self.request_timeout_s)
            with self._heads_lock:
                self._heads[sock] = bytes(head)
            self._pool.submit(self._answer, sock, address)

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._reading[sock]
        self.shutdown_request(sock)

    def take_head(self, sock: socket.socket) -> bytes:
        """The head read for ``sock`` (the handler reads the request from it)."""
        with self._heads_lock:
            return self._heads.pop(sock, b"")

    def _answer(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:  # the client's connection broke: its own business, not the log's
            return
        finally:
            self.take_head(request)
            self.shutdown_request(request)
            self._pending.release()

    def server_close(self) -> None:
        super().server_close()
        self._closing.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._reader.is_alive():
            self._reader.join()
        for sock in list(self._reading):
            self._drop(sock)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _QuietHandler(WSGIRequestHandler):
    timeout = 2.0  # [metrics] request_timeout_s, set per server (MetricsServer.start)
    server: _Server

    def setup(self) -> None:
        super().setup()
        # the request is the head the server's reader took off the socket (dlad's endpoints
        # are GETs: no body follows)
        self.rfile = io.BytesIO(self.server.take_head(self.connection))

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood the daemon's log; they are not logged."""


class MetricsServer:
    """HTTP for :class:`Metrics` on ``host:port`` (port 0: any free port; see :attr:`port`).

    :meth:`start` binds and serves on a background thread; :meth:`close` stops it and joins.
    Raises OSError from :meth:`start` when the address cannot be bound.
    """

    def __init__(
        self, metrics: Metrics, host: str = "127.0.0.1", port: int = 9464, *,
        request_timeout_s: float = 2.0,
    ) -> None:  # fmt: skip
        self._metrics = metrics
        self._handler = type("_Handler", (_QuietHandler,), {"timeout": request_timeout_s})
        self._timeout = request_timeout_s
        self._host = host
        self._want_port = port
        self._prometheus = make_wsgi_app(metrics.registry)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (valid after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the metrics server is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self._host}:{self.port}"

    def start(self) -> None:
        server_class = type("_TimedServer", (_Server,),
                            {"request_timeout_s": self._timeout})  # fmt: skip
        made: WSGIServer = make_server(
            self._host, self._want_port, self._app, server_class=server_class,
            handler_class=self._handler,
        )  # fmt: skip
        server = cast("_Server", made)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="dlad-metrics",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path in ("/health/live", "/health/ready"):
            ok, body = self._metrics.live() if path == "/health/live" else self._metrics.ready()
            data = json.dumps(body).encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
            )
            return [data]
        if path == "/metrics":
            return self._prometheus(environ, start_response)  # type: ignore[no-any-return]
        data = b"dlad: /metrics, /health/live, /health/ready\n"
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [data]
