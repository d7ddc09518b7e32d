"""The cudla backend's I/O buffers: :class:`CudlaBuffer`, an NvSciBuf raw buffer imported into
one DLA core (implements ``Buffer`` of :mod:`dlad.devices.base`).

This module owns a buffer's allocation and import: :func:`import_buffer` checks the descriptor,
allocates a CPU-mapped NvSciBuf raw buffer of its size (``GpuId`` set where CUDA imports it),
imports it with ``cudlaImportExternalMemory`` (its address must be 32-byte aligned) and views its
mapping as the descriptor's array. The core
(:meth:`~dlad.devices.cudla.backend.CudlaDlaCore.alloc_buffer`) keeps the buffers it made and
unregisters and frees them when it closes.

Only the standard library, numpy and dlad's own modules are imported.
"""

from __future__ import annotations

import math
import mmap
from ctypes import POINTER, byref, c_uint8, c_uint64, c_void_p
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from dlad.devices.base import CudlaStatus, DlaError
from dlad.devices.cudla.abi import AccessPermission, ExternalMemoryHandleDesc, Libraries
from dlad.devices.cudla.nvsci import BufferAllocation, NvSciSession, check_cudla
from dlad.loadable import TensorDescriptor

if TYPE_CHECKING:
    from dlad.devices.cudla.backend import CudlaDlaCore

__all__ = ["BUFFER_ALIGN", "CUDLA_ALIGN", "CudlaBuffer", "import_buffer"]

BUFFER_ALIGN: Final = mmap.PAGESIZE
"""Alignment asked of NvSciBuf for I/O buffers (cuDLA needs 32 bytes; a page is what an
NvSciBuf object gets anyway and what the emulated core gives)."""
CUDLA_ALIGN: Final = 32
_INVALID: Final = CudlaStatus.ERROR_INVALID_PARAM


@dataclass(frozen=True, eq=False)
class CudlaBuffer:
    """An NvSciBuf raw buffer imported into one core (implements ``Buffer``). ``raw`` and
    ``array`` view its CPU mapping; they are invalid once the core is closed."""

    descriptor: TensorDescriptor
    raw: npt.NDArray[np.uint8] = field(repr=False)
    array: npt.NDArray[Any] = field(repr=False)
    owner: CudlaDlaCore = field(repr=False)
    alloc: BufferAllocation = field(repr=False)
    registered: Any = field(repr=False)  # POINTER(c_uint64): cuDLA's handle of the buffer

    @property
    def nvsci_object(self) -> int:
        """The ``NvSciBufObj`` (for a CUDA import, :mod:`dlad.devices.cudla.cuda_interop`)."""
        return self.alloc.obj


def import_buffer(
    descriptor: TensorDescriptor,
    *,
    owner: CudlaDlaCore,
    libs: Libraries,
    nvsci: NvSciSession,
    dev: c_void_p,
    gpu_uuid: bytes | None,
) -> CudlaBuffer:
    """A zeroed NvSciBuf buffer of ``descriptor.size`` bytes imported into ``owner``'s cuDLA
    handle ``dev`` (``gpu_uuid``, if given, is added to its attributes so CUDA can import it).

    Raises DlaError: ``ERROR_INVALID_PARAM`` for anything but a TensorDescriptor its layout
    fills exactly; ``ERROR_INVALID_ADDRESS`` for a CPU mapping not 32-byte aligned; the
    NvSci or cuDLA failure otherwise (nothing stays allocated).
    """
    call = "cudlaImportExternalMemory"
    desc: object = descriptor
    if not isinstance(desc, TensorDescriptor) or desc.size < 1:
        raise DlaError(_INVALID, call, f"not a tensor descriptor of positive size: {desc!r}")
    try:
        fits = math.prod(desc.buffer_shape) * desc.numpy_dtype.itemsize
    except ValueError as exc:
        raise DlaError(_INVALID, call, str(exc)) from exc
    if fits != desc.size:
        raise DlaError(
            _INVALID, call, f"{desc.name}: {desc.buffer_shape} is {fits} B, size {desc.size}"
        )
    alloc = nvsci.raw_buffer(desc.size, align=BUFFER_ALIGN, gpu_uuid=gpu_uuid)
    try:
        if alloc.cpu_ptr % CUDLA_ALIGN:
            raise DlaError(
                CudlaStatus.ERROR_INVALID_ADDRESS, call,
                f"{desc.name}: NvSciBuf mapping {alloc.cpu_ptr:#x} is not 32-byte aligned",
            )  # fmt: skip
        mem = ExternalMemoryHandleDesc(c_void_p(alloc.obj), desc.size)
        registered = POINTER(c_uint64)()
        check_cudla(
            libs.cudlaImportExternalMemory(
                dev, byref(mem), byref(registered), AccessPermission.READ_WRITE
            ),
            call, desc.name,
        )  # fmt: skip
    except DlaError:
        nvsci.free_buffer(alloc)
        raise
    raw = np.ctypeslib.as_array((c_uint8 * desc.size).from_address(alloc.cpu_ptr))
    raw[:] = 0
    array = raw.view(desc.numpy_dtype).reshape(desc.buffer_shape)
    return CudlaBuffer(desc, raw, array, owner, alloc, registered)
