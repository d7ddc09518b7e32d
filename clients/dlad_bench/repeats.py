"""Repeated trials of a level (``--repeat N``): how much its throughput and p99 move from one
run to the next, so that a difference between two runs can be told from noise.

Each figure is reported over its N trials as the mean, the coefficient of variation (sample
standard deviation over the mean) and a 95% confidence interval of the mean by the percentile
bootstrap (10,000 resamples of the N values, seeded: the same trials give the same interval).
The bootstrap assumes no distribution (latency percentiles are far from normal) and needs only
numpy; with fewer than about five trials it is optimistic, the CV then says more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from dlad_bench.measure import LevelResult

__all__ = ["RESAMPLES", "Spread", "json_repeats", "print_repeats", "representative", "spread"]

RESAMPLES = 10_000


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over a level's trials."""

    values: tuple[float, ...]
    mean: float
    cv: float  # sample std / mean (NaN for one trial or a zero mean)
    ci95: tuple[float, float]  # bootstrap interval of the mean

    def as_dict(self) -> dict[str, Any]:
        """For JSON: a figure that is not finite (no trial had one) is null."""
        return {"values": [_finite(v) for v in self.values], "mean": _finite(self.mean),
                "cv": _finite(self.cv), "ci95": [_finite(v) for v in self.ci95]}  # fmt: skip


def spread(values: Sequence[float], *, seed: int = 0) -> Spread:
    """The mean, CV and bootstrap 95% interval of ``values`` (the finite ones; all NaN if
    none is)."""
    x = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        return Spread(tuple(values), math.nan, math.nan, (math.nan, math.nan))
    mean = float(x.mean())
    cv = float(x.std(ddof=1) / mean) if x.size > 1 and mean != 0 else math.nan
    if x.size == 1:
        return Spread(tuple(values), mean, cv, (mean, mean))
    rng = np.random.default_rng(seed)
    means = rng.choice(x, size=(RESAMPLES, x.size), replace=True).mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    # A resample of one value n times averages back to it only up to rounding: the interval
    # of a mean lies within the values, and the mean within it, exactly.
    lo = min(max(float(lo), float(x.min())), mean)
    hi = max(min(float(hi), float(x.max())), mean)
    return Spread(tuple(values), mean, cv, (lo, hi))


def representative(trials: Sequence[LevelResult]) -> int:
    """The index of the trial whose throughput is the median (the lower one of an even
    count): the trial the main table, the CSV, the plots and the thresholds show."""
    order = sorted(range(len(trials)), key=lambda i: trials[i].throughput_rps)
    return order[(len(order) - 1) // 2]


def json_repeats(label: str, trials: Sequence[LevelResult]) -> dict[str, Any]:
    """One level's trials for the JSON report."""
    return {
        "load": label,
        "trials": len(trials),
        "representative": representative(trials),
        "throughput_rps": spread([t.throughput_rps for t in trials]).as_dict(),
        "goodput_rps": spread([t.goodput_rps for t in trials]).as_dict(),
        "p99_ms": spread([t.latency_ms["p99"] for t in trials]).as_dict(),
    }


def print_repeats(rows: Sequence[tuple[str, Sequence[LevelResult]]], console: Console) -> None:
    """A table of each level's trials: throughput and p99, mean [95% CI] and CV."""
    n = max((len(t) for _, t in rows), default=0)
    table = Table(title=f"over {n} trials: mean [95% bootstrap CI], CV", header_style="bold",
                  box=None, pad_edge=False)  # fmt: skip
    for col in ("load", "ok/s", "ok/s CV %", "p99 ms", "p99 CV %"):
        table.add_column(col, justify="left" if col == "load" else "right")
    for label, trials in rows:
        rate = spread([t.throughput_rps for t in trials])
        p99 = spread([t.latency_ms["p99"] for t in trials])
        table.add_row(label, _interval(rate, 1), _pct(rate.cv), _interval(p99, 2), _pct(p99.cv))
    console.print(table)


def _interval(s: Spread, digits: int) -> str:
    if not math.isfinite(s.mean):
        return "-"
    return f"{s.mean:.{digits}f} [{s.ci95[0]:.{digits}f}, {s.ci95[1]:.{digits}f}]"


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
