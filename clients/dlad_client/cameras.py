"""Many camera sources against a daemon, with results out to sinks: what ``dlad-cam`` runs.

Each camera's decoder runs on a thread of its own and hands its newest frame to a one-frame
mailbox; the camera's sender takes it when one of its ``in_flight`` requests is free, writes it
into a shared-memory slot (a daemon on this host) or a buffer of its own, and sends it with the
camera's name as its ``stream``. A camera never queues frames behind a slow daemon: a frame
still in the mailbox when a newer one is decoded is dropped at the source, and a queued frame
the daemon supersedes with a newer one of its stream comes back ``CANCELLED``; both are
counted. A lossless source (a file not played in real time) is the exception: its decoder waits
for the sender, its frames go without a ``stream`` (none supersedes another), and one refused
OVERLOADED is sent again once there is room: every frame is answered. A live source that drops
(an RTSP stream, a camera unplugged) is opened again after a backoff (0.5 s, doubling to
10 s). With ``rig=True`` the cameras are one rig: the newest frame of each goes in one
INFER_BATCH.

Each result goes to every sink as an event (:meth:`CameraRig.event`): the camera, the frame's
index and presentation time, camera-to-result latency, and :meth:`Result.to_dict`. A sink's
queue is bounded: a sink that is down or slow drops events (counted), never a camera's frames.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import anyio.abc
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dlad_client._async import AsyncClient
from dlad_client._core import ClientTimeout, Result
from dlad_client.sinks import JsonLinesSink, Sink
from dlad_client.sources import CameraFrame, Source, SourceError
from dlad_wire.errors import Cancelled, DeadlineExceeded, DladError, InternalError, Overloaded

__all__ = ["CameraRig", "CameraStats", "JsonLinesSink", "Sink"]

BACKOFF_S: Final = (0.5, 10.0)
SINK_QUEUE: Final = 256
WRITERS: Final = 8  # threads writing frames into their buffers at once
_LATENCIES: Final = 4096  # the latest latencies kept for a camera's percentiles


LOSSLESS_RETRY_S: Final = (0.005, 0.2)
"""A lossless source's frame refused OVERLOADED is sent again after 5 ms, doubling to 0.2 s."""


