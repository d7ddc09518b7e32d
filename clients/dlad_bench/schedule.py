"""Request schedules of the open-loop modes, computed before the run starts.

Send times are precomputed so that a slow daemon cannot slow the generator down (an open loop
never waits for a reply before sending the next request): the runner only sleeps until each
time and sends. If the generator itself falls behind, the runner measures it (late sends).

* :func:`arrival_times`: one request stream at a mean rate, with ``constant`` gaps, ``poisson``
  (exponential gaps), or ``gamma`` gaps whose coefficient of variation is ``burstiness``
  (1 is Poisson; above 1 requests come in bursts, below 1 they are more regular than Poisson).
* :func:`camera_times`: ``streams`` cameras at ``fps`` each (or skewed around that mean:
  :func:`camera_fps`), every camera at its own phase (real cameras are not synchronised), every
  frame tagged with its camera's index.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Arrivals", "arrival_times", "camera_fps", "camera_times"]

Arrivals = Literal["constant", "poisson", "gamma"]
ARRIVALS: tuple[Arrivals, ...] = ("constant", "poisson", "gamma")


def _check(rate: float, duration_s: float) -> None:
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")


def arrival_times(
    rate: float,
    duration_s: float,
    *,
    arrivals: Arrivals = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> npt.NDArray[np.float64]:
    """Send times in seconds from the start, sorted, in ``[0, duration_s)``, of a mean ``rate``
    per second.

    ``constant``: ``i / rate``. ``poisson``: exponential gaps of mean ``1 / rate``. ``gamma``:
    gamma gaps of mean ``1 / rate`` and coefficient of variation ``burstiness`` (shape
    ``1 / burstiness**2``). The first request of the random modes comes after one gap (a
    stationary process started at 0). Deterministic for a given ``seed``.

    Raises ValueError for a rate or duration that is not > 0, an unknown ``arrivals``, or a
    ``burstiness`` that is not > 0.
    """
    _check(rate, duration_s)
    if arrivals == "constant":
        return np.arange(0.0, duration_s, 1.0 / rate)
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, got {arrivals!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    rng = np.random.default_rng(seed)
    mean_gap = 1.0 / rate
    chunks: list[npt.NDArray[np.float64]] = []
    last = 0.0
    expected = rate * duration_s
    # Draw in chunks a little larger than the expected count until the horizon is passed.
    size = int(expected + 6 * math.sqrt(expected) * max(burstiness, 1.0)) + 16
    while last < duration_s:
        if arrivals == "poisson":
            gaps = rng.exponential(mean_gap, size)
        else:
            shape = 1.0 / burstiness**2
            gaps = rng.gamma(shape, mean_gap / shape, size)
        times = last + np.cumsum(gaps)
        chunks.append(times)
        last = float(times[-1])
    out = np.concatenate(chunks)
    return out[out < duration_s]


def camera_fps(streams: int, fps: float, skew: float = 0.0) -> npt.NDArray[np.float64]:
    """Each camera's frame rate: all ``fps`` at ``skew = 0``; else camera ``s`` in proportion to
    ``(s + 1) ** -skew`` (Zipf), scaled so that the mean stays ``fps`` (the offered load is the
    same; a few cameras carry much of it). Raises ValueError for ``streams < 1``, ``fps <= 0``
    or a negative ``skew``."""
    if not streams >= 1:
        raise ValueError(f"streams must be an int >= 1, got {streams!r}")
    if not (fps > 0 and skew >= 0):
        raise ValueError(f"fps must be > 0 and skew >= 0, got {fps!r} and {skew!r}")
    weights = np.arange(1, streams + 1, dtype=np.float64) ** -float(skew)
    rates: npt.NDArray[np.float64] = fps * weights * streams / weights.sum()
    return rates


def camera_times(
    streams: int, fps: float, duration_s: float, *, seed: int = 0, skew: float = 0.0
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Frame times of ``streams`` cameras at :func:`camera_fps` rates (``fps`` each without
    ``skew``), merged in time order, and the camera index of each frame. Camera ``s`` sends at
    ``phase[s] + k / fps[s]`` with its phase drawn uniformly in one of its frame periods.

    Raises ValueError unless ``streams >= 1``, ``fps`` and ``duration_s`` are > 0 and ``skew``
    is >= 0.
    """
    _check(fps, duration_s)
    periods = 1.0 / camera_fps(streams, fps, skew)
    phases = np.random.default_rng(seed).uniform(0.0, 1.0, streams) * periods
    per_camera = [phase + np.arange(0.0, duration_s, period) for phase, period in zip(
        phases, periods, strict=True
    )]  # fmt: skip
    times = np.concatenate(per_camera)
    ids = np.concatenate([np.full(t.size, s, np.int64) for s, t in enumerate(per_camera)])
    order = np.argsort(times, kind="stable")
    keep = times[order] < duration_s
    return times[order][keep], ids[order][keep]
