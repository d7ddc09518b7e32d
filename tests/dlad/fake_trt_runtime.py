"""A strict stand-in for the subset of ``tensorrt``'s runtime and of cuda-python's CUDA runtime
(``cuda.bindings.runtime``) that ``dlad/devices/tensorrt_gpu.py`` uses.

Neither TensorRT nor a Jetson is available to the project's tests, so the GPU engine's runtime
code is tested against this. It is built to catch the mistakes the real libraries would punish:

* **cudart** follows cuda-python's conventions exactly: every call returns a tuple
  ``(cudaError_t, value...)``; streams and events are handle objects whose ``int()`` is the
  handle; device pointers are ints (in an address range no host pointer uses) mapped to numpy
  byte buffers; pinned host memory (``cudaHostAlloc``) is real host memory at the returned
  address. Work on a stream is *deferred*: copies, event records and engine executions run when
  the stream is synchronised, so reading results before ``cudaStreamSynchronize`` reads stale
  bytes. Events carry a virtual clock: each copy costs ``1 µs + bytes / 20 GB/s`` and each
  execution ``exec_base_ns + exec_per_frame_ns * batch``, so measured times are exact.
* **tensorrt**: ``Runtime(logger).deserialize_cuda_engine(blob)`` reads a *fake engine file*
  (:func:`serialise`: a magic line and a JSON description of the I/O tensors, their types,
  formats and profile), returning None and logging an error, as TensorRT does, for junk or an
  engine of another TensorRT version. ``execute_async_v3`` computes every head from the input
  buffer: head ``k`` channel ``c`` is ``gain_k * avgpool(x[:, c % 3]) + offset_k * c``, pooled
  by the head's stride, so wrong strides, rows, dequantisation, channel order or swapped outputs
  change the numbers.
* **misuse raises** :class:`ApiMisuse` (an AssertionError, so no product ``except`` swallows it):
  an unknown tensor name, an address not set, ``set_input_shape`` not called or outside the
  profile, ``execute_async_v3`` given anything but the int handle of a live stream of the device
  the engine was deserialised on, a copy of the wrong kind or out of bounds, a pointer used after
  free, a double free. Legitimate failures are knobs instead (``fail``, ``execute_fails``) that
  return errors the way the real libraries do, to test the product's handling of them.

:func:`install` puts both into ``sys.modules`` through a ``pytest.MonkeyPatch``. On a CUDA host the
TensorRT stand-in also runs over cuda-python's real runtime (``FakeTensorRT(runtime)``): its
engine then reads and writes the real device buffers the product allocated.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from dlad.gpu.layout import hwc4_to_nchw
from dlad.imaging.post import pack_chw16

# The enums follow TensorRT's headers; the builder's stand-in already spells them out.
from tests.prep.fake_tensorrt import DataType, Severity, TensorFormat

ENGINE_MAGIC = b"FAKE-TRT-ENGINE\n"
_DEVICE_BASE = 1 << 52  # above any x86-64/aarch64 user-space host address
_ALIGN = 256  # cudaMalloc's alignment


class ApiMisuse(AssertionError):
    """The code under test used TensorRT or the CUDA runtime in a way the real one rejects or
    leaves undefined."""


# ------------------------------------------------------------------------------ enums


class CudaError(enum.IntEnum):
    """``cudaError_t`` (the values of ``driver_types.h``)."""

    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600
    cudaErrorIllegalAddress = 700


class StreamCaptureMode(enum.IntEnum):
    """``cudaStreamCaptureMode``."""

    cudaStreamCaptureModeGlobal = 0
    cudaStreamCaptureModeThreadLocal = 1
    cudaStreamCaptureModeRelaxed = 2


class MemcpyKind(enum.IntEnum):
    """``cudaMemcpyKind``."""

    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


_NP_TYPES: dict[DataType, type[np.generic]] = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.INT32: np.int32,
}


# ------------------------------------------------------------------------------ cudart


@dataclass
class _Alloc:
    base: int
    size: int
    buffer: npt.NDArray[np.uint8]
    device: int
    freed: bool = False


@dataclass(eq=False)
class FakeStream:
    """A ``cudaStream_t``: ``int()`` is its handle; ``ops`` run at synchronisation."""

    handle: int
    device: int
    clock_ns: int = 1_000_000
    ops: list[tuple[str, Callable[[], int]]] = field(default_factory=list)
    destroyed: bool = False
    capture: list[tuple[str, Callable[[], int]]] | None = None  # capturing: work goes here

    def __int__(self) -> int:
        return self.handle

    def enqueue(self, name: str, op: Callable[[], int]) -> None:
        """Queue ``op``, or record it into the graph being captured."""
        (self.ops if self.capture is None else self.capture).append((name, op))


@dataclass(eq=False)
class FakeGraph:
    """A ``cudaGraph_t`` (``ops`` the captured work) or, ``executable``, a ``cudaGraphExec_t``."""

    handle: int
    ops: tuple[tuple[str, Callable[[], int]], ...]
    executable: bool = False
    destroyed: bool = False

    def __int__(self) -> int:
        return self.handle


@dataclass(eq=False)
class FakeEvent:
    """A ``cudaEvent_t``: ``time_ns`` is the stream clock when its record ran."""

    handle: int
    time_ns: int | None = None
    pending: bool = False
    destroyed: bool = False

    def __int__(self) -> int:
        return self.handle


class FakeCudart:
    """The CUDA runtime as ``from cuda.bindings import runtime`` gives it (the used subset).

    Args:
        device_count: devices ``cudaGetDeviceCount`` reports.
        driver: False: every device query answers ``cudaErrorInsufficientDriver`` (no driver).
        fail: call name -> the error that call returns, every time (a failing
            ``cudaStreamSynchronize`` still runs the stream's work first).
    """

    cudaError_t = CudaError
    cudaMemcpyKind = MemcpyKind
    cudaStreamCaptureMode = StreamCaptureMode
    cudaStreamNonBlocking = 1
    cudaHostAllocDefault = 0

    def __init__(
        self,
        device_count: int = 1,
        *,
        driver: bool = True,
        fail: Mapping[str, CudaError] | None = None,
    ) -> None:
        self.device_count = device_count
        self.driver = driver
        self.fail = dict(fail or {})
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.allocs: list[_Alloc] = []
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.graphs: list[FakeGraph] = []
        self._handles = itertools.count(0x5000)
        self._next_device = _DEVICE_BASE
        self._local = threading.local()
        self._mutex = threading.Lock()

    # ---- bookkeeping the tests read
    def live(self) -> dict[str, int]:
        """Live device and host allocations, streams and events."""
        return {
            "device": sum(1 for a in self.allocs if a.device >= 0 and not a.freed),
            "host": sum(1 for a in self.allocs if a.device < 0 and not a.freed),
            "stream": sum(1 for s in self.streams if not s.destroyed),
            "event": sum(1 for e in self.events if not e.destroyed),
            "graph": sum(1 for g in self.graphs if not g.destroyed),
        }

    def copies(self, kind: MemcpyKind) -> list[int]:
        """Byte counts of every ``cudaMemcpyAsync`` of ``kind``, in order."""
        return [
            args[2] for name, args in self.calls if name == "cudaMemcpyAsync" and args[3] == kind
        ]

    @property
    def current_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    def _enter(self, name: str, *args: Any) -> CudaError | None:
        self.calls.append((name, args))
        return self.fail.get(name)

    # ---- devices
    def cudaGetDeviceCount(self) -> tuple[CudaError, int]:
        if err := self._enter("cudaGetDeviceCount"):
            return err, 0
        if not self.driver:
            return CudaError.cudaErrorInsufficientDriver, 0
        if self.device_count == 0:
            return CudaError.cudaErrorNoDevice, 0
        return CudaError.cudaSuccess, self.device_count

    def cudaSetDevice(self, device: object) -> tuple[CudaError]:
        if err := self._enter("cudaSetDevice", device):
            return (err,)
        if not self.driver:
            return (CudaError.cudaErrorInsufficientDriver,)
        if not isinstance(device, int) or not 0 <= device < self.device_count:
            return (CudaError.cudaErrorInvalidDevice,)
        self._local.device = device
        return (CudaError.cudaSuccess,)

    # ---- memory
    def cudaMalloc(self, size: int) -> tuple[CudaError, int]:
        if err := self._enter("cudaMalloc", size):
            return err, 0
        self._check_size(size)
        with self._mutex:
            base = self._next_device
            self._next_device += -(-size // _ALIGN) * _ALIGN + _ALIGN  # a gap: overruns are seen
        self.allocs.append(_Alloc(base, size, np.zeros(size, np.uint8), self.current_device))
        return CudaError.cudaSuccess, base

    def cudaHostAlloc(self, size: int, flags: int) -> tuple[CudaError, int]:
        if err := self._enter("cudaHostAlloc", size, flags):
            return err, 0
        self._check_size(size)
        if flags != self.cudaHostAllocDefault:
            raise ApiMisuse(f"cudaHostAlloc flags {flags!r}: only cudaHostAllocDefault is faked")
        buffer = np.zeros(size, np.uint8)  # real memory: the product views it through ctypes
        self.allocs.append(_Alloc(int(buffer.ctypes.data), size, buffer, -1))
        return CudaError.cudaSuccess, int(buffer.ctypes.data)

    def cudaFree(self, ptr: int) -> tuple[CudaError]:
        if err := self._enter("cudaFree", ptr):
            return (err,)
        self._free(ptr, device=True)
        return (CudaError.cudaSuccess,)

    def cudaFreeHost(self, ptr: int) -> tuple[CudaError]:
        if err := self._enter("cudaFreeHost", ptr):
            return (err,)
        self._free(ptr, device=False)
        return (CudaError.cudaSuccess,)

    @staticmethod
    def _check_size(size: object) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ApiMisuse(f"allocation size {size!r}: an int >= 1")

    def _free(self, ptr: object, *, device: bool) -> None:
        for a in self.allocs:  # freed memory is kept: a view the product forgot cannot crash
            if a.base == ptr and (a.device >= 0) == device:
                if a.freed:
                    raise ApiMisuse(f"double free of {ptr:#x}")
                a.freed = True
                return
        raise ApiMisuse(f"{'cudaFree' if device else 'cudaFreeHost'} of {ptr!r}: not allocated")

    def region(self, ptr: object, count: int, *, device: bool) -> npt.NDArray[np.uint8]:
        """The ``count`` bytes at ``ptr`` (a live allocation of the given kind), as a view."""
        if not isinstance(ptr, int) or isinstance(ptr, bool):
            raise ApiMisuse(f"pointer {ptr!r} is not an int")
        for a in self.allocs:
            if (a.device >= 0) == device and a.base <= ptr < a.base + a.size:
                if a.freed:
                    raise ApiMisuse(f"pointer {ptr:#x} used after free")
                if ptr + count > a.base + a.size:
                    raise ApiMisuse(
                        f"{count} bytes at {ptr:#x} overrun the {a.size}-byte allocation"
                    )
                return a.buffer[ptr - a.base : ptr - a.base + count]
        kind = "device" if device else "pinned host"
        raise ApiMisuse(f"pointer {ptr:#x} is in no {kind} allocation")

    def cudaMemcpyAsync(
        self, dst: int, src: int, count: int, kind: MemcpyKind, stream: Any
    ) -> tuple[CudaError]:
        if err := self._enter("cudaMemcpyAsync", dst, src, count, kind, stream):
            return (err,)
        s = self._stream(stream)
        sides = {
            MemcpyKind.cudaMemcpyHostToDevice: (True, False),
            MemcpyKind.cudaMemcpyDeviceToHost: (False, True),
            MemcpyKind.cudaMemcpyDeviceToDevice: (True, True),
        }
        if kind not in sides:
            raise ApiMisuse(f"copy kind {kind!r}: only HostToDevice, DeviceToHost and "
                            "DeviceToDevice are faked")  # fmt: skip
        to_device, from_device = sides[kind]
        self._check_size(count)
        self.region(dst, count, device=to_device)  # checked now, resolved again when it runs
        self.region(src, count, device=from_device)

        def copy() -> int:
            target = self.region(dst, count, device=to_device)
            target[:] = self.region(src, count, device=from_device)
            return 1000 + count // 20

        s.enqueue("copy", copy)
        return (CudaError.cudaSuccess,)

    # ---- streams and events
    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[CudaError, FakeStream | None]:
        if err := self._enter("cudaStreamCreateWithFlags", flags):
            return err, None
        if flags != self.cudaStreamNonBlocking:
            raise ApiMisuse(f"stream flags {flags!r}: the engine's stream must be non-blocking")
        stream = FakeStream(next(self._handles), self.current_device)
        self.streams.append(stream)
        return CudaError.cudaSuccess, stream

    def _stream(self, stream: Any) -> FakeStream:
        handle = int(stream) if isinstance(stream, (FakeStream, int)) else None
        for s in self.streams:
            if s.handle == handle:
                if s.destroyed:
                    raise ApiMisuse(f"stream {handle:#x} used after cudaStreamDestroy")
                return s
        raise ApiMisuse(f"{stream!r} is not a stream of this runtime")

    def live_stream(self, handle: object) -> FakeStream | None:
        """The live stream whose handle ``handle`` is, if it is exactly an int."""
        if type(handle) is not int:
            return None
        return next((s for s in self.streams if s.handle == handle and not s.destroyed), None)

    def cudaStreamSynchronize(self, stream: Any) -> tuple[CudaError]:
        err = self._enter("cudaStreamSynchronize", stream)
        s = self._stream(stream)
        if s.capture is not None:
            raise ApiMisuse(f"cudaStreamSynchronize of stream {s.handle:#x} while it captures")
        self._drain(s)  # a failing sync still ends the stream's work
        return (err or CudaError.cudaSuccess,)

    # ---- graphs: a capture records the work queued on the stream, a launch queues it again
    def cudaStreamBeginCapture(self, stream: Any, mode: Any) -> tuple[CudaError]:
        if err := self._enter("cudaStreamBeginCapture", stream, mode):
            return (err,)
        s = self._stream(stream)
        if not isinstance(mode, StreamCaptureMode):
            raise ApiMisuse(f"capture mode {mode!r}: a cudaStreamCaptureMode")
        if s.capture is not None:
            raise ApiMisuse(f"stream {s.handle:#x} is already capturing")
        s.capture = []
        return (CudaError.cudaSuccess,)

    def cudaStreamEndCapture(self, stream: Any) -> tuple[CudaError, FakeGraph | None]:
        s = self._stream(stream)
        if s.capture is None:
            raise ApiMisuse(f"cudaStreamEndCapture of stream {s.handle:#x}, which is not capturing")
        ops, s.capture = tuple(s.capture), None
        if err := self._enter("cudaStreamEndCapture", stream):
            return err, None
        graph = FakeGraph(next(self._handles), ops)
        self.graphs.append(graph)
        return CudaError.cudaSuccess, graph

    def _graph(self, graph: Any, *, executable: bool) -> FakeGraph:
        for g in self.graphs:
            if g is graph or (isinstance(graph, int) and g.handle == graph):
                if g.executable != executable:
                    break
                if g.destroyed:
                    raise ApiMisuse(f"graph {g.handle:#x} used after it was destroyed")
                return g
        kind = "cudaGraphExec_t" if executable else "cudaGraph_t"
        raise ApiMisuse(f"{graph!r} is not a {kind} of this runtime")

    def cudaGraphInstantiate(self, graph: Any, flags: int) -> tuple[CudaError, FakeGraph | None]:
        if err := self._enter("cudaGraphInstantiate", graph, flags):
            return err, None
        executable = FakeGraph(
            next(self._handles), self._graph(graph, executable=False).ops, executable=True
        )
        self.graphs.append(executable)
        return CudaError.cudaSuccess, executable

    def cudaGraphLaunch(self, executable: Any, stream: Any) -> tuple[CudaError]:
        if err := self._enter("cudaGraphLaunch", executable, stream):
            return (err,)
        s = self._stream(stream)
        for name, op in self._graph(executable, executable=True).ops:
            s.enqueue(name, op)
        return (CudaError.cudaSuccess,)

    def cudaGraphExecDestroy(self, executable: Any) -> tuple[CudaError]:
        self._enter("cudaGraphExecDestroy", executable)
        self._graph(executable, executable=True).destroyed = True
        return (CudaError.cudaSuccess,)

    def cudaGraphDestroy(self, graph: Any) -> tuple[CudaError]:
        self._enter("cudaGraphDestroy", graph)
        self._graph(graph, executable=False).destroyed = True
        return (CudaError.cudaSuccess,)

    def cudaStreamWaitEvent(self, stream: Any, event: Any, flags: int) -> tuple[CudaError]:
        """Streams here run when synchronised, in the order the test drains them: the wait
        checks its arguments and drains the event's stream first."""
        if err := self._enter("cudaStreamWaitEvent", stream, event, flags):
            return (err,)
        self._stream(stream)
        self._event(event)
        if flags != 0:
            raise ApiMisuse(f"cudaStreamWaitEvent flags {flags!r}")
        return (CudaError.cudaSuccess,)

    def cudaEventSynchronize(self, event: Any) -> tuple[CudaError]:
        if err := self._enter("cudaEventSynchronize", event):
            return (err,)
        e = self._event(event)
        for s in self.streams:  # the stream that will record it runs its work
            if e.pending and not s.destroyed and s.capture is None:
                self._drain(s)
        return (CudaError.cudaSuccess,)

    def _drain(self, s: FakeStream) -> None:
        while s.ops:
            _, op = s.ops.pop(0)
            s.clock_ns += op()

    def cudaStreamDestroy(self, stream: Any) -> tuple[CudaError]:
        if err := self._enter("cudaStreamDestroy", stream):
            return (err,)
        s = self._stream(stream)
        self._drain(s)  # as CUDA does: queued work completes, then the stream goes
        s.destroyed = True
        return (CudaError.cudaSuccess,)

    def cudaEventCreate(self) -> tuple[CudaError, FakeEvent | None]:
        if err := self._enter("cudaEventCreate"):
            return err, None
        event = FakeEvent(next(self._handles))
        self.events.append(event)
        return CudaError.cudaSuccess, event

    def _event(self, event: Any) -> FakeEvent:
        if not isinstance(event, FakeEvent) or event not in self.events:
            raise ApiMisuse(f"{event!r} is not an event of this runtime")
        if event.destroyed:
            raise ApiMisuse(f"event {event.handle:#x} used after cudaEventDestroy")
        return event

    def cudaEventRecord(self, event: Any, stream: Any) -> tuple[CudaError]:
        if err := self._enter("cudaEventRecord", event, stream):
            return (err,)
        e, s = self._event(event), self._stream(stream)
        e.pending = True

        def record() -> int:
            e.time_ns, e.pending = s.clock_ns, False
            return 0

        s.enqueue("record", record)
        return (CudaError.cudaSuccess,)

    def cudaEventElapsedTime(self, start: Any, end: Any) -> tuple[CudaError, float]:
        if err := self._enter("cudaEventElapsedTime", start, end):
            return err, 0.0
        a, b = self._event(start), self._event(end)
        if a.time_ns is None or b.time_ns is None:
            return CudaError.cudaErrorInvalidResourceHandle, 0.0
        if a.pending or b.pending:
            return CudaError.cudaErrorNotReady, 0.0
        return CudaError.cudaSuccess, (b.time_ns - a.time_ns) / 1e6

    def cudaEventDestroy(self, event: Any) -> tuple[CudaError]:
        if err := self._enter("cudaEventDestroy", event):
            return (err,)
        self._event(event).destroyed = True
        return (CudaError.cudaSuccess,)


class FakeLayouts:
    """``dlad.gpu.layout.LayoutKernels`` on :class:`FakeCudart`: each step is queued on the
    stream (or recorded into its capture) as a kernel would be, and computes the kernels'
    numpy specification when it runs (``hwc4_to_nchw``; ``pack_chw16`` of the heads as fp16).
    ``launches`` counts them by name; ``fail`` (a ``dlad.gpu.driver.CudaError``) is raised by
    every launch, as a failing ``cuLaunchKernel`` would."""

    def __init__(self, cuda: FakeCudart, device_index: int = 0) -> None:
        self.cuda = cuda
        self.device_index = device_index
        self.launches: list[str] = []
        self.fail: Exception | None = None

    def _queue(self, name: str, stream: object, run: Callable[[], None]) -> None:
        if self.fail is not None:
            raise self.fail
        s = self.cuda.live_stream(stream)
        if s is None:
            raise ApiMisuse(f"{name} on {stream!r}: not the int handle of a live stream")
        self.launches.append(name)

        def op() -> int:
            run()
            return 2_000

        s.enqueue(name, op)

    def to_nchw(  # the LayoutKernels signature
        self, stream: int, src: int, dst: int, *, n: int, c: int, h: int, w: int,
        pitch_px: int, scale: float, half: bool,
    ) -> None:  # fmt: skip
        dtype = np.float16 if half else np.float32
        size_in, size_out = n * h * pitch_px * 4, n * c * h * w * np.dtype(dtype).itemsize
        self.cuda.region(src, size_in, device=True)
        self.cuda.region(dst, size_out, device=True)

        def run() -> None:
            frames = self.cuda.region(src, size_in, device=True).view(np.int8)
            out = hwc4_to_nchw(frames.reshape(n, h, pitch_px, 4), c, w, scale, dtype)
            self.cuda.region(dst, size_out, device=True)[:] = out.view(np.uint8).ravel()

        self._queue("to_nchw", stream, run)

    def to_chw16(
        self, stream: int, src: int, dst: int, *, n: int, c: int, h: int, w: int, half: bool
    ) -> None:
        dtype = np.float16 if half else np.float32
        size_in, size_out = n * c * h * w * np.dtype(dtype).itemsize, n * -(-c // 16) * h * w * 32
        self.cuda.region(src, size_in, device=True)
        self.cuda.region(dst, size_out, device=True)

        def run() -> None:
            heads = self.cuda.region(src, size_in, device=True).view(dtype).reshape(n, c, h, w)
            out = np.stack([pack_chw16(x) for x in heads])
            self.cuda.region(dst, size_out, device=True)[:] = out.view(np.uint8).ravel()

        self._queue("to_chw16", stream, run)


# ------------------------------------------------------------------------------ tensorrt


class Dims(tuple[int, ...]):
    """``trt.Dims``: a sequence of ints."""

    __slots__ = ()


def engine_description(
    inputs: Sequence[Mapping[str, Any]], outputs: Sequence[Mapping[str, Any]], *, version: str
) -> dict[str, Any]:
    """A fake engine: ``inputs`` ``{"name", "shape", "dtype", "format", "profile": [min, opt,
    max]}``, ``outputs`` ``{"name", "shape", "dtype", "format", "gain", "offset"}`` (dtype and
    format as member names), built with TensorRT ``version``."""
    return {"tensorrt_version": version, "inputs": list(inputs), "outputs": list(outputs)}


def serialise(desc: Mapping[str, Any]) -> bytes:
    """The bytes of a fake engine file."""
    return ENGINE_MAGIC + json.dumps(desc).encode()


class FakeILogger:
    """``trt.ILogger``: subclass it, call ``ILogger.__init__`` and implement ``log``."""

    Severity = Severity

    def __init__(self) -> None:
        self._initialised = True

    def log(self, severity: Any, msg: str) -> None:
        raise NotImplementedError


class FakeLogger(FakeILogger):
    """``trt.Logger(min_severity)``: keeps what is at least that severe in ``messages``."""

    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = tuple(Severity)

    def __init__(self, min_severity: Severity = Severity.WARNING) -> None:
        super().__init__()
        self.min_severity = min_severity
        self.messages: list[tuple[int, str]] = []

    def log(self, severity: Any, msg: str) -> None:
        if int(severity) <= int(self.min_severity):
            self.messages.append((int(severity), msg))


class FakeEngine:
    """``trt.ICudaEngine`` of a fake engine description."""

    def __init__(self, trt: FakeTensorRT, desc: Mapping[str, Any], device: int) -> None:
        self._trt = trt
        self.device = device
        self.inputs = {t["name"]: t for t in desc["inputs"]}
        self.outputs = {t["name"]: t for t in desc["outputs"]}
        self._names = [*self.inputs, *self.outputs]
        self.num_optimization_profiles = 1
        self.contexts: list[FakeContext] = []

    @property
    def num_io_tensors(self) -> int:
        return len(self._names)

    def get_tensor_name(self, index: int) -> str:
        if not 0 <= index < len(self._names):
            raise ApiMisuse(f"get_tensor_name({index}): {len(self._names)} I/O tensors")
        return self._names[index]

    def _desc(self, name: str) -> Mapping[str, Any]:
        if name in self.inputs:
            return self.inputs[name]
        if name in self.outputs:
            return self.outputs[name]
        raise ApiMisuse(f"no I/O tensor named {name!r} (the engine has {self._names})")

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        self._desc(name)
        return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT

    def get_tensor_shape(self, name: str) -> Dims:
        return Dims(self._desc(name)["shape"])

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[self._desc(name)["dtype"]]

    def get_tensor_format(self, name: str) -> TensorFormat:
        return TensorFormat[self._desc(name)["format"]]

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        if name not in self.inputs:
            raise ApiMisuse(f"get_tensor_profile_shape({name!r}): not an input")
        if profile_index != 0:
            raise ApiMisuse(f"profile {profile_index}: the engine has one profile")
        return [Dims(s) for s in self.inputs[name]["profile"]]

    def create_execution_context(self) -> FakeContext:
        context = FakeContext(self)
        self.contexts.append(context)
        return context


class FakeContext:
    """``trt.IExecutionContext``; see the module docstring for what it refuses."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.addresses: dict[str, int] = {}
        self.address_sets: dict[str, int] = {}
        self.input_shapes: dict[str, tuple[int, ...]] = {}
        self.executions: list[int] = []  # batch sizes, in enqueue order

    def set_input_shape(self, name: str, shape: Sequence[int]) -> bool:
        desc = self.engine.inputs.get(name)
        if desc is None:
            raise ApiMisuse(f"set_input_shape({name!r}): not an input of the engine")
        dims = tuple(int(d) for d in shape)
        low, _, high = desc["profile"]
        if len(dims) != len(low) or not all(
            lo <= d <= hi for lo, d, hi in zip(low, dims, high, strict=True)
        ):
            raise ApiMisuse(f"set_input_shape({name!r}, {dims}): outside the profile {low}..{high}")
        self.input_shapes[name] = dims
        return True

    def set_tensor_address(self, name: str, ptr: object) -> bool:
        self.engine._desc(name)
        if not isinstance(ptr, int) or isinstance(ptr, bool):
            raise ApiMisuse(f"set_tensor_address({name!r}, {ptr!r}): the address is an int")
        self.addresses[name] = ptr
        self.address_sets[name] = self.address_sets.get(name, 0) + 1
        return True

    def get_tensor_shape(self, name: str) -> Dims:
        shape = tuple(self.engine._desc(name)["shape"])
        batch = next(iter(self.input_shapes.values()), (-1,))[0]
        return Dims((batch, *shape[1:]) if shape[0] == -1 else shape)

    def execute_async_v3(self, stream_handle: object) -> bool:
        trt, engine = self.engine._trt, self.engine
        if missing := [n for n in engine.inputs if n not in self.input_shapes]:
            raise ApiMisuse(f"execute_async_v3 before set_input_shape of {missing}")
        if missing := [n for n in engine._names if n not in self.addresses]:
            raise ApiMisuse(f"execute_async_v3 with no address set for {missing}")
        if type(stream_handle) is not int:
            raise ApiMisuse(f"execute_async_v3({stream_handle!r}): the stream's int handle")
        if _current_device(trt.cuda) != engine.device:
            raise ApiMisuse(
                f"execute_async_v3 on device {_current_device(trt.cuda)}; the engine was"
                f" deserialised on device {engine.device}"
            )
        (in_name,) = engine.inputs
        x_shape = self.input_shapes[in_name]
        in_type = _NP_TYPES[DataType[engine.inputs[in_name]["dtype"]]]
        in_bytes = int(np.prod(x_shape)) * np.dtype(in_type).itemsize
        outs = []
        for name, desc in engine.outputs.items():
            shape = (x_shape[0], *desc["shape"][1:])
            out_type = _NP_TYPES[DataType[desc["dtype"]]]
            nbytes = int(np.prod(shape)) * np.dtype(out_type).itemsize
            outs.append(_Out(self.addresses[name], shape, out_type, nbytes, desc))
        source = _In(self.addresses[in_name], x_shape, in_type, in_bytes)
        if isinstance(trt.cuda, FakeCudart):
            return self._enqueue_fake(trt.cuda, stream_handle, source, outs)
        return self._run_on_real_cuda(trt.cuda, stream_handle, source, outs)

    def _enqueue_fake(self, cuda: FakeCudart, handle: int, source: _In, outs: list[_Out]) -> bool:
        trt = self.engine._trt
        stream = cuda.live_stream(handle)
        if stream is None:
            raise ApiMisuse(f"execute_async_v3({handle!r}): not the handle of a live stream")
        if stream.device != self.engine.device:
            raise ApiMisuse(f"execute_async_v3 on a stream of device {stream.device}")
        cuda.region(source.ptr, source.nbytes, device=True)  # checked now and when it runs
        for out in outs:
            cuda.region(out.ptr, out.nbytes, device=True)
        if trt.execute_fails:
            trt.last_logger.log(Severity.ERROR, "fake execution failure")
            return False
        self.executions.append(source.shape[0])

        def run() -> int:
            raw = cuda.region(source.ptr, source.nbytes, device=True)
            x = raw.view(source.dtype).reshape(source.shape).astype(np.float32)
            for out in outs:
                heads = fake_heads(x, out.shape[1:], out.desc["gain"], out.desc["offset"])
                cuda.region(out.ptr, out.nbytes, device=True)[:] = (
                    heads.astype(out.dtype).view(np.uint8).ravel()
                )
            return trt.exec_base_ns + trt.exec_per_frame_ns * source.shape[0]

        stream.enqueue("execute", run)
        return True

    def _run_on_real_cuda(self, cudart: Any, handle: int, source: _In, outs: list[_Out]) -> bool:
        """The same computation on a real CUDA runtime (the GPU host's tests): one kernel per
        head on the stream (:data:`_FAKE_HEAD_SOURCE`), so it runs in stream order and can be
        captured into a graph as a real engine's kernels are."""
        kernel = _fake_head_kernel(cudart)
        b, _, xh, xw = source.shape
        for out in outs:
            _, c, h, w = out.shape
            params = _FakeHeadParams(
                source.ptr, out.ptr, b, xh, xw, c, h, w, int(source.dtype is np.float16),
                int(out.dtype is np.float16), out.desc["gain"], out.desc["offset"],
            )  # fmt: skip
            argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
            drv = _cuda_driver()
            total = b * c * h * w
            _real(drv.cuLaunchKernel(kernel, -(-total // 256), 1, 1, 256, 1, 1, 0,
                                     drv.CUstream(handle), ctypes.addressof(argv), 0))  # fmt: skip
        self.executions.append(source.shape[0])
        return True


_FAKE_HEAD_SOURCE = r"""
struct FakeHeadParams {
    const void* x; void* out;
    int b, xh, xw, c, h, w, in_half, out_half;
    float gain, offset;
};
__device__ float load(const void* p, long long i, int half) {
    if (!half) return reinterpret_cast<const float*>(p)[i];
    unsigned short h = reinterpret_cast<const unsigned short*>(p)[i];
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// fake_heads: channel c of a head is gain * avgpool(x[:, c % 3]) + offset * c.
extern "C" __global__ void fake_head(const FakeHeadParams p) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)p.b * p.c * p.h * p.w) return;
    int x = t % p.w, y = (t / p.w) % p.h, c = (t / ((long long)p.w * p.h)) % p.c;
    int b = t / ((long long)p.w * p.h * p.c);
    int sh = p.xh / p.h, sw = p.xw / p.w;
    float sum = 0.0f;
    for (int dy = 0; dy < sh; ++dy)
        for (int dx = 0; dx < sw; ++dx)
            sum += load(p.x, (((long long)b * 3 + c % 3) * p.xh + y * sh + dy) * p.xw + x * sw + dx,
                        p.in_half);
    float v = p.gain * (sum / (float)(sh * sw)) + p.offset * (float)c;
    if (p.out_half) {
        unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        reinterpret_cast<unsigned short*>(p.out)[t] = h;
    } else {
        reinterpret_cast<float*>(p.out)[t] = v;
    }
}
"""


class _FakeHeadParams(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("b", ctypes.c_int),
        ("xh", ctypes.c_int), ("xw", ctypes.c_int), ("c", ctypes.c_int), ("h", ctypes.c_int),
        ("w", ctypes.c_int), ("in_half", ctypes.c_int), ("out_half", ctypes.c_int),
        ("gain", ctypes.c_float), ("offset", ctypes.c_float),
    ]  # fmt: skip


_KERNELS: dict[int, Any] = {}  # device -> the loaded fake_head function


def _cuda_driver() -> Any:
    from cuda.bindings import driver

    return driver


def _fake_head_kernel(cudart: Any) -> Any:
    """``fake_head`` compiled (NVRTC, through dlad's compiler and cache) and loaded into the
    current device's primary context, once per device."""
    from dlad.gpu.driver import compile_cubin

    device = int(_real(cudart.cudaGetDevice()))
    if device not in _KERNELS:
        drv = _cuda_driver()
        _real(cudart.cudaFree(0))  # the runtime's context is current on this thread
        props = _real(cudart.cudaGetDeviceProperties(device))
        cubin, _ = compile_cubin(_FAKE_HEAD_SOURCE, (int(props.major), int(props.minor)))
        module = _real(drv.cuModuleLoadData(cubin))
        _KERNELS[device] = _real(drv.cuModuleGetFunction(module, b"fake_head"))
    return _KERNELS[device]


@dataclass(frozen=True)
class _In:
    ptr: int
    shape: tuple[int, ...]
    dtype: type[np.generic]
    nbytes: int


@dataclass(frozen=True)
class _Out:
    ptr: int
    shape: tuple[int, ...]
    dtype: type[np.generic]
    nbytes: int
    desc: Mapping[str, Any]


def _current_device(cuda: Any) -> int:
    if isinstance(cuda, FakeCudart):
        return cuda.current_device
    return int(_real(cuda.cudaGetDevice()))


def _real(result: Any) -> Any:
    """Unpack a real cuda-python result; a failure is the test harness's, not the product's."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed in the stand-in: {err}")
    return values[0] if values else None


def fake_heads(
    x: npt.NDArray[np.float32], chw: Sequence[int], gain: float, offset: float
) -> npt.NDArray[np.float32]:
    """The fake engine's head for an input batch ``x`` ``[B, 3, H, W]``: channel ``c`` is
    ``gain * avgpool(x[:, c % 3]) + offset * c`` with the pool the head's stride."""
    c, h, w = chw
    b, _, xh, xw = x.shape
    sh, sw = xh // h, xw // w
    picked = x[:, np.arange(c) % 3]
    pooled = picked.reshape(b, c, h, sh, w, sw).mean(axis=(3, 5), dtype=np.float32)
    result: npt.NDArray[np.float32] = (
        np.float32(gain) * pooled
        + np.float32(offset) * np.arange(c, dtype=np.float32)[:, None, None]
    )
    return result


class FakeRuntime:
    """``trt.Runtime(logger)``."""

    def __init__(self, trt: FakeTensorRT, logger: Any) -> None:
        if not isinstance(logger, FakeILogger) or not getattr(logger, "_initialised", False):
            raise TypeError("Runtime needs a tensorrt.ILogger whose __init__ ran")
        self._trt = trt
        self.logger = logger
        trt.last_logger = logger

    def deserialize_cuda_engine(self, blob: bytes) -> FakeEngine | None:
        trt = self._trt
        trt.deserialised.append(bytes(blob))
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"deserialize_cuda_engine takes a buffer, not {type(blob).__name__}")
        data = bytes(blob)
        if not data.startswith(ENGINE_MAGIC):
            self.logger.log(Severity.ERROR, "1: [runtime.cpp::parsePlan] Magic tag does not match")
            return None
        desc = json.loads(data[len(ENGINE_MAGIC) :])
        if desc["tensorrt_version"] != trt.__version__:
            text = (
                "1: [stdArchiveReader.cpp] The engine plan file is not compatible with this "
                f"version of TensorRT, expecting library version {trt.__version__} got "
                f"{desc['tensorrt_version']}, please rebuild."
            )
            self.logger.log(Severity.ERROR, text)
            return None
        engine = FakeEngine(trt, desc, _current_device(trt.cuda))
        trt.engines.append(engine)
        return engine


class FakeTensorRT:
    """Module-like stand-in for ``tensorrt``'s runtime (see the module docstring).

    ``cuda`` is the :class:`FakeCudart` whose memory and streams the engines use, or a real
    ``cuda.bindings.runtime`` (on a CUDA host: the engines then compute through real device
    memory, see ``FakeContext._run_on_real_cuda``); ``execute_fails`` makes
    ``execute_async_v3`` log an error and return False.
    """

    DataType = DataType
    TensorIOMode = TensorIOMode
    TensorFormat = TensorFormat
    ILogger = FakeILogger
    Logger = FakeLogger

    def __init__(
        self,
        cuda: Any,
        version: str = "10.3.0.30",
        *,
        exec_base_ns: int = 300_000,
        exec_per_frame_ns: int = 100_000,
    ) -> None:
        self.__version__ = version
        self.cuda = cuda
        self.exec_base_ns = exec_base_ns
        self.exec_per_frame_ns = exec_per_frame_ns
        self.execute_fails = False
        self.deserialised: list[bytes] = []
        self.engines: list[FakeEngine] = []
        self.last_logger: Any = None

    def Runtime(self, logger: Any) -> FakeRuntime:
        return FakeRuntime(self, logger)


@dataclass
class Fakes:
    trt: FakeTensorRT
    cuda: FakeCudart


def install(monkeypatch: pytest.MonkeyPatch, fakes: Fakes, *, layout: str = "bindings") -> Fakes:
    """Make ``import tensorrt`` and the CUDA runtime imports return the fakes: ``layout``
    ``"bindings"`` (``from cuda.bindings import runtime``, cuda-python >= 12.6) or ``"legacy"``
    (only ``from cuda import cudart`` works)."""
    monkeypatch.setitem(sys.modules, "tensorrt", fakes.trt)
    cuda_pkg = types.ModuleType("cuda")
    if layout == "bindings":
        bindings = types.ModuleType("cuda.bindings")
        bindings.runtime = fakes.cuda  # type: ignore[attr-defined]
        cuda_pkg.bindings = bindings  # type: ignore[attr-defined]
        modules: dict[str, Any] = {"cuda.bindings": bindings, "cuda.bindings.runtime": fakes.cuda}
    elif layout == "legacy":
        cuda_pkg.cudart = fakes.cuda  # type: ignore[attr-defined]
        modules = {"cuda.bindings": None, "cuda.cudart": fakes.cuda}
    else:
        raise ValueError(f"layout {layout!r}")
    modules["cuda"] = cuda_pkg
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return fakes
