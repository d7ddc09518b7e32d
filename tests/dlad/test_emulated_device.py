"""The device interface on the emulated DLA core: numerics, latency, concurrency of two cores,
fences, ordering, fault injection, timeouts, sticky errors, resource rules and shutdown.

No test sleeps to synchronise: every wait is on a fence (with a timeout), and "has not started
yet" is only asserted where it cannot be otherwise (the task's wait fence is unsignalled).
Every core is closed at teardown and the test fails if a thread outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import mmap
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import structlog.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from dlad.devices.base import (
    MAX_LAYOUTS,
    MAX_SIGNAL_EVENTS,
    MAX_TASK_TIMEOUT_MS,
    MAX_WAIT_EVENTS,
    Buffer,
    CudlaStatus,
    DlaCore,
    DlaError,
    Module,
    SyncObject,
    Task,
    TaskHandle,
    check_task_layout,
)
from dlad.devices.emulated import (
    ABORTED_STATUS,
    EmulatedBuffer,
    EmulatedDlaCore,
    EmulatedFence,
    EmulatedModule,
    EmulatedTaskHandle,
    FaultConfig,
)
from dlad.devices.int8_engine import Int8Engine, OutputSpec
from dlad.imaging.post import unpack_chw16
from dlad.imaging.pre import quantize_hwc4
from dlad.loadable import (
    DataType,
    Loadable,
    TensorFormat,
    chw_vectorized,
    dla_linear,
    loadable_bytes,
    read_loadable,
)
from dlad.models import DEMO

pytestmark = pytest.mark.timeout(30)

WAIT_S = 10.0  # generous: a fence that is not reached by then is a failure, not slowness
DEMO0 = DEMO / "fp16_heads.dla0.emu"
DEMO1 = DEMO / "fp16_heads.dla1.emu"
OpenCore = Callable[..., EmulatedDlaCore]


# --------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture
def open_core() -> Iterator[OpenCore]:
    """Opens cores; at teardown closes them and proves that no thread outlives the test."""
    before = set(threading.enumerate())
    opened: list[EmulatedDlaCore] = []

    def factory(core: int = 0, **kwargs: Any) -> EmulatedDlaCore:
        opened.append(EmulatedDlaCore(core, **kwargs))
        return opened[-1]

    yield factory
    for core in opened:
        core.close(force=True)
    leaked = [t for t in threading.enumerate() if t not in before]
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture(scope="module")
def demo() -> Loadable:
    return read_loadable(DEMO0, expect_core=0)


def bind(core: EmulatedDlaCore, module: EmulatedModule) -> tuple[list[Any], list[Any]]:
    ins = [core.alloc_buffer(d) for d in module.inputs]
    outs = [core.alloc_buffer(d) for d in module.outputs]
    return ins, outs


def timing_core(open_core: OpenCore, core: int = 0, **kwargs: Any) -> tuple[Any, ...]:
    """A timing-mode core with the demo loadable and one set of buffers."""
    dla = open_core(core, mode="timing", **kwargs)
    module = dla.load(DEMO0 if core == 0 else DEMO1)
    ins, outs = bind(dla, module)
    return dla, module, ins, outs


def with_outputs(lo: Loadable, fmt: TensorFormat) -> bytes:
    """The demo loadable's bytes with its heads re-described as int8 ``fmt`` tensors."""
    if fmt == TensorFormat.CHW16:
        return loadable_bytes(lo)
    make = {
        TensorFormat.CHW32: lambda d: chw_vectorized(d.name, d.c, d.h, d.w, vec=32, scale=0.05),
        TensorFormat.DLA_LINEAR: lambda d: dla_linear(d.name, d.c, d.h, d.w, scale=0.05),
    }[fmt]
    outputs = tuple(make(d) for d in lo.outputs)
    scales = {d.name: 0.05 for d in outputs}
    return loadable_bytes(
        dataclasses.replace(lo, outputs=outputs, heads="int8", output_scales=scales)
    )


@contextlib.contextmanager
def raises(status: CudlaStatus, call: str | None = None) -> Iterator[None]:
    """Expect a DlaError with ``status`` (and ``call``, if given)."""
    with pytest.raises(DlaError) as info:
        yield
    assert info.value.status is status, info.value
    if call is not None:
        assert info.value.call == call, info.value


