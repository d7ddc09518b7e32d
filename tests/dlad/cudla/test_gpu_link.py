"""The GPU side of a cudla worker slot (recipe A of docs/reference/cudla.md §4.7), against the fake
cuDLA/NvSci library and a stand-in of cuda-python's runtime.

The stand-in records every runtime call and plays the CUDA stream on the fake's NvSci objects:
``cudaSignalExternalSemaphoresAsync`` fills the fence it is given (as CUDA does, at the call)
and signals the object when the stream runs; ``cudaWaitExternalSemaphoresAsync`` copies the
fence at the call and waits for it when the stream runs (``cudaStreamSynchronize``). So the
fake DLA task really waits on the "GPU's" fence and the "stream" really waits on the task's EOF
fence. Whether CUDA itself accepts these objects only an Orin shows (docs/jetson.md).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from ctypes import byref, c_uint64, c_void_p
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dlad.devices.base import CudlaStatus, DlaError
from dlad.devices.cudla import cuda_interop as ci
from dlad.devices.cudla.abi import NvSciSyncAttrKey, NvSciSyncAttrKeyValuePair, NvSciSyncFence
from dlad.devices.cudla.backend import CudlaDlaCore, CudlaTaskHandle
from dlad.devices.cudla.nvsci import _pairs
from dlad.gpu.links import CudlaFenceLink, link_cudla_slot
from dlad.gpu.prepost import GpuPipeline
from dlad.gpu.service import GpuSlot
from dlad.loadable import read_loadable
from dlad.models import DEMO
from tests.dlad.cudla.fakelib import FakeLib, expected_default_output, fake_loadable

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0
DEMO0 = read_loadable(DEMO / "fp16_heads.dla0.emu")
SIGNAL_ONLY, WAIT_ONLY = 2, 1


class Err(enum.Enum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


class Node(SimpleNamespace):
    """An attribute bag whose unknown attributes are nested bags (``desc.handle.x = ...``)."""

    def __getattr__(self, name: str) -> Any:
        child = Node()
        setattr(self, name, child)
        return child


class StandInRuntime:
    """cuda-python's runtime as far as recipe A uses it, played on the fake's NvSci objects.
    ``calls`` holds ``(name, args, position in the fake's call log)``."""

    cudaError_t = Err
    cudaNvSciSyncAttrSignal = 1
    cudaNvSciSyncAttrWait = 2
    cudaExternalSemaphoreHandleType = SimpleNamespace(cudaExternalSemaphoreHandleTypeNvSciSync=6)
    cudaExternalMemoryHandleType = SimpleNamespace(cudaExternalMemoryHandleTypeNvSciBuf=8)
    cudaExternalSemaphoreHandleDesc = Node
    cudaExternalMemoryHandleDesc = Node
    cudaExternalMemoryBufferDesc = Node
    cudaExternalSemaphoreWaitParams = Node
    cudaExternalSemaphoreSignalParams = Node

    def __init__(self, fake: FakeLib) -> None:
        self.fake = fake
        self.libs = fake.libraries()
        self.calls: list[tuple[str, tuple[Any, ...], int]] = []
        self.queues: dict[Any, list[tuple[str, Any]]] = {}
        self.pending: dict[int, int] = {}  # sync object -> signals queued, not yet run
        self.cpu_wait: c_void_p | None = None  # a core's CPU wait context (set by the test)
        self.fail: str | None = None
        self._memories = 0

    def _record(self, name: str, *args: Any) -> Err:
        self.calls.append((name, args, len(self.fake.calls())))
        return Err.cudaErrorInvalidValue if name == self.fail else Err.cudaSuccess

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]

    def cudaDeviceGetNvSciSyncAttributes(self, attr_list: int, device: int, flags: int) -> Any:
        err = self._record("cudaDeviceGetNvSciSyncAttributes", attr_list, device, flags)
        perm = SIGNAL_ONLY if flags == self.cudaNvSciSyncAttrSignal else WAIT_ONLY
        array, _keep = _pairs(
            NvSciSyncAttrKeyValuePair, [(NvSciSyncAttrKey.REQUIRED_PERM, c_uint64(perm))]
        )
        assert self.libs.NvSciSyncAttrListSetAttrs(c_void_p(attr_list), array, 1) == 0
        return (err,)

    def cudaImportExternalSemaphore(self, desc: Any) -> Any:
        return (
            self._record("cudaImportExternalSemaphore", desc),
            ("sem", desc.handle.nvSciSyncObj),
        )

    def cudaImportExternalMemory(self, desc: Any) -> Any:
        return (self._record("cudaImportExternalMemory", desc), ("mem", desc.handle.nvSciBufObject))

    def cudaExternalMemoryGetMappedBuffer(self, ext: Any, mapped: Any) -> Any:
        self._memories += 1
        err = self._record("cudaExternalMemoryGetMappedBuffer", ext, mapped)
        return (err, 0xD000_0000 + 0x10_0000 * self._memories)

    def cudaSignalExternalSemaphoresAsync(
        self, sems: list[Any], params: list[Any], n: int, stream: Any
    ) -> Any:
        err = self._record("cudaSignalExternalSemaphoresAsync", sems, params, n, stream)
        if err is not Err.cudaSuccess:
            return (err,)
        obj = sems[0][1]
        fence = NvSciSyncFence.from_address(params[0].params.nvSciSync.fence)
        # CUDA fills the fence at the call: the value the object has once this signal ran.
        libs, fid, value = self.libs, c_uint64(), c_uint64()
        assert libs.NvSciSyncObjGenerateFence(c_void_p(obj), byref(fence)) == 0
        assert libs.NvSciSyncFenceExtractFence(byref(fence), byref(fid), byref(value)) == 0
        queued = self.pending.get(obj, 0)
        assert (
            libs.NvSciSyncFenceUpdateFence(c_void_p(obj), fid, value.value + queued, byref(fence))
            == 0
        )
        self.pending[obj] = queued + 1
        self.queues.setdefault(stream, []).append(("signal", obj))
        return (err,)

    def cudaWaitExternalSemaphoresAsync(
        self, sems: list[Any], params: list[Any], n: int, stream: Any
    ) -> Any:
        err = self._record("cudaWaitExternalSemaphoresAsync", sems, params, n, stream)
        if err is not Err.cudaSuccess:
            return (err,)
        own = NvSciSyncFence()  # CUDA takes the fence at the call
        src = NvSciSyncFence.from_address(params[0].params.nvSciSync.fence)
        assert self.libs.NvSciSyncFenceDup(byref(src), byref(own)) == 0
        self.queues.setdefault(stream, []).append(("wait", own))
        return (err,)

    def cudaStreamSynchronize(self, stream: Any) -> Any:
        err = self._record("cudaStreamSynchronize", stream)
        for op, arg in self.queues.pop(stream, []):
            if op == "signal":
                self.pending[arg] -= 1
                assert self.libs.NvSciSyncObjSignal(c_void_p(arg)) == 0
            else:
                ok = self.libs.NvSciSyncFenceWait(byref(arg), self.cpu_wait, int(WAIT_S * 1e6))
                self.libs.NvSciSyncFenceClear(byref(arg))
                assert ok == 0, "the stream's wait was not reached"
        return (err,)

    def cudaDestroyExternalSemaphore(self, sem: Any) -> Any:
        return (self._record("cudaDestroyExternalSemaphore", sem),)

    def cudaDestroyExternalMemory(self, ext: Any) -> Any:
        return (self._record("cudaDestroyExternalMemory", ext),)


