"""The torch GPU engine: a loadable's model as a ``torch.export`` program, replayed as one CUDA
graph per batch size.

A product backend beside the emulated Orin GPU (``dlad/devices/emulated_gpu.py``): where that one
takes the time NVIDIA's published curve says, this one runs the model on a real CUDA GPU and
reports what it measured. It implements the GPU executor's ``GpuEngine`` protocol
(``dlad/executors/gpu.py``): ``max_batch``, ``curve_us`` and ``run(frames)``, and on CUDA its
``DeviceIoEngine`` extension (device-side I/O, below).

**The program** is a ``.pt2`` that ``prep torch-export`` writes (``prep/torch_export.py``): the
float YOLOv5 rebuilt from the very integers the DLA cores run (each conv's int8 weights times
their per-channel scale, int32 bias times its scale), in FP16, behind a wrapper that takes the
DLA's own input, a batch of ``DLA_HWC4`` int8 frames ``[B, H, W', C']`` as
``dlad.imaging.pre.quantize_hwc4`` makes them, dequantises ``q[..., :W, :3] * input_scale`` and
returns the logical heads in float32 ``[B, C, H, W]``, one per ``loadable.outputs`` descriptor in
that order. The batch dimension is dynamic (1..its ``max_batch``).

**Its metadata** is a JSON document stored in the ``.pt2`` as the extra file :data:`METADATA_FILE`
(``torch.export.save(..., extra_files=...)``); :func:`program_metadata` writes it and
:func:`check_metadata` compares it with the loadable a daemon serves. Keys (format version 1):

* ``format`` (``"dlad-torch-gpu"``), ``version`` (1);
* ``loadable_name``, ``outputs`` (``[{"name", "c", "h", "w"}, ...]`` in loadable order),
  ``image_size`` (``[h, w]``), ``input_shape`` (one frame's ``[H, W', C']``), ``input_scale``;
* ``graph_sha256``: the sha256 of the loadable's ``graph`` section, i.e. of the weights the
  program was rebuilt from (the same for both cores' loadables of one model);
* ``source`` and ``source_sha256``: the ``.emu`` file's name and the sha256 of its bytes;
* ``max_batch``, ``precision`` (``"fp16"``), ``variant`` (YOLOv5 size), ``torch_version``.

**On a CUDA device** the constructor moves the program to the device (its weights in
channels-last memory, the layout of its activations), allocates a pinned host
input buffer and a device input buffer of ``max_batch`` frames (and pinned host buffers for the
heads), and :meth:`TorchGpu.warm_up` captures one ``torch.cuda.CUDAGraph`` per batch size on the
engine's own stream, each reading the first ``b`` frames of the one device input. A batch copies
its frames into the pinned buffer, then on the stream: host to device, replay, device to host.
CUDA events time it: ``compute_us`` is the replay alone (the graph's GPU time), ``actual_us``
the stream's whole span, copies included (what the GPU is occupied for per batch, which is what
the scheduler must learn); ``curve_us[b]`` is the median of ``replays`` such spans, measured at
warm-up. ``start_ns``/``end_ns`` are ``time.monotonic_ns`` around the whole call.

**Device-side I/O** (CUDA with cuda-python, :attr:`TorchGpu.device_io`): a caller whose pre- and
post-processing run on the same GPU (the GPU executor with the daemon's ``GpuService``) keeps a
batch on the device. Frame ``b`` of the static input is at :attr:`~TorchGpu.input_ptr` ``+ b *``
:attr:`~TorchGpu.frame_bytes` (``DLA_HWC4`` int8, as ``GpuPipeline.pre`` writes it). Inside each
captured graph, after the program, its heads are also written as fp16 ``CHW16`` (channels padded
with zeros to a multiple of 16: ``[B][C/16][H][W][16]``, the layout the post-processing kernels
read as a DLA's FP16 head) into static device buffers at :attr:`~TorchGpu.head_ptrs`, image ``b``
at ``ptr + b *`` :attr:`~TorchGpu.head_image_bytes` (= ``HeadSpec(c, h, w, stride).nbytes``). The
float32 heads are fp16 values (the program computes in fp16 and casts), so the ``CHW16`` copy is
exact. :meth:`TorchGpu.run_device` makes the engine's stream wait on a CUDA event the caller
recorded on its own stream (``cuStreamWaitEvent`` on ``torch.cuda.Stream.cuda_stream``: torch
cannot wait on an event it did not create, and its runtime stream handle *is* the driver's
``CUstream``; torch's runtime and ``GpuContext`` both use the device's primary context, so
streams, events and device pointers are shared), replays the batch's graph, optionally copies the
batch's ``CHW16`` heads to the caller's buffers, and records the caller's ``done`` event, which the
caller's stream then waits on. No host copy, no host wait. :attr:`TorchGpu.graph_execs` hands
over the graphs themselves, for a caller that queues the batch on its own stream (the native
plane's GPU engine, ``dlad/native/gpu_batch_engine.hpp``). :meth:`TorchGpu.wait_input_free`
orders a caller's writes to the input after the last queued batch has read it. The returned
:class:`TorchDeviceBatch` gives the batch's GPU time (CUDA events: ``compute_us`` the replay,
``actual_us`` replay and head copies). :meth:`TorchGpu.run` (the host path) is unchanged.

**``device="cpu"`` is for tests only**: it runs the program eagerly (no CUDA graphs, no pinned
memory), in the program's own FP16, and times with the host clock (``compute_us`` =
``actual_us``).

torch is imported when an engine is constructed, never at module import: the daemon's default
install has no torch. Errors: :class:`TorchGpuError` (a ValueError) for everything that makes an
engine unusable (no torch, no CUDA, a missing, unreadable or foreign program, metadata that does
not match the loadable, a program that does not compute the loadable's heads); ValueError for a
bad argument or batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from dlad.devices.emulated_gpu import GpuBatchTiming
from dlad.devices.gpu_frames import DeviceIoSizes, check_batch, frame_shape
from dlad.gpu.driver import CudaError
from dlad.loadable import Loadable

if TYPE_CHECKING:
    import torch

__all__ = [
    "ARTIFACT_FORMAT",
    "ARTIFACT_VERSION",
    "METADATA_FILE",
    "PRECISION",
    "TorchDeviceBatch",
    "TorchGpu",
    "TorchGpuError",
    "check_metadata",
    "frame_shape",
    "program_metadata",
    "write_chw16",
]

ARTIFACT_FORMAT: Final = "dlad-torch-gpu"
ARTIFACT_VERSION: Final = 1
METADATA_FILE: Final = "dlad.json"
"""The name of the metadata's extra file inside the ``.pt2``."""
PRECISION: Final = "fp16"
"""The precision the program computes in."""