def _conforms(
    core: EmulatedDlaCore,
    module: EmulatedModule,
    buf: EmulatedBuffer,
    fence: EmulatedFence,
    handle: EmulatedTaskHandle,
) -> tuple[DlaCore, Module, Buffer, SyncObject, TaskHandle]:
    """Never called: mypy checks here that the emulated classes implement the Protocols."""
    return core, module, buf, fence, handle


# --------------------------------------------------------------------------- numerics, formats


def test_numeric_round_trip_equals_the_engine(open_core: OpenCore, demo: Loadable) -> None:
    core = open_core(0, mode="numeric")
    with structlog.testing.capture_logs() as logs:
        module = core.load(DEMO0)
    # The load names the INT8 kernel path this host runs (operands, runtime, CPU, why).
    (path,) = [e for e in logs if e["event"] == "int8_kernel_path"]
    assert module.engine is not None
    assert path["operands"] == module.engine.kernel.operands
    assert path["core"] == "dla0"
    assert path["exact"] is True
    assert path["runtime"].startswith("onnxruntime ")
    assert module.inputs == demo.inputs
    assert module.outputs == demo.outputs
    ins, outs = bind(core, module)
    rng = np.random.default_rng()
    canvas = rng.integers(0, 256, (*demo.image_size, 3), dtype=np.uint8)
    ins[0].array[0] = quantize_hwc4(canvas, demo.input_scale)
    done = core.create_fence()
    handle = core.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)

    # Reference: an engine of our own on the same loadable, fed the same bytes.
    inp = demo.inputs[0]
    specs = [OutputSpec(d.name, d.c, d.h, d.w, "fp16", None) for d in demo.outputs]
    engine = Int8Engine(
        demo.sections["graph"],
        input_scale=demo.input_scale,
        input_shape=(inp.c, inp.h, inp.w),
        outputs=specs,
    )
    want = engine.run(quantize_hwc4(canvas, demo.input_scale))
    for buf, ref in zip(outs, want, strict=True):
        assert buf.raw.tobytes() == ref.tobytes()  # byte-exact, padding channels included
    assert handle.status is CudlaStatus.SUCCESS
    assert core.last_error() is CudlaStatus.SUCCESS
    t = handle.timing
    assert t is not None
    assert t.modelled_us == demo.latency_us
    assert t.compute_us is not None
    assert t.compute_us > 0
    assert t.submit_ns <= t.start_ns < t.end_ns
    assert t.actual_us >= max(t.modelled_us, t.compute_us)


def test_timing_mode_takes_the_modelled_latency(open_core: OpenCore) -> None:
    latency_us = 40_000.0
    core, module, ins, outs = timing_core(open_core, latency_us=latency_us)
    done = core.create_fence()
    t0 = time.monotonic_ns()
    handle = core.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    elapsed_us = (time.monotonic_ns() - t0) / 1e3
    t = handle.timing
    assert t is not None
    assert t.modelled_us == latency_us
    assert latency_us <= t.actual_us <= elapsed_us
    assert t.actual_us < latency_us + 2e6  # only a gross overrun fails; timing is in benchmarks


def test_latency_defaults_to_the_loadables(open_core: OpenCore, demo: Loadable) -> None:
    core, module, ins, outs = timing_core(open_core)
    done = core.create_fence()
    handle = core.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    assert handle.timing is not None
    assert handle.timing.modelled_us == demo.latency_us
    assert handle.timing.actual_us >= demo.latency_us


@pytest.mark.parametrize("fmt", [TensorFormat.CHW16, TensorFormat.CHW32, TensorFormat.DLA_LINEAR])
def test_timing_outputs_are_valid_and_deterministic(
    open_core: OpenCore, demo: Loadable, fmt: TensorFormat
) -> None:
    core = open_core(0, mode="timing", latency_us=0)
    module = core.load(with_outputs(demo, fmt))
    ins, outs = bind(core, module)
    done = core.create_fence()
    got = []
    for value in (1, 2):
        for buf in outs:
            buf.raw[:] = 0x5A  # garbage the task must overwrite, padding included
        core.submit(Task(module, ins, outs, signal=[(done, value)]))
        assert done.wait(value, WAIT_S)
        got.append([buf.raw.copy() for buf in outs])
    assert all(np.array_equal(a, b) for a, b in zip(*got, strict=True))
    for buf, desc in zip(outs, module.outputs, strict=True):
        image = buf.array[0]
        assert buf.array.dtype == desc.numpy_dtype
        if fmt == TensorFormat.DLA_LINEAR:
            assert not image[..., desc.w :].any()  # row padding
            body = image[..., : desc.w]
        else:
            vec = image.shape[-1]
            channels = image.transpose(0, 3, 1, 2).reshape(-1, desc.h, desc.w)
            assert not channels[desc.c :].any()  # padding channels
            body = channels[: desc.c]
            assert image.shape[0] * vec >= desc.c
        assert np.isfinite(body.astype(np.float32)).all()
        assert len(np.unique(body)) > 10  # a pattern, not a constant
    if fmt == TensorFormat.CHW16:  # what post-processing reads
        head = unpack_chw16(outs[0].array[0], module.outputs[0].c)
        assert head.shape == (module.outputs[0].c, module.outputs[0].h, module.outputs[0].w)


