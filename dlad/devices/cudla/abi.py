"""The C ABI of cuDLA (``libcudla``) and of the NvSciBuf / NvSciSync calls dlad uses, in ctypes.

Every declaration follows ``docs/reference/cudla.md`` §4.2-4.6 (cudla.h v1.2.1 plus the newer calls
of the cuDLA API documentation, nvscibuf.h / nvscisync.h); ``tests/dlad/cudla/test_abi.py`` pins
each struct's size and field offsets and each enum's values to those documents. Note that
``cudlaTask`` puts its output tensors *before* its inputs.

:func:`load_libraries` finds the three libraries by name (``libcudla.so.1``,
``libnvscibuf.so.1``, ``libnvscisync.so.1``; the environment variables ``DLAD_CUDLA_LIB``,
``DLAD_NVSCIBUF_LIB`` and ``DLAD_NVSCISYNC_LIB`` name other files), declares every function's
argument and result types, and probes the symbols that only newer releases export
(``cudlaGetVersion``, ``cudlaDeviceGetCount``, ``cudlaSetTaskTimeoutInMs``,
``NvSciSyncFenceExtractFence``, ``NvSciSyncFenceUpdateFence``) instead of assuming them. A library
or required symbol that is missing raises :class:`CudlaLibraryError` naming it.

Only the standard library is imported.
"""

from __future__ import annotations

import ctypes
import enum
import os
from ctypes import (
    POINTER,
    Structure,
    Union,
    c_char,
    c_int,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_ulonglong,
    c_void_p,
)
from dataclasses import dataclass
from typing import Any, Final

from dlad.devices.base import CudlaStatus, DlaError

__all__ = [
    "LIBRARY_ENV",
    "LIBRARY_NAMES",
    "OPTIONAL_SYMBOLS",
    "AccessPermission",
    "CudlaFence",
    "CudlaLibraryError",
    "CudlaMode",
    "CudlaTask",
    "DevAttribute",
    "DevAttributeType",
    "ExternalMemoryHandleDesc",
    "ExternalSemaphoreHandleDesc",
    "FenceType",
    "Libraries",
    "ModuleAttribute",
    "ModuleAttributeType",
    "ModuleTensorDescriptor",
    "NvSciBufAccessPerm",
    "NvSciBufAttrKey",
    "NvSciBufAttrKeyValuePair",
    "NvSciBufType",
    "NvSciError",
    "NvSciSyncAccessPerm",
    "NvSciSyncAttrKey",
    "NvSciSyncAttrKeyValuePair",
    "NvSciSyncFence",
    "SignalEvents",
    "SubmitFlags",
    "SyncAttrFlags",
    "WaitEvents",
    "load_libraries",
]

NAME_MAX_LEN: Final = 80
"""``CUDLA_RUNTIME_TENSOR_DESC_NAME_MAX_LEN``."""
NUM_STRIDES: Final = 8
"""``CUDLA_LOADABLE_TENSOR_DESC_NUM_STRIDES``."""


# ----------------------------------------------------------------------------- cuDLA enums


class CudlaMode(enum.IntEnum):
    """``cudlaMode``: the ``flags`` of ``cudlaCreateDevice``."""

    CUDA_DLA = 0  # hybrid
    STANDALONE = 1


class SyncAttrFlags(enum.IntFlag):
    """``cudlaNvSciSyncAttributes``: what ``cudlaGetNvSciSyncAttributes`` fills a list for."""

    WAIT = 1
    SIGNAL = 2


class ModuleAttributeType(enum.IntEnum):
    """``cudlaModuleAttributeType``."""

    NUM_INPUT_TENSORS = 0
    NUM_OUTPUT_TENSORS = 1
    INPUT_TENSOR_DESCRIPTORS = 2
    OUTPUT_TENSOR_DESCRIPTORS = 3
    NUM_OUTPUT_TASK_STATISTICS = 4
    OUTPUT_TASK_STATISTICS_DESCRIPTORS = 5


class FenceType(enum.IntEnum):
    """``cudlaFenceType``."""

    NVSCISYNC_FENCE = 1
    NVSCISYNC_FENCE_SOF = 2


