"""Pass/fail thresholds for dlad-bench (``--fail-if``): CI can gate on a run.

A threshold is ``<metric><op><value>[unit]``, e.g. ``p99>40ms``, ``goodput<0.95``,
``slo<0.99``, ``throughput<200``; it *fails* a level when the comparison is true. Metrics:

- ``p50``, ``p90``, ``p95``, ``p99``, ``p99.9``, ``max``: client latency of OK replies from the
  send, ms; ``due_p50`` ... ``due_max``: the same from each request's due time (open loop);
- ``goodput``: OK replies within their deadline, as a fraction of the requests sent;
- ``slo``: OK replies within ``--slo-ms`` of their due time, as a fraction of those sent;
- ``throughput``: OK replies per second; ``shed``: the fraction refused or expired.

A level with no value for a metric (no OK reply, no SLO) fails a threshold on it. dlad-bench
exits :data:`EXIT_THRESHOLD` when any level fails any threshold.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from dlad_bench.measure import LevelResult

__all__ = ["EXIT_THRESHOLD", "RateSearch", "Threshold", "failures", "parse_threshold"]

EXIT_THRESHOLD: Final = 3
"""dlad-bench's exit status when a ``--fail-if`` threshold fails (1: the daemon stopped
answering; 2: a usage error)."""

_LATENCY: Final = {"p50": "p50", "p90": "p90", "p95": "p95", "p99": "p99", "p99.9": "p99_9",
                   "max": "max"}  # fmt: skip
_OPS: Final[dict[str, Callable[[float, float], bool]]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_FORM: Final = re.compile(r"^\s*([a-z_0-9.]+)\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+)\s*(ms|%|/s)?\s*$")


def _ratio(numerator: float, r: LevelResult) -> float:
    return numerator / r.sent_rps if r.sent_rps > 0 else math.nan


def _metric(name: str) -> tuple[Callable[[LevelResult], float], str] | None:
    """How to read ``name`` from a level, and its unit ("ms", "" for fractions, "/s")."""
    if name in _LATENCY:
        key = _LATENCY[name]
        return (lambda r: r.latency_ms[key]), "ms"
    if name.startswith("due_") and name[4:] in _LATENCY:
        key = _LATENCY[name[4:]]
        return (lambda r: r.intended_latency_ms.get(key, math.nan)), "ms"
    table: dict[str, tuple[Callable[[LevelResult], float], str]] = {
        "goodput": (lambda r: _ratio(r.goodput_rps, r), ""),
        "slo": (lambda r: _ratio(r.slo_goodput_rps, r), ""),
        "throughput": (lambda r: r.throughput_rps, "/s"),
        "shed": (lambda r: r.shed_fraction, ""),
    }
    return table.get(name)


@dataclass(frozen=True)
class Threshold:
    """One ``--fail-if`` condition."""

    text: str
    read: Callable[[LevelResult], float]
    op: Callable[[float, float], bool]
    value: float

    def fails(self, r: LevelResult) -> bool:
        """Whether ``r`` fails it (a missing value fails)."""
        got = self.read(r)
        return not math.isfinite(got) or self.op(got, self.value)


def parse_threshold(text: str) -> Threshold:
    """Parse ``<metric><op><value>[unit]``. Raises ValueError saying what is wrong."""
    match = _FORM.match(text)
    if match is None:
        raise ValueError(f"--fail-if {text!r}: write <metric><op><value>, e.g. 'p99>40ms'")
    name, op, number, unit = match.groups()
    metric = _metric(name)
    if metric is None:
        raise ValueError(f"--fail-if {text!r}: unknown metric {name!r} (p50 ... p99.9, max, "
                         "due_p99 ..., goodput, slo, throughput, shed)")  # fmt: skip
    read, want = metric
    value = float(number)
    if unit == "%":
        if want != "":
            raise ValueError(f"--fail-if {text!r}: % is for fractions (goodput, slo, shed)")
        value /= 100
    elif unit is not None and unit != want:
        raise ValueError(f"--fail-if {text!r}: {name} is in {want or 'a fraction'}, not {unit}")
    return Threshold(text.strip(), read, _OPS[op], value)


def failures(
    thresholds: Sequence[Threshold], results: Sequence[tuple[str, LevelResult]]
) -> list[str]:
    """One line per (level, threshold) that failed, e.g. ``rate 100: p99>40ms (p99 = 52.1)``."""
    return [
        f"{label}: {t.text} (measured {t.read(r):.4g})"
        for label, r in results
        for t in thresholds
        if t.fails(r)
    ]


class RateSearch:
    """The highest open-loop rate in ``[lo, hi]`` whose p99 from the due time stays within
    ``p99_ms`` with at most ``max_failed`` of the requests not OK (perf_analyzer's
    ``--latency-threshold`` search): ``lo`` first (if it fails there is no answer), then ``hi``
    (if it passes, it is the answer), then ``steps`` bisections between the highest passing
    and the lowest failing rate. :meth:`next` gives the rate to measure, None when done;
    :meth:`record` takes each result."""

    def __init__(self, lo: float, hi: float, p99_ms: float, *, steps: int = 6,
                 max_failed: float = 0.01) -> None:  # fmt: skip
        if not 0 < lo < hi:
            raise ValueError(f"--search-p99-ms needs --rate LO:HI with 0 < LO < HI, got {lo}:{hi}")
        if not (p99_ms > 0 and steps >= 0):
            raise ValueError("--search-p99-ms must be > 0 and --search-steps >= 0")
        self.p99_ms, self.max_failed, self._steps = p99_ms, max_failed, steps
        self.passing: float | None = None  # the highest rate that passed
        self.failing: float | None = None  # the lowest rate above it that failed
        self.tried: list[tuple[float, bool]] = []
        self._queue = [lo, hi]

    @property
    def total(self) -> int:
        """The most levels the search measures."""
        return 2 + self._steps

    def passes(self, r: LevelResult) -> bool:
        """Whether a level meets the objective."""
        p99 = r.intended_latency_ms.get("p99", math.nan)
        failed = 1 - r.status_counts.get("OK", 0) / r.requests if r.requests else 1.0
        return math.isfinite(p99) and p99 <= self.p99_ms and failed <= self.max_failed

    def next(self) -> float | None:
        if self._queue:
            return self._queue[0]
        bisections = len(self.tried) - 2
        if self.passing is None or self.failing is None or bisections >= self._steps:
            return None
        return (self.passing + self.failing) / 2

    def record(self, rate: float, r: LevelResult) -> None:
        ok = self.passes(r)
        self.tried.append((rate, ok))
        if self._queue and self._queue[0] == rate:
            self._queue.pop(0)
            if not ok and len(self.tried) == 1:
                self._queue.clear()  # even the lowest rate fails: no answer
        if ok and (self.passing is None or rate > self.passing):
            self.passing = rate
        if not ok and (self.failing is None or rate < self.failing):
            self.failing = rate
        if ok and len(self.tried) == 2:
            self.failing = None  # the highest rate passes: it is the answer, stop

    def summary(self) -> str:
        """The answer in a sentence."""
        if self.passing is None:
            return f"no rate tried keeps p99 within {self.p99_ms:g} ms (the lowest failed)"
        above = "" if self.failing is None else f"; {self.failing:.1f}/s fails"
        return (f"the highest rate with p99 within {self.p99_ms:g} ms from the due time and "
                f"<= {100 * self.max_failed:g}% not OK: {self.passing:.1f}/s{above}")  # fmt: skip
