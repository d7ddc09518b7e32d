"""The device interface's behaviour, run on every backend: the emulated core and the cudla backend
on the fake cuDLA/NvSci library (``fake_cudla.c``).

Each test states what any DLA backend must do: round trip, both cores at once, order, fences
(CPU gates, chaining across cores, callbacks), faults, timeouts, sticky errors, validation and
teardown. Faults are injected the backend's way (the emulated core's FaultConfig, the fake's
task faults); teardown proves no thread outlives a test and, on the fake, no object stays alive.
Tests wait on fences, never on sleeps. Where cuDLA's shape is stricter than the emulator (a task
waits on a DLA fence only once its signaller is submitted; CPU gates are ``signaller="cpu"``
fences), the tests use the stricter form, which both backends accept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from dlad.devices.base import (
    MAX_TASK_TIMEOUT_MS,
    MAX_WAIT_EVENTS,
    CudlaStatus,
    DlaCore,
    DlaError,
    Task,
)
from dlad.devices.cudla.backend import CudlaBuffer, CudlaDlaCore, CudlaFence_, CudlaModule
from dlad.devices.cudla.backend import CudlaTaskHandle as CudlaHandle
from dlad.devices.emulated import EmulatedDlaCore, FaultConfig
from dlad.loadable import Loadable, read_loadable
from dlad.models import DEMO
from tests.dlad.cudla.fakelib import FAULT_ERROR, FAULT_HANG, FakeLib, fake_loadable

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0
DEMO_PATHS = {0: DEMO / "fp16_heads.dla0.emu", 1: DEMO / "fp16_heads.dla1.emu"}


@dataclasses.dataclass
class Backend:
    """Opens cores of one backend and injects faults its way."""

    name: str
    fake: FakeLib | None
    opened: list[Any] = dataclasses.field(default_factory=list)

    def open(self, core: int = 0, *, faults: FaultConfig | None = None, **kw: Any) -> Any:
        if self.fake is None:
            dla: Any = EmulatedDlaCore(core, mode="timing", latency_us=kw.pop("latency_us", 0),
                                       faults=faults, **kw)  # fmt: skip
        else:
            dla = CudlaDlaCore(core, libs=self.fake.libraries(), wait_grace_ms=2000, **kw)
        self.opened.append(dla)
        return dla

    def loadable(self, core: int) -> Any:
        if self.fake is None:
            return DEMO_PATHS[core]
        lo = read_loadable(DEMO_PATHS[core])
        return fake_loadable(lo.inputs, lo.outputs, core)

    def scales(self, core: int) -> dict[str, float]:
        lo = read_loadable(DEMO_PATHS[core])
        return {d.name: d.scale for d in (*lo.inputs, *lo.outputs) if d.scale is not None}

    def load(self, dla: Any, core: int | None = None) -> Any:
        src = self.loadable(dla.core if core is None else core)
        if self.fake is None:
            return dla.load(src)
        return dla.load(src, scales=self.scales(dla.core))

    def setup(self, core: int = 0, **kw: Any) -> tuple[Any, Any, list[Any], list[Any]]:
        dla = self.open(core, **kw)
        module = self.load(dla)
        ins = [dla.alloc_buffer(d) for d in module.inputs]
        outs = [dla.alloc_buffer(d) for d in module.outputs]
        return dla, module, ins, outs

    def gate(self, dla: Any) -> Any:
        """A fence the CPU signals and tasks wait on."""
        return dla.create_fence(signaller="cpu") if self.fake else dla.create_fence()

    def fail_tasks(self, dla: Any, status: CudlaStatus, count: int = 1) -> None:
        assert self.fake is not None
        self.fake.task_fault(dla.core, FAULT_ERROR, int(status), count)

    def hang_tasks(self, dla: Any, count: int = 1) -> None:
        assert self.fake is not None
        self.fake.task_fault(dla.core, FAULT_HANG, 0, count)


@pytest.fixture(params=["emulated", "cudla"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    before = set(threading.enumerate())
    fake: FakeLib | None = request.getfixturevalue("fake") if request.param == "cudla" else None
    b = Backend(request.param, fake)
    yield b
    for dla in reversed(b.opened):
        dla.close(force=True)
    leaked = [t for t in threading.enumerate() if t not in before]
    assert not leaked, f"threads left running: {leaked}"


def faulty(
    backend: Backend, core: int, status: CudlaStatus
) -> tuple[Any, Any, list[Any], list[Any]]:
    """A core whose next tasks fail with ``status``."""
    if backend.fake is None:
        return backend.setup(core, faults=FaultConfig(error_rate=1.0, error_status=status))
    setup = backend.setup(core)
    backend.fail_tasks(setup[0], status, count=1000)
    return setup


def hanging(backend: Backend, core: int = 0) -> tuple[Any, Any, list[Any], list[Any]]:
    if backend.fake is None:
        return backend.setup(core, faults=FaultConfig(hang_rate=1.0))
    setup = backend.setup(core)
    backend.hang_tasks(setup[0], count=1000)
    return setup


@contextlib.contextmanager
def raises(status: CudlaStatus, call: str | None = None) -> Iterator[None]:
    with pytest.raises(DlaError) as info:
        yield
    assert info.value.status is status, info.value
    if call is not None:
        assert info.value.call == call, info.value


def _conforms(core: CudlaDlaCore, module: CudlaModule, buf: CudlaBuffer, fence: CudlaFence_,
              handle: CudlaHandle) -> tuple[DlaCore, Any, Any, Any, Any]:  # fmt: skip
    """Never called: mypy checks that the cudla classes implement the Protocols."""
    from dlad.devices.base import Buffer, Module, SyncObject, TaskHandle

    m: Module = module
    b: Buffer = buf
    f: SyncObject = fence
    h: TaskHandle = handle
    return core, m, b, f, h


# --------------------------------------------------------------------------- round trip


def test_round_trip_outputs_follow_inputs(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    demo: Loadable = read_loadable(DEMO_PATHS[0])
    assert [d.name for d in module.inputs] == [d.name for d in demo.inputs]
    assert module.outputs == demo.outputs
    assert module.inputs == demo.inputs
    done = dla.create_fence()
    results = []
    rng = np.random.default_rng(7)
    for value, seed_input in enumerate((1, 2, 1), start=1):
        ins[0].raw[:] = np.random.default_rng(seed_input).integers(
            0, 256, ins[0].raw.size, np.uint8
        )
        for buf in outs:
            buf.raw[:] = rng.integers(0, 256, buf.raw.size, np.uint8)  # garbage to overwrite
        handle = dla.submit(Task(module, ins, outs, signal=[(done, value)]))
        assert done.wait(value, WAIT_S)
        assert handle.status is CudlaStatus.SUCCESS
        results.append([b.raw.tobytes() for b in outs])
        t = handle.timing
        assert t is not None
        assert t.submit_ns <= t.start_ns <= t.end_ns
    if backend.fake is None:  # timing mode: a fixed pattern per tensor, whatever the input
        assert results[0] == results[1] == results[2]
    else:  # the fake computes from the input bytes
        assert results[0] == results[2]
        assert results[0] != results[1]
    assert dla.last_error() is CudlaStatus.SUCCESS


def test_buffers_are_aligned_zeroed_views(backend: Backend) -> None:
    dla = backend.open(0)
    demo = read_loadable(DEMO_PATHS[0])
    for desc in (*demo.inputs, *demo.outputs):
        buf = dla.alloc_buffer(desc)
        assert buf.raw.ctypes.data % 32 == 0
        assert buf.raw.size == desc.size
        assert not buf.raw.any()
        assert buf.array.shape == desc.buffer_shape
        assert np.shares_memory(buf.raw, buf.array)
    bad = dataclasses.replace(demo.inputs[0], size=demo.inputs[0].size - 1)
    for descriptor in (bad, "images"):
        with raises(CudlaStatus.ERROR_INVALID_PARAM, "cudlaImportExternalMemory"):
            dla.alloc_buffer(descriptor)


# --------------------------------------------------------------------------- both cores, order


def test_both_cores_run_and_chain(backend: Backend) -> None:
    dla0, m0, in0, out0 = backend.setup(0)
    dla1, m1, in1, out1 = backend.setup(1)
    a, b = dla0.create_fence(), dla1.create_fence()
    gate = backend.gate(dla0)
    first = dla0.submit(Task(m0, in0, out0, wait=[(gate, 1)], signal=[(a, 1)]))
    second = dla1.submit(Task(m1, in1, out1, wait=[(a, 1)], signal=[(b, 1)]))  # after its signaller
    assert not b.reached(1)
    gate.signal(1)
    assert b.wait(1, WAIT_S)
    assert first.status is second.status is CudlaStatus.SUCCESS
    assert first.timing is not None
    assert second.timing is not None
    assert second.timing.start_ns >= first.timing.end_ns
    # Both cores accept work at the same time and each ends it.
    h0 = dla0.submit(Task(m0, in0, out0, signal=[(a, 2)]))
    h1 = dla1.submit(Task(m1, in1, out1, signal=[(b, 2)]))
    assert a.wait(2, WAIT_S)
    assert b.wait(2, WAIT_S)
    assert h0.status is h1.status is CudlaStatus.SUCCESS


def test_tasks_end_in_submission_order(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    fence = dla.create_fence()
    order: list[int] = []
    for value in range(1, 21):
        fence.on_reached(value, functools.partial(order.append, value))
    finished = threading.Event()
    fence.on_reached(20, finished.set)
    handles = [dla.submit(Task(module, ins, outs, signal=[(fence, v)])) for v in range(1, 21)]
    assert finished.wait(WAIT_S)
    assert order == list(range(1, 21))
    assert [h.id for h in handles] == list(range(1, 21))
    for a, b in itertools.pairwise(h.timing for h in handles):
        assert a is not None
        assert b is not None
        assert a.end_ns <= b.start_ns


def test_task_waits_for_its_gate(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    gate, done = backend.gate(dla), dla.create_fence()
    handle = dla.submit(Task(module, ins, outs, wait=[(gate, 2)], signal=[(done, 1)]))
    gate.signal(1)  # below the awaited value
    pending = handle.status
    assert pending is None
    assert not done.reached(1)
    assert dla.in_flight == 1
    gate.signal(2)
    assert done.wait(1, WAIT_S)
    assert handle.status is CudlaStatus.SUCCESS
    assert dla.in_flight == 0


def test_callbacks_run_on_the_core_thread(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    done = dla.create_fence()
    seen: list[threading.Thread] = []
    refused: list[DlaError] = []

    def close_from_callback() -> None:
        seen.append(threading.current_thread())
        try:
            dla.close()
        except DlaError as exc:
            refused.append(exc)

    done.on_reached(1, close_from_callback)
    ended = threading.Event()
    done.on_reached(1, ended.set)
    dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert ended.wait(WAIT_S)
    assert seen == [dla.thread]
    assert refused[0].status is CudlaStatus.ERROR_UNSUPPORTED_OPERATION
    now: list[int] = []
    done.on_reached(1, lambda: now.append(1))
    assert now == [1]


def test_signal_values_are_reserved_at_submission(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    gate, done = backend.gate(dla), dla.create_fence()
    dla.submit(Task(module, ins, outs, wait=[(gate, 1)], signal=[(done, 5)]))
    for value in (5, 4):
        with raises(CudlaStatus.ERROR_INVALID_PARAM, "cudlaSubmitTask"):
            dla.submit(Task(module, ins, outs, signal=[(done, value)]))
    assert dla.in_flight == 1
    gate.signal(1)
    assert done.wait(5, WAIT_S)


# --------------------------------------------------------------------------- faults, timeouts


@pytest.mark.parametrize(
    "status", [CudlaStatus.DLA_ERR_DATA_MISMATCH, CudlaStatus.DLA_ERR_INVALID_INPUT]
)
def test_failed_task_signals_and_error_is_sticky(backend: Backend, status: CudlaStatus) -> None:
    dla, module, ins, outs = faulty(backend, 0, status)
    done = dla.create_fence()
    handle = dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)  # a failed task still signals
    assert handle.status is status
    calls: list[tuple[str, Callable[[], object]]] = [
        ("cudlaSubmitTask", lambda: dla.submit(Task(module, ins, outs))),
        ("cudlaImportExternalMemory", lambda: dla.alloc_buffer(module.inputs[0])),
        ("cudlaImportExternalSemaphore", dla.create_fence),
        ("cudlaSetTaskTimeoutInMs", lambda: dla.set_task_timeout(100)),
        ("cudlaModuleLoadFromMemory", lambda: backend.load(dla)),
    ]
    for _ in range(2):
        for call, fn in calls:
            with raises(status, call):
                fn()
    assert dla.last_error() is status
    assert dla.last_error() is CudlaStatus.SUCCESS
    dla.create_fence()


def test_hang_ends_with_the_task_timeout(backend: Backend) -> None:
    dla, module, ins, outs = hanging(backend)
    dla.set_task_timeout(50)
    done = dla.create_fence()
    handle = dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    assert handle.status is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
    t = handle.timing
    assert t is not None
    assert t.end_ns - t.submit_ns >= 50_000_000
    assert dla.last_error() is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT


def test_timeout_covers_a_gate_never_signalled(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    dla.set_task_timeout(30)
    never, done = backend.gate(dla), dla.create_fence()
    handle = dla.submit(Task(module, ins, outs, wait=[(never, 1)], signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    assert handle.status is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
    assert dla.last_error() is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT


def test_task_timeout_bounds(backend: Backend) -> None:
    dla = backend.open(0)
    for ms in (0, MAX_TASK_TIMEOUT_MS + 1, True, 1.5):
        with raises(CudlaStatus.ERROR_INVALID_PARAM, "cudlaSetTaskTimeoutInMs"):
            dla.set_task_timeout(ms)
    dla.set_task_timeout(1)
    dla.set_task_timeout(MAX_TASK_TIMEOUT_MS)


# --------------------------------------------------------------------------- validation


def test_one_module_per_core_and_the_right_core(backend: Backend) -> None:
    dla = backend.open(1)
    with pytest.raises(DlaError) as info:
        backend.load(dla, core=0)  # built for the other core
    assert info.value.status is CudlaStatus.ERROR_INVALID_MODULE
    with raises(CudlaStatus.ERROR_INVALID_MODULE):
        dla.load(b"not a loadable")
    backend.load(dla)
    with raises(CudlaStatus.ERROR_UNSUPPORTED_OPERATION, "cudlaModuleLoadFromMemory"):
        backend.load(dla)


def test_submit_validates_the_task(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0, queue_depth=2)
    _, other_module, other_ins, _ = backend.setup(1)
    fence = dla.create_fence()
    too_many = [(fence, 1)] * (MAX_WAIT_EVENTS + 1)
    cases: list[tuple[CudlaStatus, Task]] = [
        (CudlaStatus.ERROR_INVALID_MODULE, Task(other_module, ins, outs)),
        (CudlaStatus.ERROR_INVALID_ADDRESS, Task(module, other_ins, outs)),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs[:2])),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, [outs[2], outs[1], outs[2]])),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs, signal=[(fence, 1)] * 2)),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs, wait=too_many)),
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs, wait=[(object(), 1)])),  # type: ignore[list-item]
        (CudlaStatus.ERROR_INVALID_PARAM, Task(module, ins, outs, signal=[(fence, -1)])),
    ]  # fmt: skip
    for status, task in cases:
        with raises(status, "cudlaSubmitTask"):
            dla.submit(task)
    assert dla.in_flight == 0
    assert fence.value == 0
    gate, held = backend.gate(dla), dla.create_fence()
    for value in (1, 2):
        dla.submit(Task(module, ins, outs, wait=[(gate, 1)], signal=[(held, value)]))
    with raises(CudlaStatus.ERROR_OUT_OF_RESOURCES):
        dla.submit(Task(module, ins, outs, signal=[(fence, 7)]))
    gate.signal(1)
    assert held.wait(2, WAIT_S)
    dla.submit(Task(module, ins, outs, signal=[(fence, 7)]))  # the refused task reserved nothing
    assert fence.wait(7, WAIT_S)


# --------------------------------------------------------------------------- teardown


def test_close_with_tasks_in_flight(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    gate, done = backend.gate(dla), dla.create_fence()
    handles = [
        dla.submit(Task(module, ins, outs, wait=[(gate, 1)], signal=[(done, v)])) for v in (1, 2)
    ]
    with raises(CudlaStatus.DLA_ERR_PROCESSOR_BUSY, "cudlaDestroyDevice"):
        dla.close()
    assert dla.in_flight == 2
    dla.close(force=True)
    assert [h.status for h in handles] == [CudlaStatus.ERROR_INVALID_DEVICE] * 2
    assert done.reached(2)
    assert not dla.thread.is_alive()
    dla.close()  # idempotent
    for fn in (lambda: dla.submit(Task(module, ins, outs)), dla.create_fence, dla.last_error):
        with raises(CudlaStatus.ERROR_INVALID_DEVICE):
            fn()


def test_close_after_the_last_task(backend: Backend) -> None:
    dla, module, ins, outs = backend.setup(0)
    done = dla.create_fence()
    dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    assert dla.in_flight == 0  # woken by the fence, the consumer may close at once
    dla.close()
    assert not dla.thread.is_alive()