def test_timing_outputs_reach_each_slots_own_buffers(open_core: OpenCore, demo: Loadable) -> None:
    """The core remembers the output images of a tuple of buffers it wrote: a second slot's
    buffers, and a first slot's again, each get the task's outputs (no stale views)."""
    core = open_core(0, mode="timing", latency_us=0)
    module = core.load(with_outputs(demo, TensorFormat.CHW16))
    slots = [tuple(map(tuple, bind(core, module))) for _ in range(2)]  # a slot's own tuples
    done = core.create_fence()
    for value, (ins, outs) in enumerate((*slots, slots[0]), start=1):
        for buf in (b for _, o in slots for b in o):
            buf.raw[:] = 0x5A
        core.submit(Task(module, ins, outs, signal=[(done, value)]))
        assert done.wait(value, WAIT_S)
        others = [b for _, o in slots if o is not outs for b in o]
        assert all((buf.raw != 0x5A).any() for buf in outs)
        assert all((buf.raw == 0x5A).all() for buf in others)


def test_numeric_mode_refuses_what_the_engine_cannot_run(
    open_core: OpenCore, demo: Loadable
) -> None:
    linear = open_core(0, mode="numeric")
    with raises(CudlaStatus.ERROR_UNSUPPORTED_OPERATION, "cudlaModuleLoadFromMemory"):
        linear.load(with_outputs(demo, TensorFormat.DLA_LINEAR))
    # CHW32 int8 is supported, but this graph writes fp16 heads: the engine refuses the module.
    mismatch = open_core(1, mode="numeric")
    with raises(CudlaStatus.ERROR_INVALID_MODULE):
        mismatch.load(with_outputs(dataclasses.replace(demo, dla_core=1), TensorFormat.CHW32))


# --------------------------------------------------------------------------- concurrency, order


def test_two_cores_run_concurrently(open_core: OpenCore) -> None:
    x_us = 250_000.0
    cores = [open_core(i, mode="numeric", latency_us=x_us) for i in (0, 1)]
    jobs = []
    for core, path in zip(cores, (DEMO0, DEMO1), strict=True):
        module = core.load(path)
        ins, outs = bind(core, module)
        ins[0].raw[:] = np.random.default_rng().integers(0, 256, ins[0].raw.size, np.uint8)
        jobs.append((core, Task(module, ins, outs, signal=[(core.create_fence(), 1)])))
    handles = [core.submit(task) for core, task in jobs]
    for _, task in jobs:
        assert task.signal[0][0].wait(1, WAIT_S)
    timings = [h.timing for h in handles]
    assert all(t is not None and t.actual_us >= x_us for t in timings)
    starts = [t.start_ns for t in timings if t]
    ends = [t.end_ns for t in timings if t]
    assert max(starts) < min(ends), "the two cores' tasks did not overlap"
    assert (max(ends) - min(starts)) / 1e3 < 1.6 * x_us
    assert all(h.status is CudlaStatus.SUCCESS for h in handles)


def test_tasks_run_in_submission_order(open_core: OpenCore) -> None:
    core, module, ins, outs = timing_core(open_core, latency_us=300)
    fence = core.create_fence()
    order: list[int] = []
    for value in range(1, 21):  # appended from the core's thread as the fence passes each
        fence.on_reached(value, functools.partial(order.append, value))
    finished = threading.Event()
    fence.on_reached(20, finished.set)  # after order's callback of 20 (same value: FIFO)
    handles = [core.submit(Task(module, ins, outs, signal=[(fence, v)])) for v in range(1, 21)]
    assert finished.wait(WAIT_S)
    assert order == list(range(1, 21))
    assert [h.id for h in handles] == list(range(1, 21))
    timings = [h.timing for h in handles]
    for a, b in itertools.pairwise(timings):
        assert a is not None
        assert b is not None
        assert a.end_ns <= b.start_ns


