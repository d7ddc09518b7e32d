"""Checks every GPU engine (emulated, torch, TensorRT) must pass, shared by their tests."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt


def assert_batches_run_one_at_a_time(
    engine: Any, frames: Sequence[npt.NDArray[np.int8]], *, threads: int, timeout_s: float
) -> None:
    """``engine.run(frames)`` from ``threads`` threads at once: each gets the heads a lone run
    gives, bit for bit, and the batches' timed spans never overlap (one engine, one batch)."""
    want, _ = engine.run(frames)
    results: list[list[list[npt.NDArray[np.float32]]]] = []
    timings = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            heads, timing = engine.run(frames)
            results.append(heads)
            timings.append(timing)
        except BaseException as exc:  # noqa: BLE001 (reported by the test thread below)
            errors.append(exc)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout_s)
    assert not errors, errors
    assert len(results) == threads
    for heads in results:
        for frame, lone in zip(heads, want, strict=True):
            for a, b in zip(frame, lone, strict=True):
                np.testing.assert_array_equal(a, b)
    spans = sorted((t.start_ns, t.end_ns) for t in timings)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # one at a time
