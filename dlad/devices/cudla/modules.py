"""The cudla backend's modules: :class:`CudlaModule`, a TensorRT DLA standalone loadable loaded
on one DLA core (implements ``Module`` of :mod:`dlad.devices.base`), and its I/O descriptors.

This module owns loading: :func:`load_module` reads the loadable into
``cudlaModuleLoadFromMemory`` and its I/O descriptors with ``cudlaModuleGetAttributes``, and
:func:`descriptor_from_c` / :func:`descriptor_to_c` convert a descriptor between cuDLA's C struct
and :class:`~dlad.loadable.TensorDescriptor`. The core
(:meth:`~dlad.devices.cudla.backend.CudlaDlaCore.load`) holds one module per handle and unloads it
when it closes.

Only the standard library and dlad's own modules are imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from ctypes import POINTER, byref, c_uint8, c_void_p, cast
from dataclasses import dataclass, field
from pathlib import Path

from dlad.devices.base import CudlaStatus, DlaError, LoadableSource
from dlad.devices.cudla.abi import (
    Libraries,
    ModuleAttribute,
    ModuleAttributeType,
    ModuleTensorDescriptor,
)
from dlad.devices.cudla.nvsci import check_cudla
from dlad.loadable import (
    DataCategory,
    DataFormat,
    DataType,
    PixelFormat,
    PixelMapping,
    TensorDescriptor,
    TensorFormat,
)

__all__ = ["CudlaModule", "descriptor_from_c", "descriptor_to_c", "load_module"]


def descriptor_from_c(c: ModuleTensorDescriptor, scale: float | None) -> TensorDescriptor:
    """A :class:`TensorDescriptor` from what ``cudlaModuleGetAttributes`` filled in.

    cuDLA does not report TensorRT's I/O format: it follows from the data format and type
    (NHWC: ``DLA_HWC4``; NCxHWx: ``CHW16`` for fp16, ``CHW32`` for int8; NCHW: ``DLA_LINEAR``).
    ``scale`` (INT8 tensors only) comes from the model's metadata. Raises ValueError for a
    descriptor dlad cannot use.
    """
    data_format = DataFormat(c.dataFormat)
    data_type = DataType(c.dataType)
    if data_format == DataFormat.NHWC:
        fmt = TensorFormat.DLA_HWC4
    elif data_format == DataFormat.NCxHWx and data_type == DataType.HALF:
        fmt = TensorFormat.CHW16
    elif data_format == DataFormat.NCxHWx and data_type == DataType.INT8:
        fmt = TensorFormat.CHW32
    elif data_format == DataFormat.NCHW:
        fmt = TensorFormat.DLA_LINEAR
    else:
        raise ValueError(f"{data_format.name} {data_type.name} is no DLA I/O format dlad reads")
    try:
        name = bytes(c.name).split(b"\0", 1)[0].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"tensor name is not UTF-8: {bytes(c.name)!r}") from exc
    return TensorDescriptor(
        name, c.size, c.n, c.c, c.h, c.w, data_format, data_type,
        DataCategory(c.dataCategory), PixelFormat(c.pixelFormat), PixelMapping(c.pixelMapping),
        tuple(c.stride),
        fmt, scale if data_type == DataType.INT8 else None,
    )  # fmt: skip


def descriptor_to_c(d: TensorDescriptor) -> ModuleTensorDescriptor:
    """The C struct of ``d`` (its format and scale are not part of it)."""
    c = ModuleTensorDescriptor()
    c.name = d.name.encode("utf-8")
    c.size, c.n, c.c, c.h, c.w = d.size, d.n, d.c, d.h, d.w
    c.dataFormat, c.dataType, c.dataCategory = d.data_format, d.data_type, d.data_category
    c.pixelFormat, c.pixelMapping = d.pixel_format, d.pixel_mapping
    for i, s in enumerate(d.stride):
        c.stride[i] = s
    return c


@dataclass(frozen=True, eq=False)
class CudlaModule:
    """A loadable loaded on one core (implements ``Module``)."""

    core: int
    inputs: tuple[TensorDescriptor, ...]
    outputs: tuple[TensorDescriptor, ...]
    handle: int = field(repr=False)
    image: bytes = field(repr=False)  # the loadable's bytes, kept for the module's life


def load_module(
    loadable: LoadableSource,
    *,
    libs: Libraries,
    dev: c_void_p,
    core: int,
    scales: Mapping[str, float] | None,
) -> CudlaModule:
    """Load a TensorRT DLA standalone loadable (bytes or a path) into the cuDLA handle ``dev``
    of DLA core ``core``.

    ``scales`` gives INT8 tensors' scales by name (cuDLA does not report them). Raises
    DlaError: ``ERROR_OS`` for an unreadable file, ``ERROR_INVALID_MODULE`` for an empty
    loadable or descriptors dlad cannot use (the module is then unloaded), and whatever
    ``cudlaModuleLoadFromMemory`` / ``cudlaModuleGetAttributes`` return.
    """
    call = "cudlaModuleLoadFromMemory"
    if isinstance(loadable, (bytes, bytearray, memoryview)):
        image = bytes(loadable)
    else:
        try:
            image = Path(os.fspath(loadable)).read_bytes()
        except (OSError, TypeError) as exc:
            raise DlaError(CudlaStatus.ERROR_OS, call, str(exc)) from exc
    if not image:
        raise DlaError(CudlaStatus.ERROR_INVALID_MODULE, call, "empty loadable")
    data = (c_uint8 * len(image)).from_buffer_copy(image)
    handle = c_void_p()
    check_cudla(libs.cudlaModuleLoadFromMemory(dev, data, len(image), byref(handle), 0), call)
    try:
        inputs = _descriptors(libs, handle, ModuleAttributeType.NUM_INPUT_TENSORS, scales)
        outputs = _descriptors(libs, handle, ModuleAttributeType.NUM_OUTPUT_TENSORS, scales)
    except DlaError:
        libs.cudlaModuleUnload(handle, 0)
        raise
    return CudlaModule(core, inputs, outputs, int(handle.value or 0), image)


def _descriptors(
    libs: Libraries,
    handle: c_void_p,
    count_attr: ModuleAttributeType,
    scales: Mapping[str, float] | None,
) -> tuple[TensorDescriptor, ...]:
    call = "cudlaModuleGetAttributes"
    attr = ModuleAttribute()
    check_cudla(libs.cudlaModuleGetAttributes(handle, count_attr, byref(attr)), call)
    is_input = count_attr == ModuleAttributeType.NUM_INPUT_TENSORS
    count = attr.numInputTensors if is_input else attr.numOutputTensors
    array = (ModuleTensorDescriptor * max(count, 1))()
    if is_input:
        attr.inputTensorDesc = cast(array, POINTER(ModuleTensorDescriptor))
        which = ModuleAttributeType.INPUT_TENSOR_DESCRIPTORS
    else:
        attr.outputTensorDesc = cast(array, POINTER(ModuleTensorDescriptor))
        which = ModuleAttributeType.OUTPUT_TENSOR_DESCRIPTORS
    check_cudla(libs.cudlaModuleGetAttributes(handle, which, byref(attr)), call)
    out = []
    for c in array[:count]:
        name = bytes(c.name).split(b"\0", 1)[0].decode("utf-8", "replace")
        try:
            out.append(descriptor_from_c(c, (scales or {}).get(name)))
        except ValueError as exc:
            raise DlaError(CudlaStatus.ERROR_INVALID_MODULE, call, f"{name!r}: {exc}") from exc
    return tuple(out)
