"""The emulated DLA core's numeric engine: an INT8 graph run by onnxruntime on the CPU.

The graph comes from ``prep.emulate_graph.build_int8_graph`` (stored in the emulated loadable).
It holds the DLA's arithmetic as QuantizeLinear/DequantizeLinear pairs that onnxruntime fuses
into its integer kernels (QLinearConv, QLinearMul, ...): per-tensor symmetric INT8 activations,
per-output-channel symmetric INT8 weights, FP16 where the loadable says so. Its contract with
this module:

* one input, ``uint8 [1, C, H, W]``: the DLA's int8 activation values plus 128. A symmetric
  int8 tensor (zero point 0) is value for value the same as uint8 with zero point 128, and
  onnxruntime's CPU INT8 kernels are several times faster with uint8 activations;
* outputs ``uint8 [1, C, H, W]`` (int8 heads, again ``q + 128``) or ``float16 [1, C, H, W]``
  (fp16 heads), in the order of the output specs;
* INT8 weights as int8 at zero point 0 behind ``DequantizeLinear``.

**The same integers on every host.** onnxruntime's uint8 x int8 kernels saturate on x86 CPUs
without VNNI, so the engine runs on the operands :mod:`dlad.devices.int8_layout` finds exact on
this host (probed once per process): the graph as it is (``u8s8``) where that is exact, else with
its weights re-encoded as uint8 at zero point 128 (``u8u8``, exact everywhere, slower). Both give
the exact int32 sums a DLA computes; :attr:`Int8Engine.kernel` says which one runs.

:class:`Int8Engine` turns DLA bytes into that input and its outputs back into DLA bytes:

* input ``DLA_HWC4`` int8 ``[H][W_padded][C']`` (``C' = 4`` for 3 or 4 channels, 1 for 1;
  ``W_padded >= W``; the padding channel and row padding are ignored), exactly what
  ``dlad.imaging.pre.quantize_hwc4`` produces;
* outputs ``CHW32`` int8 ``[ceil(C/32)][H][W][32]`` or ``CHW16`` fp16 ``[ceil(C/16)][H][W][16]``,
  padding channels zero (``docs/reference/cudla.md`` §3.3), byte-identical to
  ``dlad.imaging.post.pack_chw32`` / ``pack_chw16`` of the logical heads.

onnxruntime is imported when an engine is constructed, never at module import.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from dlad.devices.int8_layout import (
    KernelPath,
    NoExactKernelError,
    OperandsChoice,
    open_session,
    select_kernel_path,
)
from dlad.imaging.pre import hwc4_layout
from dlad.loadable import DataType, Loadable

__all__ = [
    "EngineConfigError",
    "EngineInputError",
    "EngineRunError",
    "Int8Engine",
    "Int8EngineError",
    "OutputSpec",
    "engine_for_loadable",
    "hwc4_channels",
]

OutputDType = Literal["int8", "fp16"]

_LANES: dict[str, int] = {"int8": 32, "fp16": 16}
_ORT_TYPES: dict[str, str] = {"int8": "tensor(uint8)", "fp16": "tensor(float16)"}
_SIGN_BIT = np.uint8(0x80)  # q_u8 ^ 0x80, read as int8, is q_u8 - 128 (and the inverse)


class Int8EngineError(Exception):
    """Base class of the engine's errors."""


class EngineConfigError(Int8EngineError, ValueError):
    """The model bytes, shapes, scales or output specs cannot make a working engine."""


class EngineInputError(Int8EngineError, ValueError):
    """An input or output buffer passed to :meth:`Int8Engine.run` has the wrong type or shape."""


class EngineRunError(Int8EngineError, RuntimeError):
    """onnxruntime failed while running a valid input (the message carries its error)."""


