"""cuda_interop's argument construction against a stand-in of cuda-python's runtime.

NvSci exists only on Tegra, so the real imports cannot run here or on the H200: these tests check
which runtime calls are made with which handle types, fields and flags, and that errors name
the call. Whether CUDA accepts them is for the on-Orin check in docs/jetson.md.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest

from dlad.devices.cudla import cuda_interop as ci


class Err(enum.Enum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


class Node(SimpleNamespace):
    """An attribute bag whose unknown attributes are nested bags (``desc.handle.x = ...``)."""

    def __getattr__(self, name: str) -> Any:
        child = Node()
        setattr(self, name, child)
        return child


class FakeRuntime:
    cudaError_t = Err
    cudaNvSciSyncAttrSignal = 1
    cudaNvSciSyncAttrWait = 2
    cudaExternalSemaphoreHandleType = SimpleNamespace(cudaExternalSemaphoreHandleTypeNvSciSync=6)
    cudaExternalMemoryHandleType = SimpleNamespace(cudaExternalMemoryHandleTypeNvSciBuf=8)

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail = fail
        for name in ("cudaExternalSemaphoreHandleDesc", "cudaExternalMemoryHandleDesc",
                     "cudaExternalMemoryBufferDesc", "cudaExternalSemaphoreWaitParams",
                     "cudaExternalSemaphoreSignalParams"):  # fmt: skip
            setattr(self, name, Node)

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            err = Err.cudaErrorInvalidValue if name == self.fail else Err.cudaSuccess
            values = {"cudaImportExternalSemaphore": "sem", "cudaImportExternalMemory": "ext",
                      "cudaExternalMemoryGetMappedBuffer": 0xD000}  # fmt: skip
            return (err, values[name]) if name in values else (err,)

        return call


def test_semaphore_import_and_stream_ops() -> None:
    rt = FakeRuntime()
    ci.fill_wait_attributes(0x1234, 0, rt=rt)
    ci.fill_signal_attributes(0x1235, 0, rt=rt)
    sem = ci.import_semaphore(0xABC, rt=rt)
    assert sem == "sem"
    ci.wait_fence(sem, 0xF00, "stream", rt=rt)
    ci.signal_fence(sem, 0xF08, "stream", rt=rt)
    ci.destroy_semaphore(sem, rt=rt)
    names = [n for n, _ in rt.calls]
    assert names == [
        "cudaDeviceGetNvSciSyncAttributes", "cudaDeviceGetNvSciSyncAttributes",
        "cudaImportExternalSemaphore", "cudaWaitExternalSemaphoresAsync",
        "cudaSignalExternalSemaphoresAsync", "cudaDestroyExternalSemaphore",
    ]  # fmt: skip
    assert rt.calls[0][1] == (0x1234, 0, 2)  # waiter
    assert rt.calls[1][1] == (0x1235, 0, 1)  # signaller
    desc = rt.calls[2][1][0]
    assert (desc.type, desc.handle.nvSciSyncObj, desc.flags) == (6, 0xABC, 0)
    sems, params, n, stream = rt.calls[3][1]
    assert (sems, n, stream) == (["sem"], 1, "stream")
    assert params[0].params.nvSciSync.fence == 0xF00


def test_buffer_import_maps_the_whole_buffer() -> None:
    rt = FakeRuntime()
    ext, ptr = ci.import_buffer(0xB0F, 4096, rt=rt)
    assert (ext, ptr) == ("ext", 0xD000)
    desc = rt.calls[0][1][0]
    assert (desc.type, desc.handle.nvSciBufObject, desc.size) == (8, 0xB0F, 4096)
    mapped = rt.calls[1][1][1]
    assert (mapped.offset, mapped.size) == (0, 4096)
    ci.destroy_memory(ext, rt=rt)


def test_failures_name_the_call() -> None:
    rt = FakeRuntime(fail="cudaExternalMemoryGetMappedBuffer")
    with pytest.raises(ci.CudaInteropError, match="cudaExternalMemoryGetMappedBuffer"):
        ci.import_buffer(0xB0F, 64, rt=rt)
    assert rt.calls[-1][0] == "cudaDestroyExternalMemory"  # the half-made import is undone
    with pytest.raises(ci.CudaInteropError, match="cudaImportExternalSemaphore"):
        ci.import_semaphore(1, rt=FakeRuntime(fail="cudaImportExternalSemaphore"))