def test_task_starts_only_after_its_wait_fence(open_core: OpenCore) -> None:
    core, module, ins, outs = timing_core(open_core, latency_us=0)
    gate, done = EmulatedFence("gate"), core.create_fence()
    handle = core.submit(Task(module, ins, outs, wait=[(gate, 2)], signal=[(done, 1)]))
    gate.signal(1)  # below the awaited value: still blocked
    pending = handle.status  # a local: mypy would keep the attribute narrowed to None
    assert pending is None
    assert not done.reached(1)
    assert core.in_flight == 1
    opened_ns = time.monotonic_ns()
    gate.signal(2)
    assert done.wait(1, WAIT_S)
    assert handle.timing is not None
    assert handle.timing.start_ns >= opened_ns
    assert handle.status is CudlaStatus.SUCCESS
    assert core.in_flight == 0


def test_fences_chain_tasks_across_cores(open_core: OpenCore) -> None:
    dla0, m0, in0, out0 = timing_core(open_core, 0, latency_us=20_000)
    dla1, m1, in1, out1 = timing_core(open_core, 1, latency_us=0)
    a, b = dla0.create_fence(), dla1.create_fence()
    second = dla1.submit(Task(m1, in1, out1, wait=[(a, 1)], signal=[(b, 1)]))
    first = dla0.submit(Task(m0, in0, out0, signal=[(a, 1)]))
    assert b.wait(1, WAIT_S)
    assert first.timing is not None
    assert second.timing is not None
    assert second.timing.start_ns >= first.timing.end_ns


def test_callbacks_reach_an_event_loop_from_the_core_thread(open_core: OpenCore) -> None:
    core, module, ins, outs = timing_core(open_core, latency_us=1_000)
    done = core.create_fence()
    refused: list[DlaError] = []

    def close_from_callback() -> None:
        try:
            core.close()
        except DlaError as exc:
            refused.append(exc)

    async def main() -> threading.Thread:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[threading.Thread] = loop.create_future()
        # Callbacks of one value run in registration order: the close attempt is over by the
        # time the loop learns of the completion.
        done.on_reached(1, close_from_callback)
        done.on_reached(
            1, lambda: loop.call_soon_threadsafe(fut.set_result, threading.current_thread())
        )
        core.submit(Task(module, ins, outs, signal=[(done, 1)]))
        return await asyncio.wait_for(fut, WAIT_S)

    assert asyncio.run(main()) is core.thread
    assert refused
    assert refused[0].status is CudlaStatus.ERROR_UNSUPPORTED_OPERATION
    called: list[int] = []
    done.on_reached(1, lambda: called.append(1))  # already reached: runs now, in this thread
    assert called == [1]


def test_a_failing_callback_does_not_stop_the_core(open_core: OpenCore) -> None:
    core, module, ins, outs = timing_core(open_core, latency_us=0)
    fence = core.create_fence()

    def boom() -> None:
        raise RuntimeError("consumer bug")

    fence.on_reached(1, boom)
    with capture_logs() as logs:
        core.submit(Task(module, ins, outs, signal=[(fence, 1)]))
        core.submit(Task(module, ins, outs, signal=[(fence, 2)]))
        assert fence.wait(2, WAIT_S)
    assert [e["event"] for e in logs] == ["fence_callback_failed"]


# --------------------------------------------------------------------------- fences


def test_fence_values_only_grow() -> None:
    fence = EmulatedFence()
    assert fence.value == 0
    assert fence.reached(0)
    assert not fence.reached(1)
    fence.signal(3)
    for lower in (3, 2):
        with raises(CudlaStatus.ERROR_INVALID_PARAM, "NvSciSyncObjSignal"):
            fence.signal(lower)
    assert fence.value == 3
    assert fence.reached(2)
    assert fence.wait(3, 0)
    assert not fence.wait(4, timeout=0)
    for bad in (-1, 1 << 64, True, 1.5, "2"):
        with raises(CudlaStatus.ERROR_INVALID_PARAM):
            fence.signal(bad)  # type: ignore[arg-type]
    with raises(CudlaStatus.ERROR_INVALID_PARAM):
        fence.wait(4, timeout=-1)