class TorchGpuError(ValueError):
    """The torch GPU engine cannot be used: no torch or no CUDA, a missing or unreadable program,
    one made for another model, or one that does not compute the loadable's heads. The message
    names the file and what to do."""


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def program_metadata(
    loadable: Loadable,
    *,
    max_batch: int,
    source: str,
    source_sha256: str,
    variant: str,
    torch_version: str,
) -> dict[str, Any]:
    """The metadata document of a program exported from ``loadable`` (module docstring)."""
    return {
        "format": ARTIFACT_FORMAT,
        "version": ARTIFACT_VERSION,
        "loadable_name": loadable.name,
        "outputs": [{"name": d.name, "c": d.c, "h": d.h, "w": d.w} for d in loadable.outputs],
        "image_size": list(loadable.image_size),
        "input_shape": list(frame_shape(loadable)),
        "input_scale": loadable.input_scale,
        "graph_sha256": _sha256(loadable.sections["graph"]),
        "source": source,
        "source_sha256": source_sha256,
        "max_batch": max_batch,
        "precision": PRECISION,
        "variant": variant,
        "torch_version": torch_version,
    }


def check_metadata(
    meta: Mapping[str, Any], loadable: Loadable, *, max_batch: int, src: str
) -> None:
    """Raise TorchGpuError, naming ``src`` and every field that differs, unless ``meta`` is a
    version-1 document of a program exported from ``loadable``'s model (same outputs, image
    size, input shape and scale, graph) for batches of at least ``max_batch``."""
    if meta.get("format") != ARTIFACT_FORMAT or meta.get("version") != ARTIFACT_VERSION:
        raise TorchGpuError(
            f"{src}: not a {ARTIFACT_FORMAT} version {ARTIFACT_VERSION} program (format "
            f"{meta.get('format')!r:.40}, version {meta.get('version')!r:.20}); export it with "
            "prep torch-export"
        )
    want = program_metadata(
        loadable, max_batch=max_batch, source="", source_sha256="", variant="", torch_version=""
    )
    diff = [
        f"{key} {meta.get(key)!r:.200} (loadable: {want[key]!r:.200})"
        for key in ("outputs", "image_size", "input_shape", "input_scale", "graph_sha256")
        if meta.get(key) != want[key]
    ]
    got_batch = meta.get("max_batch")
    if isinstance(got_batch, bool) or not isinstance(got_batch, int) or got_batch < max_batch:
        diff.append(f"max_batch {got_batch!r:.20} (wanted at least {max_batch})")
    if meta.get("precision") != PRECISION:
        diff.append(f"precision {meta.get('precision')!r:.20} (this engine runs {PRECISION})")
    if diff:
        raise TorchGpuError(
            f"{src} was not exported for loadable {loadable.name!r}: " + "; ".join(diff)
            + " (re-export it: prep torch-export --loadable <the .emu> --out <the .pt2>)"
        )  # fmt: skip


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _drv_check(result: Any, call: str) -> None:
    """Raise CudaError unless a cuda.bindings call returned success."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise CudaError(call, int(err), getattr(err, "name", str(err)))


def write_chw16(heads: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
    """Write float ``[b, C, H, W]`` heads into the first ``b`` images of fp16 ``CHW16`` tensors
    ``[B, ceil(C/16), H, W, 16]`` (``dlad.imaging.post.pack_chw16``'s layout; one strided copy
    per 16-channel block run, no temporaries, so it can be captured in a CUDA graph). Padding
    channels are left as they are (zeros in the engine's buffers). Exact for fp16 values."""
    for src, dst in zip(heads, out, strict=True):
        b, c = int(src.shape[0]), int(src.shape[1])
        view = dst[:b].permute(0, 1, 4, 2, 3)  # [b][C/16][16][H][W] over [b][C/16][H][W][16]
        full, rest = divmod(c, 16)
        if full:
            view[:, :full].copy_(src[:, : full * 16].reshape(b, full, 16, *src.shape[2:]))
        if rest:
            view[:, full, :rest].copy_(src[:, full * 16 :])


def _import_driver() -> Any:
    """cuda-python's driver API, or None where it is not installed (no device-side I/O)."""
    try:
        from cuda.bindings import driver  # noqa: PLC0415 (the [gpu] extra; GPU hosts only)
    except ImportError:
        return None
    return driver


def _import_torch() -> Any:
    try:
        import torch  # noqa: PLC0415 (lazy: the daemon's default install has no torch)
        import torch.export.passes  # noqa: PLC0415 (move_to_device_pass; not imported by torch)
    except ImportError as exc:
        raise TorchGpuError(
            f"the torch GPU engine needs torch, which cannot be imported here ({exc}); install "
            "a CUDA build of torch on the GPU host"
        ) from exc
    return torch


@dataclass
class _Graph:
    """One batch size's captured graph and the static outputs its replay writes."""

    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]


