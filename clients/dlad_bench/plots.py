"""dlad-bench's plots (PNG, matplotlib's Agg canvas; pyplot and its global state are not used):

* :func:`plot_cdf`: the client latency CDF of each load level;
* :func:`plot_load`: throughput and goodput, p99 latency and the shed fraction vs offered load;
* :func:`plot_timeline`: a Gantt chart of which request ran on which device when, from the
  replies' device start/end stamps: the picture that shows a scheduler keeping every engine
  busy, or not.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from dlad_bench.measure import LevelResult, Record

__all__ = ["plot_cdf", "plot_load", "plot_timeline", "timeline_window"]

_DPI = 100


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, format="png")
    return path


def plot_cdf(levels: Sequence[tuple[str, Sequence[Record]]], path: Path) -> Path:
    """One CDF of OK replies' client latency per ``(label, records)`` level."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for label, records in levels:
        lat = np.sort(
            [r.latency_ms for r in records if r.status == "OK" and not math.isnan(r.done)]
        )
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency on the client (ms, log)")
    ax.set_ylabel("fraction of OK replies")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return _save(fig, path)


def plot_load(
    results: Sequence[LevelResult], path: Path, capacity_rps: float | None = None
) -> Path:
    """Throughput, goodput, p99 and shed fraction against the offered load (closed loop: the
    concurrency). ``capacity_rps`` draws the engines' summed capacity as a reference line."""
    fig = Figure(figsize=(7, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    closed = all(r.mode == "concurrency" for r in results)
    x = np.array([r.level if closed else r.offered_rps for r in results], dtype=float)
    top.plot(x, [r.throughput_rps for r in results], "o-", label="throughput (OK/s)")
    top.plot(x, [r.goodput_rps for r in results], "s--", label="goodput (within deadline)")
    if not closed:
        top.plot(x, x, ":", color="grey", label="offered")
    if capacity_rps is not None:
        top.axhline(
            capacity_rps, color="red", lw=0.8, label=f"engine capacity {capacity_rps:.0f}/s"
        )
    top.set_ylabel("replies per second")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.legend(fontsize="small")
    bottom.plot(x, [r.latency_ms["p99"] for r in results], "o-", color="C3", label="p99 latency")
    bottom.set_yscale("log")
    bottom.set_ylabel("p99 latency (ms, log)", color="C3")
    bottom.grid(True, alpha=0.3)
    shed = bottom.twinx()
    shed.plot(x, [100 * r.shed_fraction for r in results], "^:", color="C4", label="shed")
    shed.set_ylabel("shed (% of requests)", color="C4")
    shed.set_ylim(0, 100)
    bottom.set_xlabel("concurrency (requests in flight)" if closed else "offered load (req/s)")
    return _save(fig, path)


def timeline_window(
    records: Sequence[Record], span_ms: float, at: float = 0.5
) -> tuple[list[tuple[str, int, int]], int]:
    """The ``(device, start_ns, end_ns)`` of the OK records whose device execution overlaps a
    ``span_ms`` window placed at fraction ``at`` of the level's device activity, and the
    window's start (ns, the daemon's clock)."""
    ran = [
        (r.device or "?", r.start_ns, r.end_ns)
        for r in records
        if r.start_ns is not None and r.end_ns is not None
    ]
    if not ran:
        return [], 0
    first = min(a for _, a, _ in ran)
    last = max(b for _, _, b in ran)
    start = max(int(first + (last - first - span_ms * 1e6) * min(max(at, 0.0), 1.0)), first)
    end = start + int(span_ms * 1e6)
    return [(d, a, b) for d, a, b in ran if b > start and a < end], start


def plot_timeline(
    records: Sequence[Record], path: Path, *, span_ms: float = 100.0, title: str = ""
) -> Path:
    """A Gantt chart of a ``span_ms`` window: one row per device, one bar per device run
    (``timing.start_ns``/``end_ns``; the frames of one batch share theirs, and a batch's bar
    is labelled with its size); the busy fraction of each row in its label."""
    inside, t0 = timeline_window(records, span_ms)
    devices = sorted({d for d, _, _ in inside})
    fig = Figure(figsize=(9, 1.2 + 0.7 * max(len(devices), 1)))
    ax = fig.add_subplot()
    end = t0 + span_ms * 1e6
    labels = []
    for row, dev in enumerate(devices):
        sizes = Counter((a, b) for d, a, b in inside if d == dev)  # one run: one batch
        spans = sorted(sizes)
        busy = sum(min(b, end) - max(a, t0) for a, b in spans)
        bars = [((a - t0) / 1e6, (b - a) / 1e6) for a, b in spans]
        colors = [f"C{i % 2}" for i in range(len(bars))]  # alternate, so back-to-back tasks show
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=colors, edgecolor="white", lw=0.3)
        for (a, b), (x, width) in zip(spans, bars, strict=True):
            if sizes[a, b] > 1 and width > span_ms / 60:
                ax.text(x + width / 2, row, str(sizes[a, b]), ha="center", va="center",
                        fontsize="x-small", color="white")  # fmt: skip
        labels.append(f"{dev}  {100 * busy / (span_ms * 1e6):.0f}% busy")
    ax.set_yticks(range(len(devices)), labels)
    ax.set_xlim(0, span_ms)
    ax.set_ylim(-0.6, len(devices) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"device timeline, {span_ms:g} ms window", fontsize="medium")
    ax.grid(True, axis="x", alpha=0.3)
    if not inside:
        ax.text(0.5, 0.5, "no request ran on a device in this window", transform=ax.transAxes,
                ha="center")  # fmt: skip
    return _save(fig, path)