@settings(max_examples=80, deadline=None)
@given(
    signals=st.lists(st.integers(0, 40), max_size=30),
    watched=st.lists(st.integers(0, 40), max_size=10),
)
def test_fence_model(signals: list[int], watched: list[int]) -> None:
    """Signals are accepted iff above the value; callbacks fire once, exactly when reached."""
    fence = EmulatedFence()
    fired: list[int] = []
    for w in watched:
        fence.on_reached(w, functools.partial(fired.append, w))
    high = 0
    for s in signals:
        if s > high:
            fence.signal(s)
            high = s
        else:
            with raises(CudlaStatus.ERROR_INVALID_PARAM):
                fence.signal(s)
        assert fence.value == high
        assert sorted(fired) == sorted(w for w in watched if w <= high)


def test_task_signal_values_are_reserved_at_submission(open_core: OpenCore) -> None:
    core, module, ins, outs = timing_core(open_core, latency_us=0)
    gate, done = core.create_fence(), core.create_fence()
    core.submit(Task(module, ins, outs, wait=[(gate, 1)], signal=[(done, 5)]))
    for value in (5, 4):
        with raises(CudlaStatus.ERROR_INVALID_PARAM):
            done.signal(value)  # promised to the task
        with raises(CudlaStatus.ERROR_INVALID_PARAM, "cudlaSubmitTask"):
            core.submit(Task(module, ins, outs, signal=[(done, value)]))
    assert core.in_flight == 1
    gate.signal(1)
    assert done.wait(5, WAIT_S)


# --------------------------------------------------------------------------- faults, timeouts


def test_error_injection_rate_is_plausible_and_seeded(open_core: OpenCore) -> None:
    n, rate = 300, 0.2

    def failures(core_index: int, tasks: int) -> list[bool]:
        faults = FaultConfig(error_rate=rate, seed=1234)
        core, module, ins, outs = timing_core(open_core, core_index, latency_us=0, faults=faults)
        fence = core.create_fence()
        failed = []
        for value in range(1, tasks + 1):
            handle = core.submit(Task(module, ins, outs, signal=[(fence, value)]))
            assert fence.wait(value, WAIT_S)  # a failed task still signals
            failed.append(handle.status is not CudlaStatus.SUCCESS)
            if failed[-1]:
                assert handle.status is CudlaStatus.DLA_ERR_DATA_MISMATCH
                assert core.last_error() is handle.status
        return failed

    first = failures(0, n)
    sd = (n * rate * (1 - rate)) ** 0.5
    assert abs(sum(first) - n * rate) < 4 * sd, sum(first)
    assert failures(1, 100) == first[:100]  # same seed, same faults


def test_hang_ends_with_the_task_timeout(open_core: OpenCore) -> None:
    core, module, ins, outs = timing_core(
        open_core, latency_us=0, faults=FaultConfig(hang_rate=1.0)
    )
    core.set_task_timeout(50)
    done = core.create_fence()
    handle = core.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    assert handle.status is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
    t = handle.timing  # the timeout runs from the head of the queue, at or after submission
    assert t is not None
    assert t.end_ns - t.submit_ns >= 50_000_000
    assert core.last_error() is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT


