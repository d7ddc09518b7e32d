"""Drive one load level against a daemon through the SDK's :class:`~dlad_client.AsyncClient`.

Three load shapes (:class:`Load`):

* ``concurrency``: closed loop, N requests always in flight (each worker sends its next
  request when the previous one is answered), so the daemon sets the pace;
* ``rate``: open loop at a mean rate, with constant, Poisson or gamma inter-arrival gaps;
* ``streams``: open loop of S cameras at F fps each (or Zipf-skewed around that mean,
  ``fps_skew``); every frame carries its camera's stream id (``cam<i>``) and a deadline of one of
  its camera's frame periods, so the daemon's "latest frame wins" and deadline shedding act as
  they would on real cameras.

With ``Settings.batch`` > 1 each request is an INFER_BATCH of that many frames (perf_analyzer's
``-b``): the level counts messages (in flight, or sent a second) and every record is a frame, so
rates, counts and latencies are per frame (a frame's latency is its message's). Camera streams
send one frame a message.

Open-loop send times are computed before the level starts (:mod:`dlad_bench.schedule`); the
sender only sleeps until each one and sends without waiting for replies, so a slow daemon cannot
slow the generator. When the generator itself falls behind, each record's ``sent - scheduled``
shows it (late sends, reported per level).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio
import numpy as np
import numpy.typing as npt

from dlad.errors import DladError
from dlad.protocol import MAX_BATCH_IMAGES
from dlad_bench.measure import CLIENT_TIMEOUT, LevelResult, Measurement, Record, summarize
from dlad_bench.measure import window_stats as _window_stats
from dlad_bench.schedule import Arrivals, arrival_times, camera_fps, camera_times
from dlad_client import AsyncClient, AsyncHandle, ClientTimeout, Result

__all__ = ["Level", "Load", "Settings", "run_level"]

Mode = Literal["concurrency", "rate", "streams"]
_MAX_COUNT_WINDOW_S = 60.0
"""A count window also closes after this long, so a stalled daemon cannot hang the run."""


@dataclass(frozen=True, slots=True)
class Load:
    """One load level. ``level`` is the concurrency, the mean rate (req/s) or the number of
    streams, by ``mode``."""

    mode: Mode
    level: float
    arrivals: Arrivals = "poisson"
    burstiness: float = 1.0
    fps: float = 30.0
    fps_skew: float = 0.0
    """streams: camera ``s`` at a rate in proportion to ``(s + 1) ** -fps_skew``, mean ``fps``."""

    @property
    def offered_rps(self) -> float:
        """The offered request rate (NaN in closed loop, where the daemon sets the pace)."""
        if self.mode == "rate":
            return self.level
        if self.mode == "streams":
            return self.level * self.fps
        return math.nan

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"concurrency {self.level:g}"
        if self.mode == "rate":
            return f"{self.arrivals} {self.level:g}/s"
        skew = f" (skew {self.fps_skew:g})" if self.fps_skew else ""
        return f"{self.level:g} streams x {self.fps:g} fps{skew}"

    @property
    def frame_deadline_ms(self) -> int:
        """One frame period in ms at the mean ``fps``."""
        return max(1, round(1000.0 / self.fps))

    def stream_deadlines_ms(self) -> list[int]:
        """Each camera's frame period in ms (the deadline of its frames)."""
        rates = camera_fps(int(self.level), self.fps, self.fps_skew)
        return [max(1, round(1000.0 / r)) for r in rates.tolist()]


@dataclass(frozen=True, slots=True)
class Settings:
    """How each level is run and measured (defaults after perf_analyzer's)."""

    model: str = "demo"
    deadline_ms: int | None = None  # per request; camera streams use one frame period
    timeout_s: float = 10.0  # the client's own limit per request
    warmup_s: float = 2.0
    window_s: float = 2.0
    window_count: int | None = None  # close windows by completed requests instead of time
    stability_pct: float = 10.0
    stability_windows: int = 3
    max_trials: int = 10
    late_tolerance_ms: float = 2.0
    seed: int = 0
    duration_s: float | None = None  # measure each level this long (ceil(d / window_s) windows)
    slo_ms: float | None = None  # a latency objective: goodput counts OK replies within it
    batch: int = 1  # frames a message (INFER_BATCH when > 1); the level counts messages

    @property
    def trials(self) -> int:
        """Windows a level runs at most: ``max_trials``, or as many as ``duration_s`` spans."""
        if self.duration_s is None:
            return self.max_trials
        return max(1, math.ceil(self.duration_s / self.window_s - 1e-9))

    def measurement(self) -> Measurement:
        """A fresh stopping rule for one level (raises ValueError for inconsistent settings)."""
        fixed = self.duration_s is not None
        windows = min(self.stability_windows, self.trials) if fixed else self.stability_windows
        return Measurement(
            pct=self.stability_pct, windows=windows, max_trials=self.trials, fixed=fixed
        )

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        if self.duration_s is not None:
            if not (math.isfinite(self.duration_s) and self.duration_s > 0):
                raise ValueError(f"duration_s must be > 0, got {self.duration_s!r}")
            if self.window_count is not None:
                raise ValueError("duration_s needs time windows, not window_count")
        self.measurement()
        for name in ("timeout_s", "window_s", "late_tolerance_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.warmup_s >= 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s!r}")
        if self.window_count is not None and self.window_count < 1:
            raise ValueError(f"window_count must be >= 1, got {self.window_count!r}")
        if not 1 <= self.batch <= MAX_BATCH_IMAGES:
            raise ValueError(f"batch must be an int in [1, {MAX_BATCH_IMAGES}], got {self.batch!r}")


