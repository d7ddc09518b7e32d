"""The CUDA driver, through cuda-python's ``cuda.bindings`` (imported lazily): probe, context,
NVRTC compilation with an on-disk cache, memory, streams and stream memory operations.

Only what dlad's pre/post pipeline needs, with every failure turned into a :class:`CudaError`
that names the call. Nothing here imports torch or CuPy.

Probing never crashes: on a machine without a driver, cuda-python's runtime answers
``cudaErrorInsufficientDriver`` (35) while the driver API raises ``DynamicLibNotFoundError``
from ``cuInit``; a missing cuda-python is an ImportError. :func:`probe` maps each to "no GPU"
with the reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import structlog

from dlad.families import cuda_kernels, cuda_sources

__all__ = [
    "CudaError",
    "DeviceBuffer",
    "GpuContext",
    "GpuProbe",
    "HostBuffer",
    "Kernel",
    "compile_cubin",
    "launch",
    "plane_functions",
    "probe",
]

if TYPE_CHECKING:
    from dlad.native_plane import CudaFunctions

log = structlog.get_logger("dlad.gpu")

KERNEL_SOURCE = Path(__file__).with_name("kernels.cu")
"""The CUDA C source of dlad's kernels but the model families' decodes."""


def kernel_source() -> str:
    """The one CUDA program of every dlad kernel: ``kernels.cu``, then each model family's."""
    files = [KERNEL_SOURCE, *cuda_sources()]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17", "--fmad=false", "-default-device")
"""``--fmad=false``: the float steps must round one by one, as the numpy reference does."""


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed.

    Attributes:
        call: the function, e.g. ``cuLaunchKernel``.
        code: its numeric result (``CUresult``/``nvrtcResult``), or -1 when not a result code.
    """

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call = call
        self.code = code
        super().__init__(f"{call} failed ({code}){': ' + detail if detail else ''}")


_DRIVER: Any = None


def _driver() -> Any:
    """cuda-python's driver module (imported on first use: the daemon runs without it)."""
    global _DRIVER  # noqa: PLW0603 (a cached import, set once)
    if _DRIVER is None:
        from cuda.bindings import driver

        _DRIVER = driver
    return _DRIVER


