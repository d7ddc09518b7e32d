"""The emulated DLA loadable: what ``prep build --target emulated`` writes and an emulated DLA core
loads, and the cuDLA I/O tensor descriptors it carries.

A TensorRT standalone loadable is opaque; what a program learns from it is what
``cudlaModuleGetAttributes`` reports, the I/O tensor descriptors. The emulated loadable carries
those descriptors, computed by the formulas of ``docs/reference/cudla.md`` §3.3, next to what
the emulated core needs to compute and to take the chip's time: the INT8 emulation graph, the
scales, the per-layer precision, the detection-head geometry and the modelled latency. The byte
layout, the header schema and the descriptor conventions are in ``docs/loadable.md``.

Errors raised by :func:`read_loadable` (every message names the file)::

    ValueError
     └── LoadableError
          ├── LoadableCorruptError   bad magic, CRC or section hash, truncation, malformed or
          │                          incomplete header, a descriptor that breaks its formula
          ├── LoadableVersionError   a format version this dlad does not read
          └── LoadableCoreError      built for the other DLA core

Only the standard library and numpy are imported, so the daemon can import this anywhere.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
import os
import re
import struct
import tempfile
import types
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias, TypeVar

import numpy as np

__all__ = [
    "DEFAULT_FAMILY", "FORMAT_VERSION", "MAGIC", "READABLE_VERSIONS", "DataCategory",
    "DataFormat", "DataType",
    "Loadable", "LoadableCoreError", "LoadableCorruptError", "LoadableError",
    "LoadableVersionError", "PixelFormat", "PixelMapping", "TensorDescriptor", "TensorFormat",
    "check_descriptor", "chw_vectorized", "descriptor_for", "dla_linear", "hwc4_input",
    "loadable_bytes", "read_loadable", "write_loadable",
]  # fmt: skip

FORMAT_VERSION: Final = 3
"""The container version this module writes (2 added the model family, as ``decoder``;
3 calls it ``family`` and lets a family without anchors leave ``anchors_px`` empty)."""
READABLE_VERSIONS: Final = (1, 2, 3)
"""The container versions :func:`read_loadable` accepts (a version 1 file is a ``yolov5``)."""
DEFAULT_FAMILY: Final = "yolov5"
"""The model family of version 1 files, which do not name one."""
MAGIC: Final = b"DLADEMU\0"
FORMAT_NAME: Final = "dlad-emulated-loadable"
SECTION_ALIGN: Final = 64
"""Sections start on 64-byte boundaries of the data area, so they can be viewed in place."""
NAME_MAX_BYTES: Final = 80
"""``CUDLA_RUNTIME_TENSOR_DESC_NAME_MAX_LEN``: a tensor name is at most 80 UTF-8 bytes."""
CLASS_NAME_MAX_BYTES: Final = 128
"""A class name is at most 128 UTF-8 bytes (the STATUS report's name bound)."""
NUM_STRIDES: Final = 8
MAX_DIM: Final = 8192
"""DLA limit on C, H and W of an I/O tensor (docs/reference/cudla.md §3.4); batch is limited to
4096."""
MAX_BATCH: Final = 4096
ROW_ALIGN_BYTES: Final = 64
"""Row pitch alignment of ``DLA_HWC4`` and ``DLA_LINEAR`` on Orin (32 on Xavier)."""
REQUIRED_SECTIONS: Final = ("graph",)

_PREAMBLE = struct.Struct("<8sII")  # magic, version, header length
_CRC = struct.Struct("<I")
_T = TypeVar("_T")


class LoadableError(ValueError):
    """A loadable could not be used; the message names the file."""


class LoadableCorruptError(LoadableError):
    """Not a well-formed emulated loadable: bad magic, CRC or section hash, truncated, malformed
    or incomplete header, or a tensor descriptor that does not follow its layout formula."""


class LoadableVersionError(LoadableError):
    """A well-framed loadable of a format version this dlad does not read."""


class LoadableCoreError(LoadableError):
    """A loadable built for one DLA core, loaded on the other (cuDLA needs one per core)."""


# ----------------------------------------------------------------------------- cuDLA enums


class DataType(enum.IntEnum):
    """``CUDLA_DATA_TYPE_*``."""

    UNKNOWN = 0
    FLOAT = 1
    HALF = 2
    INT16 = 3
    INT8 = 4
    UINT8 = 5
    UINT16 = 6


class DataFormat(enum.IntEnum):
    """``CUDLA_DATA_FORMAT_*``."""

    UNKNOWN = 0
    NCHW = 1
    NHWC = 2
    NCxHWx = 3


class DataCategory(enum.IntEnum):
    """``CUDLA_DATA_CATEGORY_*``."""

    IMAGE = 0
    WEIGHT = 1
    FEATURE = 2
    PLANAR = 3
    BIAS = 4


class PixelMapping(enum.IntEnum):
    """``CUDLA_PIXEL_MAPPING_*``."""

    PITCH_LINEAR = 0
    BLOCK_LINEAR = 1


class PixelFormat(enum.IntEnum):
    """The ``CUDLA_PIXEL_FORMAT_*`` values the emulator reports (cuDLA numbers 0..37).

    cuDLA's list is NVDLA's ``R8 = 0`` ... ``FEATURE = 36`` without ``FEATURE_X8``, then
    ``UNKNOWN = 37``; ``docs/loadable.md`` has the whole table.
    """

    R8 = 0
    R16_F = 5
    A16B16G16R16_F = 8
    A8B8G8R8 = 12
    FEATURE = 36
    UNKNOWN = 37


class TensorFormat(enum.IntEnum):
    """The TensorRT I/O format of a DLA tensor, valued as ``nvinfer1::TensorFormat``."""

    CHW16 = 4
    CHW32 = 5
    DLA_LINEAR = 9
    DLA_HWC4 = 10


_NUMPY: Final = {
    DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT16: np.int16,
    DataType.INT8: np.int8, DataType.UINT8: np.uint8, DataType.UINT16: np.uint16,
}  # fmt: skip
# "I/O Formats on DLA" (docs/reference/cudla.md §3.3): the element types each format takes,
# default first.
_FORMAT_TYPES: Final = {
    TensorFormat.DLA_HWC4: (DataType.INT8, DataType.HALF),
    TensorFormat.CHW16: (DataType.HALF,),
    TensorFormat.CHW32: (DataType.INT8,),
    TensorFormat.DLA_LINEAR: (DataType.INT8, DataType.HALF),
}
OUTPUT_FORMATS: Final = frozenset({TensorFormat.CHW16, TensorFormat.CHW32, TensorFormat.DLA_LINEAR})
"""A DLA writes only these; ``DLA_HWC4`` is input-only."""


# ----------------------------------------------------------------------------- descriptors


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _uint(value: object, what: str, bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if not 0 <= int(value) < 1 << bits:
        raise ValueError(f"{what} must fit a uint{bits}, got {value!r}")
    return int(value)


def _text(value: object, what: str, *, max_bytes: int | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8 text: {value!r}") from None
    if max_bytes is not None and ("\0" in value or size > max_bytes):
        raise ValueError(f"{what} must be at most {max_bytes} UTF-8 bytes without NUL: {value!r}")
    return value


def _number(value: object, what: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{what} must be finite and {'>= 0' if allow_zero else '> 0'}, got {v}")
    return v


Stride: TypeAlias = tuple[int, int, int, int, int, int, int, int]
_ENUM_FIELDS: Final[dict[str, type[enum.IntEnum]]] = {
    "data_format": DataFormat, "data_type": DataType, "data_category": DataCategory,
    "pixel_format": PixelFormat, "pixel_mapping": PixelMapping, "tensor_format": TensorFormat,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorDescriptor:
    """One I/O tensor as ``cudlaModuleTensorDescriptor`` describes it, plus its TensorRT format and
    INT8 scale (neither is in cuDLA's struct).

    ``stride`` is in bytes, as NVDLA's compiler fills it: ``[0]`` element size, ``[1]`` line (row)
    stride, ``[2]`` surface stride (between channel planes or channel groups; 0 for an image),
    ``[3]`` plane stride, ``[4:]`` zero. Sizes and strides are those of the whole tensor, batch
    included (``size``) or of one image (strides).

    Construction checks only what the C struct can hold (name, uint ranges, enum members) and a
    positive scale on INT8 tensors only, because a real cuDLA may report what our formulas do not
    predict; :func:`check_descriptor` compares with the formula. Raises ValueError.
    """

    name: str
    size: int
    n: int
    c: int
    h: int
    w: int
    data_format: DataFormat
    data_type: DataType
    data_category: DataCategory
    pixel_format: PixelFormat
    pixel_mapping: PixelMapping
    stride: Stride
    tensor_format: TensorFormat
    scale: float | None = None

    def __post_init__(self) -> None:
        _text(self.name, "tensor name", max_bytes=NAME_MAX_BYTES)
        for key in ("size", "n", "c", "h", "w"):
            object.__setattr__(self, key, _uint(getattr(self, key), key, 64))
        for key, kind in _ENUM_FIELDS.items():
            object.__setattr__(self, key, kind(getattr(self, key)))
        stride = tuple(self.stride)
        if len(stride) != NUM_STRIDES:
            raise ValueError(f"stride must have {NUM_STRIDES} entries, got {len(stride)}")
        object.__setattr__(self, "stride", tuple(_uint(s, "stride", 32) for s in stride))
        if self.scale is not None:
            if self.data_type != DataType.INT8:
                raise ValueError(f"{self.name}: only INT8 tensors carry a scale")
            object.__setattr__(self, "scale", _number(self.scale, "scale"))

    @property
    def numpy_dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype of one element. Raises ValueError for ``DataType.UNKNOWN``."""
        if self.data_type not in _NUMPY:
            raise ValueError(f"{self.name}: data type {self.data_type.name} has no numpy dtype")
        return np.dtype(_NUMPY[self.data_type])

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        """The buffer as a C-contiguous numpy shape, padding included: ``DLA_HWC4``
        ``(N, H, W', C')``, ``CHWx`` ``(N, ceil(C/x), H, W, x)``, ``DLA_LINEAR``
        ``(N, C, H, W')``, where ``W'`` is the row pitch ``stride[1]`` over the pixel size."""
        e = self.numpy_dtype.itemsize
        if self.tensor_format == TensorFormat.DLA_HWC4:
            cp = 1 if self.c == 1 else 4
            return (self.n, self.h, self.stride[1] // (cp * e), cp)
        if self.tensor_format == TensorFormat.DLA_LINEAR:
            return (self.n, self.c, self.h, self.stride[1] // e)
        vec = 16 if self.tensor_format == TensorFormat.CHW16 else 32
        return (self.n, -(-self.c // vec), self.h, self.w, vec)

    def to_dict(self) -> dict[str, JSONValue]:
        """The JSON form stored in the loadable header (enums by name)."""
        out: dict[str, JSONValue] = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update({key: getattr(self, key).name for key in _ENUM_FIELDS})
        out["stride"] = list(self.stride)
        return out

    @classmethod
    def from_dict(cls, d: object) -> TensorDescriptor:
        """Inverse of :meth:`to_dict`. Raises ValueError for a missing, extra or mistyped key."""
        if not isinstance(d, dict):
            raise ValueError(f"a tensor descriptor must be an object, got {type(d).__name__}")
        expected = {f.name for f in fields(cls)}
        if set(d) != expected:
            raise ValueError(f"descriptor keys differ: missing {sorted(expected - set(d))}, "
                             f"unknown {sorted(set(d) - expected)}")  # fmt: skip
        values = dict(d)
        for key, kind in _ENUM_FIELDS.items():
            if not isinstance(d[key], str) or d[key] not in kind.__members__:
                raise ValueError(f"descriptor {key} {d[key]!r} is not a {kind.__name__} name")
            values[key] = kind.__members__[d[key]]
        if not isinstance(d["stride"], list):
            raise ValueError(f"descriptor stride must be a list, got {d['stride']!r}")
        if d["scale"] is not None:
            values["scale"] = _number(d["scale"], "scale")
        return cls(**values)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _checked(fmt: TensorFormat, nchw: tuple[int, int, int, int], dt: DataType | None) -> DataType:
    for key, value, limit in zip("nchw", nchw, (MAX_BATCH, MAX_DIM, MAX_DIM, MAX_DIM), strict=True):
        if not _is_int(value) or not 1 <= value <= limit:
            raise ValueError(
                f"{key} must be an int in [1, {limit}] for a DLA tensor, got {value!r}"
            )
    data_type = _FORMAT_TYPES[fmt][0] if dt is None else DataType(dt)
    if data_type not in _FORMAT_TYPES[fmt]:
        allowed = ", ".join(t.name for t in _FORMAT_TYPES[fmt])
        raise ValueError(f"{fmt.name} on DLA takes {allowed}, not {data_type.name}")
    return data_type


def _stride(*head: int) -> Stride:
    return (*head, 0, 0, 0, 0, 0, 0, 0, 0)[:NUM_STRIDES]  # type: ignore[return-value]


def hwc4_input(
    name: str, c: int, h: int, w: int, *, n: int = 1,
    data_type: DataType = DataType.INT8, scale: float | None = None,
) -> TensorDescriptor:  # fmt: skip
    """A ``DLA_HWC4`` input, ``[N][H][roundUp(W, 64 / (C' * elem))][C']`` on Orin.

    ``C'`` is 1 for ``c == 1`` and 4 for ``c`` in {3, 4}, so the row pitch
    ``W' * C' * elem`` is a multiple of 64 bytes (int8 RGB pads W to 16 pixels). ``c`` is
    reported as given; ``size = n * h * pitch``; ``stride = (elem, pitch, 0, 0, ...)`` (an image
    has no surface stride); NHWC, IMAGE, pixel format R8 / A8B8G8R8 (int8) or R16_F /
    A16B16G16R16_F (fp16). Raises ValueError for ``c`` not in {1, 3, 4}, a type other than INT8
    or HALF, or a dimension outside the DLA's limits.
    """
    dt = _checked(TensorFormat.DLA_HWC4, (n, c, h, w), data_type)
    if c not in (1, 3, 4):
        raise ValueError(f"DLA_HWC4 takes 1, 3 or 4 channels, got {c}")
    e, cp = np.dtype(_NUMPY[dt]).itemsize, (1 if c == 1 else 4)
    pitch = _round_up(w, ROW_ALIGN_BYTES // (cp * e)) * cp * e
    pixel = {(1, 1): PixelFormat.R8, (4, 1): PixelFormat.A8B8G8R8, (1, 2): PixelFormat.R16_F,
             (4, 2): PixelFormat.A16B16G16R16_F}[cp, e]  # fmt: skip
    return TensorDescriptor(
        name, n * h * pitch, n, c, h, w, DataFormat.NHWC, dt, DataCategory.IMAGE, pixel,
        PixelMapping.PITCH_LINEAR, _stride(e, pitch), TensorFormat.DLA_HWC4, scale,
    )  # fmt: skip


def chw_vectorized(
    name: str, c: int, h: int, w: int, *, vec: Literal[16, 32], n: int = 1,
    data_type: DataType | None = None, scale: float | None = None,
) -> TensorDescriptor:  # fmt: skip
    """A ``CHW16`` (fp16) or ``CHW32`` (int8) tensor, ``[N][ceil(C/vec)][H][W][vec]``.

    C is padded to a multiple of ``vec`` (255 → 256): ``line = W * vec * elem`` (32 bytes a pixel
    in both formats), ``surface = H * line``, ``size = n * ceil(C/vec) * surface``,
    ``stride = (elem, line, surface, 0, ...)``; NCxHWx, FEATURE, pixel format FEATURE.
    ``data_type`` defaults to the one type the format takes on DLA. Raises ValueError for ``vec``
    not in {16, 32}, another type, or a dimension outside the DLA's limits.
    """
    if vec not in (16, 32):
        raise ValueError(f"vec must be 16 (CHW16) or 32 (CHW32), got {vec!r}")
    fmt = TensorFormat.CHW16 if vec == 16 else TensorFormat.CHW32
    dt = _checked(fmt, (n, c, h, w), data_type)
    e = np.dtype(_NUMPY[dt]).itemsize
    line = w * vec * e
    return TensorDescriptor(
        name, n * -(-c // vec) * h * line, n, c, h, w, DataFormat.NCxHWx, dt,
        DataCategory.FEATURE, PixelFormat.FEATURE, PixelMapping.PITCH_LINEAR,
        _stride(e, line, h * line), fmt, scale,
    )  # fmt: skip


def dla_linear(
    name: str, c: int, h: int, w: int, *, n: int = 1,
    data_type: DataType = DataType.INT8, scale: float | None = None,
) -> TensorDescriptor:  # fmt: skip
    """A ``DLA_LINEAR`` tensor, ``[N][C][H][roundUp(W, 64 / elem)]`` (rows padded to 64 bytes).

    ``line = roundUp(W * elem, 64)``, ``surface = H * line``, ``size = n * C * surface``,
    ``stride = (elem, line, surface, surface, 0, ...)``; NCHW, PLANAR, pixel format 0: what cuDLA
    reported for such a tensor in cuda-samples issue #192. Raises ValueError for a type other
    than INT8 or HALF, or a dimension outside the DLA's limits.
    """
    dt = _checked(TensorFormat.DLA_LINEAR, (n, c, h, w), data_type)
    e = np.dtype(_NUMPY[dt]).itemsize
    line = _round_up(w * e, ROW_ALIGN_BYTES)
    return TensorDescriptor(
        name, n * c * h * line, n, c, h, w, DataFormat.NCHW, dt, DataCategory.PLANAR,
        PixelFormat.R8, PixelMapping.PITCH_LINEAR, _stride(e, line, h * line, h * line),
        TensorFormat.DLA_LINEAR, scale,
    )  # fmt: skip


def descriptor_for(
    tensor_format: TensorFormat, name: str, *, n: int, c: int, h: int, w: int,
    data_type: DataType | None = None, scale: float | None = None,
) -> TensorDescriptor:  # fmt: skip
    """What the formula of ``tensor_format`` gives (dispatches to the factories, whose
    ValueErrors it raises)."""
    fmt = TensorFormat(tensor_format)
    if fmt == TensorFormat.DLA_HWC4:
        return hwc4_input(name, c, h, w, n=n, data_type=data_type or DataType.INT8, scale=scale)
    if fmt == TensorFormat.DLA_LINEAR:
        return dla_linear(name, c, h, w, n=n, data_type=data_type or DataType.INT8, scale=scale)
    vec: Literal[16, 32] = 16 if fmt == TensorFormat.CHW16 else 32
    return chw_vectorized(name, c, h, w, vec=vec, n=n, data_type=data_type, scale=scale)


def check_descriptor(d: TensorDescriptor) -> None:
    """Raise ValueError, naming the differing fields, unless ``d`` is exactly what its format's
    formula gives for its name, dimensions, data type and scale."""
    want = descriptor_for(
        d.tensor_format, d.name, n=d.n, c=d.c, h=d.h, w=d.w, data_type=d.data_type, scale=d.scale
    )
    diff = [
        f"{f.name}={getattr(d, f.name)!r} (formula: {getattr(want, f.name)!r})"
        for f in fields(TensorDescriptor)
        if getattr(d, f.name) != getattr(want, f.name)
    ]
    if diff:
        raise ValueError(f"tensor {d.name!r} breaks the {d.tensor_format.name} formula: "
                         + "; ".join(diff))  # fmt: skip


# ----------------------------------------------------------------------------- the loadable

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"
Heads: TypeAlias = Literal["int8", "fp16"]
_HEADS: Final[dict[str, Heads]] = {"int8": "int8", "fp16": "fp16"}
_SECTION_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_FAMILY_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _json_object(value: object, what: str) -> Mapping[str, JSONValue]:
    """A detached, read-only copy of a JSON object (round-tripped, so it is serialisable)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    try:
        text = json.dumps(dict(value), allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None
    return types.MappingProxyType(json.loads(text))


def _anchors(value: object) -> tuple[tuple[tuple[float, float], ...], ...]:
    def seq(x: object, length: int | None = None, *, empty: bool = False) -> Sequence[object]:
        if isinstance(x, np.ndarray):  # e.g. dlad.families.yolov5.ANCHORS
            x = x.tolist()
        if isinstance(x, (str, bytes)) or not isinstance(x, Sequence) or (not x and not empty):
            raise ValueError("anchors_px must be [levels][anchors][2] (w, h), or empty")
        if length is not None and len(x) != length:
            raise ValueError("anchors_px must be [levels][anchors][2] (w, h), or empty")
        return x

    levels = [[seq(a, 2) for a in seq(lvl)] for lvl in seq(value, empty=True)]
    if len({len(lvl) for lvl in levels}) > 1:
        raise ValueError("anchors_px needs the same number of anchors on every level")
    return tuple(tuple((_number(a[0], "anchor"), _number(a[1], "anchor")) for a in lvl)
                 for lvl in levels)  # fmt: skip


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Loadable:
    """An emulated DLA loadable: I/O descriptors, scales, head geometry, latency and sections.

    Construction checks (ValueError names the first broken one): every descriptor follows its
    formula and is a legal DLA input / output format; tensor names are unique; one batch size;
    every INT8 tensor has a scale, every INT8 input's is ``input_scale``; ``output_scales`` holds
    exactly the INT8 outputs' scales; ``heads`` is ``"int8"`` iff every output is INT8, ``"fp16"``
    iff every output is HALF; output ``i`` is the stride-``strides[i]`` head of an
    ``image_size`` input, with the channels (and ``anchors_px``, empty where it has none) its
    model ``family`` has (``dlad.families``; a family this dlad does not have is not checked
    here, and refused where the model is configured); ``sections`` has a non-empty ``graph``.
    Sequences are stored as tuples, mappings as read-only copies.
    ``dataclasses.replace(loadable, dla_core=1)`` gives the other core's loadable.
    """

    name: str
    dla_core: int
    inputs: tuple[TensorDescriptor, ...]
    outputs: tuple[TensorDescriptor, ...]
    input_scale: float
    output_scales: Mapping[str, float]
    heads: Heads
    num_classes: int
    class_names: tuple[str, ...]
    anchors_px: tuple[tuple[tuple[float, float], ...], ...]
    strides: tuple[int, ...]
    image_size: tuple[int, int]
    latency_us: float
    sections: Mapping[str, bytes]
    fp16_nodes: tuple[str, ...] = ()
    family: str = DEFAULT_FAMILY
    latency_layers: Mapping[str, JSONValue] = field(default_factory=dict)
    provenance: Mapping[str, JSONValue] = field(default_factory=dict)
    created: str = field(default_factory=_utc_now)

    def __post_init__(self) -> None:
        def put(key: str, value: object) -> None:
            object.__setattr__(self, key, value)

        _text(self.name, "name")
        if not _is_int(self.dla_core) or self.dla_core not in (0, 1):
            raise ValueError(f"dla_core must be 0 or 1, got {self.dla_core!r}")
        datetime.fromisoformat(_text(self.created, "created"))  # ValueError unless ISO 8601
        heads: object = self.heads
        if not isinstance(heads, str) or heads not in _HEADS:
            raise ValueError(f"heads must be 'int8' or 'fp16', got {self.heads!r}")
        put("input_scale", _number(self.input_scale, "input_scale"))
        put("latency_us", _number(self.latency_us, "latency_us", allow_zero=True))
        put("fp16_nodes", tuple(_text(s, "fp16 node") for s in self.fp16_nodes))
        family: object = self.family
        if not isinstance(family, str) or not _FAMILY_NAME.fullmatch(family):
            raise ValueError(f"family must match {_FAMILY_NAME.pattern}, got {family!r:.80}")
        put("class_names", tuple(_text(s, "class name", max_bytes=CLASS_NAME_MAX_BYTES)
                                 for s in self.class_names))  # fmt: skip
        put("latency_layers", _json_object(self.latency_layers, "latency_layers"))
        put("provenance", _json_object(self.provenance, "provenance"))
        put("anchors_px", _anchors(self.anchors_px))
        put("strides", tuple(_uint(s, "stride", 16) for s in self.strides))
        size = tuple(_uint(s, "image_size", 16) for s in self.image_size)
        if len(size) != 2 or 0 in size or 0 in self.strides:
            raise ValueError(
                f"image_size (h, w) and strides must be positive: {size} {self.strides}"
            )
        put("image_size", size)
        put("inputs", tuple(self.inputs))
        put("outputs", tuple(self.outputs))
        raw: object = self.sections  # checked as untyped: callers need not be type-checked
        if not isinstance(raw, Mapping):
            raise ValueError("sections must be a mapping of name to bytes")
        sections: dict[str, bytes] = {}
        for key, blob in raw.items():
            if not isinstance(key, str) or not _SECTION_NAME.fullmatch(key):
                raise ValueError(f"section name {key!r} must match {_SECTION_NAME.pattern}")
            if not isinstance(blob, (bytes, bytearray, memoryview)):
                raise ValueError(f"section {key!r} must be bytes, got {type(blob).__name__}")
            sections[key] = bytes(blob)
        if missing := [key for key in REQUIRED_SECTIONS if not sections.get(key)]:
            raise ValueError(f"sections {missing} are required and must not be empty")
        put("sections", types.MappingProxyType(sections))
        put("output_scales", self._check_tensors())
        self._check_geometry()

    def _check_tensors(self) -> Mapping[str, float]:
        tensors = (*self.inputs, *self.outputs)
        if not self.inputs or not self.outputs:
            raise ValueError("a loadable needs at least one input and one output")
        for d in tensors:
            if not isinstance(d, TensorDescriptor):
                raise ValueError(f"inputs and outputs must be TensorDescriptors, got {d!r}")
            check_descriptor(d)
            if d.data_type == DataType.INT8 and d.scale is None:
                raise ValueError(f"INT8 tensor {d.name!r} has no scale")
        if len({d.name for d in tensors}) != len(tensors):
            raise ValueError(f"tensor names must be unique: {[d.name for d in tensors]}")
        if len({d.n for d in tensors}) != 1:
            raise ValueError("all tensors of a DLA loadable have the same batch size n")
        for d in self.inputs:
            if d.scale is not None and d.scale != self.input_scale:
                raise ValueError(f"input {d.name!r} scale {d.scale} is not input_scale")
        for d in self.outputs:
            if d.tensor_format not in OUTPUT_FORMATS:
                raise ValueError(f"output {d.name!r}: a DLA cannot write {d.tensor_format.name}")
        head_type = DataType.INT8 if self.heads == "int8" else DataType.HALF
        if any(d.data_type != head_type for d in self.outputs):
            raise ValueError(f"heads={self.heads!r} but not every output is {head_type.name}")
        want = {d.name: d.scale for d in self.outputs if d.scale is not None}
        raw: object = self.output_scales
        got = dict(raw) if isinstance(raw, Mapping) else None
        if got != want:
            raise ValueError(f"output_scales {got!r} must be the INT8 outputs' scales {want}")
        return types.MappingProxyType(want)

    def _check_geometry(self) -> None:
        if not _is_int(self.num_classes) or self.num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {self.num_classes!r}")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes")
        size = self.image_size
        if len(self.strides) != len(self.outputs):
            raise ValueError(f"{len(self.outputs)} outputs and {len(self.strides)} strides "
                             "must agree")  # fmt: skip
        for d in self.inputs:
            if (d.h, d.w) != size:
                raise ValueError(f"input {d.name!r} is {d.h}x{d.w}, image_size is {size}")
        for d, s in zip(self.outputs, self.strides, strict=True):
            if (d.h * s, d.w * s) != size:
                raise ValueError(f"output {d.name!r} ({d.c}x{d.h}x{d.w}) is not the stride-{s} "
                                 f"head of a {size} input")  # fmt: skip
        from dlad import families  # noqa: PLC0415  # the families import this module

        if (family := families.FAMILIES.get(self.family)) is not None:
            family.check_heads(self)


# ----------------------------------------------------------------------------- encoding


def _jsonable(value: object) -> JSONValue:
    if isinstance(value, TensorDescriptor):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value  # type: ignore[return-value]  # str, int, float, bool, None by construction


def loadable_bytes(loadable: Loadable) -> bytes:
    """The file bytes of ``loadable``; deterministic (equal loadables give equal bytes)."""
    entries: list[JSONValue] = []
    chunks: list[bytes] = []
    end = 0
    for name, blob in loadable.sections.items():
        offset = _round_up(end, SECTION_ALIGN)
        chunks += [bytes(offset - end), blob]
        entries.append({"name": name, "offset": offset, "size": len(blob),
                        "sha256": hashlib.sha256(blob).hexdigest()})  # fmt: skip
        end = offset + len(blob)
    h = {
        f.name: _jsonable(getattr(loadable, f.name))
        for f in fields(Loadable)
        if f.name != "sections"
    }
    h.update(format=FORMAT_NAME, version=FORMAT_VERSION, sections=entries, data_size=end)
    text = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    header = text.encode("utf-8")
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    body = b"".join([head, bytes(_round_up(len(head), SECTION_ALIGN) - len(head)), *chunks])
    return body + _CRC.pack(zlib.crc32(body))


def write_loadable(path: str | os.PathLike[str], loadable: Loadable) -> Path:
    """Write ``loadable`` to ``path`` atomically (a temporary file in the same directory,
    fsync, rename), so a reader never sees a partial file; mode 0644. Returns the path.
    Raises OSError if the directory is missing or not writable."""
    target = Path(path)
    blob = loadable_bytes(loadable)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


# ----------------------------------------------------------------------------- decoding

_HEADER_KEYS: Final = frozenset(
    {f.name for f in fields(Loadable)} | {"format", "version", "data_size"}
)
_HEADER_KEYS_BY_VERSION: Final = {
    1: _HEADER_KEYS - {"family"}, 2: _HEADER_KEYS - {"family"} | {"decoder"}, 3: _HEADER_KEYS
}  # fmt: skip
_FAMILY_KEY: Final = {1: None, 2: "decoder", 3: "family"}


def _get(h: dict[str, Any], key: str, kind: type[_T]) -> _T:
    value = h[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"header field {key!r} must be a {kind.__name__}, got {value!r:.80}")
    return value


def _sections(h: dict[str, Any], data: bytes, start: int) -> dict[str, bytes]:
    data_size = _uint(h["data_size"], "data_size", 64)
    if start + data_size + _CRC.size != len(data):
        raise ValueError(f"file is {len(data)} bytes, header implies {start + data_size + 4}")
    out: dict[str, bytes] = {}
    end = 0
    for e in _get(h, "sections", list):
        if not isinstance(e, dict) or set(e) != {"name", "offset", "size", "sha256"}:
            raise ValueError(f"malformed section entry {e!r:.200}")
        name = _text(e["name"], "section name")
        offset, size = _uint(e["offset"], "offset", 64), _uint(e["size"], "size", 64)
        if name in out or offset != _round_up(end, SECTION_ALIGN) or offset + size > data_size:
            raise ValueError(f"section {name!r} at {offset}+{size} breaks the layout")
        if any(data[start + end : start + offset]):
            raise ValueError(f"non-zero padding before section {name!r}")
        blob = data[start + offset : start + offset + size]
        if hashlib.sha256(blob).hexdigest() != e["sha256"]:
            raise ValueError(f"section {name!r} does not match its sha256")
        out[name], end = blob, offset + size
    if end != data_size:
        raise ValueError(f"sections end at {end}, the data area is {data_size} bytes")
    return out


def _crc_diagnosis(data: bytes, header_end: int, stored: int, computed: int) -> str:
    """Say "truncated" rather than "CRC mismatch" when the header tells the expected length."""
    with contextlib.suppress(ValueError, TypeError, KeyError, RecursionError):
        h = json.loads(data[_PREAMBLE.size : header_end].decode("utf-8"))
        want = _round_up(header_end, SECTION_ALIGN) + _uint(h["data_size"], "", 64) + _CRC.size
        if want > len(data):
            return f"truncated: {len(data)} bytes, the header implies {want}"
        if want < len(data):
            return f"{len(data) - want} unexpected bytes after the end ({want} bytes)"
    return f"CRC32 mismatch (stored {stored:08x}, computed {computed:08x})"


def _decode(data: bytes, src: str) -> Loadable:
    if len(data) < _PREAMBLE.size + _CRC.size:
        raise ValueError(f"truncated: {len(data)} bytes, a loadable has at least 20")
    magic, version, header_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}: not a dlad emulated loadable")
    header_end = _PREAMBLE.size + header_len
    if header_end + _CRC.size > len(data):
        raise ValueError(f"truncated: {len(data)} bytes, the header alone needs {header_end + 4}")
    # The frame (magic, version, header length, trailing CRC32) is the same in every version,
    # so the CRC is checked first: a flipped version byte reads as corruption, not as "v2".
    (stored,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    computed = zlib.crc32(memoryview(data)[: -_CRC.size])
    if stored != computed:
        raise ValueError(_crc_diagnosis(data, header_end, stored, computed))
    if version not in READABLE_VERSIONS:
        raise LoadableVersionError(
            f"{src}: emulated loadable format version {version}; this dlad reads version "
            f"{', '.join(map(str, READABLE_VERSIONS))} (rebuild: prep build --target emulated)"
        )
    h = json.loads(data[_PREAMBLE.size : header_end].decode("utf-8"))
    want = _HEADER_KEYS_BY_VERSION[version]
    if not isinstance(h, dict) or set(h) != want:
        keys = set(h) if isinstance(h, dict) else set()
        raise ValueError(f"header fields differ: missing {sorted(want - keys)}, "
                         f"unknown {sorted(keys - want)}")  # fmt: skip
    if h["format"] != FORMAT_NAME or _get(h, "version", int) != version:
        raise ValueError(f"header says format {h['format']!r:.80} version {h['version']!r}")
    if any(data[header_end : _round_up(header_end, SECTION_ALIGN)]):
        raise ValueError("non-zero padding after the header")
    heads = _HEADS.get(_get(h, "heads", str))
    if heads is None:
        raise ValueError(f"header field 'heads' must be 'int8' or 'fp16', got {h['heads']!r:.80}")
    image_size = _get(h, "image_size", list)
    if len(image_size) != 2:
        raise ValueError(f"image_size must be [h, w], got {image_size!r:.80}")
    return Loadable(
        name=_get(h, "name", str),
        dla_core=_get(h, "dla_core", int),
        inputs=tuple(TensorDescriptor.from_dict(d) for d in _get(h, "inputs", list)),
        outputs=tuple(TensorDescriptor.from_dict(d) for d in _get(h, "outputs", list)),
        input_scale=_number(h["input_scale"], "input_scale"),
        output_scales={
            str(k): _number(v, "output scale") for k, v in _get(h, "output_scales", dict).items()
        },
        heads=heads,
        num_classes=_get(h, "num_classes", int),
        class_names=tuple(_get(h, "class_names", list)),
        anchors_px=_anchors(_get(h, "anchors_px", list)),
        strides=tuple(_get(h, "strides", list)),
        image_size=(image_size[0], image_size[1]),
        latency_us=_number(h["latency_us"], "latency_us", allow_zero=True),
        sections=_sections(h, data, _round_up(header_end, SECTION_ALIGN)),
        fp16_nodes=tuple(_get(h, "fp16_nodes", list)),
        family=_get(h, key, str) if (key := _FAMILY_KEY[version]) else DEFAULT_FAMILY,
        latency_layers=_get(h, "latency_layers", dict),
        provenance=_get(h, "provenance", dict),
        created=_get(h, "created", str),
    )


def read_loadable(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview,
    *,
    expect_core: int | None = None,
    source_name: str | None = None,
) -> Loadable:
    """Read and fully validate an emulated loadable from a path or from its bytes.

    ``expect_core`` is the DLA core it is being loaded on (None: any). ``source_name`` names
    in-memory bytes in messages (default ``<bytes>``; a path names itself).
    Raises LoadableCorruptError, LoadableVersionError or LoadableCoreError (module docstring);
    OSError if the file cannot be read; ValueError for ``expect_core`` not None, 0 or 1.
    """
    if expect_core is not None and (not _is_int(expect_core) or expect_core not in (0, 1)):
        raise ValueError(f"expect_core must be None, 0 or 1, got {expect_core!r}")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, src = bytes(source), source_name or "<bytes>"
    else:
        data, src = Path(source).read_bytes(), source_name or os.fspath(source)
    try:
        loadable = _decode(data, src)
    except LoadableError:
        raise
    except (ValueError, RecursionError) as exc:  # JSON, UTF-8, schema, invariants; deep JSON
        raise LoadableCorruptError(f"{src}: corrupt emulated loadable: {exc}") from exc
    if expect_core is not None and loadable.dla_core != expect_core:
        raise LoadableCoreError(
            f"{src}: built for DLA core {loadable.dla_core}, loaded on core {expect_core}; cuDLA "
            f"needs a loadable per core (build one with dla_core={expect_core})"
        )
    return loadable
