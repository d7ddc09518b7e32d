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

__all__ = ["EXIT_THRESHOLD", "Threshold", "failures", "parse_threshold"]

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