@pytest.mark.parametrize("cause", ["wait fence never signalled", "latency above the timeout"])
def test_timeout_covers_fence_waits_and_execution(open_core: OpenCore, cause: str) -> None:
    slow = cause.startswith("latency")
    core, module, ins, outs = timing_core(open_core, latency_us=10_000_000 if slow else 0)
    core.set_task_timeout(30)
    never, done = core.create_fence(), core.create_fence()
    waits = [] if slow else [(never, 1)]
    t0 = time.monotonic_ns()
    handle = core.submit(Task(module, ins, outs, wait=waits, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    assert handle.status is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
    assert (time.monotonic_ns() - t0) / 1e6 >= 30
    assert core.last_error() is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT


def test_errors_are_sticky_until_read(open_core: OpenCore) -> None:
    status = CudlaStatus.DLA_ERR_INVALID_INPUT
    faults = FaultConfig(error_rate=1.0, error_status=0x40000001)  # type: ignore[arg-type]
    core, module, ins, outs = timing_core(open_core, latency_us=0, faults=faults)
    done = core.create_fence()
    handle = core.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    assert handle.status is status
    calls: list[tuple[str, Callable[[], object]]] = [
        ("cudlaSubmitTask", lambda: core.submit(Task(module, ins, outs))),
        ("cudlaImportExternalMemory", lambda: core.alloc_buffer(module.inputs[0])),
        ("cudlaImportExternalSemaphore", core.create_fence),
        ("cudlaSetTaskTimeoutInMs", lambda: core.set_task_timeout(100)),
        ("cudlaModuleLoadFromMemory", lambda: core.load(DEMO0)),
    ]
    for _ in range(2):  # reported again and again, not just once
        for call, fn in calls:
            with raises(status, call):
                fn()
    assert core.in_flight == 0
    assert core.last_error() is status
    assert core.last_error() is CudlaStatus.SUCCESS
    core.create_fence()
    core.submit(Task(module, ins, outs, signal=[(done, 2)]))
    assert done.wait(2, WAIT_S)


def test_a_crashing_task_fails_alone(open_core: OpenCore) -> None:
    class BrokenFence(EmulatedFence):  # a bug inside the core's thread, simulated
        def on_reached(self, value: int, callback: Callable[[], object]) -> None:
            raise RuntimeError("bug")

    core, module, ins, outs = timing_core(open_core, latency_us=0)
    done = core.create_fence()
    with capture_logs() as logs:
        crashed = core.submit(Task(module, ins, outs, wait=[(BrokenFence(), 1)]))
        after = core.submit(Task(module, ins, outs, signal=[(done, 1)]))  # queued before it
        assert done.wait(1, WAIT_S)
    assert crashed.status is CudlaStatus.ERROR_UNKNOWN
    assert after.status is CudlaStatus.SUCCESS
    assert [e["event"] for e in logs] == ["emulated_task_crashed"]
    assert core.last_error() is CudlaStatus.ERROR_UNKNOWN  # a later success does not clear it
    assert core.thread.is_alive()


# --------------------------------------------------------------------------- resources, validation


def test_one_module_per_core(open_core: OpenCore, tmp_path: Any) -> None:
    core = open_core(0, mode="timing")
    with raises(CudlaStatus.ERROR_INVALID_MODULE):
        core.load(b"not a loadable")
    with raises(CudlaStatus.ERROR_OS):
        core.load(tmp_path / "missing.emu")
    data = bytearray(DEMO0.read_bytes())
    data[8:12] = struct.pack("<I", 99)  # a future format version, correctly framed
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    with raises(CudlaStatus.ERROR_INCOMPATIBLE_DLA_SW_VERSION):
        core.load(bytes(data))
    core.load(DEMO0)  # failed loads leave the handle free
    with raises(CudlaStatus.ERROR_UNSUPPORTED_OPERATION, "cudlaModuleLoadFromMemory"):
        core.load(DEMO0)


def test_loadable_for_the_other_core_is_refused(open_core: OpenCore) -> None:
    core = open_core(1, mode="timing")
    with pytest.raises(DlaError) as info:
        core.load(DEMO0)
    assert info.value.status is CudlaStatus.ERROR_INVALID_MODULE
    assert "core 0" in str(info.value)
    assert "core 1" in str(info.value)
    core.load(DEMO1)


def test_submit_validates_the_task(open_core: OpenCore) -> None:
    core, module, ins, outs = timing_core(open_core, latency_us=0, queue_depth=2)
    other, other_module, other_ins, _ = timing_core(open_core, 1, latency_us=0)
    fence = core.create_fence()
    cases: list[tuple[CudlaStatus, Task]] = [
        (CudlaStatus.ERROR_INVALID_MODULE, Task(other_module, ins, outs)),
        (CudlaStatus.ERROR_INVALID_ADDRESS, Task(module, other_ins, outs)),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs[:2])),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, [outs[2], outs[1], outs[2]])),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs, signal=[(fence, 1)] * 2)),
        (
            CudlaStatus.ERROR_INVALID_PARAM,
            Task(module, ins, outs, wait=[(fence, 1)] * (MAX_WAIT_EVENTS + 1)),
        ),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs, wait=[(object(), 1)])),  # type: ignore[list-item]
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs, signal=[(fence, -1)])),
    ]
    for status, task in cases:
        with raises(status, "cudlaSubmitTask"):
            core.submit(task)
    assert core.in_flight == 0
    assert fence.value == 0
    gate = core.create_fence()
    for _ in range(2):
        core.submit(Task(module, ins, outs, wait=[(gate, 1)]))
    with raises(CudlaStatus.ERROR_OUT_OF_RESOURCES):
        core.submit(Task(module, ins, outs, signal=[(fence, 7)]))
    fence.signal(7)  # the refused task reserved nothing
    gate.signal(1)
    other.close()