class ModuleLoadFlags(enum.IntEnum):
    """``cudlaModuleLoadFlags``."""

    DEFAULT = 0
    ENABLE_FAULT_DIAGNOSTICS = 1


class SubmitFlags(enum.IntFlag):
    """``cudlaSubmissionFlags``."""

    NOOP = 1
    SKIP_LOCK_ACQUIRE = 2
    DIAGNOSTICS_TASK = 4


class AccessPermission(enum.IntEnum):
    """``cudlaAccessPermissionFlags``: the ``flags`` of ``cudlaImportExternalMemory``."""

    READ_WRITE = 0
    READ_ONLY = 1
    TASK_STATISTICS = 2


class DevAttributeType(enum.IntEnum):
    """``cudlaDevAttributeType``."""

    UNIFIED_ADDRESSING = 0
    DEVICE_VERSION = 1


# ----------------------------------------------------------------------------- NvSci enums


class NvSciError(enum.IntEnum):
    """The ``NvSciError`` values dlad tells apart (nvscierror.h); any other is reported by
    number."""

    SUCCESS = 0
    INSUFFICIENT_MEMORY = 0x30
    BAD_PARAMETER = 0x100
    TIMEOUT = 0x200


class NvSciBufType(enum.IntEnum):
    """``NvSciBufType``."""

    GENERAL = 0
    RAW_BUFFER = 1
    IMAGE = 2
    TENSOR = 3
    ARRAY = 4
    PYRAMID = 5


class NvSciBufAttrKey(enum.IntEnum):
    """The ``NvSciBufAttrKey`` values used (key = (type << 16) + index)."""

    TYPES = 1
    NEED_CPU_ACCESS = 2
    REQUIRED_PERM = 3
    ENABLE_CPU_CACHE = 4
    GPU_ID = 5
    CPU_NEED_SW_CACHE_COHERENCY = 6
    ACTUAL_PERM = 7
    RAW_BUFFER_SIZE = 0x10000
    RAW_BUFFER_ALIGN = 0x10001
    TENSOR_DATA_TYPE = 0x30000
    TENSOR_NUM_DIMS = 0x30001
    TENSOR_SIZE_PER_DIM = 0x30002
    TENSOR_ALIGNMENT_PER_DIM = 0x30003
    TENSOR_STRIDES_PER_DIM = 0x30004
    TENSOR_PIXEL_FORMAT = 0x30005
    TENSOR_BASE_ADDR_ALIGN = 0x30006
    TENSOR_SIZE = 0x30007


class NvSciBufAccessPerm(enum.IntEnum):
    """``NvSciBufAttrValAccessPerm`` (a 32-bit enum)."""

    READ_ONLY = 1
    READ_WRITE = 3


class NvSciSyncAttrKey(enum.IntEnum):
    """``NvSciSyncAttrKey``."""

    LOWER_BOUND = 0
    NEED_CPU_ACCESS = 1
    REQUIRED_PERM = 2
    ACTUAL_PERM = 3
    WAITER_CONTEXT_INSENSITIVE_FENCE_EXPORTS = 4
    WAITER_REQUIRE_TIMESTAMPS = 5
    REQUIRE_DETERMINISTIC_FENCES = 6
    NUM_TIMESTAMP_SLOTS = 7


class NvSciSyncAccessPerm(enum.IntEnum):
    """``NvSciSyncAccessPerm``: a ``uint64_t`` in current headers."""

    WAIT_ONLY = 1
    SIGNAL_ONLY = 2
    WAIT_SIGNAL = 3
    AUTO = 1 << 63


# ----------------------------------------------------------------------------- structs


class ModuleTensorDescriptor(Structure):
    """``cudlaModuleTensorDescriptor``: 168 bytes on LP64."""

    _fields_ = [
        ("name", c_char * (NAME_MAX_LEN + 1)),
        ("size", c_uint64),
        ("n", c_uint64),
        ("c", c_uint64),
        ("h", c_uint64),
        ("w", c_uint64),
        ("dataFormat", c_uint8),
        ("dataType", c_uint8),
        ("dataCategory", c_uint8),
        ("pixelFormat", c_uint8),
        ("pixelMapping", c_uint8),
        ("stride", c_uint32 * NUM_STRIDES),
    ]


