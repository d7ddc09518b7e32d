"""What dlad-bench measures: one :class:`Record` per request, measurement windows, the
stability rule, and the :class:`LevelResult` of one load level.

Times on the client are seconds on the runner's monotonic clock, relative to the level's start;
the daemon's side comes from each reply's ``timing`` (µs, and device start/end in ns on the
daemon host's monotonic clock).

**Windows and stability** (after Triton's perf_analyzer): after the warm-up, the runner closes a
window every ``window_s`` seconds (or every ``window_count`` completed requests) and computes its
throughput and mean latency. The level is *stable* when each of the last ``windows`` windows
(3 by default) is within ``stability_pct`` percent of their mean, on throughput and on latency;
the level stops when it is stable or after ``max_trials`` windows, and its results are computed
over those last windows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from dlad.errors import Status

__all__ = [
    "CLIENT_TIMEOUT", "STATUS_NAMES", "LevelResult", "Measurement", "Record", "WindowStats",
    "is_stable", "summarize", "window_stats",
]  # fmt: skip

CLIENT_TIMEOUT = "CLIENT_TIMEOUT"
"""The status of a request the daemon did not answer within the client's own timeout."""
STATUS_NAMES: tuple[str, ...] = (*(s.name for s in Status), CLIENT_TIMEOUT)
"""Every status a record can have, in a fixed order (the CSV's status columns)."""
SHED: frozenset[str] = frozenset({"OVERLOADED", "DEADLINE_EXCEEDED", "CANCELLED"})
"""Statuses by which the daemon sheds load (refused, expired, or superseded by a newer frame)."""