def test_buffers_are_page_aligned_zeroed_views(open_core: OpenCore, demo: Loadable) -> None:
    core = open_core(0, mode="timing")
    for desc in (*demo.inputs, *demo.outputs):
        buf = core.alloc_buffer(desc)
        assert buf.raw.ctypes.data % mmap.PAGESIZE == 0
        assert buf.raw.size == desc.size
        assert not buf.raw.any()
        assert buf.array.shape == desc.buffer_shape
        assert buf.array.dtype == desc.numpy_dtype
        assert np.shares_memory(buf.raw, buf.array)
        assert buf.raw.flags.writeable
    bad = dataclasses.replace(demo.inputs[0], size=demo.inputs[0].size - 1)
    for descriptor in (bad, "images"):
        with raises(CudlaStatus.ERROR_INVALID_PARAM, "cudlaImportExternalMemory"):
            core.alloc_buffer(descriptor)  # type: ignore[arg-type]
    unknown = dataclasses.replace(demo.inputs[0], data_type=DataType.UNKNOWN, scale=None)
    with raises(CudlaStatus.ERROR_INVALID_PARAM):
        core.alloc_buffer(unknown)


def test_task_timeout_bounds(open_core: OpenCore) -> None:
    core = open_core(0, mode="timing")
    for ms in (0, MAX_TASK_TIMEOUT_MS + 1, True, 1.5):
        with raises(CudlaStatus.ERROR_INVALID_PARAM, "cudlaSetTaskTimeoutInMs"):
            core.set_task_timeout(ms)  # type: ignore[arg-type]
    core.set_task_timeout(1)
    core.set_task_timeout(MAX_TASK_TIMEOUT_MS)


# --------------------------------------------------------------------------- shutdown


def test_close_with_tasks_in_flight(open_core: OpenCore) -> None:
    before = set(threading.enumerate())
    core, module, ins, outs = timing_core(open_core, latency_us=0)
    gate, done = core.create_fence(), core.create_fence()
    handles = [
        core.submit(Task(module, ins, outs, wait=[(gate, 1)], signal=[(done, v)])) for v in (1, 2)
    ]
    with raises(CudlaStatus.DLA_ERR_PROCESSOR_BUSY, "cudlaDestroyDevice"):
        core.close()
    assert core.in_flight == 2
    assert core.thread.is_alive()
    core.close(force=True)
    assert [h.status for h in handles] == [ABORTED_STATUS, ABORTED_STATUS]
    assert done.reached(2)  # waiters were woken
    assert not core.thread.is_alive()
    assert set(threading.enumerate()) <= before
    core.close()  # idempotent
    for fn in (
        lambda: core.submit(Task(module, ins, outs)),
        core.create_fence,
        core.last_error,
        lambda: core.load(DEMO0),
    ):
        with raises(CudlaStatus.ERROR_INVALID_DEVICE):
            fn()


def test_close_after_the_last_task_and_as_context_manager(open_core: OpenCore) -> None:
    before = set(threading.enumerate())
    with EmulatedDlaCore(0, mode="timing", latency_us=0) as core:
        module = core.load(DEMO0)
        ins, outs = bind(core, module)
        done = core.create_fence()
        core.submit(Task(module, ins, outs, signal=[(done, 1)]))
        assert done.wait(1, WAIT_S)
        # Woken by the fence, the consumer sees the task ended and may close at once.
        assert core.in_flight == 0
    assert not core.thread.is_alive()
    assert set(threading.enumerate()) <= before
    with pytest.raises(RuntimeError), EmulatedDlaCore(0, mode="timing") as other:
        raise RuntimeError("leaving on an exception forces the close")
    assert not other.thread.is_alive()


# --------------------------------------------------------------------------- statuses, config