class ModuleAttribute(Union):
    """``cudlaModuleAttribute``: a count, or the caller's descriptor array cuDLA fills."""

    _fields_ = [
        ("numInputTensors", c_uint32),
        ("numOutputTensors", c_uint32),
        ("inputTensorDesc", POINTER(ModuleTensorDescriptor)),
        ("outputTensorDesc", POINTER(ModuleTensorDescriptor)),
    ]


class DevAttribute(Union):
    """``cudlaDevAttribute``."""

    _fields_ = [("unifiedAddressingSupported", c_uint8), ("deviceVersion", c_uint32)]


class ExternalMemoryHandleDesc(Structure):
    """``cudlaExternalMemoryHandleDesc``: an ``NvSciBufObj`` and its size."""

    _fields_ = [("extBufObject", c_void_p), ("size", c_ulonglong)]


class ExternalSemaphoreHandleDesc(Structure):
    """``cudlaExternalSemaphoreHandleDesc``: an ``NvSciSyncObj``."""

    _fields_ = [("extSyncObject", c_void_p)]


class CudlaFence(Structure):
    """``CudlaFence``: an ``NvSciSyncFence*`` and its :class:`FenceType`."""

    _fields_ = [("fence", c_void_p), ("type", c_int)]


class WaitEvents(Structure):
    """``cudlaWaitEvents``."""

    _fields_ = [("preFences", POINTER(CudlaFence)), ("numEvents", c_uint32)]


class SignalEvents(Structure):
    """``cudlaSignalEvents``: registered semaphore pointers and the EOF fences cuDLA fills."""

    _fields_ = [
        ("devPtrs", POINTER(POINTER(c_uint64))),
        ("eofFences", POINTER(CudlaFence)),
        ("numEvents", c_uint32),
    ]


class CudlaTask(Structure):
    """``cudlaTask``: 48 bytes; outputs come *before* inputs."""

    _fields_ = [
        ("moduleHandle", c_void_p),
        ("outputTensor", POINTER(POINTER(c_uint64))),
        ("numOutputTensors", c_uint32),
        ("numInputTensors", c_uint32),
        ("inputTensor", POINTER(POINTER(c_uint64))),
        ("waitEvents", POINTER(WaitEvents)),
        ("signalEvents", POINTER(SignalEvents)),
    ]


class NvSciBufAttrKeyValuePair(Structure):
    """``NvSciBufAttrKeyValuePair``."""

    _fields_ = [("key", c_int), ("value", c_void_p), ("len", c_size_t)]


class NvSciSyncAttrKeyValuePair(Structure):
    """``NvSciSyncAttrKeyValuePair``."""

    _fields_ = [("attrKey", c_int), ("value", c_void_p), ("len", c_size_t)]


class NvSciSyncFence(Structure):
    """``NvSciSyncFence``: 48 opaque bytes; all zero is ``NvSciSyncFenceInitializer``."""

    _fields_ = [("payload", c_uint64 * 6)]


# ----------------------------------------------------------------------------- functions

_P = c_void_p
_PP = POINTER(c_void_p)
_U64P = POINTER(c_uint64)
_REGP = POINTER(POINTER(c_uint64))
_FENCEP = POINTER(NvSciSyncFence)

