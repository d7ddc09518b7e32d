"""The GPU side of cuDLA standalone mode: NvSciSync objects and NvSciBuf buffers imported into
CUDA through cuda-python's runtime, so a CUDA stream waits on a DLA task's EOF fence and the GPU
pre/post-processing kernels read and write the DLA's buffers (recipe A, ``docs/reference/cudla.md``
§4.6-4.7).

Every function takes the runtime module as ``rt`` (default: ``cuda.bindings.runtime``, imported
on first use, never at import time) and raises :class:`CudaInteropError` naming the call and its
``cudaError_t``. This needs an Orin (NvSci exists only on Tegra); on other machines only the
argument construction is exercised, with a stand-in runtime, by the tests.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CudaInteropError",
    "destroy_memory",
    "destroy_semaphore",
    "fill_signal_attributes",
    "fill_wait_attributes",
    "import_buffer",
    "import_semaphore",
    "runtime",
    "signal_fence",
    "synchronize",
    "wait_fence",
]


class CudaInteropError(RuntimeError):
    """A CUDA runtime call failed; ``call`` names it, ``error`` is its ``cudaError_t``."""

    def __init__(self, call: str, error: object) -> None:
        self.call = call
        self.error = error
        super().__init__(f"{call}: {error}")


def runtime() -> Any:
    """cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart`` before
    cuda-python 12.6). Raises CudaInteropError when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime as rt  # noqa: PLC0415 (lazy: Orin only)
    except ImportError:
        try:
            from cuda import cudart as rt  # noqa: PLC0415
        except ImportError as exc:
            raise CudaInteropError("import cuda.bindings.runtime", exc) from exc
    return rt


def _check(rt: Any, call: str, result: Any) -> Any:
    """cuda-python returns ``(err, *values)``; raise unless ``err`` is ``cudaSuccess``."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise CudaInteropError(call, err)
    return values[0] if len(values) == 1 else tuple(values) or None


def fill_wait_attributes(attr_list: int, device: int = 0, rt: Any = None) -> None:
    """Make NvSciSync list ``attr_list`` CUDA's waiter list (``cudaNvSciSyncAttrWait``): pass
    as the cudla core's ``extra_waiter`` so a stream can wait on DLA fences."""
    rt = rt or runtime()
    result = rt.cudaDeviceGetNvSciSyncAttributes(attr_list, device, rt.cudaNvSciSyncAttrWait)
    _check(rt, "cudaDeviceGetNvSciSyncAttributes", result)


def fill_signal_attributes(attr_list: int, device: int = 0, rt: Any = None) -> None:
    """Make ``attr_list`` CUDA's signaller list (``cudaNvSciSyncAttrSignal``)."""
    rt = rt or runtime()
    result = rt.cudaDeviceGetNvSciSyncAttributes(attr_list, device, rt.cudaNvSciSyncAttrSignal)
    _check(rt, "cudaDeviceGetNvSciSyncAttributes", result)


def import_semaphore(sync_obj: int, rt: Any = None) -> Any:
    """``cudaImportExternalSemaphore`` of an ``NvSciSyncObj`` (handle type NvSciSync)."""
    rt = rt or runtime()
    desc = rt.cudaExternalSemaphoreHandleDesc()
    desc.type = rt.cudaExternalSemaphoreHandleType.cudaExternalSemaphoreHandleTypeNvSciSync
    desc.handle.nvSciSyncObj = sync_obj
    desc.flags = 0
    return _check(rt, "cudaImportExternalSemaphore", rt.cudaImportExternalSemaphore(desc))


def import_buffer(buf_obj: int, size: int, rt: Any = None) -> tuple[Any, int]:
    """``cudaImportExternalMemory`` of an ``NvSciBufObj`` and its mapped device pointer:
    ``(external memory, device pointer)``."""
    rt = rt or runtime()
    desc = rt.cudaExternalMemoryHandleDesc()
    desc.type = rt.cudaExternalMemoryHandleType.cudaExternalMemoryHandleTypeNvSciBuf
    desc.handle.nvSciBufObject = buf_obj
    desc.size = size
    desc.flags = 0
    ext = _check(rt, "cudaImportExternalMemory", rt.cudaImportExternalMemory(desc))
    mapped = rt.cudaExternalMemoryBufferDesc()
    mapped.offset = 0
    mapped.size = size
    mapped.flags = 0
    try:
        ptr = _check(rt, "cudaExternalMemoryGetMappedBuffer",
                     rt.cudaExternalMemoryGetMappedBuffer(ext, mapped))  # fmt: skip
    except CudaInteropError:
        rt.cudaDestroyExternalMemory(ext)
        raise
    return ext, int(ptr)


def wait_fence(sem: Any, fence_address: int, stream: Any, rt: Any = None) -> None:
    """Make ``stream`` wait for the NvSciSyncFence at ``fence_address`` (a DLA task's EOF fence,
    e.g. an ``NvSciSyncFence`` the cudla core holds): the GPU issue's chain point."""
    rt = rt or runtime()
    params = rt.cudaExternalSemaphoreWaitParams()
    params.params.nvSciSync.fence = fence_address
    params.flags = 0
    _check(rt, "cudaWaitExternalSemaphoresAsync",
           rt.cudaWaitExternalSemaphoresAsync([sem], [params], 1, stream))  # fmt: skip


def signal_fence(sem: Any, fence_address: int, stream: Any, rt: Any = None) -> None:
    """Make ``stream`` signal into the NvSciSyncFence at ``fence_address`` (a DLA pre-fence)."""
    rt = rt or runtime()
    params = rt.cudaExternalSemaphoreSignalParams()
    params.params.nvSciSync.fence = fence_address
    params.flags = 0
    _check(rt, "cudaSignalExternalSemaphoresAsync",
           rt.cudaSignalExternalSemaphoresAsync([sem], [params], 1, stream))  # fmt: skip


def synchronize(stream: Any, rt: Any = None) -> None:
    """``cudaStreamSynchronize``: block until ``stream`` (a driver API ``CUstream`` is a
    ``cudaStream_t``) has run everything queued, e.g. before its semaphores are destroyed."""
    rt = rt or runtime()
    _check(rt, "cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))


def destroy_semaphore(sem: Any, rt: Any = None) -> None:
    """``cudaDestroyExternalSemaphore`` (before the cudla core frees the NvSciSync object)."""
    rt = rt or runtime()
    _check(rt, "cudaDestroyExternalSemaphore", rt.cudaDestroyExternalSemaphore(sem))


def destroy_memory(ext: Any, rt: Any = None) -> None:
    """``cudaDestroyExternalMemory`` (before the cudla core frees the NvSciBuf object)."""
    rt = rt or runtime()
    _check(rt, "cudaDestroyExternalMemory", rt.cudaDestroyExternalMemory(ext))