def test_statuses_are_cudlas() -> None:
    # Values and C names of docs/reference/cudla.md §4.3.
    expected = {
        "cudlaSuccess": 0, "cudlaErrorInvalidParam": 1, "cudlaErrorOutOfResources": 2,
        "cudlaErrorCreationFailed": 3, "cudlaErrorInvalidAddress": 4, "cudlaErrorOs": 5,
        "cudlaErrorCuda": 6, "cudlaErrorUmd": 7, "cudlaErrorInvalidDevice": 8,
        "cudlaErrorInvalidAttribute": 9, "cudlaErrorIncompatibleDlaSWVersion": 10,
        "cudlaErrorMemoryRegistered": 11, "cudlaErrorInvalidModule": 12,
        "cudlaErrorUnsupportedOperation": 13, "cudlaErrorNvSci": 14,
        "cudlaErrorDriverNotFound": 15, "cudlaErrorDlaErrInvalidInput": 0x40000001,
        "cudlaErrorDlaErrInvalidPreAction": 0x40000002, "cudlaErrorDlaErrNoMem": 0x40000003,
        "cudlaErrorDlaErrProcessorBusy": 0x40000004,
        "cudlaErrorDlaErrTaskStatusMismatch": 0x40000005,
        "cudlaErrorDlaErrEngineTimeout": 0x40000006, "cudlaErrorDlaErrDataMismatch": 0x40000007,
        "cudlaErrorUnknown": 0x7FFFFFFF,
    }  # fmt: skip
    assert {s.c_name: int(s) for s in CudlaStatus} == expected
    err = DlaError(CudlaStatus.DLA_ERR_ENGINE_TIMEOUT, "cudlaSubmitTask", "slow")
    assert (err.status, err.call, err.detail) == (
        CudlaStatus.DLA_ERR_ENGINE_TIMEOUT,
        "cudlaSubmitTask",
        "slow",
    )
    assert "cudlaErrorDlaErrEngineTimeout" in str(err)
    assert "0x40000006" in str(err)
    with pytest.raises(ValueError, match="failure status"):
        DlaError(CudlaStatus.SUCCESS, "cudlaSubmitTask")


def test_bad_configuration_is_refused(open_core: OpenCore) -> None:
    for core in (2, -1, True):
        with raises(CudlaStatus.ERROR_INVALID_DEVICE, "cudlaCreateDevice"):
            open_core(core)
    bad_kwargs: list[dict[str, Any]] = [
        {"mode": "fast"},
        {"latency_us": -1.0},
        {"latency_us": float("nan")},
        {"threads": 0},
        {"queue_depth": 0},
        {"faults": {"error_rate": 0.1}},
    ]
    for kwargs in bad_kwargs:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            open_core(0, **kwargs)
    bad_faults: list[dict[str, Any]] = [
        {"error_rate": 1.5},
        {"hang_rate": -0.1},
        {"error_rate": 0.6, "hang_rate": 0.6},
        {"seed": 1.5},
        {"error_status": CudlaStatus.SUCCESS},
    ]
    for fault_kwargs in bad_faults:
        with pytest.raises(ValueError, match=r"error_rate|hang_rate|seed|error_status"):
            FaultConfig(**fault_kwargs)


def test_a_layout_accepted_once_is_not_walked_again_but_module_and_events_still_are(
    open_core: OpenCore,
) -> None:
    dla, module, ins, outs = timing_core(open_core)
    ins, outs = tuple(ins), tuple(outs)
    accepted: dict[Any, Any] = {}

    def check(task: Task, buffer_type: type = EmulatedBuffer, mod: object = module) -> None:
        check_task_layout(task, mod, owner=dla, buffer_type=buffer_type, core=0, call="x",
                          accepted=accepted)  # fmt: skip

    check(Task(module, ins, outs))
    assert accepted == {(id(ins), id(outs)): (module, ins, outs)}
    # The walk over the buffers is skipped for these very tuples (a wrong buffer type passes)
    check(Task(module, ins, outs), buffer_type=int)
    with raises(CudlaStatus.ERROR_INVALID_ADDRESS):  # the same buffers in new tuples: walked
        check(Task(module, (*ins,), outs), buffer_type=int)
    fence = dla.create_fence()
    too_many = tuple((fence, i + 1) for i in range(MAX_SIGNAL_EVENTS + 1))
    with raises(CudlaStatus.ERROR_INVALID_PARAM):  # events are checked on every task
        check(Task(module, ins, outs, signal=too_many))
    other = open_core(1, mode="timing")
    theirs = other.load(DEMO1)
    with raises(CudlaStatus.ERROR_INVALID_MODULE):
        check(Task(theirs, ins, outs))
    with raises(CudlaStatus.ERROR_INVALID_ADDRESS):  # another module: these tuples are walked
        check(Task(theirs, ins, outs), buffer_type=int, mod=theirs)
    foreign = tuple(other.alloc_buffer(d) for d in module.inputs)
    with raises(CudlaStatus.ERROR_INVALID_ADDRESS):
        check(Task(module, foreign, outs))
    for _ in range(MAX_LAYOUTS + 3):
        check(Task(module, (*ins,), outs))  # new tuples of the same buffers each time
    assert 0 < len(accepted) <= MAX_LAYOUTS
