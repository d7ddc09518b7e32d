"""The native plane's DRAM model (dlad/native/dram.cpp) is dlad/devices/dram.py's: on generated
sequences of tasks beginning and finishing on a stepped clock, both project the same ends and
run each task at the same slowdown. The plane's cores then share it
(tests/dlad/test_native_plane.py serves through it)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlad.devices.dram import ORIN_DRAM_K, SharedDram


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


# one step: advance the clock, then begin a task (kind, work in µs) or finish a running one
STEP = st.tuples(
    st.integers(0, 50_000),
    st.one_of(
        st.tuples(st.just("begin"), st.sampled_from(["dla", "gpu"]), st.floats(0, 20_000)),
        st.tuples(st.just("finish"), st.integers(0, 1_000)),
    ),
)


@settings(max_examples=200, deadline=None)
@given(contention=st.floats(0, 10), steps=st.lists(STEP, min_size=1, max_size=40))
def test_the_plane_projects_the_python_models_ends(
    contention: float, steps: list[tuple[int, tuple[object, ...]]]
) -> None:
    from dlad import _native  # present: the mark says so

    clock = Clock()
    python = SharedDram(contention, clock=clock)
    native = _native.SharedDram(contention, dict(ORIN_DRAM_K), clock)
    running: list[tuple[object, int]] = []  # (Python's transfer, the plane's id)
    for elapsed, action in steps:
        clock.now += elapsed
        if action[0] == "begin":
            _, kind, work_us = action
            running.append((python.begin(kind, work_us * 1e3), native.begin(kind, work_us * 1e3)))  # type: ignore[arg-type]
        elif running:
            transfer, id_ = running.pop(int(action[1]) % len(running))  # type: ignore[call-overload]
            python.finish(transfer)  # type: ignore[arg-type]
            native.finish(id_)
        for transfer, id_ in running:
            assert native.slowdown(id_) == pytest.approx(transfer.slowdown, rel=1e-12)  # type: ignore[attr-defined]
            assert abs(native.end_ns(id_) - python.end_ns(transfer)) <= 1  # type: ignore[arg-type]


def test_a_bad_contention_is_refused() -> None:
    from dlad import _native

    with pytest.raises(ValueError, match="contention must be in"):
        _native.SharedDram(11.0, dict(ORIN_DRAM_K), Clock())