@dataclass
class Level:
    """One level's raw records and its results."""

    load: Load
    records: list[Record]
    result: LevelResult


OnWindow = Callable[[Load, Measurement], None]


class _Run:
    def __init__(
        self,
        client: AsyncClient,
        load: Load,
        settings: Settings,
        frames: Sequence[npt.NDArray[np.uint8]],
    ) -> None:
        self.client = client
        self.load = load
        self.settings = settings
        self.frames = frames
        self.records: list[Record] = []
        self.t0 = 0.0
        self.done = 0
        self._want: tuple[int, anyio.Event] | None = None

    def now(self) -> float:
        return anyio.current_time() - self.t0

    def _deadline(self, stream: bool) -> int | None:
        if stream:
            return self.load.frame_deadline_ms
        return self.settings.deadline_ms

    def _finish(
        self, rec: Record, outcome: Result | BaseException, at: float | None = None
    ) -> None:
        rec.done = self.now() if at is None else at  # ``at``: a message's frames, answered at once
        if isinstance(outcome, Result):
            t = outcome.timing
            rec.status = "OK"
            rec.device = outcome.device
            rec.queue_us, rec.pre_us, rec.device_us = t.queue_us, t.pre_us, t.device_us
            rec.post_us, rec.total_us = t.post_us, t.total_us
            rec.start_ns, rec.end_ns = t.start_ns, t.end_ns
        elif isinstance(outcome, DladError):
            rec.status = outcome.status.name
        else:
            rec.status = CLIENT_TIMEOUT
        self.done += 1
        if self._want is not None and self.done >= self._want[0]:
            self._want[1].set()

    def _frames_at(self, i: int) -> list[npt.NDArray[np.uint8]]:
        """The frames of message ``i`` (``batch`` of them, in turn through the inputs)."""
        b, n = self.settings.batch, len(self.frames)
        return [self.frames[(i * b + j) % n] for j in range(b)]

    async def _batch_call(self, i: int, due: float, deadline: int | None) -> None:
        """Message ``i`` as one INFER_BATCH, due at ``due`` (NaN: closed loop): a record per
        frame, each with its own outcome (the whole message's error, when the daemon refused it
        or the client timed out)."""
        sent, images = self.now(), self._frames_at(i)
        recs = [Record(due, sent, deadline_ms=deadline or math.nan) for _ in images]
        self.records.extend(recs)
        try:
            outcomes = await self.client.detect_batch(
                images, model=self.settings.model, deadline_ms=deadline,
                timeout_s=self.settings.timeout_s,
            )  # fmt: skip
        except (DladError, ClientTimeout) as exc:
            at = self.now()
            for rec in recs:
                self._finish(rec, exc, at)
        else:
            at = self.now()
            for rec, outcome in zip(recs, outcomes, strict=True):
                self._finish(rec, outcome, at)

    async def _closed_worker(self, index: int, stride: int) -> None:
        i = index
        deadline = self._deadline(False)
        if self.settings.batch > 1:
            while True:
                await self._batch_call(i, math.nan, deadline)
                i += stride
        while True:
            frame = self.frames[i % len(self.frames)]
            i += stride
            rec = Record(math.nan, self.now(), deadline_ms=deadline or math.nan)
            self.records.append(rec)
            try:
                result = await self.client.detect(
                    frame, model=self.settings.model, deadline_ms=deadline,
                    timeout_s=self.settings.timeout_s,
                )  # fmt: skip
            except (DladError, ClientTimeout) as exc:
                self._finish(rec, exc)
            else:
                self._finish(rec, result)

    async def _await(self, rec: Record, handle: AsyncHandle) -> None:
        try:
            result = await handle.result()
        except (DladError, ClientTimeout) as exc:
            self._finish(rec, exc)
        else:
            self._finish(rec, result)

    async def _open_sender(
        self,
        times: npt.NDArray[np.float64],
        streams: npt.NDArray[np.int64] | None,
        tg: anyio.abc.TaskGroup,
    ) -> None:
        deadline = self._deadline(streams is not None)
        per_stream = self.load.stream_deadlines_ms() if streams is not None else []
        for i, due in enumerate(times.tolist()):
            delay = due - self.now()
            if delay > 0:
                await anyio.sleep(delay)
            stream = int(streams[i]) if streams is not None else -1
            if stream >= 0:
                deadline = per_stream[stream]
            if self.settings.batch > 1:  # (never with streams: run_level refuses it)
                tg.start_soon(self._batch_call, i, due, deadline)
                continue
            rec = Record(due, self.now(), stream=stream, deadline_ms=deadline or math.nan)
            self.records.append(rec)
            try:
                handle = await self.client.submit(
                    self.frames[i % len(self.frames)], model=self.settings.model,
                    stream=f"cam{stream}" if stream >= 0 else None, deadline_ms=deadline,
                    timeout_s=self.settings.timeout_s,
                )  # fmt: skip
            except ClientTimeout as exc:
                self._finish(rec, exc)
                continue
            tg.start_soon(self._await, rec, handle)

    def _horizon(self) -> float:
        s = self.settings
        if s.window_count is None:
            return s.warmup_s + s.trials * s.window_s + 1.0
        return s.warmup_s + s.trials * _MAX_COUNT_WINDOW_S

    async def run(self, on_window: OnWindow | None) -> Measurement:
        s = self.settings
        load = self.load
        measurement = s.measurement()
        async with anyio.create_task_group() as tg:
            self.t0 = anyio.current_time()
            if load.mode == "concurrency":
                n = int(load.level)
                for k in range(n):
                    tg.start_soon(self._closed_worker, k, n)
            elif load.mode == "rate":
                times = arrival_times(
                    load.level, self._horizon(), arrivals=load.arrivals,
                    burstiness=load.burstiness, seed=s.seed,
                )  # fmt: skip
                tg.start_soon(self._open_sender, times, None, tg)
            else:
                times, ids = camera_times(
                    int(load.level), load.fps, self._horizon(), seed=s.seed, skew=load.fps_skew
                )
                tg.start_soon(self._open_sender, times, ids, tg)
            await anyio.sleep(s.warmup_s)
            start = self.now()
            while True:
                if s.window_count is None:
                    await anyio.sleep(max(start + s.window_s - self.now(), 0.0))
                else:
                    event = anyio.Event()
                    self._want = (self.done + s.window_count, event)
                    with anyio.move_on_after(_MAX_COUNT_WINDOW_S):
                        await event.wait()
                end = self.now()
                stats = _window_stats(self.records, len(measurement.windows), start, end)
                stop = measurement.add(stats)
                if on_window is not None:
                    on_window(load, measurement)
                if stop:
                    break
                start = end
            tg.cancel_scope.cancel()
        return measurement


