"""Request schedules of the open-loop modes, computed before the run starts.

Send times are precomputed so that a slow daemon cannot slow the generator down (an open loop
never waits for a reply before sending the next request): the runner only sleeps until each
time and sends. If the generator itself falls behind, the runner measures it (late sends).

* :func:`arrival_times`: one request stream at a mean rate, with ``constant`` gaps, ``poisson``
  (exponential gaps), or ``gamma`` gaps whose coefficient of variation is ``burstiness``
  (1 is Poisson; above 1 requests come in bursts, below 1 they are more regular than Poisson).
* :func:`camera_times`: ``streams`` cameras at ``fps`` each, every camera at its own phase (real
  cameras are not synchronised), every frame tagged with its camera's index.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Arrivals", "arrival_times", "camera_times"]

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


def camera_times(
    streams: int, fps: float, duration_s: float, *, seed: int = 0
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Frame times of ``streams`` cameras at ``fps`` each, merged in time order, and the camera
    index of each frame. Camera ``s`` sends at ``phase[s] + k / fps`` with its phase drawn
    uniformly in one frame period.

    Raises ValueError unless ``streams >= 1`` and ``fps`` and ``duration_s`` are > 0.
    """
    if not streams >= 1:
        raise ValueError(f"streams must be an int >= 1, got {streams!r}")
    _check(fps, duration_s)
    period = 1.0 / fps
    phases = np.random.default_rng(seed).uniform(0.0, period, streams)
    frames = np.arange(0.0, duration_s, period)
    times = (phases[:, None] + frames[None, :]).ravel()
    ids = np.repeat(np.arange(streams, dtype=np.int64), frames.size)
    order = np.argsort(times, kind="stable")
    keep = times[order] < duration_s
    return times[order][keep], ids[order][keep]