@dataclass
class _Cuda:
    """What the engine holds on a CUDA device: its stream, the static buffers, the graphs;
    ``dev_heads`` the ``CHW16`` fp16 heads every graph writes, ``input_free`` an event recorded
    after every replay, ``drv`` cuda-python's driver API (None: no device-side I/O)."""

    stream: torch.cuda.Stream
    host_in: torch.Tensor
    host_in_np: npt.NDArray[np.int8]
    dev_in: torch.Tensor
    host_out: list[torch.Tensor]
    host_out_np: list[npt.NDArray[np.float32]]
    events: list[torch.cuda.Event]
    graphs: dict[int, _Graph]
    dev_heads: list[torch.Tensor]
    input_free: torch.cuda.Event
    drv: Any


class TorchDeviceBatch:
    """One batch :meth:`TorchGpu.run_device` queued: ``size`` frames; :meth:`timing` once the
    caller knows it is done."""

    def __init__(self, size: int, modelled_us: float, events: tuple[torch.cuda.Event, ...]) -> None:
        self.size = size
        self._modelled_us = modelled_us
        self._events = events

    def timing(self, end_ns: int | None = None) -> GpuBatchTiming:
        """The batch's GPU times (CUDA events: ``compute_us`` the replay, ``actual_us`` the
        replay and the head copies), waiting for it first if it is still running. The span is
        placed on the host's ``time.monotonic_ns`` clock ending at ``end_ns`` (default: now);
        only the caller knows when, on that clock, the GPU finished it."""
        start, replayed, copied = self._events
        copied.synchronize()
        compute_us = float(start.elapsed_time(replayed)) * 1e3
        actual_us = float(start.elapsed_time(copied)) * 1e3
        end = time.monotonic_ns() if end_ns is None else end_ns
        return GpuBatchTiming(
            self.size, self._modelled_us, compute_us, actual_us, end - round(actual_us * 1e3), end
        )