def stand_in_pipeline(stream: str) -> GpuPipeline:
    """A GpuPipeline whose fence methods run (they use only its stream) without a GPU."""
    pipe = GpuPipeline.__new__(GpuPipeline)
    pipe.stream = stream
    return pipe


@pytest.fixture
def rt(fake: FakeLib) -> StandInRuntime:
    return StandInRuntime(fake)


@pytest.fixture
def core(fake: FakeLib, rt: StandInRuntime) -> Iterator[CudlaDlaCore]:
    dla = CudlaDlaCore(
        0,
        libs=fake.libraries(),
        gpu_uuid=bytes(range(16)),
        extra_waiter=lambda h: ci.fill_wait_attributes(h, 0, rt=rt),
        gpu_signaller=lambda h: ci.fill_signal_attributes(h, 0, rt=rt),
    )
    rt.cpu_wait = dla.nvsci.cpu_wait
    yield dla
    dla.close(force=True)


def loaded(core: CudlaDlaCore) -> tuple[Any, list[Any], list[Any]]:
    lo = DEMO0
    module = core.load(fake_loadable(lo.inputs, lo.outputs, 0), scales={"images": lo.input_scale})
    ins = [core.alloc_buffer(d) for d in module.inputs]
    outs = [core.alloc_buffer(d) for d in module.outputs]
    return module, ins, outs