# name: (library, result type or None for void, argument types)
_FUNCTIONS: Final[dict[str, tuple[str, Any, tuple[Any, ...]]]] = {
    "cudlaGetVersion": ("cudla", c_int, (_U64P,)),
    "cudlaDeviceGetCount": ("cudla", c_int, (_U64P,)),
    "cudlaCreateDevice": ("cudla", c_int, (c_uint64, _PP, c_uint32)),
    "cudlaDestroyDevice": ("cudla", c_int, (_P,)),
    "cudlaDeviceGetAttribute": ("cudla", c_int, (_P, c_int, POINTER(DevAttribute))),
    "cudlaSetTaskTimeoutInMs": ("cudla", c_int, (_P, c_uint32)),
    "cudlaGetLastError": ("cudla", c_int, (_P,)),
    "cudlaModuleLoadFromMemory": (
        "cudla",
        c_int,
        (_P, POINTER(c_uint8), c_size_t, _PP, c_uint32),
    ),
    "cudlaModuleGetAttributes": ("cudla", c_int, (_P, c_int, POINTER(ModuleAttribute))),
    "cudlaModuleUnload": ("cudla", c_int, (_P, c_uint32)),
    "cudlaImportExternalMemory": (
        "cudla",
        c_int,
        (_P, POINTER(ExternalMemoryHandleDesc), _REGP, c_uint32),
    ),
    "cudlaGetNvSciSyncAttributes": ("cudla", c_int, (_U64P, c_uint32)),
    "cudlaImportExternalSemaphore": (
        "cudla",
        c_int,
        (_P, POINTER(ExternalSemaphoreHandleDesc), _REGP, c_uint32),
    ),
    "cudlaMemUnregister": ("cudla", c_int, (_P, _U64P)),
    "cudlaSubmitTask": ("cudla", c_int, (_P, POINTER(CudlaTask), c_uint32, _P, c_uint32)),
    "NvSciBufModuleOpen": ("nvscibuf", c_int, (_PP,)),
    "NvSciBufModuleClose": ("nvscibuf", None, (_P,)),
    "NvSciBufAttrListCreate": ("nvscibuf", c_int, (_P, _PP)),
    "NvSciBufAttrListSetAttrs": (
        "nvscibuf",
        c_int,
        (_P, POINTER(NvSciBufAttrKeyValuePair), c_size_t),
    ),
    "NvSciBufAttrListReconcile": ("nvscibuf", c_int, (_PP, c_size_t, _PP, _PP)),
    "NvSciBufAttrListFree": ("nvscibuf", None, (_P,)),
    "NvSciBufObjAlloc": ("nvscibuf", c_int, (_P, _PP)),
    "NvSciBufObjGetCpuPtr": ("nvscibuf", c_int, (_P, _PP)),
    "NvSciBufObjFree": ("nvscibuf", None, (_P,)),
    "NvSciSyncModuleOpen": ("nvscisync", c_int, (_PP,)),
    "NvSciSyncModuleClose": ("nvscisync", None, (_P,)),
    "NvSciSyncCpuWaitContextAlloc": ("nvscisync", c_int, (_P, _PP)),
    "NvSciSyncCpuWaitContextFree": ("nvscisync", None, (_P,)),
    "NvSciSyncAttrListCreate": ("nvscisync", c_int, (_P, _PP)),
    "NvSciSyncAttrListSetAttrs": (
        "nvscisync",
        c_int,
        (_P, POINTER(NvSciSyncAttrKeyValuePair), c_size_t),
    ),
    "NvSciSyncAttrListReconcile": ("nvscisync", c_int, (_PP, c_size_t, _PP, _PP)),
    "NvSciSyncAttrListFree": ("nvscisync", None, (_P,)),
    "NvSciSyncObjAlloc": ("nvscisync", c_int, (_P, _PP)),
    "NvSciSyncObjFree": ("nvscisync", None, (_P,)),
    "NvSciSyncObjGenerateFence": ("nvscisync", c_int, (_P, _FENCEP)),
    "NvSciSyncObjSignal": ("nvscisync", c_int, (_P,)),
    "NvSciSyncFenceWait": ("nvscisync", c_int, (_FENCEP, _P, c_int64)),
    "NvSciSyncFenceClear": ("nvscisync", None, (_FENCEP,)),
    "NvSciSyncFenceDup": ("nvscisync", c_int, (_FENCEP, _FENCEP)),
    "NvSciSyncFenceExtractFence": ("nvscisync", c_int, (_FENCEP, _U64P, _U64P)),
    "NvSciSyncFenceUpdateFence": ("nvscisync", c_int, (_P, c_uint64, c_uint64, _FENCEP)),
}

OPTIONAL_SYMBOLS: Final = frozenset({
    "cudlaGetVersion", "cudlaDeviceGetCount", "cudlaSetTaskTimeoutInMs",
    "NvSciSyncFenceExtractFence", "NvSciSyncFenceUpdateFence",
})  # fmt: skip
"""Symbols only newer releases export (docs/reference/cudla.md §4.1; JetPack 5.1.2 lacks the two
fence calls)."""

