"""What the cudla backend asks of cuDLA and NvSci, asserted on the fake library's call log:
standalone mode, NULL stream, SKIP_LOCK, fence recipes, the teardown order, deterministic
semaphores, symbol probing, failures at every step releasing what was made, and the emulated
INT8 engine running behind the fake through its task callback."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlad.devices.base import CudlaStatus, DlaError, Task
from dlad.devices.cudla.backend import CudlaDlaCore
from dlad.devices.emulated import EmulatedDlaCore
from dlad.imaging.pre import quantize_hwc4
from dlad.loadable import read_loadable
from dlad.models import DEMO
from tests.dlad.cudla.fakelib import FAULT_ERROR, FakeLib, expected_default_output, fake_loadable
from tests.dlad.test_metrics import wait_for

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0
DEMO0 = read_loadable(DEMO / "fp16_heads.dla0.emu")


@pytest.fixture
def cores(fake: FakeLib) -> Iterator[list[CudlaDlaCore]]:
    opened: list[CudlaDlaCore] = []
    yield opened
    for core in reversed(opened):
        core.close(force=True)


def open_loaded(
    fake: FakeLib, cores: list[CudlaDlaCore], core: int = 0, **kw: Any
) -> tuple[Any, ...]:
    dla = CudlaDlaCore(core, libs=fake.libraries(), **kw)
    cores.append(dla)
    lo = DEMO0
    module = dla.load(fake_loadable(lo.inputs, lo.outputs, core), scales={"images": lo.input_scale})
    ins = [dla.alloc_buffer(d) for d in module.inputs]
    outs = [dla.alloc_buffer(d) for d in module.outputs]
    return dla, module, ins, outs


def test_call_sequence_and_arguments(fake: FakeLib, cores: list[CudlaDlaCore]) -> None:
    dla, module, ins, outs = open_loaded(fake, cores)
    calls = fake.calls()
    assert calls[:4] == [
        "NvSciBufModuleOpen", "NvSciSyncModuleOpen",
        calls[2], "cudlaCreateDevice device=0 flags=1",  # standalone
    ]  # fmt: skip
    assert calls[2].startswith("NvSciSyncCpuWaitContextAlloc")
    names = fake.call_names()
    load = names.index("cudlaModuleLoadFromMemory")
    assert names[load + 1 : load + 5] == ["cudlaModuleGetAttributes"] * 4
    raw_size = [c for c in calls if "key=0x10000" in c]
    assert len(raw_size) == 4  # one RawBuffer per I/O tensor
    imports = [c for c in calls if c.startswith("cudlaImportExternalMemory")]
    sizes = [int(c.split("size=")[1].split()[0]) for c in imports]
    assert sizes == [d.size for d in (*module.inputs, *module.outputs)]
    fake.clear_log()
    done = dla.create_fence()
    gate = dla.create_fence(signaller="cpu")
    names = fake.call_names()
    # DLA-signalled fence: cuDLA's list (signal|wait) + the CPU waiter's; CPU-signalled: the
    # CPU signaller's list + cuDLA's waiter list; each reconciled, allocated, imported.
    assert names.count("cudlaGetNvSciSyncAttributes") == 2
    assert "cudlaGetNvSciSyncAttributes list=" in fake.calls()[1]
    assert fake.calls()[1].endswith("flags=3")
    assert names.count("NvSciSyncAttrListReconcile") == 2
    assert names.count("cudlaImportExternalSemaphore") == 2
    fake.clear_log()
    dla.submit(Task(module, ins, outs, wait=[(gate, 1)], signal=[(done, 1)]))
    submit = [c for c in fake.calls() if c.startswith("cudlaSubmitTask")]
    assert submit == [submit[0]]
    assert "stream=(nil)" in submit[0]
    assert submit[0].endswith("flags=2")  # CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE
    assert any(c.startswith("task ") and "waits=1 signals=1" in c for c in fake.calls())
    gate.signal(1)
    assert done.wait(1, WAIT_S)
    fake.clear_log()
    dla.close()
    names = fake.call_names()
    # §4.7 step 8: buffers, then sync objects, then the module, the device, the NvSci modules.
    last_buf = max(i for i, n in enumerate(names) if n == "NvSciBufObjFree")
    first_sync = names.index("NvSciSyncObjFree")
    assert (
        last_buf < first_sync < names.index("cudlaModuleUnload") < names.index("cudlaDestroyDevice")
    )
    assert names[-3:] == [
        "NvSciSyncCpuWaitContextFree",
        "NvSciSyncModuleClose",
        "NvSciBufModuleClose",
    ]
    assert names.count("cudlaMemUnregister") == 4 + 3  # buffers + completion/done/gate fences


def test_outputs_are_the_fakes_computation(fake: FakeLib, cores: list[CudlaDlaCore]) -> None:
    dla, module, ins, outs = open_loaded(fake, cores)
    ins[0].raw[:] = np.random.default_rng(3).integers(0, 256, ins[0].raw.size, np.uint8)
    done = dla.create_fence()
    dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    for j, buf in enumerate(outs):
        assert buf.raw.tobytes() == expected_default_output(ins[0].raw.tobytes(), j, buf.raw.size)


def test_emulated_engine_behind_the_fake(fake: FakeLib, cores: list[CudlaDlaCore]) -> None:
    """The fake's callback runs dlad's emulated INT8 core: cudla + fake = emulated, byte-exact."""
    emu = EmulatedDlaCore(0, mode="numeric", latency_us=0)
    try:
        emu_module = emu.load(DEMO / "fp16_heads.dla0.emu")
        emu_in = [emu.alloc_buffer(d) for d in emu_module.inputs]
        emu_out = [emu.alloc_buffer(d) for d in emu_module.outputs]
        emu_done = emu.create_fence()

        def run_on_emulator(core: int, inputs: list[memoryview], outputs: list[memoryview]) -> int:
            emu_in[0].raw[:] = np.frombuffer(inputs[0], np.uint8)
            value = emu_done.value + 1
            emu.submit(Task(emu_module, emu_in, emu_out, signal=[(emu_done, value)]))
            if not emu_done.wait(value, WAIT_S):
                return int(CudlaStatus.DLA_ERR_ENGINE_TIMEOUT)
            for out, buf in zip(outputs, emu_out, strict=True):
                np.frombuffer(out, np.uint8)[:] = buf.raw
            return 0

        fake.set_callback(run_on_emulator)
        dla, module, ins, outs = open_loaded(fake, cores)
        canvas = np.random.default_rng(5).integers(0, 256, (*DEMO0.image_size, 3), np.uint8)
        ins[0].array[0] = quantize_hwc4(canvas, DEMO0.input_scale)
        done = dla.create_fence()
        handle = dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
        assert done.wait(1, WAIT_S)
        assert handle.status is CudlaStatus.SUCCESS
        assert all(b.raw.any() for b in outs)
        assert [b.raw.tobytes() for b in outs] == [b.raw.tobytes() for b in emu_out]
    finally:
        fake.set_callback(None)
        emu.close(force=True)


def test_deterministic_semaphores(fake: FakeLib, cores: list[CudlaDlaCore]) -> None:
    dla, module, ins, outs = open_loaded(fake, cores, semaphores="deterministic")
    done = dla.create_fence()
    for value in (1, 2, 3):
        dla.submit(Task(module, ins, outs, signal=[(done, value)]))
    assert done.wait(3, WAIT_S)
    calls = fake.calls()
    assert any("key=6" in c for c in calls)  # RequireDeterministicFences on the waiter lists
    updates = [c for c in calls if c.startswith("NvSciSyncFenceUpdateFence")]
    assert updates[0].endswith("id=0 value=0")  # primed from (0, 0), §4.7 step 7
    assert [u.rsplit("value=", 1)[1] for u in updates[-3:]] == ["1", "2", "3"]


def test_auto_falls_back_to_deterministic(fake: FakeLib, cores: list[CudlaDlaCore]) -> None:
    fake.option("deterministic_only", 1)  # an older JetPack: syncpoint import refused
    dla, module, ins, outs = open_loaded(fake, cores)
    assert dla.semaphores == "deterministic"
    done = dla.create_fence()
    dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert done.wait(1, WAIT_S)
    fake.option("deterministic_only", 1)
    with pytest.raises(DlaError) as info:
        CudlaDlaCore(1, libs=fake.libraries(), semaphores="syncpoint")
    assert info.value.call == "cudlaImportExternalSemaphore"


def test_old_release_probes_symbols(fake: FakeLib, fake_old_so: Path) -> None:
    old = FakeLib(fake_old_so)
    old.reset()
    dla = CudlaDlaCore(0, libs=old.libraries())
    try:
        module = dla.load(fake_loadable(DEMO0.inputs, DEMO0.outputs, 0))
        ins = [dla.alloc_buffer(d) for d in module.inputs]
        outs = [dla.alloc_buffer(d) for d in module.outputs]
        dla.set_task_timeout(500)  # no cudlaSetTaskTimeoutInMs: enforced on the CPU side
        assert "cudlaSetTaskTimeoutInMs" not in old.call_names()
        gate, done = dla.create_fence(signaller="cpu"), dla.create_fence()
        with pytest.raises(DlaError) as info:  # only the next value without UpdateFence
            dla.submit(Task(module, ins, outs, wait=[(gate, 2)], signal=[(done, 1)]))
        assert info.value.call == "NvSciSyncFenceUpdateFence"
        dla.submit(Task(module, ins, outs, wait=[(gate, 1)], signal=[(done, 1)]))
        gate.signal(1)
        assert done.wait(1, WAIT_S)
        with pytest.raises(DlaError, match="NvSciSyncFenceUpdateFence"):
            CudlaDlaCore(1, libs=old.libraries(), semaphores="deterministic")
    finally:
        dla.close(force=True)
    assert all(v == 0 for v in old.live().values()), old.live()


STEPS = [
    "NvSciBufModuleOpen", "NvSciSyncModuleOpen", "NvSciSyncCpuWaitContextAlloc",
    "cudlaCreateDevice", "cudlaGetNvSciSyncAttributes", "NvSciSyncAttrListReconcile",
    "NvSciSyncObjAlloc", "cudlaImportExternalSemaphore", "cudlaModuleLoadFromMemory",
    "cudlaModuleGetAttributes", "NvSciBufAttrListSetAttrs", "NvSciBufObjAlloc",
    "NvSciBufObjGetCpuPtr", "cudlaImportExternalMemory",
]  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_any_step_names_it_and_leaks_nothing(fake: FakeLib, step: str) -> None:
    status = 0x100 if step.startswith("NvSci") else int(CudlaStatus.ERROR_OUT_OF_RESOURCES)
    fake.fail_next(step, status)
    dla: list[CudlaDlaCore] = []

    def steps() -> None:
        dla.append(CudlaDlaCore(0, libs=fake.libraries(), semaphores="syncpoint"))
        module = dla[0].load(fake_loadable(DEMO0.inputs, DEMO0.outputs, 0))
        dla[0].alloc_buffer(module.inputs[0])

    with pytest.raises(DlaError) as info:
        steps()
    assert info.value.call == step
    expected = (
        CudlaStatus.ERROR_NVSCI if step.startswith("NvSci") else CudlaStatus.ERROR_OUT_OF_RESOURCES
    )
    assert info.value.status is expected
    for core in dla:
        core.close()  # the fake fixture asserts nothing stays alive


def test_unaligned_buffer_is_refused(fake: FakeLib, cores: list[CudlaDlaCore]) -> None:
    dla = CudlaDlaCore(0, libs=fake.libraries())
    cores.append(dla)
    fake.option("misalign", 1)
    with pytest.raises(DlaError) as info:
        dla.alloc_buffer(DEMO0.inputs[0])
    assert info.value.status is CudlaStatus.ERROR_INVALID_ADDRESS
    assert "32-byte" in str(info.value)


def test_cudla_shape_rules(fake: FakeLib, cores: list[CudlaDlaCore]) -> None:
    dla0, m0, in0, out0 = open_loaded(fake, cores, 0)
    dla1, m1, in1, out1 = open_loaded(fake, cores, 1)
    a = dla0.create_fence()
    with pytest.raises(DlaError) as info:  # waiter before its signaller
        dla1.submit(Task(m1, in1, out1, wait=[(a, 1)]))
    assert "neither reached nor promised" in str(info.value)
    with pytest.raises(DlaError) as info:
        a.signal(1)  # a DLA-signalled fence
    assert info.value.status is CudlaStatus.ERROR_UNSUPPORTED_OPERATION
    with pytest.raises(DlaError, match="only DLA fences of its core"):
        dla1.submit(Task(m1, in1, out1, signal=[(a, 1)]))
    # dla0's task is held by a CPU gate, so `a` is certainly not reached when dla1's task is
    # submitted (a wait on a fence already reached needs no import, and would race dla0).
    gate = dla0.create_fence(signaller="cpu")
    dla0.submit(Task(m0, in0, out0, wait=[(gate, 1)], signal=[(a, 1)]))
    b = dla1.create_fence()
    dla1.submit(Task(m1, in1, out1, wait=[(a, 1)], signal=[(b, 1)]))  # imports a into dla1
    gate.signal(1)
    assert a.wait(1, WAIT_S)
    assert b.wait(1, WAIT_S)
    # Each (core, semaphore) pair imported exactly once: the two completion fences, the gate,
    # a and b on their own cores, a on dla1 (by the submit that waits on it, not the refused one).
    imports = Counter(
        c.rsplit(" flags=", 1)[0]
        for c in fake.calls()
        if c.startswith("cudlaImportExternalSemaphore ")
    )
    assert len(imports) == 6, imports
    assert set(imports.values()) == {1}, imports


def test_async_error_from_the_fake_is_reported_by_status(
    fake: FakeLib, cores: list[CudlaDlaCore]
) -> None:
    dla, module, ins, outs = open_loaded(fake, cores)
    fake.fail_next("cudlaSubmitTask", int(CudlaStatus.ERROR_INVALID_ADDRESS))
    done = dla.create_fence()
    with pytest.raises(DlaError) as info:
        dla.submit(Task(module, ins, outs, signal=[(done, 1)]))
    assert info.value.status is CudlaStatus.ERROR_INVALID_ADDRESS
    assert dla.in_flight == 0
    dla.submit(Task(module, ins, outs, signal=[(done, 1)]))  # nothing was reserved
    assert done.wait(1, WAIT_S)


def test_a_failure_that_may_be_either_of_two_tasks_fails_both(
    fake: FakeLib, cores: list[CudlaDlaCore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDLA's error is the handle's: when the second of two tasks failed before the first's
    status was read, the failure cannot be told apart, and both are reported failed (never a
    failed task reported SUCCESS)."""
    dla, module, ins, outs = open_loaded(fake, cores)
    first, second = dla.create_fence(), dla.create_fence()
    original = dla._await
    fake.clear_log()

    def late(record: Any, timeout_us: int) -> CudlaStatus:  # read once both have run
        wait_for(lambda: sum(c.startswith("done ") for c in fake.calls()) >= 2)
        return original(record, timeout_us)

    monkeypatch.setattr(dla, "_await", late)
    fake.option("hold_tasks", 1)  # both are submitted before the first has ended
    ok = dla.submit(Task(module, ins, outs, signal=[(first, 1)]))
    fake.task_fault(0, FAULT_ERROR, int(CudlaStatus.DLA_ERR_ENGINE_TIMEOUT), 1)
    bad = dla.submit(Task(module, ins, outs, signal=[(second, 1)]))
    fake.option("hold_tasks", 0)
    assert first.wait(1, WAIT_S)
    assert second.wait(1, WAIT_S)
    assert bad.status is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT
    assert ok.status is CudlaStatus.DLA_ERR_ENGINE_TIMEOUT  # either's, as far as cuDLA says