def test_slot_imports_buffers_and_both_fences(
    fake: FakeLib, rt: StandInRuntime, core: CudlaDlaCore
) -> None:
    _module, ins, outs = loaded(core)
    assert len([c for c in fake.calls() if "key=0x5 len=16" in c]) == 4  # GpuId on each buffer
    slot = link_cudla_slot(core, stand_in_pipeline("s0"), ins, outs, rt=rt)
    assert isinstance(slot, GpuSlot)
    assert isinstance(slot.ready_link, CudlaFenceLink)
    assert isinstance(slot.done_link, CudlaFenceLink)
    mems = [args[0] for name, args, _ in rt.calls if name == "cudaImportExternalMemory"]
    assert [(d.type, d.handle.nvSciBufObject, d.size, d.flags) for d in mems] == [
        (8, b.nvsci_object, b.descriptor.size, 0) for b in (*ins, *outs)
    ]
    mapped = [args for name, args, _ in rt.calls if name == "cudaExternalMemoryGetMappedBuffer"]
    assert [(m.offset, m.size) for _, m in mapped] == [
        (0, b.descriptor.size) for b in (*ins, *outs)
    ]
    assert [slot.input_ptr, *slot.head_ptrs] == [0xD000_0000 + 0x10_0000 * i for i in (1, 2, 3, 4)]
    sems = [args[0] for name, args, _ in rt.calls if name == "cudaImportExternalSemaphore"]
    assert [(d.type, d.handle.nvSciSyncObj, d.flags) for d in sems] == [
        (6, slot.ready.nvsci_object, 0), (6, slot.done.nvsci_object, 0),
    ]  # fmt: skip
    assert (slot.ready.signaller, slot.done.signaller) == ("gpu", "dla")
    fills = [args[2] for name, args, _ in rt.calls if name == "cudaDeviceGetNvSciSyncAttributes"]
    # CUDA signals the ready fence only; it waits on every DLA-signalled fence of the core (its
    # completion fence and the slot's done fence)
    assert sorted(fills) == [1, 2, 2]