async def run_level(
    client: AsyncClient,
    load: Load,
    settings: Settings,
    frames: Sequence[npt.NDArray[np.uint8]],
    on_window: OnWindow | None = None,
) -> Level:
    """Run ``load`` until it is stable or out of trials, and summarise the measured windows.

    Raises ValueError for an invalid load or setting; the SDK's ClientClosed if the client is
    closed meanwhile. Requests still in flight when the level ends are withdrawn (the SDK
    sends a CANCEL) and not counted.
    """
    settings.check()
    if not frames:
        raise ValueError("no frames to send")
    if load.mode == "concurrency" and not (load.level >= 1 and float(load.level).is_integer()):
        raise ValueError(f"concurrency must be an int >= 1, got {load.level!r}")
    if load.mode == "streams" and not (load.level >= 1 and float(load.level).is_integer()):
        raise ValueError(f"streams must be an int >= 1, got {load.level!r}")
    if load.mode == "streams" and settings.batch > 1:
        raise ValueError("camera streams send one frame a message: batch needs concurrency or rate")
    run = _Run(client, load, settings, frames)
    measurement = await run.run(on_window)
    result = summarize(
        run.records, mode=load.mode, level=load.level,
        offered_rps=load.offered_rps * settings.batch,  # frames a second
        measurement=measurement, late_tolerance_ms=settings.late_tolerance_ms,
        slo_ms=settings.slo_ms,
    )  # fmt: skip
    return Level(load, run.records, result)