@dataclass(slots=True)
class Record:
    """One request: when it was due, sent and answered (s), and what the daemon said."""

    scheduled: float  # due time; NaN in closed loop (sent when the previous one returned)
    sent: float
    done: float = math.nan
    status: str = ""
    device: str | None = None
    stream: int = -1
    deadline_ms: float = math.nan
    queue_us: float = 0.0
    pre_us: float = 0.0
    device_us: float = 0.0
    post_us: float = 0.0
    total_us: float = 0.0
    start_ns: int | None = None
    end_ns: int | None = None

    @property
    def latency_ms(self) -> float:
        """Client-side latency: send to reply."""
        return (self.done - self.sent) * 1e3

    @property
    def intended_latency_ms(self) -> float:
        """Latency from when the request was due (open loop), so that a generator that fell
        behind cannot hide the queueing it skipped (coordinated omission, wrk2's correction);
        the same as :attr:`latency_ms` in closed loop, where nothing is due."""
        start = self.sent if math.isnan(self.scheduled) else self.scheduled
        return (self.done - start) * 1e3

    @property
    def good(self) -> bool:
        """Answered OK within its deadline (any OK answer when it had none)."""
        return self.status == "OK" and not self.latency_ms > self.deadline_ms


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One measurement window ``[start, end)`` (by completion time)."""

    index: int
    start: float
    end: float
    completed: int
    throughput: float  # OK replies per second
    latency_ms: float  # mean client latency of the OK replies (NaN without any)


def window_stats(records: Sequence[Record], index: int, start: float, end: float) -> WindowStats:
    """The stats of the records completed in ``[start, end)``."""
    lat = [r.latency_ms for r in records if start <= r.done < end and r.status == "OK"]
    span = end - start
    return WindowStats(
        index,
        start,
        end,
        len(lat),
        len(lat) / span if span > 0 else 0.0,
        float(np.mean(lat)) if lat else math.nan,
    )


def is_stable(windows: Sequence[WindowStats], pct: float, n: int = 3) -> bool:
    """Whether each of the last ``n`` windows is within ``pct`` percent of their mean, on
    throughput and on latency (a window without OK replies is never stable)."""
    if len(windows) < n:
        return False
    last = windows[-n:]
    for values in ([w.throughput for w in last], [w.latency_ms for w in last]):
        mean = float(np.mean(values))
        if not (math.isfinite(mean) and mean > 0):
            return False
        if any(abs(v - mean) > pct / 100.0 * mean for v in values):
            return False
    return True


class Measurement:
    """The stopping rule of one level: feed it each closed window; :meth:`add` says when to stop.

    ``fixed``: a fixed-duration level (``dlad-bench --duration``): it runs all ``max_trials``
    windows whatever their spread, its results cover them all, and :attr:`stable` still says
    whether the last ``windows`` of them agree.

    Raises ValueError unless ``1 <= windows <= max_trials`` and ``pct > 0``.
    """

    def __init__(
        self, *, pct: float = 10.0, windows: int = 3, max_trials: int = 10, fixed: bool = False
    ) -> None:
        if not (pct > 0 and 1 <= windows <= max_trials):
            raise ValueError(
                f"need stability_pct > 0 and 1 <= stability_windows ({windows}) <= max_trials "
                f"({max_trials})"
            )
        self.pct = pct
        self.windows_needed = windows
        self.max_trials = max_trials
        self.fixed = fixed
        self.windows: list[WindowStats] = []
        self.stable = False

    def add(self, window: WindowStats) -> bool:
        """Record a window; True when the level should stop (stable, or out of trials)."""
        self.windows.append(window)
        self.stable = is_stable(self.windows, self.pct, self.windows_needed)
        return (self.stable and not self.fixed) or len(self.windows) >= self.max_trials

    @property
    def measured(self) -> tuple[float, float]:
        """The span the results cover: the last ``windows`` windows (all of them if fixed)."""
        last = self.windows if self.fixed else self.windows[-self.windows_needed :]
        return (last[0].start, last[-1].end) if last else (0.0, 0.0)


@dataclass
class LevelResult:
    """The results of one load level (one CSV row; see ``report.CSV_COLUMNS``)."""

    mode: str
    level: float  # concurrency, offered rate (req/s) or number of streams
    offered_rps: float  # NaN in closed loop (the daemon sets the pace)
    sent_rps: float
    throughput_rps: float  # OK replies per second
    goodput_rps: float  # OK replies within their deadline, per second
    requests: int  # completed (answered or timed out) in the measured span
    status_counts: dict[str, int]
    shed_fraction: float  # OVERLOADED + DEADLINE_EXCEEDED + CANCELLED, of requests
    latency_ms: dict[str, float]  # client side, OK replies: p50 p90 p95 p99 p99.9 max mean
    client_overhead_ms: float  # mean of client latency minus the daemon's total_us
    daemon_ms: dict[str, float]  # means of queue, pre, device, post, total; p99 of queue, total
    device_share: dict[str, float]  # fraction of OK replies per device
    device_batch: dict[str, float]  # mean batch size per device (replies sharing device times)
    late_sends: int  # open loop: sent more than the tolerance after their due time
    late_fraction: float
    max_late_ms: float
    windows: int
    stable: bool
    measured_s: float
    window_stats: list[WindowStats] = field(default_factory=list)
    intended_latency_ms: dict[str, float] = field(default_factory=dict)  # from the due time
    slo_ms: float = math.nan  # the latency objective (--slo-ms), NaN if none
    slo_goodput_rps: float = math.nan  # OK within slo_ms of the due time, per second


def _percentiles(values: npt.NDArray[np.float64]) -> dict[str, float]:
    keys = ("p50", "p90", "p95", "p99", "p99_9")
    if values.size == 0:
        return {**dict.fromkeys(keys, math.nan), "max": math.nan, "mean": math.nan}
    qs = np.percentile(values, [50, 90, 95, 99, 99.9])
    return {
        **{k: float(q) for k, q in zip(keys, qs, strict=True)},
        "max": float(values.max()),
        "mean": float(values.mean()),
    }


def summarize(
    records: Sequence[Record],
    *,
    mode: str,
    level: float,
    offered_rps: float,
    measurement: Measurement,
    late_tolerance_ms: float,
    slo_ms: float | None = None,
) -> LevelResult:
    """The :class:`LevelResult` of the records completed in the measured span; ``slo_ms``: a
    latency objective, counted from each request's due time."""
    start, end = measurement.measured
    span = max(end - start, 1e-9)
    done = [r for r in records if start <= r.done < end]
    sent = [r for r in records if start <= r.sent < end]
    ok = [r for r in done if r.status == "OK"]
    counts = Counter(r.status for r in done)
    status_counts = {name: counts.get(name, 0) for name in STATUS_NAMES}
    lat = np.array([r.latency_ms for r in ok], dtype=np.float64)
    intended = np.array([r.intended_latency_ms for r in ok], dtype=np.float64)
    daemon_total = np.array([r.total_us / 1e3 for r in ok], dtype=np.float64)
    queue = np.array([r.queue_us / 1e3 for r in ok], dtype=np.float64)

    def mean(values: Sequence[float] | npt.NDArray[np.float64]) -> float:
        return float(np.mean(values)) if len(values) else math.nan

    def p99(values: npt.NDArray[np.float64]) -> float:
        return float(np.percentile(values, 99)) if values.size else math.nan

    devices = Counter(r.device or "" for r in ok)
    # Frames of one batch report the same device start and end: count the distinct runs (a
    # reply without device times is a run of its own).
    runs = Counter(
        device
        for device, *_ in {
            (r.device or "", r.start_ns, r.end_ns) if r.start_ns is not None else (
                r.device or "", id(r), None)
            for r in ok
        }
    )  # fmt: skip
    scheduled = [r for r in sent if not math.isnan(r.scheduled)]
    lateness = np.array([(r.sent - r.scheduled) * 1e3 for r in scheduled], dtype=np.float64)
    late = int(np.count_nonzero(lateness > late_tolerance_ms))
    return LevelResult(
        mode=mode,
        level=level,
        offered_rps=offered_rps,
        sent_rps=len(sent) / span,
        throughput_rps=len(ok) / span,
        goodput_rps=sum(1 for r in ok if r.good) / span,
        requests=len(done),
        status_counts=status_counts,
        shed_fraction=sum(counts.get(s, 0) for s in SHED) / len(done) if done else math.nan,
        latency_ms=_percentiles(lat),
        client_overhead_ms=mean(lat - daemon_total) if lat.size else math.nan,
        daemon_ms={
            "queue": mean(queue),
            "pre": mean([r.pre_us / 1e3 for r in ok]),
            "device": mean([r.device_us / 1e3 for r in ok]),
            "post": mean([r.post_us / 1e3 for r in ok]),
            "total": mean(daemon_total),
            "queue_p99": p99(queue),
            "total_p99": p99(daemon_total),
        },
        device_share={d: n / len(ok) for d, n in sorted(devices.items())},
        device_batch={d: n / runs[d] for d, n in sorted(devices.items())},
        late_sends=late,
        late_fraction=late / len(scheduled) if scheduled else 0.0,
        max_late_ms=float(lateness.max()) if lateness.size else 0.0,
        windows=len(measurement.windows),
        stable=measurement.stable,
        measured_s=span,
        window_stats=list(measurement.windows),
        intended_latency_ms=_percentiles(intended),
        slo_ms=math.nan if slo_ms is None else float(slo_ms),
        slo_goodput_rps=(
            math.nan if slo_ms is None
            else float(np.count_nonzero(intended <= slo_ms)) / span
        ),
    )  # fmt: skip


def level_records_ok(records: Sequence[Record]) -> list[Record]:
    """The OK records (helper for plots)."""
    return [r for r in records if r.status == "OK"]


def as_dict(window: WindowStats) -> dict[str, Any]:
    """A window as a JSON-ready dict."""
    return {
        "index": window.index,
        "start_s": window.start,
        "end_s": window.end,
        "completed": window.completed,
        "throughput_rps": window.throughput,
        "latency_ms": window.latency_ms,
    }