def test_one_frame_is_chained_on_one_stream(
    fake: FakeLib, rt: StandInRuntime, core: CudlaDlaCore
) -> None:
    module, ins, outs = loaded(core)
    slot = link_cudla_slot(core, stand_in_pipeline("s0"), ins, outs, rt=rt)
    ins[0].raw[:] = np.arange(ins[0].raw.size) % 251
    for n in (1, 2):
        rt.calls.clear()
        fake.clear_log()
        handle = slot.chain_task(core, module, ins, outs)
        assert isinstance(handle, CudlaTaskHandle)
        assert handle.task.wait == ((slot.ready, n),)
        assert handle.task.signal == ((slot.done, n),)
        assert rt.names() == [
            "cudaSignalExternalSemaphoresAsync",
            "cudaWaitExternalSemaphoresAsync",
        ]
        (_, sig, at_signal), (_, wait, at_wait) = rt.calls
        submit = fake.call_names().index("cudlaSubmitTask")
        assert at_signal <= submit < at_wait  # signal(ready) → submit → wait(done)
        assert sig[0] == [("sem", slot.ready.nvsci_object)]
        assert wait[0] == [("sem", slot.done.nvsci_object)]
        assert sig[3] == wait[3] == "s0"  # the same stream
        assert not slot.done.reached(n)  # the DLA waits for the GPU's signal
        ci.synchronize("s0", rt=rt)  # the stream runs: signal, (DLA task), wait
        assert slot.done.wait(n, WAIT_S)
        assert handle.status is CudlaStatus.SUCCESS
        assert slot.ready.value == n  # the DLA passed it
        for j, out in enumerate(outs):
            want = expected_default_output(bytes(ins[0].raw), j, out.raw.size)
            assert bytes(out.raw) == want


def test_close_destroys_imports_after_the_stream_drained(
    fake: FakeLib, rt: StandInRuntime, core: CudlaDlaCore
) -> None:
    module, ins, outs = loaded(core)
    slot = link_cudla_slot(core, stand_in_pipeline("s0"), ins, outs, rt=rt)
    slot.chain_task(core, module, ins, outs)
    ci.synchronize("s0", rt=rt)
    assert slot.done.wait(1, WAIT_S)
    sems = [("sem", slot.ready.nvsci_object), ("sem", slot.done.nvsci_object)]
    mems = [("mem", b.nvsci_object) for b in (*ins, *outs)]
    rt.calls.clear()
    fake.clear_log()
    core.close()
    names = rt.names()
    assert names == [
        "cudaStreamSynchronize", "cudaDestroyExternalSemaphore", "cudaDestroyExternalSemaphore",
        *["cudaDestroyExternalMemory"] * 4,
    ]  # fmt: skip
    log = fake.call_names()
    first_free = min(log.index("cudlaMemUnregister"), log.index("NvSciBufObjFree"))
    assert max(at for _, _, at in rt.calls) <= first_free  # CUDA lets go before NvSci frees
    assert [a[0] for n, a, _ in rt.calls if n == "cudaDestroyExternalSemaphore"] == sems
    assert [a[0] for n, a, _ in rt.calls if n == "cudaDestroyExternalMemory"] == mems
    slot.release_fences()  # the GPU service's close: nothing left to destroy
    assert rt.names() == names


def test_refusals(fake: FakeLib, rt: StandInRuntime, core: CudlaDlaCore) -> None:
    module, ins, outs = loaded(core)
    plain = CudlaDlaCore(1, libs=fake.libraries())
    try:
        with pytest.raises(ValueError, match="cudla_options"):
            link_cudla_slot(plain, stand_in_pipeline("s1"), ins, outs, rt=rt)
        with pytest.raises(DlaError) as info:
            plain.create_fence(signaller="gpu")
        assert info.value.status is CudlaStatus.ERROR_UNSUPPORTED_OPERATION
    finally:
        plain.close()
    slot = link_cudla_slot(core, stand_in_pipeline("s0"), ins, outs, rt=rt)
    with pytest.raises(DlaError) as info:
        slot.done.signal_from_gpu(1, lambda address: None)
    assert info.value.status is CudlaStatus.ERROR_UNSUPPORTED_OPERATION
    rt.fail = "cudaSignalExternalSemaphoresAsync"
    with pytest.raises(ci.CudaInteropError, match="cudaSignalExternalSemaphoresAsync"):
        slot.chain_task(core, module, ins, outs)
    assert slot.ready.next_value() == 1  # the promise is withdrawn, the fence cleared
    assert core.in_flight == 0
    rt.fail = None
    with pytest.raises(DlaError, match="neither reached nor promised"):
        slot.done_link.gpu_wait(slot.pipeline, 5)
