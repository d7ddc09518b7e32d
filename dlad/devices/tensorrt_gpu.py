"""The TensorRT GPU engine: a model's TensorRT engine (``prep build --target gpu``) run on the
Jetson's GPU in dynamic batches, through TensorRT's runtime and the CUDA runtime of cuda-python.

A product backend beside the emulated Orin GPU (``dlad/devices/emulated_gpu.py``) and the torch
GPU engine (``dlad/devices/torch_gpu.py``): where those take the published curve's time or run a
``torch.export`` program, this one runs the INT8/FP16 engine TensorRT built from the same
translated ONNX as the DLA loadables. It implements the GPU executor's ``GpuEngine`` protocol
(``dlad/executors/gpu.py``): ``max_batch``, ``curve_us`` and ``run(frames)``.

**The engine** (``<name>.gpu.engine``, ``docs/build.md``) has one input, the loadable's input
name (``images``), FP16 (or FP32) linear NCHW ``[B, 3, H, W]`` with ``B`` dynamic in one
optimisation profile ``1..N``, and one FP16 (or FP32) linear ``[B, C, H, W]`` output per raw head
conv, named as the loadable's outputs. The constructor checks all of this against the loadable
and raises :class:`TensorRtGpuError` naming every difference.

**Its metadata** (optional) is the JSON sidecar :func:`engine_metadata_path` names
(``<engine>.json``), written by ``prep build --target gpu`` (``prep/build_trt.py``). Keys (format
version 1): ``format`` (:data:`METADATA_FORMAT`), ``version`` (1), ``engine`` (file name),
``engine_sha256``, ``engine_bytes``, ``tensorrt_version``, ``max_batch``, ``inputs`` and
``outputs`` (``[{"name", "shape", "dtype", "format"}, ...]``, the input with its ``profile``
``{"min", "opt", "max"}``), ``precision`` (builder flags, INT8 mode, FP16 layers), ``onnx``
(``{"name", "sha256"}``), ``created``. Where it exists, it must describe this engine file (its
sha256), and its TensorRT version goes into the error when the engine does not deserialise
(engines are bound to the TensorRT release and the GPU that built them).

**A batch**: its frames are ``DLA_HWC4`` int8 arrays ``(H, W', 4)`` as
``dlad.imaging.pre.quantize_hwc4`` makes them. On the host, into pinned memory, each frame is
dequantised, ``q[..., :W, :3] * input_scale``, and laid out NCHW in the engine's input type;
then on the engine's own non-blocking stream: host to device (the batch's rows only),
``set_input_shape`` + ``execute_async_v3``, device to host of the batch's rows of every output,
synchronise. CUDA events time it: ``compute_us`` is the execution alone, ``actual_us`` the
stream's whole span, copies included (what the GPU is occupied for per batch, which the scheduler
must learn); ``curve_us[b]`` is the median of ``replays`` such spans per batch size, measured at
warm-up (after one untimed run per size). ``start_ns``/``end_ns`` are ``time.monotonic_ns``
around the whole call. Batches run one at a time (a lock); every call makes the device current on
its own thread first (the CUDA runtime's current device is per thread).

**Device-side I/O** (where pre/post-processing runs on CUDA: the engine is built with the
GPU service's layout kernels, ``dlad/gpu/layout.py``). The engine then also holds static int8
``DLA_HWC4`` frames and fp16 ``CHW16`` heads, the layouts dlad's pre and post kernels speak,
and one CUDA graph per batch size, captured on its stream at start (after warm-up has enqueued
every shape once, as TensorRT asks before a capture): the layout kernel from the frames into
the engine's linear input, ``execute_async_v3``, and a layout kernel from each linear head into
``CHW16``. Those graphs are what the native plane launches between its own pre and post kernels
(``graph_execs``, the torch engine's contract: ``dlad/executors/gpu.py``'s
``DeviceIoEngine``), so a frame never comes back to the host between decoding and detections.

**What was not run.** TensorRT cannot be installed on the project's machines, and the GPU host
(an H200) has no TensorRT either: this module has never run against a real TensorRT or a real
engine, nor on a Jetson. Its TensorRT calls are tested only against a strict stand-in
(``tests/dlad/fake_trt_runtime.py``) whose engine computes a known function of its input, so
that strides, rows, dequantisation and output order are checked end to end; the stand-in
captures and launches graphs and runs the layout kernels' numpy specification, which the real
kernels are held to bit for bit on a GPU (``tests/dlad/gpu/test_layout.py``). Its CUDA side is
tested against that file's stand-in of the CUDA runtime and, on the H200, against cuda-python's
real runtime (cuda-bindings 13.3): the stream, events, device and pinned buffers, copies and
timing are real there, with only the engine standing in.

``tensorrt`` and cuda-python are imported when an engine is constructed, never at module import:
the daemon's default install has neither. Errors: :class:`TensorRtGpuError` (a ValueError) for
everything that makes an engine unusable (no TensorRT, no cuda-python, no CUDA device, a missing
or unreadable engine, one TensorRT cannot deserialise, one whose I/O or profile does not fit the
loadable, a failure while setting up or warming up); :class:`TensorRtRunError` (a RuntimeError)
when a CUDA or TensorRT call fails on a batch; ValueError for a bad argument or batch.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dlad.devices.emulated_gpu import GpuBatchTiming
from dlad.devices.gpu_frames import DeviceIoSizes, check_batch, frame_shape
from dlad.gpu.driver import CudaError
from dlad.gpu.layout import LayoutKernels, hwc4_to_nchw
from dlad.loadable import Loadable

__all__ = [
    "METADATA_FORMAT",
    "METADATA_VERSION",
    "TensorRtGpu",
    "TensorRtGpuError",
    "TensorRtRunError",
    "engine_metadata_path",
    "frame_shape",
    "read_engine_metadata",
]

METADATA_FORMAT: Final = "dlad-tensorrt-gpu"
METADATA_VERSION: Final = 1
_MAX_LOG_MESSAGES = 200


class TensorRtGpuError(ValueError):
    """The TensorRT GPU engine cannot be used: no TensorRT, cuda-python or CUDA device; a
    missing, unreadable or undeserialisable engine; one built for another model; or a failure
    while allocating or warming up. The message names the file and what to do."""


class TensorRtRunError(RuntimeError):
    """A CUDA or TensorRT call failed while a batch ran (the message names the call and the
    error). The engine may be unusable afterwards; close it.

    Attributes:
        call: the function, e.g. ``cudaMemcpyAsync``.
        code: the ``cudaError_t`` value, or -1 for a TensorRT call (which returns only a bool).
    """

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call = call
        self.code = code
        super().__init__(f"{call} failed ({code}){': ' + detail if detail else ''}")


def engine_metadata_path(engine_path: str | os.PathLike[str]) -> Path:
    """The JSON sidecar of an engine file: its name with ``.json`` appended
    (``model.gpu.engine`` -> ``model.gpu.engine.json``)."""
    path = Path(engine_path)
    return path.with_name(path.name + ".json")


def read_engine_metadata(engine_path: str | os.PathLike[str], blob: bytes) -> dict[str, Any] | None:
    """The sidecar of the engine at ``engine_path`` whose bytes are ``blob``, or None where there
    is none. Raises TensorRtGpuError for a sidecar that is unreadable, not a version-1 document
    of this format, or that describes another engine file (its ``engine_sha256``)."""
    path = engine_metadata_path(engine_path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise TensorRtGpuError(f"{path}: cannot read the engine's metadata: {exc}") from exc
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TensorRtGpuError(f"{path}: the engine's metadata is not JSON: {exc}") from exc
    if not isinstance(meta, dict) or (meta.get("format"), meta.get("version")) != (
        METADATA_FORMAT,
        METADATA_VERSION,
    ):
        raise TensorRtGpuError(
            f"{path}: not a {METADATA_FORMAT} version {METADATA_VERSION} document; remove it or "
            "rebuild the engine with prep build --target gpu"
        )
    digest = hashlib.sha256(blob).hexdigest()
    if meta.get("engine_sha256") != digest:
        raise TensorRtGpuError(
            f"{path} describes another engine (engine_sha256 {meta.get('engine_sha256')!r:.70}, "
            f"the file's is {digest!r}); it is stale: rebuild with prep build --target gpu, or "
            "remove it"
        )
    return meta


# ------------------------------------------------------------------------------ lazy imports


def _import_tensorrt() -> Any:
    try:
        import tensorrt  # noqa: PLC0415 (lazy: the daemon's default install has no TensorRT)
    except (ImportError, OSError) as exc:  # OSError: the bindings load but a libnvinfer does not
        raise TensorRtGpuError(
            f"the TensorRT GPU engine needs TensorRT's Python bindings, which cannot be imported "
            f"here ({exc}); on a Jetson they come with JetPack (python3-libnvinfer)"
        ) from exc
    return tensorrt


def _import_cudart() -> Any:
    try:
        from cuda.bindings import runtime  # noqa: PLC0415 (cuda-python >= 12.6)
    except ImportError:
        try:
            from cuda import cudart  # noqa: PLC0415 (older cuda-python)
        except ImportError as exc:
            raise TensorRtGpuError(
                f"the TensorRT GPU engine needs cuda-python's CUDA runtime bindings, which "
                f"cannot be imported here ({exc}); pip install cuda-python"
            ) from exc
        return cudart
    return runtime


def _error_name(value: Any) -> str:
    """An enum member's name (``cudaErrorNoDevice``, ``INT8``), else its text."""
    return str(getattr(value, "name", value))