class TorchGpu(DeviceIoSizes):
    """One torch GPU engine for one model (see the module docstring).

    Args:
        loadable: the model's emulated loadable (input geometry and scale, output descriptors,
            the graph the program must have been exported from).
        program_path: the ``.pt2`` that ``prep torch-export`` wrote from that loadable.
        max_batch: the largest batch :meth:`run` takes (>= 1, at most the program's).
        device: ``"cuda"``, ``"cuda:N"``, or ``"cpu"`` (tests only: eager, host-timed).
        replays: timed runs per batch size at warm-up; ``curve_us`` holds their median.

    Raises ValueError for a bad argument, TorchGpuError for an engine that cannot be used
    (module docstring). :meth:`run` is thread-safe: batches run one at a time.
    """

    def __init__(
        self,
        loadable: Loadable,
        program_path: str | os.PathLike[str],
        *,
        max_batch: int = 8,
        device: str = "cuda",
        replays: int = 5,
    ) -> None:
        for key, value in (("max_batch", max_batch), ("replays", replays)):
            if not _positive_int(value):
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        raw_device: object = device  # checked as untyped: callers need not be type-checked
        if not isinstance(raw_device, str):
            raise ValueError(f"device must be a string such as 'cuda' or 'cpu', got {device!r}")
        torch = _import_torch()
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device {device!r} is not a torch device: {exc}") from exc
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise TorchGpuError(
                    f"device {device!r}: torch {torch.__version__} sees no CUDA GPU (a CPU-only "
                    "build, no driver, or no device); the torch GPU engine needs one"
                )
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise TorchGpuError(
                    f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)"
                )
        self.loadable = loadable
        self.max_batch = max_batch
        self.device: str = str(dev)
        self.program_path = Path(program_path)
        self.replays = replays
        self.curve_us: dict[int, float] = {}
        self._torch: Any = torch
        self._dev = dev
        self._frame_shape = frame_shape(loadable)
        self._heads_shape = [(d.c, d.h, d.w) for d in loadable.outputs]
        self._lock = threading.Lock()
        self._module: Any = None
        self.metadata: dict[str, Any] = self._load()
        self._cuda: _Cuda | None = self._setup_cuda() if dev.type == "cuda" else None
        self.warm_up()

    # ------------------------------------------------------------------------------ setup

    def _load(self) -> dict[str, Any]:
        """Load the program and its metadata, check it against the loadable, move it to the
        device (``self._module``); returns the metadata."""
        torch, path = self._torch, self.program_path
        if not path.is_file():
            raise TorchGpuError(
                f"{path}: no such program file (export one: prep torch-export --loadable "
                f"<the .emu> --out {path})"
            )
        extra = {METADATA_FILE: ""}
        try:
            with warnings.catch_warnings():
                # torch 2.11's loader views the archive's read-only bytes as tensors and says so;
                # nothing here writes to them (the device copy and the layout change are new).
                warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
                program = torch.export.load(path, extra_files=extra)
        except Exception as exc:  # torch's deserialisation errors share no base class
            raise TorchGpuError(
                f"{path}: torch {torch.__version__} cannot load it as an exported program "
                f"({type(exc).__name__}: {exc}); re-export it with this torch"
            ) from exc
        if not extra[METADATA_FILE]:
            raise TorchGpuError(f"{path}: an exported program without dlad's {METADATA_FILE}")
        try:
            meta = json.loads(extra[METADATA_FILE])
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TorchGpuError(f"{path}: its {METADATA_FILE} is not JSON: {exc}") from exc
        if not isinstance(meta, dict):
            raise TorchGpuError(f"{path}: its {METADATA_FILE} is not a JSON object")
        check_metadata(meta, self.loadable, max_batch=self.max_batch, src=str(path))
        if self._dev.type == "cuda":
            # torch.export records the export device in the graph (tensor-metadata asserts);
            # the pass rewrites those and moves the weights.
            try:
                program = torch.export.passes.move_to_device_pass(program, str(self._dev))
            except Exception as exc:  # torch's pass errors share no base class
                raise TorchGpuError(f"{path}: cannot move it to {self._dev}: {exc}") from exc
        # The program's activations are channels-last; weights in the same layout spare every
        # conv a reorder (they are saved in the default one: see prep/torch_export.py).
        self._module = program.module().to(memory_format=torch.channels_last)
        return meta

    def _setup_cuda(self) -> _Cuda:
        torch, dev = self._torch, self._dev
        shape = (self.max_batch, *self._frame_shape)
        with torch.cuda.device(dev):
            host_in = torch.zeros(shape, dtype=torch.int8, pin_memory=True)
            host_out = [
                torch.empty((self.max_batch, *s), dtype=torch.float32, pin_memory=True)
                for s in self._heads_shape
            ]
            # Zeroed: the padding channels of CHW16 are never written and must read as zeros.
            dev_heads = [
                torch.zeros(
                    (self.max_batch, -(-c // 16), h, w, 16), dtype=torch.float16, device=dev
                )
                for c, h, w in self._heads_shape
            ]
            return _Cuda(
                stream=torch.cuda.Stream(device=dev),
                host_in=host_in,
                host_in_np=host_in.numpy(),
                dev_in=torch.zeros(shape, dtype=torch.int8, device=dev),
                host_out=host_out,
                host_out_np=[h.numpy() for h in host_out],
                events=[torch.cuda.Event(enable_timing=True) for _ in range(4)],
                graphs={},
                dev_heads=dev_heads,
                input_free=torch.cuda.Event(),
                drv=_import_driver(),
            )

    def warm_up(self) -> dict[int, float]:
        """Capture (CUDA) or run (CPU) every batch size 1..``max_batch``, check the program's
        heads, and measure ``curve_us``; returns it. The constructor calls it; calling it again
        re-measures. Raises TorchGpuError if the program fails on a batch or returns heads other
        than the loadable's; RuntimeError after :meth:`close`."""
        with self._lock:
            self._check_open()
            curve: dict[int, float] = {}
            for b in range(1, self.max_batch + 1):
                try:
                    if self._cuda is not None:
                        if b not in self._cuda.graphs:
                            self._cuda.graphs[b] = self._capture(self._cuda, b)
                        times = [self._replay(self._cuda, b)[0] for _ in range(self.replays)]
                    else:  # the first timed run checks the heads too
                        times = [self._cpu_timed(b) for _ in range(self.replays)]
                except TorchGpuError:
                    raise
                except Exception as exc:  # the program's errors share no base class
                    raise TorchGpuError(
                        f"{self.program_path}: the program failed on a batch of {b} on "
                        f"{self.device}: {type(exc).__name__}: {exc}"
                    ) from exc
                curve[b] = statistics.median(times)
            self.curve_us = curve
            return dict(curve)

    def _check_heads(self, outputs: Any, b: int) -> tuple[torch.Tensor, ...]:
        torch = self._torch
        want = [((b, *s), "torch.float32") for s in self._heads_shape]
        got = None
        if isinstance(outputs, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in outputs):
            got = [(tuple(o.shape), str(o.dtype)) for o in outputs]
        if got != want:
            raise TorchGpuError(
                f"{self.program_path}: the program returns {got!r:.300}, the loadable's heads "
                f"are {want} (outputs {[d.name for d in self.loadable.outputs]})"
            )
        return tuple(outputs)

    def _capture(self, cuda: _Cuda, b: int) -> _Graph:
        torch = self._torch
        x = cuda.dev_in[:b]
        with torch.cuda.device(self._dev), torch.no_grad():
            # Eager runs first, on the capture stream: cuDNN picks its kernels for this shape and
            # lazy initialisation happens outside the capture (torch.cuda.graph's guidance).
            cuda.stream.wait_stream(torch.cuda.current_stream(self._dev))
            with torch.cuda.stream(cuda.stream):
                for _ in range(2):
                    write_chw16(self._check_heads(self._module(x), b), cuda.dev_heads)
            cuda.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=cuda.stream):
                outputs = self._check_heads(self._module(x), b)  # a shape check, no kernel
                write_chw16(outputs, cuda.dev_heads)
        return _Graph(graph, outputs)

    def _replay(self, cuda: _Cuda, b: int) -> tuple[float, float]:
        """Copy in, replay, copy out the first ``b`` frames on the stream; returns (the span's
        GPU µs, the replay's GPU µs). The heads are in the pinned output buffers after it."""
        torch = self._torch
        g = cuda.graphs[b]
        e0, e1, e2, e3 = cuda.events
        with torch.cuda.device(self._dev), torch.cuda.stream(cuda.stream):
            e0.record(cuda.stream)
            cuda.dev_in[:b].copy_(cuda.host_in[:b], non_blocking=True)
            e1.record(cuda.stream)
            g.graph.replay()
            e2.record(cuda.stream)
            cuda.input_free.record(cuda.stream)
            for host, out in zip(cuda.host_out, g.outputs, strict=True):
                host[:b].copy_(out, non_blocking=True)
            e3.record(cuda.stream)
        e3.synchronize()
        return float(e0.elapsed_time(e3)) * 1e3, float(e1.elapsed_time(e2)) * 1e3

    def _cpu_forward(self, batch: npt.NDArray[np.int8]) -> list[npt.NDArray[np.float32]]:
        torch = self._torch
        with torch.inference_mode():
            outputs = self._check_heads(self._module(torch.from_numpy(batch)), len(batch))
        return [o.numpy() for o in outputs]

    def _cpu_timed(self, b: int) -> float:
        start = time.perf_counter_ns()
        self._cpu_forward(np.zeros((b, *self._frame_shape), np.int8))
        return (time.perf_counter_ns() - start) / 1e3

    def _check_open(self) -> None:
        if self._module is None:
            raise RuntimeError(f"the torch GPU engine of {self.program_path} is closed")

    # ------------------------------------------------------------------------------ serving

    def run(
        self, frames: Sequence[npt.NDArray[np.int8]]
    ) -> tuple[list[list[npt.NDArray[np.float32]]], GpuBatchTiming]:
        """Run one batch of ``DLA_HWC4`` int8 frames (``quantize_hwc4``'s output); returns, per
        frame, its logical heads (float32 ``[C, H, W]`` each, new arrays), and the batch's
        measured timing (module docstring).

        Raises ValueError for an empty batch, one over ``max_batch`` or a frame that is not an
        int8 array of :func:`frame_shape`; RuntimeError after :meth:`close`.
        """
        check_batch(frames, self.max_batch, self._frame_shape)
        b = len(frames)
        with self._lock:  # one engine: batches queue behind each other
            self._check_open()
            start = time.monotonic_ns()
            outs: Sequence[npt.NDArray[np.float32]]
            if self._cuda is not None:
                for i, f in enumerate(frames):
                    self._cuda.host_in_np[i] = f
                actual_us, compute_us = self._replay(self._cuda, b)
                outs = self._cuda.host_out_np  # reused by the next batch: copied out below
            else:
                outs = self._cpu_forward(np.stack(frames))
            heads = [[np.array(o[i], dtype=np.float32) for o in outs] for i in range(b)]
            end = time.monotonic_ns()
            if self._cuda is None:
                actual_us = compute_us = (end - start) / 1e3
        timing = GpuBatchTiming(b, self.curve_us[b], compute_us, actual_us, start, end)
        return heads, timing

    # ------------------------------------------------------------------------------ device I/O

    @property
    def device_io(self) -> bool:
        """Whether batches can stay on the device (CUDA, cuda-python installed, not closed):
        the members below then work."""
        return self._cuda is not None and self._cuda.drv is not None and self._module is not None

    @property
    def input_ptr(self) -> int:
        """Device address of the static input (``max_batch`` frames). Raises RuntimeError
        without device I/O."""
        return int(self._io().dev_in.data_ptr())

    @property
    def head_ptrs(self) -> tuple[int, ...]:
        """Device addresses of the static ``CHW16`` heads, in output order (``max_batch``
        images each; the next batch overwrites them). Raises RuntimeError without device I/O."""
        return tuple(int(h.data_ptr()) for h in self._io().dev_heads)

    @property
    def graph_execs(self) -> tuple[int, ...]:
        """The captured graph of each batch size, ``CUgraphExec`` handles (a batch of n at
        ``[n - 1]``): a launch on any stream of the device reads the first n frames of the
        input and writes their heads, as a replay does. For a caller that queues the whole
        batch itself (the native plane's GPU engine), who must then be the only one to run
        batches: one launch at a time, in its stream's order. Raises RuntimeError without
        device I/O."""
        graphs = self._io().graphs
        return tuple(int(graphs[b].graph.raw_cuda_graph_exec()) for b in sorted(graphs))

    def _io(self) -> _Cuda:
        self._check_open()
        if self._cuda is None or self._cuda.drv is None:
            raise RuntimeError(
                f"the torch GPU engine on {self.device} has no device-side I/O (it needs a CUDA "
                "device and cuda-python)"
            )
        return self._cuda

    def wait_input_free(self, stream: Any) -> None:
        """Queue on ``stream`` (a driver ``CUstream`` of this device) a wait until every batch
        queued on the engine so far has read the input: work queued on ``stream`` after it may
        overwrite the input. The caller must keep other batches from being queued between this
        and its own :meth:`run_device` (one writer of the input at a time), and must not call
        :meth:`run` meanwhile. Raises RuntimeError without device I/O, CudaError."""
        cuda = self._io()
        handle = int(cuda.input_free.cuda_event)
        if handle:  # 0: never recorded, nothing has read the input yet
            drv = cuda.drv
            _drv_check(
                drv.cuStreamWaitEvent(drv.CUstream(int(stream)), drv.CUevent(handle), 0),
                "cuStreamWaitEvent",
            )

    def run_device(
        self,
        n: int,
        *,
        after: Any,
        done: Any,
        heads_to: Sequence[int] | None = None,
    ) -> TorchDeviceBatch:
        """Queue the first ``n`` frames of the static input as one batch, without a host copy
        or wait: the engine's stream waits for ``after`` (a driver ``CUevent`` the caller
        recorded after writing the frames; None: no wait), replays batch ``n``'s graph (the
        heads, also as ``CHW16`` at :attr:`head_ptrs`), copies the ``n`` images of each
        ``CHW16`` head to ``heads_to`` (device addresses, output order; None: no copy) and
        records ``done`` (a driver ``CUevent``), which the caller's stream waits on before
        reading the heads. Returns the batch, whose :meth:`~TorchDeviceBatch.timing` the caller
        reads once it is done.

        Raises ValueError for ``n`` outside 1..``max_batch`` or ``heads_to`` of the wrong
        length, RuntimeError without device I/O (or after :meth:`close`), CudaError.
        """
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a batch holds 1..{self.max_batch} frames, got {n}")
        if heads_to is not None and len(heads_to) != len(self._heads_shape):
            raise ValueError(f"heads_to needs {len(self._heads_shape)} addresses")
        torch = self._torch
        with self._lock:  # one engine: batches queue behind each other
            cuda = self._io()
            drv = cuda.drv
            stream = drv.CUstream(int(cuda.stream.cuda_stream))
            events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            with torch.cuda.device(self._dev), torch.cuda.stream(cuda.stream):
                if after is not None:
                    _drv_check(drv.cuStreamWaitEvent(stream, after, 0), "cuStreamWaitEvent")
                events[0].record(cuda.stream)
                cuda.graphs[n].graph.replay()
                events[1].record(cuda.stream)
                cuda.input_free.record(cuda.stream)
                for dst, src, nbytes in zip(
                    heads_to or (), cuda.dev_heads, self.head_image_bytes, strict=False
                ):
                    _drv_check(
                        drv.cuMemcpyDtoDAsync(int(dst), int(src.data_ptr()), n * nbytes, stream),
                        "cuMemcpyDtoDAsync",
                    )
                events[2].record(cuda.stream)
                _drv_check(drv.cuEventRecord(done, stream), "cuEventRecord")
            return TorchDeviceBatch(n, self.curve_us[n], events)

    def close(self) -> None:
        """Release the program, its graphs and buffers; idempotent. :meth:`run` raises
        RuntimeError afterwards."""
        with self._lock:
            self._module = None
            self._cuda = None