LIBRARY_NAMES: Final = {
    "cudla": ("libcudla.so.1", "libcudla.so"),
    "nvscibuf": ("libnvscibuf.so.1", "libnvscibuf.so"),
    "nvscisync": ("libnvscisync.so.1", "libnvscisync.so"),
}
"""The names each library is looked up by, in order (the dynamic loader's search path)."""
LIBRARY_ENV: Final = {
    "cudla": "DLAD_CUDLA_LIB",
    "nvscibuf": "DLAD_NVSCIBUF_LIB",
    "nvscisync": "DLAD_NVSCISYNC_LIB",
}
"""Environment variables that name a library file to use instead."""


class CudlaLibraryError(DlaError):
    """A library or a required symbol could not be loaded; ``detail`` names what is missing.
    Its status is ``ERROR_DRIVER_NOT_FOUND`` and its call ``dlopen``."""

    def __init__(self, detail: str) -> None:
        super().__init__(CudlaStatus.ERROR_DRIVER_NOT_FOUND, "dlopen", detail)


@dataclass(frozen=True)
class Libraries:
    """The three loaded libraries and their declared functions.

    ``paths`` names the file (or name) each library was loaded from; ``missing`` holds the
    optional symbols this release lacks.
    """

    paths: dict[str, str]
    functions: dict[str, Any]
    missing: frozenset[str]

    def has(self, name: str) -> bool:
        """Whether this release exports ``name``."""
        return name in self.functions

    def __getattr__(self, name: str) -> Any:
        """The declared function ``name``. Raises DlaError (``ERROR_UNSUPPORTED_OPERATION``)
        for an optional symbol this release lacks; AttributeError for anything else."""
        functions = self.__dict__.get("functions", {})
        if name in functions:
            return functions[name]
        if name in self.__dict__.get("missing", ()):
            raise DlaError(
                CudlaStatus.ERROR_UNSUPPORTED_OPERATION, name, "not exported by this release"
            )
        raise AttributeError(name)


def _open(kind: str, explicit: str | None) -> tuple[str, ctypes.CDLL]:
    given = explicit or os.environ.get(LIBRARY_ENV[kind])
    candidates = (given,) if given else LIBRARY_NAMES[kind]
    errors = []
    for name in candidates:
        try:
            return name, ctypes.CDLL(name)
        except OSError as exc:  # noqa: PERF203 (a few names, tried once)
            errors.append(f"{name}: {exc}")
    where = f" (from {LIBRARY_ENV[kind]})" if given and not explicit else ""
    raise CudlaLibraryError(
        f"lib{kind} not found{where}; tried " + "; ".join(errors)
        + ". cuDLA and NvSci ship with JetPack on a Jetson Orin (docs/jetson.md)"
    )  # fmt: skip


def load_libraries(
    cudla: str | None = None, nvscibuf: str | None = None, nvscisync: str | None = None
) -> Libraries:
    """Load libcudla, libnvscibuf and libnvscisync and declare every function of the ABI.

    Each argument names a file or library name to use instead of the environment variable or
    the standard names. Raises :class:`CudlaLibraryError` naming the library that does not load
    or the required symbol it lacks.
    """
    libs: dict[str, ctypes.CDLL] = {}
    paths: dict[str, str] = {}
    for kind, explicit in (("cudla", cudla), ("nvscibuf", nvscibuf), ("nvscisync", nvscisync)):
        paths[kind], libs[kind] = _open(kind, explicit)
    functions: dict[str, Any] = {}
    missing = set()
    for name, (kind, restype, argtypes) in _FUNCTIONS.items():
        try:
            fn = getattr(libs[kind], name)
        except AttributeError:
            if name in OPTIONAL_SYMBOLS:
                missing.add(name)
                continue
            raise CudlaLibraryError(f"{paths[kind]} lacks {name}") from None
        fn.restype = restype
        fn.argtypes = argtypes
        functions[name] = fn
    return Libraries(paths, functions, frozenset(missing))