def _check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple ``(err, *values)``; raise TensorRtRunError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != 0:
        raise TensorRtRunError(call, code, _error_name(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def capturing_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` keeping TensorRT's warnings and errors in ``.messages`` (``(severity,
    text)``, the newest few hundred) for error messages and reports (prep's builder uses it
    too)."""

    class CapturingLogger(trt.ILogger):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[tuple[int, str]] = []

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                if len(self.messages) >= _MAX_LOG_MESSAGES:
                    del self.messages[0]
                self.messages.append((int(severity), str(msg)))

    return CapturingLogger()


# ------------------------------------------------------------------------------ the engine


@dataclass(frozen=True)
class _Tensor:
    """One engine I/O tensor as the engine describes it (``np_dtype`` None: not FLOAT/HALF)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    np_dtype: np.dtype[Any] | None
    fmt: Any


@dataclass(frozen=True)
class _Head:
    """One output: its device buffer and its pinned host view ``[max_batch, C, H, W]``."""

    name: str
    row_bytes: int
    device: int
    host_ptr: int
    host: npt.NDArray[Any]


@dataclass
class _DeviceIo:
    """The device-side I/O (module docstring): the static int8 ``DLA_HWC4`` frames, the fp16
    ``CHW16`` heads, and per batch size the captured graph and its executable."""

    layouts: LayoutKernels
    frames: int
    heads: tuple[int, ...]
    graphs: dict[int, tuple[Any, Any]]  # batch size -> (cudaGraph_t, cudaGraphExec_t)
    input_free: Any  # a cudaEvent_t recorded after every run_device's launch
    input_read: bool = False  # input_free was recorded at least once
    batch_events: set[Any] = field(default_factory=set)  # run_device's, until read


@dataclass(frozen=True)
class _Buffers:
    """What a batch runs on: the input's pinned view ``[max_batch, 3, H, W]`` and device buffer,
    and the heads in ``loadable.outputs`` order."""

    input_name: str
    in_row_bytes: int
    in_device: int
    in_host_ptr: int
    in_host: npt.NDArray[Any]
    heads: tuple[_Head, ...]


class TensorRtGpu(DeviceIoSizes):
    """One TensorRT GPU engine for one model (see the module docstring).

    Args:
        loadable: the model's emulated loadable (input geometry and scale, output descriptors).
        engine_path: the serialised engine ``prep build --target gpu`` wrote for that model.
        max_batch: the largest batch :meth:`run` takes (>= 1, at most the engine profile's).
        device_index: the CUDA device (on a Jetson, 0: the integrated GPU).
        replays: timed runs per batch size at warm-up; ``curve_us`` holds their median.

    Raises ValueError for a bad argument, TensorRtGpuError for an engine that cannot be used
    (module docstring). :meth:`run` is thread-safe: batches run one at a time.
    """

    def __init__(
        self,
        loadable: Loadable,
        engine_path: str | os.PathLike[str],
        *,
        max_batch: int = 8,
        device_index: int = 0,
        replays: int = 5,
        layouts: LayoutKernels | None = None,
    ) -> None:
        for key, value, low in (
            ("max_batch", max_batch, 1), ("device_index", device_index, 0),
            ("replays", replays, 1),
        ):  # fmt: skip
            raw: object = value  # checked as untyped: callers need not be type-checked
            if not isinstance(raw, int) or isinstance(raw, bool) or value < low:
                raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
        if layouts is not None and layouts.device_index != device_index:
            raise ValueError(
                f"the layout kernels are on CUDA device {layouts.device_index}, the engine on "
                f"{device_index}"
            )
        self.loadable = loadable
        self.engine_path = Path(engine_path)
        self.device = f"cuda:{device_index}"
        self.max_batch = max_batch
        self.device_index = device_index
        self.replays = replays
        self.curve_us: dict[int, float] = {}
        self._frame_shape = frame_shape(loadable)
        self._lock = threading.Lock()
        self._closed = False
        # Everything allocated, so that close() (or a failed constructor) frees exactly that.
        self._device_ptrs: list[int] = []
        self._host_ptrs: list[int] = []
        self._events: list[Any] = []
        self._stream: Any = None
        self._context: Any = None
        self._engine: Any = None
        self._runtime: Any = None
        self._bufs: _Buffers | None = None
        self._io: _DeviceIo | None = None
        self._layouts = layouts

        blob = self._read_engine()
        self.metadata: dict[str, Any] | None = read_engine_metadata(self.engine_path, blob)
        trt = _import_tensorrt()
        self._cudart: Any = _import_cudart()
        self._trt: Any = trt
        self.tensorrt_version = str(getattr(trt, "__version__", "unknown"))
        self._logger: Any = capturing_logger(trt)
        self._open_device()
        try:
            self._deserialise(blob)
            inp = self._check_engine()
            self._bufs = self._allocate(inp)
            self.warm_up()
            if layouts is not None:
                self._io = self._device_io(self._bufs, layouts)
        except TensorRtRunError as exc:
            self._release(raise_failure=False)
            raise TensorRtGpuError(
                f"{self.engine_path}: cannot set the engine up on CUDA device {device_index}: "
                f"{exc}{self._trt_errors()}"
            ) from exc
        except BaseException:
            self._release(raise_failure=False)
            raise

    # ------------------------------------------------------------------------------ setup

    def _read_engine(self) -> bytes:
        path = self.engine_path
        if not path.is_file():
            raise TensorRtGpuError(
                f"{path}: no such engine file (build one on the device: prep build --target gpu)"
            )
        try:
            return path.read_bytes()
        except OSError as exc:
            raise TensorRtGpuError(f"{path}: cannot read the engine: {exc}") from exc

    def _open_device(self) -> None:
        cudart, index = self._cudart, self.device_index
        err, count = cudart.cudaGetDeviceCount()
        if int(err) != 0:
            raise TensorRtGpuError(
                f"no CUDA device: cudaGetDeviceCount answers {_error_name(err)} (no driver, or "
                "no GPU); the TensorRT GPU engine needs one"
            )
        if int(count) <= index:
            raise TensorRtGpuError(
                f"no CUDA device {index}: the CUDA runtime sees {int(count)} device(s)"
            )
        try:
            _check(cudart.cudaSetDevice(index), "cudaSetDevice")
        except TensorRtRunError as exc:
            raise TensorRtGpuError(f"cannot use CUDA device {index}: {exc}") from exc

    def _trt_errors(self) -> str:
        """``"; TensorRT said: ..."`` with its last errors, or ``""``."""
        error = int(self._trt.ILogger.Severity.ERROR)
        errors = [m for sev, m in self._logger.messages if sev <= error]
        return "; TensorRT said: " + " | ".join(errors[-5:]) if errors else ""

    def _deserialise(self, blob: bytes) -> None:
        self._runtime = self._trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(blob)
        if engine is None:
            built = ""
            if self.metadata is not None:
                built = f" (built with TensorRT {self.metadata.get('tensorrt_version')!r:.40})"
            raise TensorRtGpuError(
                f"{self.engine_path}: TensorRT {self.tensorrt_version} cannot deserialise it"
                f"{built}{self._trt_errors()}; an engine runs only with the TensorRT release and "
                "on the GPU it was built with: rebuild it on this device (prep build --target gpu)"
            )
        self._engine = engine

    def _tensor(self, name: str) -> _Tensor:
        trt, engine = self._trt, self._engine
        dtype = engine.get_tensor_dtype(name)
        types: dict[Any, np.dtype[Any]] = {
            trt.DataType.FLOAT: np.dtype(np.float32),
            trt.DataType.HALF: np.dtype(np.float16),
        }
        return _Tensor(
            name=name,
            shape=tuple(int(d) for d in engine.get_tensor_shape(name)),
            dtype=dtype,
            np_dtype=types.get(dtype),
            fmt=engine.get_tensor_format(name),
        )

    def _check_engine(self) -> _Tensor:
        """Compare the engine's I/O and profile with the loadable; returns the input tensor.
        Raises TensorRtGpuError naming every difference."""
        trt, engine, loadable = self._trt, self._engine, self.loadable
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        want_in = loadable.inputs[0]
        if inputs != [want_in.name]:
            raise self._mismatch([f"inputs {inputs} (the loadable's: [{want_in.name!r}])"])
        problems: list[str] = []

        def check_io(t: _Tensor, chw: tuple[int, int, int]) -> None:
            batch_ok = len(t.shape) == 4 and (t.shape[0] == -1 or t.shape[0] >= 1)
            if not batch_ok or t.shape[1:] != chw:
                problems.append(
                    f"{t.name} has shape {t.shape} (wanted [B, {', '.join(map(str, chw))}])"
                )
            if t.np_dtype is None:
                problems.append(
                    f"{t.name} is {_error_name(t.dtype)} (this engine takes FLOAT or HALF)"
                )
            if t.fmt != trt.TensorFormat.LINEAR:
                problems.append(f"{t.name} has format {_error_name(t.fmt)} (wanted LINEAR)")

        inp = self._tensor(want_in.name)
        chw_in = (want_in.c, *loadable.image_size)
        check_io(inp, chw_in)
        low, _, high = (
            tuple(int(d) for d in s) for s in engine.get_tensor_profile_shape(inp.name, 0)
        )
        if low != (1, *chw_in) or high[1:] != chw_in or high[0] < self.max_batch:
            problems.append(
                f"{inp.name}'s profile is {low}..{high}; wanted batches 1..>= {self.max_batch} "
                f"of {chw_in} (rebuild with --max-batch >= {self.max_batch})"
            )
        want_out = {d.name: (d.c, d.h, d.w) for d in loadable.outputs}
        if sorted(outputs) != sorted(want_out):
            problems.append(f"outputs {sorted(outputs)} (the loadable's: {sorted(want_out)})")
        else:
            for name in outputs:
                check_io(self._tensor(name), want_out[name])
        if problems:
            raise self._mismatch(problems)
        return inp

    def _mismatch(self, problems: list[str]) -> TensorRtGpuError:
        return TensorRtGpuError(
            f"{self.engine_path} was not built for loadable {self.loadable.name!r}: "
            + "; ".join(problems)
            + " (rebuild it from the model's translated ONNX: prep build --target gpu)"
        )

    def _allocate(self, inp: _Tensor) -> _Buffers:
        """Context, stream, events, device and pinned host buffers; every address set once."""
        cudart = self._cudart
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise TensorRtRunError("ICudaEngine.create_execution_context", -1, "returned None")
        self._stream = _check(
            cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags",
        )
        for _ in range(4):
            self._events.append(_check(cudart.cudaEventCreate(), "cudaEventCreate"))
        in_shape = (self.loadable.inputs[0].c, *self.loadable.image_size)
        in_device, in_ptr, in_host, in_row = self._buffers_for(inp, in_shape)
        heads = []
        for desc in self.loadable.outputs:  # loadable order: the order heads are returned in
            device, ptr, host, row = self._buffers_for(
                self._tensor(desc.name), (desc.c, desc.h, desc.w)
            )
            heads.append(_Head(desc.name, row, device, ptr, host))
        return _Buffers(inp.name, in_row, in_device, in_ptr, in_host, tuple(heads))

    def _buffers_for(
        self, t: _Tensor, chw: tuple[int, ...]
    ) -> tuple[int, int, npt.NDArray[Any], int]:
        """``max_batch`` rows of ``t`` on the device and pinned on the host, the address set:
        (device pointer, host pointer, host view ``[max_batch, *chw]``, bytes a row)."""
        cudart = self._cudart
        if t.np_dtype is None:  # _check_engine refused it already; this keeps the types exact
            raise TensorRtGpuError(f"{t.name} is {_error_name(t.dtype)}")
        row = int(np.prod(chw)) * t.np_dtype.itemsize
        nbytes = self.max_batch * row
        device = int(_check(cudart.cudaMalloc(nbytes), "cudaMalloc"))
        self._device_ptrs.append(device)
        host = int(
            _check(cudart.cudaHostAlloc(nbytes, cudart.cudaHostAllocDefault), "cudaHostAlloc")
        )
        self._host_ptrs.append(host)
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(host))
        view = raw.view(t.np_dtype).reshape(self.max_batch, *chw)
        if not self._context.set_tensor_address(t.name, device):
            raise TensorRtRunError(f"IExecutionContext.set_tensor_address({t.name!r})", -1)
        return device, host, view, row

    def warm_up(self) -> dict[int, float]:
        """Run every batch size 1..``max_batch`` on zero frames (one untimed run, then
        ``replays`` timed ones), check that each output's shape follows the batch, and measure
        ``curve_us``; returns it. The constructor calls it; calling it again re-measures.
        Raises TensorRtGpuError if the engine fails or its outputs do not follow the batch;
        RuntimeError after :meth:`close`."""
        with self._lock:
            bufs = self._open()
            curve: dict[int, float] = {}
            for b in range(1, self.max_batch + 1):
                bufs.in_host[:b] = 0
                try:
                    self._execute(bufs, b)
                    self._check_output_shapes(bufs, b)
                    spans = [self._execute(bufs, b)[0] for _ in range(self.replays)]
                except TensorRtRunError as exc:
                    raise TensorRtGpuError(
                        f"{self.engine_path}: the engine failed on a batch of {b} at warm-up: "
                        f"{exc}{self._trt_errors()}"
                    ) from exc
                curve[b] = statistics.median(spans)
            self.curve_us = curve
            return dict(curve)

    def _check_output_shapes(self, bufs: _Buffers, b: int) -> None:
        ctx = self._context
        got = {h.name: tuple(int(d) for d in ctx.get_tensor_shape(h.name)) for h in bufs.heads}
        want = {h.name: (b, *h.host.shape[1:]) for h in bufs.heads}
        if got != want:
            raise TensorRtGpuError(
                f"{self.engine_path}: for a batch of {b} the engine's outputs are {got}, the "
                f"loadable's heads {want}"
            )

    def _open(self) -> _Buffers:
        """The buffers, with the device made current on this thread; RuntimeError if closed."""
        if self._closed or self._bufs is None:
            raise RuntimeError(f"the TensorRT GPU engine of {self.engine_path} is closed")
        _check(self._cudart.cudaSetDevice(self.device_index), "cudaSetDevice")
        return self._bufs

    # ------------------------------------------------------------------------------ serving

    def _execute(self, bufs: _Buffers, b: int) -> tuple[float, float]:
        """Copy in, execute, copy out the first ``b`` rows on the stream, then synchronise;
        returns (the stream span's µs, the execution's µs). The heads are in the pinned host
        views afterwards. Raises TensorRtRunError."""
        cudart, stream, ctx = self._cudart, self._stream, self._context
        e0, e1, e2, e3 = self._events[:4]  # the host path's (device I/O adds one)
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        shape = (b, *bufs.in_host.shape[1:])
        if not ctx.set_input_shape(bufs.input_name, shape):
            raise TensorRtRunError(
                f"IExecutionContext.set_input_shape({bufs.input_name!r}, {shape})", -1,
                self._trt_errors(),
            )  # fmt: skip
        try:
            _check(cudart.cudaEventRecord(e0, stream), "cudaEventRecord")
            _check(
                cudart.cudaMemcpyAsync(
                    bufs.in_device, bufs.in_host_ptr, b * bufs.in_row_bytes, h2d, stream
                ),
                "cudaMemcpyAsync",
            )
            _check(cudart.cudaEventRecord(e1, stream), "cudaEventRecord")
            if not ctx.execute_async_v3(int(stream)):
                raise TensorRtRunError("IExecutionContext.execute_async_v3", -1, self._trt_errors())
            _check(cudart.cudaEventRecord(e2, stream), "cudaEventRecord")
            for head in bufs.heads:
                _check(
                    cudart.cudaMemcpyAsync(
                        head.host_ptr, head.device, b * head.row_bytes, d2h, stream
                    ),
                    "cudaMemcpyAsync",
                )
            _check(cudart.cudaEventRecord(e3, stream), "cudaEventRecord")
        finally:
            # Even after a failed enqueue nothing may stay in flight on the buffers.
            synced = cudart.cudaStreamSynchronize(stream)
        _check(synced, "cudaStreamSynchronize")
        span_ms = _check(cudart.cudaEventElapsedTime(e0, e3), "cudaEventElapsedTime")
        exec_ms = _check(cudart.cudaEventElapsedTime(e1, e2), "cudaEventElapsedTime")
        return float(span_ms) * 1e3, float(exec_ms) * 1e3

    def run(
        self, frames: Sequence[npt.NDArray[np.int8]]
    ) -> tuple[list[list[npt.NDArray[np.float32]]], GpuBatchTiming]:
        """Run one batch of ``DLA_HWC4`` int8 frames (``quantize_hwc4``'s output); returns, per
        frame, its heads (float32 ``[C, H, W]`` each, new arrays, in ``loadable.outputs``
        order), and the batch's measured timing (module docstring).

        Raises ValueError for an empty batch, one over ``max_batch`` or a frame that is not an
        int8 array of :func:`frame_shape`; TensorRtRunError when a CUDA or TensorRT call fails;
        RuntimeError after :meth:`close`.
        """
        check_batch(frames, self.max_batch, self._frame_shape)
        b = len(frames)
        c, w = self.loadable.inputs[0].c, self.loadable.image_size[1]
        scale = np.float32(self.loadable.input_scale)
        with self._lock:  # one engine: batches queue behind each other
            start = time.monotonic_ns()
            bufs = self._open()
            for i, f in enumerate(frames):  # [H, W', 4] int8 -> [3, H, W] of the input's type
                hwc4_to_nchw(f[None], c, w, float(scale), bufs.in_host.dtype,
                             out=bufs.in_host[i : i + 1])  # fmt: skip
            actual_us, compute_us = self._execute(bufs, b)
            heads = [[np.array(h.host[i], dtype=np.float32) for h in bufs.heads] for i in range(b)]
            end = time.monotonic_ns()
        timing = GpuBatchTiming(b, self.curve_us[b], compute_us, actual_us, start, end)
        return heads, timing

    # ------------------------------------------------------------------------------ device I/O

    def _device_io(self, bufs: _Buffers, layouts: LayoutKernels) -> _DeviceIo:
        """Allocate the static frames and ``CHW16`` heads and capture one graph per batch size
        (after warm-up: every shape has been enqueued once, as TensorRT wants before a
        capture). Raises TensorRtRunError."""
        cudart = self._cudart
        frames = int(_check(cudart.cudaMalloc(self.max_batch * self.frame_bytes), "cudaMalloc"))
        self._device_ptrs.append(frames)
        heads = []
        for nbytes in self.head_image_bytes:
            heads.append(int(_check(cudart.cudaMalloc(self.max_batch * nbytes), "cudaMalloc")))
            self._device_ptrs.append(heads[-1])
        event = _check(cudart.cudaEventCreate(), "cudaEventCreate")
        self._events.append(event)
        io = _DeviceIo(layouts, frames, tuple(heads), {}, event)
        with self._lock:
            self._open()
            for b in range(1, self.max_batch + 1):
                io.graphs[b] = self._capture(bufs, io, b)
        return io

    def _capture(self, bufs: _Buffers, io: _DeviceIo, b: int) -> tuple[Any, Any]:
        """Batch ``b``'s graph: the frames into the engine's input, the engine, its heads into
        ``CHW16``, captured on the engine's stream (thread-local mode: other threads' CUDA calls
        go on). Returns (graph, executable)."""
        cudart, stream, ctx = self._cudart, self._stream, self._context
        handle = int(stream)
        (c, h, w), pitch = bufs.in_host.shape[1:], self._frame_shape[1]
        shape = (b, c, h, w)
        if not ctx.set_input_shape(bufs.input_name, shape):
            raise TensorRtRunError(
                f"IExecutionContext.set_input_shape({bufs.input_name!r}, {shape})", -1,
                self._trt_errors(),
            )  # fmt: skip
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        _check(cudart.cudaStreamBeginCapture(stream, mode), "cudaStreamBeginCapture")
        try:
            try:
                io.layouts.to_nchw(
                    handle, io.frames, bufs.in_device, n=b, c=c, h=h, w=w, pitch_px=pitch,
                    scale=float(np.float32(self.loadable.input_scale)),
                    half=bufs.in_host.dtype == np.float16,
                )  # fmt: skip
                if not ctx.execute_async_v3(handle):
                    raise TensorRtRunError(
                        "IExecutionContext.execute_async_v3", -1, self._trt_errors()
                    )
                for head, dst in zip(bufs.heads, io.heads, strict=True):
                    hc, hh, hw = head.host.shape[1:]
                    io.layouts.to_chw16(
                        handle, head.device, dst, n=b, c=hc, h=hh, w=hw,
                        half=head.host.dtype == np.float16,
                    )  # fmt: skip
            except CudaError as exc:
                raise TensorRtRunError(exc.call, exc.code, f"capturing a batch of {b}") from exc
        except BaseException:
            ended = cudart.cudaStreamEndCapture(stream)  # a capture must end, whatever failed
            if int(ended[0]) == 0:
                cudart.cudaGraphDestroy(ended[1])
            raise
        graph = _check(cudart.cudaStreamEndCapture(stream), "cudaStreamEndCapture")
        try:
            executable = _check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        except TensorRtRunError:
            cudart.cudaGraphDestroy(graph)
            raise
        return graph, executable

    @property
    def device_io(self) -> bool:
        """Whether batches can stay on the device (built with layout kernels, not closed): the
        members below then work (the torch engine's contract, ``dlad/executors/gpu.py``'s
        ``DeviceIoEngine``)."""
        return self._io is not None and not self._closed

    @property
    def input_ptr(self) -> int:
        """Device address of the static ``DLA_HWC4`` frames (``max_batch``). Raises
        RuntimeError without device I/O."""
        return self._device().frames

    @property
    def head_ptrs(self) -> tuple[int, ...]:
        """Device addresses of the static ``CHW16`` heads, in output order (``max_batch``
        images each; the next batch overwrites them). Raises RuntimeError without device I/O."""
        return self._device().heads

    @property
    def graph_execs(self) -> tuple[int, ...]:
        """The captured graph of each batch size, ``cudaGraphExec_t`` handles (a batch of n at
        ``[n - 1]``): a launch on any stream of the device reads the first n frames and writes
        their ``CHW16`` heads. For a caller that queues the whole batch itself (the native
        plane's GPU engine), who must then be the only one to run batches: one launch at a
        time, in its stream's order. Raises RuntimeError without device I/O."""
        graphs = self._device().graphs
        return tuple(int(graphs[b][1]) for b in sorted(graphs))

    def _device(self) -> _DeviceIo:
        if self._closed or self._io is None:
            raise RuntimeError(
                f"the TensorRT GPU engine of {self.engine_path} has no device-side I/O (it is "
                "built with the GPU's layout kernels where pre/post-processing runs on CUDA)"
                if not self._closed
                else f"the TensorRT GPU engine of {self.engine_path} is closed"
            )
        return self._io

    def wait_input_free(self, stream: Any) -> None:
        """Queue on ``stream`` (a stream of this device, driver or runtime handle) a wait until
        every batch queued so far has read the frames; the torch engine's contract. Raises
        RuntimeError without device I/O, TensorRtRunError."""
        io = self._device()
        if io.input_read:
            _check(self._cudart.cudaStreamWaitEvent(stream, io.input_free, 0),
                   "cudaStreamWaitEvent")  # fmt: skip

    def run_device(
        self, n: int, *, after: Any, done: Any, heads_to: Sequence[int] | None = None
    ) -> TensorRtDeviceBatch:
        """Queue the first ``n`` static frames as one batch, without a host copy or wait: the
        engine's stream waits for ``after`` (an event; None: no wait), launches batch ``n``'s
        graph, copies the ``n`` images of each ``CHW16`` head to ``heads_to`` (device
        addresses, output order; None: no copy) and records ``done``. The torch engine's
        contract (``TorchGpu.run_device``). Raises ValueError for ``n`` outside
        1..``max_batch`` or ``heads_to`` of the wrong length, RuntimeError without device I/O,
        TensorRtRunError."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a batch holds 1..{self.max_batch} frames, got {n}")
        sizes = self.head_image_bytes
        if heads_to is not None and len(heads_to) != len(sizes):
            raise ValueError(f"heads_to needs {len(sizes)} addresses")
        cudart = self._cudart
        d2d = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        with self._lock:  # one engine: batches queue behind each other
            io = self._device()
            self._open()
            stream = self._stream
            events = tuple(_check(cudart.cudaEventCreate(), "cudaEventCreate") for _ in range(3))
            io.batch_events.update(events)
            if after is not None:
                _check(cudart.cudaStreamWaitEvent(stream, after, 0), "cudaStreamWaitEvent")
            _check(cudart.cudaEventRecord(events[0], stream), "cudaEventRecord")
            _check(cudart.cudaGraphLaunch(io.graphs[n][1], stream), "cudaGraphLaunch")
            _check(cudart.cudaEventRecord(events[1], stream), "cudaEventRecord")
            _check(cudart.cudaEventRecord(io.input_free, stream), "cudaEventRecord")
            io.input_read = True
            for dst, src, nbytes in zip(heads_to or (), io.heads, sizes, strict=False):
                _check(cudart.cudaMemcpyAsync(int(dst), src, n * nbytes, d2d, stream),
                       "cudaMemcpyAsync")  # fmt: skip
            _check(cudart.cudaEventRecord(events[2], stream), "cudaEventRecord")
            _check(cudart.cudaEventRecord(done, stream), "cudaEventRecord")
        return TensorRtDeviceBatch(self, n, self.curve_us[n], events)

    def _batch_timing(
        self, events: tuple[Any, ...], end_ns: int | None
    ) -> tuple[float, float, int]:
        """(compute µs, span µs, end) of a run_device batch once done; its events freed."""
        cudart = self._cudart
        start, launched, copied = events
        with self._lock:
            io = self._device()
            try:
                _check(cudart.cudaEventSynchronize(copied), "cudaEventSynchronize")
                compute_ms = _check(cudart.cudaEventElapsedTime(start, launched),
                                    "cudaEventElapsedTime")  # fmt: skip
                span_ms = _check(cudart.cudaEventElapsedTime(start, copied),
                                 "cudaEventElapsedTime")  # fmt: skip
            finally:
                for event in events:
                    if event in io.batch_events:
                        io.batch_events.discard(event)
                        cudart.cudaEventDestroy(event)
        end = time.monotonic_ns() if end_ns is None else end_ns
        return float(compute_ms) * 1e3, float(span_ms) * 1e3, end

    # ------------------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Free the buffers, events and stream and release TensorRT's objects; idempotent.
        :meth:`run` raises RuntimeError afterwards. Raises TensorRtRunError (once everything
        else was freed) if a free fails."""
        with self._lock:
            if self._closed:
                return
            self._release(raise_failure=True)

    def _release(self, *, raise_failure: bool) -> None:
        """Free whatever was allocated; every free is attempted, the first failure is raised
        afterwards if ``raise_failure``."""
        cudart = self._cudart
        self._closed = True
        failures: list[TensorRtRunError] = []

        def attempt(call: str, fn: Callable[..., Any], *args: Any) -> None:
            try:
                _check(fn(*args), call)
            except TensorRtRunError as exc:
                failures.append(exc)

        attempt("cudaSetDevice", cudart.cudaSetDevice, self.device_index)
        if self._stream is not None:  # nothing may be in flight on what is freed below
            attempt("cudaStreamSynchronize", cudart.cudaStreamSynchronize, self._stream)
        # TensorRT's objects first (the context refers to the buffers); the pinned views die
        # with the memory they view.
        self._bufs = None
        if self._io is not None:  # the graphs refer to the buffers
            for graph, executable in self._io.graphs.values():
                attempt("cudaGraphExecDestroy", cudart.cudaGraphExecDestroy, executable)
                attempt("cudaGraphDestroy", cudart.cudaGraphDestroy, graph)
            for event in self._io.batch_events:
                attempt("cudaEventDestroy", cudart.cudaEventDestroy, event)
            self._io = None
        self._context = self._engine = self._runtime = None
        for ptr in self._device_ptrs:
            attempt("cudaFree", cudart.cudaFree, ptr)
        for ptr in self._host_ptrs:
            attempt("cudaFreeHost", cudart.cudaFreeHost, ptr)
        for event in self._events:
            attempt("cudaEventDestroy", cudart.cudaEventDestroy, event)
        if self._stream is not None:
            attempt("cudaStreamDestroy", cudart.cudaStreamDestroy, self._stream)
        self._device_ptrs, self._host_ptrs, self._events, self._stream = [], [], [], None
        if failures and raise_failure:
            raise failures[0]


class TensorRtDeviceBatch:
    """One batch :meth:`TensorRtGpu.run_device` queued: ``size`` frames; :meth:`timing` once
    the caller knows it is done (reading it frees the batch's events)."""

    def __init__(
        self, engine: TensorRtGpu, size: int, modelled_us: float, events: tuple[Any, ...]
    ) -> None:
        self.size = size
        self._engine = engine
        self._modelled_us = modelled_us
        self._events = events

    def timing(self, end_ns: int | None = None) -> GpuBatchTiming:
        """The batch's GPU times (``compute_us`` the graph, ``actual_us`` the graph and the
        head copies), waiting for it first; the span ends at ``end_ns`` (default: now) on the
        host's ``time.monotonic_ns`` clock. Raises TensorRtRunError."""
        compute_us, actual_us, end = self._engine._batch_timing(self._events, end_ns)
        start = end - round(actual_us * 1e3)
        return GpuBatchTiming(self.size, self._modelled_us, compute_us, actual_us, start, end)