class OutputSpec(NamedTuple):
    """One output tensor of the emulated core, as the loadable describes it.

    Attributes:
        name: the graph output's name (``s8``, ``s16``, ``s32`` for YOLOv5).
        channels: logical channel count ``C`` (255 for YOLOv5 with 80 classes).
        height: ``H``.
        width: ``W``.
        dtype: ``"int8"`` (``CHW32`` bytes) or ``"fp16"`` (``CHW16`` bytes).
        scale: the int8 output scale (``value = q * scale``); ``None`` for fp16.
    """

    name: str
    channels: int
    height: int
    width: int
    dtype: OutputDType
    scale: float | None

    @property
    def lanes(self) -> int:
        """Channels per group: 32 for ``CHW32`` int8, 16 for ``CHW16`` fp16."""
        return _LANES[self.dtype]

    @property
    def packed_shape(self) -> tuple[int, int, int, int]:
        """``(ceil(C / lanes), H, W, lanes)``: the DLA buffer's shape."""
        return (-(-self.channels // self.lanes), self.height, self.width, self.lanes)

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """``int8`` or ``float16``."""
        return np.dtype(np.int8 if self.dtype == "int8" else np.float16)

    @property
    def size_bytes(self) -> int:
        """Bytes of the packed buffer (channels padded to a whole group)."""
        return math.prod(self.packed_shape) * self.numpy_dtype.itemsize


def hwc4_channels(c: int) -> int:
    """``C'`` of a ``DLA_HWC4`` tensor with ``c`` channels: 1 for 1, 4 for 3 or 4.

    Raises EngineConfigError for any other ``c``.
    """
    if c == 1:
        return 1
    if c in (3, 4):
        return 4
    raise EngineConfigError(f"DLA_HWC4 holds 1, 3 or 4 channels, got {c}")


def _positive_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and bool(x >= 1)


def _positive_float(x: object) -> bool:
    return (
        isinstance(x, (int, float, np.floating))
        and not isinstance(x, bool)
        and math.isfinite(x)
        and bool(x > 0)
    )


def _check_model_bytes(x: object) -> bytes:
    if not isinstance(x, (bytes, bytearray, memoryview)) or not len(x):
        raise EngineConfigError("model_bytes must be non-empty bytes")
    return bytes(x)


def _check_shape(x: object) -> tuple[int, int, int]:
    if not isinstance(x, tuple) or len(x) != 3 or not all(_positive_int(d) for d in x):
        raise EngineConfigError(f"input_shape must be (C, H, W) positive ints, got {x!r}")
    c, h, w = (int(d) for d in x)
    return c, h, w


def _check_spec(raw: object) -> OutputSpec:
    if not isinstance(raw, tuple) or len(raw) != 6:
        raise EngineConfigError(f"an output spec is (name, C, H, W, dtype, scale), got {raw!r}")
    name, c, h, w, dtype, scale = raw
    if not isinstance(name, str) or not name:
        raise EngineConfigError(f"output name must be a non-empty str, got {name!r}")
    if not all(_positive_int(d) for d in (c, h, w)):
        raise EngineConfigError(f"output {name!r}: C, H, W must be positive ints, got {c, h, w}")
    if dtype == "int8":
        if not _positive_float(scale):
            raise EngineConfigError(f"int8 output {name!r} needs a finite positive scale")
        return OutputSpec(name, int(c), int(h), int(w), "int8", float(scale))
    if dtype == "fp16":
        if scale is not None:
            raise EngineConfigError(f"fp16 output {name!r} takes no scale, got {scale!r}")
        return OutputSpec(name, int(c), int(h), int(w), "fp16", None)
    raise EngineConfigError(f"output {name!r}: dtype must be 'int8' or 'fp16', got {dtype!r}")


def _pack_into(src: npt.NDArray[Any], dst: npt.NDArray[Any], lanes: int, *, offset: bool) -> None:
    """Write ``src [C, H, W]`` into the C-contiguous ``dst [G, H, W, lanes]``, padding lanes zero.

    ``offset``: ``src`` is uint8 ``q + 128`` and ``dst`` a uint8 view of int8 bytes; the sign
    flip ``^ 0x80`` maps one onto the other in the same pass as the reformat.
    """
    c, h, w = src.shape
    full, rem = divmod(c, lanes)
    flat = dst.reshape(dst.shape[0], h * w, lanes)  # a view: dst is C-contiguous
    # Channel g*lanes + k goes to flat[g, :, k]. Reading src strided and writing flat in order
    # is the cheaper direction (0.5 ms for 255 x 84 x 84 on one core).
    parts = [(src[: full * lanes].reshape(full, lanes, h * w), flat[:full])] if full else []
    if rem:
        parts.append((src[full * lanes :].reshape(1, rem, h * w), flat[full:, :, :rem]))
        flat[full, :, rem:] = 0
    for body, view in parts:
        if offset:
            np.bitwise_xor(body.transpose(0, 2, 1), _SIGN_BIT, out=view)
        else:
            np.copyto(view, body.transpose(0, 2, 1))


class Int8Engine:
    """One emulated DLA core's numeric engine: one onnxruntime CPU session.

    Args:
        model_bytes: the serialized ONNX graph of ``prep.emulate_graph`` (contract above).
        input_scale: the ``images`` scale the input bytes were quantised with (metadata for
            callers; the graph holds it too).
        input_shape: ``(C, H, W)`` of the logical input; ``C`` in {1, 3, 4}.
        outputs: one :class:`OutputSpec` (or equal 6-tuple) per graph output, in order.
        threads: onnxruntime intra-op threads (>= 1).
        operands: ``"auto"`` (the exact, fastest operands of this host, see
            :mod:`dlad.devices.int8_layout`), or ``"u8s8"`` / ``"u8u8"`` to force one (for
            benchmarks and tests; a forced ``u8s8`` is not exact on every host).

    Raises:
        EngineConfigError: a bad argument, model bytes onnxruntime cannot load, a graph whose
            input or outputs disagree with ``input_shape`` / ``outputs``, or a host on which
            no operands are exact.

    :meth:`run` is thread-safe; calls are serialised, one task at a time, as on a DLA core.
    """

    def __init__(
        self,
        model_bytes: bytes,
        *,
        input_scale: float,
        input_shape: tuple[int, int, int],
        outputs: Sequence[OutputSpec | tuple[Any, ...]],
        threads: int = 1,
        operands: OperandsChoice = "auto",
    ) -> None:
        model = _check_model_bytes(model_bytes)
        if not _positive_float(input_scale):
            raise EngineConfigError(f"input_scale must be finite and positive: {input_scale!r}")
        c, h, w = _check_shape(input_shape)
        if not _positive_int(threads):
            raise EngineConfigError(f"threads must be a positive int, got {threads!r}")
        self._c_padded = hwc4_channels(c)
        specs = tuple(_check_spec(o) for o in outputs)
        if not specs:
            raise EngineConfigError("the engine needs at least one output")
        if len({s.name for s in specs}) != len(specs):
            raise EngineConfigError(f"output names repeat: {[s.name for s in specs]}")
        self.input_scale = float(input_scale)
        self.input_shape = (c, h, w)
        self.outputs = specs
        self.threads = int(threads)
        self.kernel: KernelPath
        self._session = self._open(model, operands)
        self._output_names = [s.name for s in specs]
        # The one input buffer, reused by every run under the lock (1.3 MB at 672x672).
        self._input = np.empty((1, c, h, w), dtype=np.uint8)
        self._feed = {self.input_name: self._input}
        self._lock = threading.Lock()

    def _open(self, model: bytes, operands: OperandsChoice) -> Any:
        try:
            self.kernel = select_kernel_path(operands)
        except (ValueError, NoExactKernelError) as exc:
            raise EngineConfigError(str(exc)) from exc
        try:
            session = open_session(model, threads=self.threads, kernel=self.kernel)
        except Exception as exc:  # onnxruntime's errors share no base class but Exception
            raise EngineConfigError(f"onnxruntime cannot load the engine graph: {exc}") from exc
        inputs = session.get_inputs()
        c, h, w = self.input_shape
        if len(inputs) != 1:
            raise EngineConfigError(f"the graph must have one input, has {len(inputs)}")
        if inputs[0].type != "tensor(uint8)" or list(inputs[0].shape) != [1, c, h, w]:
            raise EngineConfigError(
                f"graph input {inputs[0].name!r} is {inputs[0].type} {inputs[0].shape}, "
                f"expected tensor(uint8) [1, {c}, {h}, {w}]"
            )
        self.input_name: str = inputs[0].name
        got = {o.name: o for o in session.get_outputs()}
        for spec in self.outputs:
            out = got.get(spec.name)
            want = [1, spec.channels, spec.height, spec.width]
            if out is None or out.type != _ORT_TYPES[spec.dtype] or list(out.shape) != want:
                found = "missing" if out is None else f"{out.type} {out.shape}"
                raise EngineConfigError(
                    f"graph output {spec.name!r} is {found}, expected "
                    f"{_ORT_TYPES[spec.dtype]} {want}"
                )
        return session

    @property
    def input_hwc4_shape(self) -> tuple[int, int, int]:
        """``(H, W_padded, C')`` of the canonical input buffer (64-byte row pitch, as on Orin)."""
        c, h, w = self.input_shape
        return h, hwc4_layout(c, h, w, 1)[0], self._c_padded

    def new_outputs(self) -> list[npt.NDArray[Any]]:
        """Fresh, zeroed output buffers of the packed shapes and dtypes (for ``run(out=...)``)."""
        return [np.zeros(s.packed_shape, dtype=s.numpy_dtype) for s in self.outputs]

    def _check_input(self, x: object) -> npt.NDArray[np.int8]:
        c, h, w = self.input_shape
        if not isinstance(x, np.ndarray) or x.dtype != np.int8 or x.ndim != 3:
            got = f"{x.dtype} array of {x.ndim} dims" if isinstance(x, np.ndarray) else type(x)
            raise EngineInputError(f"input must be a 3-D int8 DLA_HWC4 array, got {got}")
        if x.shape[0] != h or x.shape[1] < w or x.shape[2] != self._c_padded:
            raise EngineInputError(
                f"input {x.shape} is not DLA_HWC4 [{h}][>={w}][{self._c_padded}] "
                f"for a {c}x{h}x{w} image"
            )
        return x

    def _check_out(self, out: object) -> list[npt.NDArray[Any]]:
        if not isinstance(out, (list, tuple)) or len(out) != len(self.outputs):
            raise EngineInputError(f"out must be a list of {len(self.outputs)} arrays")
        for spec, buf in zip(self.outputs, out, strict=True):
            if (
                not isinstance(buf, np.ndarray)
                or buf.dtype != spec.numpy_dtype
                or buf.shape != spec.packed_shape
                or not buf.flags.c_contiguous
                or not buf.flags.writeable
            ):
                raise EngineInputError(
                    f"out buffer for {spec.name!r} must be a writeable C-contiguous "
                    f"{spec.numpy_dtype} array of shape {spec.packed_shape}"
                )
        return list(out)

    def run(
        self,
        input_hwc4: npt.NDArray[np.int8],
        out: Sequence[npt.NDArray[Any]] | None = None,
    ) -> list[npt.NDArray[Any]]:
        """Run one frame: ``DLA_HWC4`` int8 in, packed DLA output buffers out.

        ``input_hwc4`` is ``int8 [H][W_padded][C']`` with ``W_padded >= W`` (any row pitch);
        only ``[:, :W, :C]`` is read. Returns one array per :attr:`outputs` entry: ``CHW32``
        int8 ``[ceil(C/32)][H][W][32]`` or ``CHW16`` fp16 ``[ceil(C/16)][H][W][16]`` with zero
        padding channels; written into ``out`` (and returned) when given, else new arrays.

        Raises:
            EngineInputError: ``input_hwc4`` or ``out`` has the wrong type, dtype or shape.
            EngineRunError: onnxruntime failed.
        """
        x = self._check_input(input_hwc4)
        dsts = self._check_out(out) if out is not None else None
        c, _, w = self.input_shape
        src = x.view(np.uint8)[:, :w, :c].transpose(2, 0, 1)
        with self._lock:
            np.bitwise_xor(src, _SIGN_BIT, out=self._input[0])
            try:
                results = self._session.run(self._output_names, self._feed)
            except Exception as exc:  # onnxruntime's errors share no base class but Exception
                raise EngineRunError(f"onnxruntime failed: {exc}") from exc
        if dsts is None:
            dsts = [np.empty(s.packed_shape, dtype=s.numpy_dtype) for s in self.outputs]
        for spec, result, dst in zip(self.outputs, results, dsts, strict=True):
            if spec.dtype == "int8":
                _pack_into(result[0], dst.view(np.uint8), spec.lanes, offset=True)
            else:
                _pack_into(result[0], dst, spec.lanes, offset=False)
        return dsts


def engine_for_loadable(
    loadable: Loadable, *, threads: int = 1, operands: OperandsChoice = "auto"
) -> Int8Engine:
    """The engine of an emulated loadable: its ``graph`` section, input scale and shape, and one
    :class:`OutputSpec` per output descriptor (``CHW32`` int8 with its scale, else ``CHW16``
    fp16). Raises what :class:`Int8Engine` raises."""
    specs = [
        OutputSpec(d.name, d.c, d.h, d.w, "int8", d.scale)
        if d.data_type == DataType.INT8
        else OutputSpec(d.name, d.c, d.h, d.w, "fp16", None)
        for d in loadable.outputs
    ]
    inp = loadable.inputs[0]
    return Int8Engine(
        loadable.sections["graph"],
        input_scale=loadable.input_scale,
        input_shape=(inp.c, inp.h, inp.w),
        outputs=specs,
        threads=threads,
        operands=operands,
    )
