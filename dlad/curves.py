"""Service time as a function of batch size, from a few known points (``interpolate``).

Shared by the scheduler's learned estimates and the emulated GPU's published curve.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

__all__ = ["interpolate"]


def interpolate(points: Mapping[int, float], size: int) -> float:
    """The value at ``size`` of the curve through ``points`` (batch size -> time): linear
    between the nearest known sizes; below the smallest, proportional to it; above the largest,
    its per-item cost. Raises ValueError for no points."""
    if size in points:
        return points[size]
    if not points:
        raise ValueError("a curve needs at least one point")
    sizes = sorted(points)
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return points[sizes[0]] * size / sizes[0]
    if i == len(sizes):
        return points[sizes[-1]] * size / sizes[-1]
    lo, hi = sizes[i - 1], sizes[i]
    return points[lo] + (size - lo) / (hi - lo) * (points[hi] - points[lo])
