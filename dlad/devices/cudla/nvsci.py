"""NvSciBuf and NvSciSync through the ctypes ABI: status checks, attribute lists, buffers, sync
objects and fences, with every failure a :class:`~dlad.devices.base.DlaError` naming the call.

A :class:`NvSciSession` owns one NvSciBuf module, one NvSciSync module and one CPU wait context
(one per DLA core in dlad). Handles are plain ints (addresses); the caller frees what it
allocates, in the order of ``docs/reference/cudla.md`` §4.7 step 8.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from ctypes import byref, c_uint8, c_uint32, c_uint64, c_void_p, sizeof
from dataclasses import dataclass, field
from typing import Any, Final

from dlad.devices.base import CudlaStatus, DlaError
from dlad.devices.cudla.abi import (
    Libraries,
    NvSciBufAccessPerm,
    NvSciBufAttrKey,
    NvSciBufAttrKeyValuePair,
    NvSciBufType,
    NvSciError,
    NvSciSyncAccessPerm,
    NvSciSyncAttrKey,
    NvSciSyncAttrKeyValuePair,
    NvSciSyncFence,
    SyncAttrFlags,
)

__all__ = ["BufferAllocation", "NvSciSession", "SyncAllocation", "check_cudla", "check_nvsci"]

_MAX_CPU_WAIT_US: Final = (1 << 63) - 1


def check_cudla(status: int, call: str, detail: str = "") -> None:
    """Raise DlaError(status, call) unless ``status`` is ``cudlaSuccess``; a value cuDLA does
    not document becomes ``ERROR_UNKNOWN`` with the value in the detail."""
    if status == 0:
        return
    try:
        known = CudlaStatus(status)
    except ValueError:
        known = CudlaStatus.ERROR_UNKNOWN
        detail = f"undocumented status {status:#x}" + (f"; {detail}" if detail else "")
    raise DlaError(known, call, detail)


def nvsci_error_text(err: int) -> str:
    """``NvSciError 0x100 (BAD_PARAMETER)``; unknown values by number only."""
    try:
        return f"NvSciError {err:#x} ({NvSciError(err).name})"
    except ValueError:
        return f"NvSciError {err:#x}"


def check_nvsci(err: int, call: str, detail: str = "") -> None:
    """Raise DlaError(``ERROR_NVSCI``, call) unless ``err`` is ``NvSciError_Success``."""
    if err != 0:
        text = nvsci_error_text(err)
        raise DlaError(CudlaStatus.ERROR_NVSCI, call, f"{text}: {detail}" if detail else text)


@dataclass
class BufferAllocation:
    """One NvSciBuf raw buffer: its attribute lists, object and CPU address."""

    lists: list[int] = field(default_factory=list)
    obj: int = 0
    cpu_ptr: int = 0
    size: int = 0


@dataclass
class SyncAllocation:
    """One NvSciSync object and the attribute lists it was reconciled from."""

    lists: list[int] = field(default_factory=list)
    obj: int = 0


def _pairs(kind: Any, items: Sequence[tuple[int, Any]]) -> tuple[Any, list[Any]]:
    """A ctypes array of key/value pairs and the value objects it points into (keep both)."""
    keep = [value for _, value in items]
    array = (kind * len(items))()
    for slot, (key, value) in zip(array, items, strict=True):
        slot_fields = kind._fields_
        setattr(slot, slot_fields[0][0], int(key))
        slot.value = ctypes.cast(ctypes.pointer(value), c_void_p)
        slot.len = sizeof(value)
    return array, keep


class NvSciSession:
    """The NvSci modules and CPU wait context of one core. Raises DlaError (``ERROR_NVSCI``)
    naming the call that failed; on failure nothing stays allocated."""

    def __init__(self, libs: Libraries) -> None:
        self.libs = libs
        self.buf_module = c_void_p()
        self.sync_module = c_void_p()
        self.cpu_wait = c_void_p()
        try:
            check_nvsci(libs.NvSciBufModuleOpen(byref(self.buf_module)), "NvSciBufModuleOpen")
            check_nvsci(libs.NvSciSyncModuleOpen(byref(self.sync_module)), "NvSciSyncModuleOpen")
            check_nvsci(
                libs.NvSciSyncCpuWaitContextAlloc(self.sync_module, byref(self.cpu_wait)),
                "NvSciSyncCpuWaitContextAlloc",
            )
        except DlaError:
            self.close()
            raise

    def close(self) -> None:
        """Free the CPU wait context and close both modules (idempotent)."""
        if self.cpu_wait.value:
            self.libs.NvSciSyncCpuWaitContextFree(self.cpu_wait)
            self.cpu_wait = c_void_p()
        if self.sync_module.value:
            self.libs.NvSciSyncModuleClose(self.sync_module)
            self.sync_module = c_void_p()
        if self.buf_module.value:
            self.libs.NvSciBufModuleClose(self.buf_module)
            self.buf_module = c_void_p()

    # ------------------------------------------------------------------ NvSciBuf

    def raw_buffer(
        self, size: int, *, align: int, gpu_uuid: bytes | None = None
    ) -> BufferAllocation:
        """A CPU-accessible, read-write NvSciBuf raw buffer of ``size`` bytes (recipe B of
        docs/reference/cudla.md §4.7 with ``RawBuffer`` type; ``gpu_uuid`` adds ``GpuId`` for
        CUDA import)."""
        libs = self.libs
        out = BufferAllocation(size=size)
        try:
            unreconciled = c_void_p()
            check_nvsci(
                libs.NvSciBufAttrListCreate(self.buf_module, byref(unreconciled)),
                "NvSciBufAttrListCreate",
            )
            out.lists.append(int(unreconciled.value or 0))
            items: list[tuple[int, Any]] = [
                (NvSciBufAttrKey.TYPES, (c_uint32 * 1)(NvSciBufType.RAW_BUFFER)),
                (NvSciBufAttrKey.RAW_BUFFER_SIZE, c_uint64(size)),
                (NvSciBufAttrKey.RAW_BUFFER_ALIGN, c_uint64(align)),
                (NvSciBufAttrKey.NEED_CPU_ACCESS, c_uint8(1)),
                (NvSciBufAttrKey.REQUIRED_PERM, c_uint32(NvSciBufAccessPerm.READ_WRITE)),
            ]
            if gpu_uuid is not None:
                items.append((NvSciBufAttrKey.GPU_ID, (c_uint8 * 16)(*gpu_uuid[:16])))
            array, _keep = _pairs(NvSciBufAttrKeyValuePair, items)
            check_nvsci(
                libs.NvSciBufAttrListSetAttrs(unreconciled, array, len(items)),
                "NvSciBufAttrListSetAttrs",
            )
            reconciled, conflict = c_void_p(), c_void_p()
            lists = (c_void_p * 1)(unreconciled.value)
            err = libs.NvSciBufAttrListReconcile(lists, 1, byref(reconciled), byref(conflict))
            if conflict.value:
                out.lists.append(conflict.value)
            check_nvsci(err, "NvSciBufAttrListReconcile")
            out.lists.append(int(reconciled.value or 0))
            obj = c_void_p()
            check_nvsci(libs.NvSciBufObjAlloc(reconciled, byref(obj)), "NvSciBufObjAlloc")
            out.obj = int(obj.value or 0)
            ptr = c_void_p()
            check_nvsci(libs.NvSciBufObjGetCpuPtr(obj, byref(ptr)), "NvSciBufObjGetCpuPtr")
            out.cpu_ptr = int(ptr.value or 0)
        except DlaError:
            self.free_buffer(out)
            raise
        return out

    def free_buffer(self, alloc: BufferAllocation) -> None:
        """``NvSciBufObjFree`` then ``NvSciBufAttrListFree`` of each list (idempotent)."""
        if alloc.obj:
            self.libs.NvSciBufObjFree(c_void_p(alloc.obj))
            alloc.obj = 0
        for handle in alloc.lists:
            self.libs.NvSciBufAttrListFree(c_void_p(handle))
        alloc.lists.clear()

    # ------------------------------------------------------------------ NvSciSync

    def sync_list(self, alloc: SyncAllocation) -> c_void_p:
        """A new, empty attribute list, recorded in ``alloc`` for freeing."""
        handle = c_void_p()
        check_nvsci(
            self.libs.NvSciSyncAttrListCreate(self.sync_module, byref(handle)),
            "NvSciSyncAttrListCreate",
        )
        alloc.lists.append(int(handle.value or 0))
        return handle

    def cudla_list(self, alloc: SyncAllocation, flags: SyncAttrFlags) -> c_void_p:
        """A list filled by ``cudlaGetNvSciSyncAttributes`` (which sets ``RequiredPerm`` itself:
        the app only appends other keys)."""
        handle = self.sync_list(alloc)
        status = self.libs.cudlaGetNvSciSyncAttributes(
            ctypes.cast(handle, ctypes.POINTER(c_uint64)), int(flags)
        )
        check_cudla(status, "cudlaGetNvSciSyncAttributes")
        return handle

    def cpu_list(self, alloc: SyncAllocation, perm: NvSciSyncAccessPerm) -> c_void_p:
        """The CPU's list: ``NeedCpuAccess = true``, ``RequiredPerm = perm``."""
        handle = self.sync_list(alloc)
        self.set_sync_attrs(
            handle,
            [
                (NvSciSyncAttrKey.NEED_CPU_ACCESS, c_uint8(1)),
                (NvSciSyncAttrKey.REQUIRED_PERM, c_uint64(perm)),
            ],
        )
        return handle

    def set_sync_attrs(self, handle: c_void_p, items: list[tuple[int, Any]]) -> None:
        """``NvSciSyncAttrListSetAttrs`` with ``items`` of (key, ctypes value)."""
        array, _keep = _pairs(NvSciSyncAttrKeyValuePair, items)
        check_nvsci(
            self.libs.NvSciSyncAttrListSetAttrs(handle, array, len(items)),
            "NvSciSyncAttrListSetAttrs",
        )

    def require_deterministic(self, handle: c_void_p) -> None:
        """Append ``RequireDeterministicFences = true`` (older JetPack/DriveOS, §4.7 step 7)."""
        self.set_sync_attrs(handle, [(NvSciSyncAttrKey.REQUIRE_DETERMINISTIC_FENCES, c_uint8(1))])

    def reconcile_and_alloc(self, alloc: SyncAllocation, lists: Sequence[c_void_p]) -> None:
        """Reconcile ``lists`` and allocate the sync object into ``alloc.obj``."""
        reconciled, conflict = c_void_p(), c_void_p()
        array = (c_void_p * len(lists))(*(h.value for h in lists))
        err = self.libs.NvSciSyncAttrListReconcile(
            array, len(lists), byref(reconciled), byref(conflict)
        )
        if conflict.value:
            alloc.lists.append(conflict.value)
        check_nvsci(err, "NvSciSyncAttrListReconcile")
        alloc.lists.append(int(reconciled.value or 0))
        obj = c_void_p()
        check_nvsci(self.libs.NvSciSyncObjAlloc(reconciled, byref(obj)), "NvSciSyncObjAlloc")
        alloc.obj = int(obj.value or 0)

    def free_sync(self, alloc: SyncAllocation) -> None:
        """``NvSciSyncObjFree`` then ``NvSciSyncAttrListFree`` of each list (idempotent)."""
        if alloc.obj:
            self.libs.NvSciSyncObjFree(c_void_p(alloc.obj))
            alloc.obj = 0
        for handle in alloc.lists:
            self.libs.NvSciSyncAttrListFree(c_void_p(handle))
        alloc.lists.clear()

    # ------------------------------------------------------------------ fences

    def generate_fence(self, obj: int, fence: NvSciSyncFence) -> None:
        """The fence the next CPU signal of ``obj`` reaches."""
        check_nvsci(
            self.libs.NvSciSyncObjGenerateFence(c_void_p(obj), byref(fence)),
            "NvSciSyncObjGenerateFence",
        )

    def signal(self, obj: int) -> None:
        """One CPU signal of ``obj``."""
        check_nvsci(self.libs.NvSciSyncObjSignal(c_void_p(obj)), "NvSciSyncObjSignal")

    def wait(self, fence: NvSciSyncFence, timeout_us: int | None) -> bool:
        """Block until ``fence`` is reached (True) or ``timeout_us`` passes (False; None waits
        without limit). Raises DlaError for any other NvSciSync failure."""
        limit = -1 if timeout_us is None else min(max(timeout_us, 0), _MAX_CPU_WAIT_US)
        err = self.libs.NvSciSyncFenceWait(byref(fence), self.cpu_wait, limit)
        if err == NvSciError.TIMEOUT:
            return False
        check_nvsci(err, "NvSciSyncFenceWait")
        return True

    def extract(self, fence: NvSciSyncFence) -> tuple[int, int]:
        """``(id, value)`` of ``fence``."""
        fid, value = c_uint64(), c_uint64()
        check_nvsci(
            self.libs.NvSciSyncFenceExtractFence(byref(fence), byref(fid), byref(value)),
            "NvSciSyncFenceExtractFence",
        )
        return int(fid.value), int(value.value)

    def update(self, obj: int, fid: int, value: int, fence: NvSciSyncFence) -> None:
        """Make ``fence`` the fence of ``obj`` reached at ``value``."""
        check_nvsci(
            self.libs.NvSciSyncFenceUpdateFence(c_void_p(obj), fid, value, byref(fence)),
            "NvSciSyncFenceUpdateFence",
        )

    def dup(self, src: NvSciSyncFence, dst: NvSciSyncFence) -> None:
        """Copy ``src`` into ``dst`` (a reference of its own, cleared separately)."""
        check_nvsci(self.libs.NvSciSyncFenceDup(byref(src), byref(dst)), "NvSciSyncFenceDup")

    def clear(self, fence: NvSciSyncFence) -> None:
        """Release ``fence``'s reference and zero it."""
        self.libs.NvSciSyncFenceClear(byref(fence))