@dataclass(slots=True)
class CameraStats:
    """One camera's counts since it started (the rig's thread alone writes them)."""

    name: str
    decoded: int = 0  # frames the source yielded
    sent: int = 0
    ok: int = 0
    dropped_at_source: int = 0  # replaced in the mailbox by a newer frame before it was sent
    superseded: int = 0  # CANCELLED by the daemon: a newer frame of the stream took its place
    shed: int = 0  # OVERLOADED or DEADLINE_EXCEEDED: the daemon had no room or time for it
    failed: int = 0  # any other error (the last one in ``error``)
    reconnects: int = 0
    error: str = ""
    ended: bool = False
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_LATENCIES))

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile of camera-to-result latency (ms) of the latest results."""
        if not self.latencies_ms:
            return None
        return float(np.percentile(np.fromiter(self.latencies_ms, float), q))


class _Mailbox:
    """A camera's newest frame, not yet sent (the rig's thread only)."""

    def __init__(self, stats: CameraStats, news: Callable[[], None]) -> None:
        self.stats = stats
        self.news = news  # told of each frame and of the end (the rig's batching waits on it)
        self.frame: CameraFrame | None = None
        self.taken = threading.Event()  # no frame waits (a lossless source's decoder waits)
        self.taken.set()
        self.ended = False
        self._new = anyio.Event()

    def put(self, frame: CameraFrame) -> None:
        if self.frame is not None:
            self.stats.dropped_at_source += 1
        self.frame = frame
        self.stats.decoded += 1
        self._new.set()
        self.news()

    def end(self) -> None:
        self.ended = True
        self._new.set()
        self.news()

    async def ready(self) -> None:
        """Once there is a frame, or the source has ended."""
        while self.frame is None and not self.ended:
            self._new = anyio.Event()
            await self._new.wait()

    async def take(self) -> CameraFrame | None:
        """The newest frame, once there is one (None: the source has ended)."""
        await self.ready()
        frame, self.frame = self.frame, None
        self.taken.set()
        return frame


@dataclass(slots=True)
class _Sinks:
    sinks: list[tuple[Sink, MemoryObjectSendStream[dict[str, Any]]]]
    dropped: dict[str, int]


class CameraRig:
    """Runs ``sources`` against ``client`` (an entered :class:`AsyncClient`) for ``model``
    until every source has ended, or :meth:`stop`; results go to ``sinks`` and to
    ``on_result`` (the event, the result and the frame, on the rig's thread). A live source
    that fails is opened again after ``backoff_s`` (first, most; doubling). Made and run inside
    the event loop. Once the sources end, the sinks have ``sink_drain_s`` to send what they
    hold."""

    def __init__(
        self,
        client: AsyncClient,
        sources: Sequence[Source],
        *,
        model: str = "demo",
        in_flight: int = 2,
        rig: bool = False,
        sinks: Sequence[Sink] = (),
        conf: float | None = None,
        deadline_ms: int | None = None,
        on_result: Callable[[dict[str, Any], Result, CameraFrame], None] | None = None,
        backoff_s: tuple[float, float] = BACKOFF_S,
        sink_drain_s: float = 5.0,
    ) -> None:
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"two sources have one name (each is a stream): {names}")
        if not isinstance(in_flight, int) or in_flight < 1:  # type: ignore[redundant-expr]
            raise ValueError(f"in_flight must be an int >= 1, got {in_flight!r}")
        self.client, self.sources, self.model = client, list(sources), model
        self.in_flight, self.rig, self.conf, self.deadline_ms = in_flight, rig, conf, deadline_ms
        self.on_result, self.backoff_s, self.sink_drain_s = on_result, backoff_s, sink_drain_s
        self._sinks_running = 0
        self._sink_ended = anyio.Event()
        self.stats = {s.name: CameraStats(s.name) for s in sources}
        self._news = anyio.Event()
        self._boxes = {s.name: _Mailbox(self.stats[s.name], self._told) for s in sources}
        self._lossless = {s.name: s.lossless for s in sources}
        self._sinks = list(sinks)
        self.sink_dropped = {s.name: 0 for s in sinks}
        self.sink_errors: dict[str, str] = {}
        self._streams: list[tuple[Sink, MemoryObjectSendStream[dict[str, Any]]]] = []
        self._scope: anyio.CancelScope | None = None
        self._stopping = threading.Event()
        self._decoders = anyio.CapacityLimiter(len(self.sources))  # a thread each, all along
        self._writers = anyio.CapacityLimiter(WRITERS)
        self.started_ns = 0

    # ------------------------------------------------------------------ running
    async def run(self) -> None:
        """Run until every source has ended and its frames are answered, or :meth:`stop`.
        Raises NotFound where the daemon does not serve the model."""
        self.started_ns = time.monotonic_ns()
        with contextlib.suppress(InternalError, ClientTimeout):  # results then carry no names
            await self.client.class_names(self.model, timeout_s=5.0)
        async with anyio.create_task_group() as sinks_tg:
            for sink in self._sinks:
                send, receive = anyio.create_memory_object_stream[dict[str, Any]](SINK_QUEUE)
                self._streams.append((sink, send))
                sinks_tg.start_soon(self._run_sink, sink, receive)
            with anyio.CancelScope() as self._scope:
                async with anyio.create_task_group() as tg:
                    for source in self.sources:
                        tg.start_soon(self._decode, source)
                    if self.rig:
                        tg.start_soon(self._send_rig)
                    else:
                        for source in self.sources:
                            tg.start_soon(self._send_camera, source.name)
            for source in self.sources:
                source.close()
            for _, send in self._streams:
                await send.aclose()
            with anyio.move_on_after(self.sink_drain_s):  # the sinks send what they hold
                while self._sinks_running:
                    self._sink_ended = anyio.Event()
                    await self._sink_ended.wait()
            sinks_tg.cancel_scope.cancel()

    def _told(self) -> None:
        self._news.set()

    def stop(self) -> None:
        """End the run: the sources stop, frames in flight are left to the client's close."""
        self._stopping.set()
        for source in self.sources:
            source.close()
        if self._scope is not None:
            self._scope.cancel()

    async def _decode(self, source: Source) -> None:
        box, stats = self._boxes[source.name], self.stats[source.name]
        backoff = self.backoff_s[0]
        try:
            while True:
                decoded = stats.decoded
                try:
                    await anyio.to_thread.run_sync(
                        self._pump, source, box, abandon_on_cancel=True, limiter=self._decoders
                    )
                except SourceError as exc:
                    stats.error = str(exc)
                    if not source.live:
                        return
                    if stats.decoded > decoded:  # it ran a while: start the backoff over
                        backoff = self.backoff_s[0]
                    stats.reconnects += 1
                    await anyio.sleep(backoff)
                    backoff = min(2 * backoff, self.backoff_s[1])
                    continue
                return
        finally:
            stats.ended = True
            box.end()

    def _pump(self, source: Source, box: _Mailbox) -> None:
        """The decoder's thread: each frame to the mailbox, on the rig's thread (a lossless
        source's once the one before has been taken)."""
        for frame in source.frames():
            while source.lossless and not box.taken.wait(0.1):
                if self._stopping.is_set():
                    return
            box.taken.clear()
            if self._stopping.is_set():
                return
            anyio.from_thread.run_sync(box.put, frame)

    async def _send_camera(self, name: str) -> None:
        box = self._boxes[name]
        free = anyio.Semaphore(self.in_flight)
        async with anyio.create_task_group() as tg:
            while True:
                await free.acquire()
                frame = await box.take()
                if frame is None:
                    free.release()
                    return
                tg.start_soon(self._send_one, frame, free)

    async def _send_one(self, frame: CameraFrame, free: anyio.Semaphore) -> None:
        try:
            await self._send_image(frame, await self._written(frame))
        finally:
            free.release()

    async def _written(self, frame: CameraFrame) -> np.ndarray:
        """The frame written into a shared-memory slot where one is free, else a new array: on
        a worker thread (a 1080p frame is megabytes: the rig's thread goes on meanwhile)."""
        buffer = self.client.frame(frame.shape)
        self.stats[frame.source].sent += 1
        out = buffer if buffer is not None else np.empty(frame.shape, np.uint8)
        try:
            return await anyio.to_thread.run_sync(frame.write, out, limiter=self._writers)
        except BaseException:
            self._unsent(out)
            raise

    def _stream(self, frame: CameraFrame) -> str | None:
        """The frame's stream: its camera's, so that a newer frame supersedes it in the
        daemon's queue; none for a lossless source's, each of which is to be answered."""
        return None if self._lossless[frame.source] else frame.source

    def _unsent(self, image: np.ndarray) -> None:
        """A frame written into a slot but not sent: the slot is free again."""
        if self.client.shm is not None:
            self.client.shm.release(image)

    async def _send_rig(self) -> None:
        """The rig's frames of one instant in one INFER_BATCH: the newest of each camera that
        has one, once each has or 1/30 s after the first."""
        free = anyio.Semaphore(self.in_flight)
        async with anyio.create_task_group() as tg:
            while True:
                await free.acquire()
                frames = await self._instant()
                if not frames:
                    free.release()
                    return
                tg.start_soon(self._send_batch, frames, free)

    async def _instant(self) -> list[CameraFrame]:
        boxes = list(self._boxes.values())
        while not any(b.frame is not None for b in boxes):
            if all(b.ended for b in boxes):
                return []
            self._news = anyio.Event()
            await self._news.wait()
        with anyio.move_on_after(1 / 30):
            for box in boxes:
                await box.ready()
        taken = [box.frame for box in boxes]
        for box in boxes:
            box.frame = None
            box.taken.set()
        return [f for f in taken if f is not None]

    async def _send_batch(self, frames: list[CameraFrame], free: anyio.Semaphore) -> None:
        try:
            images = [await self._written(frame) for frame in frames]
            formats = {str(f.pixel_format) for f in frames}
            if len(formats) > 1:  # one message has one pixel format: send them one by one
                for frame, image in zip(frames, images, strict=True):
                    await self._send_image(frame, image)
                return
            try:
                outcomes: Sequence[Result | DladError] = await self.client.detect_batch(
                    images, model=self.model, pixel_format=frames[0].pixel_format,
                    streams=[self._stream(f) for f in frames], conf=self.conf,
                    deadline_ms=self.deadline_ms,
                )  # fmt: skip
            except (DladError, ClientTimeout) as exc:
                for frame, image in zip(frames, images, strict=True):
                    self._unsent(image)
                    self._failed(self.stats[frame.source], exc)
                return
            for frame, image, outcome in zip(frames, images, outcomes, strict=True):
                if isinstance(outcome, Result):
                    self._answered(frame, outcome)
                elif isinstance(outcome, Overloaded) and self._lossless[frame.source]:
                    await self._send_image(frame, image)  # again, alone, once there is room
                else:
                    self._failed(self.stats[frame.source], outcome)
        finally:
            free.release()

    async def _send_image(self, frame: CameraFrame, image: np.ndarray) -> None:
        """Send one frame and take its answer. A lossless source's frame that finds the daemon
        full (OVERLOADED) is sent again once it has room (backing off 5 ms, doubling to
        0.2 s): every frame of such a source is answered."""
        delay = LOSSLESS_RETRY_S[0]
        while True:
            try:
                result = await self.client.detect(
                    image, model=self.model, pixel_format=frame.pixel_format,
                    stream=self._stream(frame), conf=self.conf, deadline_ms=self.deadline_ms,
                )  # fmt: skip
            except Overloaded as exc:
                if self._lossless[frame.source] and not self._stopping.is_set():
                    await anyio.sleep(delay)
                    delay = min(2 * delay, LOSSLESS_RETRY_S[1])
                    continue
                self._unsent(image)
                self._failed(self.stats[frame.source], exc)
                return
            except (DladError, ClientTimeout) as exc:
                self._unsent(image)
                self._failed(self.stats[frame.source], exc)
                return
            self._answered(frame, result)
            return

    # ------------------------------------------------------------------ results
    def _failed(self, stats: CameraStats, exc: Exception) -> None:
        if isinstance(exc, Cancelled) and "superseded" in str(exc):
            stats.superseded += 1
        elif isinstance(exc, (Overloaded, DeadlineExceeded)):
            stats.shed += 1
        else:
            stats.failed += 1
            stats.error = f"{type(exc).__name__}: {exc}"

    def _answered(self, frame: CameraFrame, result: Result) -> None:
        stats = self.stats[frame.source]
        stats.ok += 1
        latency_ms = (time.monotonic_ns() - frame.captured_ns) / 1e6
        stats.latencies_ms.append(latency_ms)
        event = self.event(frame, result, latency_ms)
        for sink, send in self._streams:
            if sink.name in self.sink_errors:
                self.sink_dropped[sink.name] += 1
                continue
            try:
                send.send_nowait(event)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.sink_dropped[sink.name] += 1
        if self.on_result is not None:
            self.on_result(event, result, frame)

    @staticmethod
    def event(frame: CameraFrame, result: Result, latency_ms: float) -> dict[str, Any]:
        """A result as the sinks get it: plain values, JSON-ready."""
        return {"camera": frame.source, "frame": frame.index, "pts_s": frame.pts_s,
                "latency_ms": round(latency_ms, 3), **result.to_dict()}  # fmt: skip

    async def _run_sink(
        self, sink: Sink, events: MemoryObjectReceiveStream[dict[str, Any]]
    ) -> None:
        self._sinks_running += 1
        try:
            await sink.run(events)
        except Exception as exc:  # noqa: BLE001 (a sink's failure stops that sink only)
            self.sink_errors[sink.name] = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await events.aclose()
        finally:
            events.close()
            self._sinks_running -= 1
            self._sink_ended.set()

    # ------------------------------------------------------------------ reporting
    def rows(self) -> list[dict[str, Any]]:
        """Each camera's figures: fps in (decoded) and out (answered), drops, p50/p99 (ms)."""
        seconds = max((time.monotonic_ns() - self.started_ns) / 1e9, 1e-9)
        out = []
        for s in self.stats.values():
            p50, p99 = s.percentile(50), s.percentile(99)
            out.append({
                "camera": s.name, "fps_in": s.decoded / seconds, "fps_out": s.ok / seconds,
                "decoded": s.decoded, "sent": s.sent, "ok": s.ok,
                "dropped_at_source": s.dropped_at_source, "superseded": s.superseded,
                "shed": s.shed, "failed": s.failed, "reconnects": s.reconnects,
                "p50_ms": None if p50 is None else round(p50, 2),
                "p99_ms": None if p99 is None else round(p99, 2),
                "error": s.error,
            })  # fmt: skip
        return out

    @property
    def finite(self) -> bool:
        """Whether every source has an end (files, images): the run then ends by itself."""
        return not any(s.live for s in self.sources)


def fmt_ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"