def _check(result: Any, call: str) -> Any:
    """Unpack a cuda.bindings result tuple ``(err, *values)``; raise CudaError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != 0:
        name = getattr(err, "name", str(err))
        raise CudaError(call, code, name)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# ------------------------------------------------------------------------------- probe


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """What :func:`probe` found: ``available`` and, if not, ``reason``; else the device."""

    available: bool
    reason: str = ""
    name: str = ""
    compute_capability: tuple[int, int] = (0, 0)
    driver_version: int = 0
    memory_bytes: int = 0

    def describe(self) -> str:
        """One line for logs and ``dlad status``."""
        if not self.available:
            return f"no GPU ({self.reason})"
        major, minor = self.compute_capability
        gib = self.memory_bytes / 2**30
        return f"{self.name}, sm_{major}{minor}, {gib:.0f} GiB, driver {self.driver_version}"


def probe(device_index: int = 0) -> GpuProbe:
    """Whether a CUDA GPU is usable here, never raising: a missing cuda-python, a missing or too
    old driver, no device, or a failing ``cuInit`` all mean "no GPU", with the reason."""
    try:
        from cuda.bindings import driver, runtime
    except ImportError as exc:
        return GpuProbe(False, f"cuda-python is not installed ({exc.name or exc})")
    try:
        # The runtime's count answers cleanly (error 35) where the driver library is absent.
        err, count = runtime.cudaGetDeviceCount()
        if int(err) != 0:
            return GpuProbe(False, f"cudaGetDeviceCount: {getattr(err, 'name', err)}")
        if count <= device_index:
            return GpuProbe(False, f"{count} CUDA devices, need index {device_index}")
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        name = _check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
        attr = driver.CUdevice_attribute
        major = _check(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
            "cuDeviceGetAttribute",
        )
        minor = _check(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
            "cuDeviceGetAttribute",
        )
        memory = _check(driver.cuDeviceTotalMem(dev), "cuDeviceTotalMem")
        version = _check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
    except Exception as exc:  # noqa: BLE001 (DynamicLibNotFoundError & co.: any failure = no GPU)
        return GpuProbe(False, f"{type(exc).__name__}: {exc}")
    if int(major) < 8:
        return GpuProbe(False, f"compute capability {major}.{minor} < 8.0 (kernels need sm_80+)")
    text = bytes(name).split(b"\0", 1)[0].decode("utf-8", "replace")
    return GpuProbe(True, "", text, (int(major), int(minor)), int(version), int(memory))


# ------------------------------------------------------------------------------- NVRTC


def _cache_dir() -> Path:
    base = os.environ.get("DLAD_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "dlad" if base else Path.home() / ".cache" / "dlad"


def compile_cubin(
    source: str, arch: tuple[int, int], cache_dir: Path | None = None
) -> tuple[bytes, bool]:
    """Compile ``source`` with NVRTC for ``sm_<arch>`` to a cubin, through an on-disk cache keyed
    by the source, the options, the architecture and the NVRTC version.

    Returns ``(cubin, from_cache)``. Raises CudaError for a compile failure (its log is in the
    message) or a missing NVRTC library.
    """
    from cuda.bindings import nvrtc

    try:
        version = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except CudaError:
        raise
    except Exception as exc:  # DynamicLibNotFoundError: libnvrtc is not installed
        raise CudaError("nvrtcVersion", -1, f"{type(exc).__name__}: {exc}") from exc
    options = (*NVRTC_OPTIONS, f"--gpu-architecture=sm_{arch[0]}{arch[1]}")
    key = hashlib.sha256(
        "\0".join([source, *options, repr(tuple(version))]).encode("utf-8")
    ).hexdigest()[:32]
    directory = (cache_dir or _cache_dir()) / "kernels"
    path = directory / f"{key}.cubin"
    try:
        return path.read_bytes(), True
    except OSError:
        pass
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernels.cu", 0, [], []), "nvrtc")
    try:
        opts = [o.encode() for o in options]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            text = b" " * size
            _check(nvrtc.nvrtcGetProgramLog(prog, text), "nvrtcGetProgramLog")
            raise CudaError("nvrtcCompileProgram", int(err), text.decode("utf-8", "replace"))
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    try:  # a cache that cannot be written costs a recompile next time, nothing else
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False, suffix=".tmp") as tmp:
            tmp.write(cubin)
        os.replace(tmp.name, path)
    except OSError as exc:
        log.warning("kernel_cache_not_written", path=str(path), error=str(exc))
    return cubin, False


# ------------------------------------------------------------------------------- memory


@dataclass(eq=False)
class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr`` (``cuMemAlloc``); freed by :meth:`free`."""

    ptr: int
    nbytes: int
    _ctx: GpuContext

    def free(self) -> None:
        if self.ptr:
            self._ctx.make_current()
            _check(_driver().cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0


@dataclass(eq=False)
class HostBuffer:
    """Pinned, device-mapped host memory (``cuMemHostAlloc`` with ``DEVICEMAP``): ``array`` is
    the bytes as a numpy uint8 view, ``device_ptr`` the address kernels and stream memory
    operations use. The emulated analogue of an Orin's NvSciBuf memory, which CPU, GPU and DLA
    share."""

    array: npt.NDArray[np.uint8]
    host_ptr: int
    device_ptr: int
    _ctx: GpuContext

    def free(self) -> None:
        if self.host_ptr:
            self._ctx.make_current()
            _check(_driver().cuMemFreeHost(self.host_ptr), "cuMemFreeHost")
            self.host_ptr = 0


@dataclass(frozen=True)
class Kernel:
    """One ``extern "C"`` kernel of the module."""

    name: str
    function: Any


class GpuContext:
    """The GPU as dlad uses it: the device's primary context, the compiled kernel module and
    allocation helpers. Every method makes the context current on the calling thread first, so
    any thread may call it.

    Args:
        device_index: the CUDA device.
        cache_dir: where compiled kernels are cached (default ``$DLAD_CACHE_DIR/dlad`` or
            ``~/.cache/dlad``).

    Raises CudaError when the device cannot be opened or the kernels do not compile or load.
    """

    def __init__(self, device_index: int = 0, cache_dir: Path | None = None) -> None:
        drv = _driver()
        _check(drv.cuInit(0), "cuInit")
        self.device = _check(drv.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = _check(drv.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._lock = threading.Lock()
        self._closed = False
        self._current = threading.local()  # .bound: this thread has the context current
        self.make_current()
        attr = drv.CUdevice_attribute
        self.arch = (
            int(self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)),
            int(self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
        )
        self.sm_count = int(self._attr(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))
        # An integrated GPU (an Orin's) shares the host's DRAM: it reads host memory in place.
        self.integrated = bool(self._attr(attr.CU_DEVICE_ATTRIBUTE_INTEGRATED))
        self.max_smem_optin = int(
            self._attr(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        )
        source = kernel_source()
        cubin, cached = compile_cubin(source, self.arch, cache_dir)
        self.module = _check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.kernels: dict[str, Kernel] = {}
        for name in (
            "pre_hwc4_i8",
            "pre_chw16_f16",
            *cuda_kernels(),
            "post_select_sort",
            "post_mask",
            "post_scan",
            "layout_hwc4_nchw",
            "layout_nchw_chw16",
        ):
            fn = _check(drv.cuModuleGetFunction(self.module, name.encode()), "cuModuleGetFunction")
            self.kernels[name] = Kernel(name, fn)
        log.info("gpu_kernels_ready", arch=f"sm_{self.arch[0]}{self.arch[1]}", cached=cached)

    def _attr(self, attribute: Any) -> int:
        return int(_check(_driver().cuDeviceGetAttribute(attribute, self.device), "attr"))

    def make_current(self) -> None:
        """Bind the context to the calling thread (a driver call the first time on a thread,
        a thread-local check after)."""
        if getattr(self._current, "bound", False):
            return
        _check(_driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._current.bound = True

    def set_max_dynamic_smem(self, kernel: Kernel, nbytes: int) -> None:
        """Allow ``kernel`` up to ``nbytes`` of dynamic shared memory. Raises CudaError when the
        device has less."""
        if nbytes > self.max_smem_optin:
            raise CudaError("cuFuncSetAttribute", -1, f"{nbytes} B > {self.max_smem_optin} B")
        drv = _driver()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(drv.cuFuncSetAttribute(kernel.function, attr, nbytes), "cuFuncSetAttribute")

    def alloc(self, nbytes: int, *, zero: bool = True) -> DeviceBuffer:
        """``nbytes`` (at least 1) of device memory, zeroed unless ``zero`` is False."""
        self.make_current()
        drv = _driver()
        ptr = int(_check(drv.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc"))
        if zero:
            _check(drv.cuMemsetD8(ptr, 0, max(nbytes, 1)), "cuMemsetD8")
        return DeviceBuffer(ptr, nbytes, self)

    def host_alloc(self, nbytes: int) -> HostBuffer:
        """``nbytes`` of zeroed, pinned, device-mapped host memory (page aligned)."""
        self.make_current()
        drv = _driver()
        flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
        host = int(_check(drv.cuMemHostAlloc(max(nbytes, 1), flags), "cuMemHostAlloc"))
        dev = int(_check(drv.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
        array = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(host))
        array[:] = 0
        return HostBuffer(array[:nbytes], host, dev, self)

    def register_host(self, address: int, nbytes: int) -> int:
        """Page-lock ``nbytes`` of existing host memory at ``address`` (read-only to the GPU: a
        client's shared-memory frames) and map it for the GPU; returns its device address.
        Copies from it are then DMA, without a staging copy by the CPU, and kernels can read it
        in place. Raises CudaError (e.g. no memory to lock)."""
        self.make_current()
        drv = _driver()
        flags = (drv.CU_MEMHOSTREGISTER_DEVICEMAP | drv.CU_MEMHOSTREGISTER_READ_ONLY
                 | drv.CU_MEMHOSTREGISTER_PORTABLE)  # fmt: skip
        _check(drv.cuMemHostRegister(address, nbytes, flags), "cuMemHostRegister")
        return int(_check(drv.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))

    def unregister_host(self, address: int) -> None:
        """Undo :meth:`register_host` (no GPU work may still read the memory)."""
        self.make_current()
        _check(_driver().cuMemHostUnregister(address), "cuMemHostUnregister")

    def stream(self) -> Any:
        """A new non-blocking stream."""
        self.make_current()
        drv = _driver()
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        return _check(drv.cuStreamCreate(flags), "cuStreamCreate")

    def event(self, *, timing: bool = False, blocking: bool = False) -> Any:
        """A new event (without timing unless ``timing``: cheaper to record and wait). A
        ``blocking`` event's waiter sleeps until the GPU interrupts instead of spinning."""
        self.make_current()
        drv = _driver()
        flags = 0 if timing else int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking:
            flags |= int(drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        return _check(drv.cuEventCreate(flags), "cuEventCreate")

    def close(self) -> None:
        """Unload the module and release the primary context; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        drv = _driver()
        self.make_current()
        drv.cuModuleUnload(self.module)
        drv.cuDevicePrimaryCtxRelease(self.device)


def launch(  # noqa: PLR0917 (the CUDA launch tuple, in cuLaunchKernel's order)
    kernel: Kernel,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    params: ctypes.Structure,
    stream: Any,
    smem: int = 0,
) -> None:
    """Launch ``kernel`` with one by-value struct argument. Raises CudaError."""
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    result = _driver().cuLaunchKernel(
        kernel.function, *grid, *block, smem, stream, ctypes.addressof(argv), 0
    )
    if int(result[0]) != 0:  # the call's name is formatted only when it failed
        _check(result, f"cuLaunchKernel({kernel.name})")


# The driver's entry points the native plane's GPU chain calls (dlad/native/gpu_chain.hpp's
# CudaApi order), by their versioned names in libcuda (cuda.h maps the plain names to these).
_PLANE_FUNCTIONS = (
    "cuCtxSetCurrent",
    "cuMemcpyHtoDAsync_v2",
    "cuLaunchKernel",
    "cuStreamWriteValue32_v2",
    "cuStreamWaitValue32_v2",
    "cuGraphLaunch",
    "cuLaunchHostFunc",
    # a cuDLA core's chain (recipe A): the NvSciSync objects imported as external semaphores
    "cuSignalExternalSemaphoresAsync",
    "cuWaitExternalSemaphoresAsync",
)


def plane_functions() -> CudaFunctions:
    """The addresses of the driver functions the native plane calls, in the libcuda this
    process has loaded (cuda-python's), and ``CU_STREAM_WAIT_VALUE_GEQ``. Raises CudaError
    naming a function the driver lacks (one older than CUDA 11.7)."""
    from dlad.native_plane import CudaFunctions

    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise CudaError("dlopen(libcuda.so.1)", -1, str(exc)) from None
    addresses: list[int] = []
    for name in _PLANE_FUNCTIONS:
        try:
            address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        except AttributeError:
            address = None
        if not address:
            raise CudaError(name, -1, "not in this driver's libcuda")
        addresses.append(address)
    geq = int(_driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    a = addresses
    return CudaFunctions(a[0], a[1], a[2], a[3], a[4], a[5], a[6], wait_geq=geq,
                         signal_external=a[7], wait_external=a[8])  # fmt: skip
