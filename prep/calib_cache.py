"""TensorRT INT8 calibration cache (text) and the ``trtexec --layerPrecisions`` argument.

A calibration cache is how a PTQ build receives the scales that QAT learned (see
``docs/reference/cudla.md`` §0 item 4 and §2.2). Its format::

    TRT-8600-EntropyCalibration2
    images: 3c00f9f4
    /model.0/act/Mul_output_0: 3e6c9314

The header is ``TRT-<version>-<algorithm>``; each further line is ``<tensor name>: <hex>``
where ``<hex>`` is the IEEE-754 float32 bit pattern of the tensor's **scale** (= amax / 127,
TensorRT's dynamic range is ±scale·127) printed as a lowercase hexadecimal integer without
``0x`` and without zero padding (``1.0`` is ``3f800000``; a subnormal scale has fewer than 8
digits). Scales are rounded to float32 when written, so a round trip is exact for float32
values and rounds float64 values to nearest float32.

Tensor names: ONNX allows almost any character in a name, including ``:`` and ``": "``. A line
is therefore split on its **last** ``": "``, which is unambiguous because the hex field never
contains one. Names may not be empty and may not contain ``\\n`` or ``\\r`` (the line
separators); the writer refuses such names rather than produce a cache that reads back
differently.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_ALGORITHM",
    "DEFAULT_TRT_VERSION",
    "CalibrationCache",
    "CalibrationCacheError",
    "float_to_hex",
    "hex_to_float",
    "layer_precisions_arg",
    "parse_calibration_cache",
    "write_calibration_cache",
]

DEFAULT_TRT_VERSION = 8600
"""TensorRT 8.6.0, the version JetPack 6 ships; use the target's number (e.g. 8502 on JP 5.1)."""

DEFAULT_ALGORITHM = "EntropyCalibration2"
"""The calibrator name TensorRT writes for ``IInt8EntropyCalibrator2`` caches."""

LAYER_PRECISIONS = frozenset({"fp32", "fp16", "bf16", "int8", "fp8"})
"""Precision names ``trtexec --layerPrecisions`` accepts that a DLA build can use."""

_HEADER = re.compile(r"TRT-(\d+)-([A-Za-z][A-Za-z0-9_]*)")
_HEX = re.compile(r"[0-9a-fA-F]{1,8}")
_SEPARATOR = ": "


class CalibrationCacheError(ValueError):
    """A calibration cache (or the scales given to write one) is malformed.

    The message names the offending line number or tensor.
    """


@dataclass(frozen=True)
class CalibrationCache:
    """A parsed calibration cache.

    Attributes:
        trt_version: the number in the header (``8600`` for ``TRT-8600-...``).
        algorithm: the calibrator name in the header (``EntropyCalibration2``).
        scales: tensor name -> scale (float32 value as a Python float), in file order.
    """

    trt_version: int
    algorithm: str
    scales: dict[str, float]

    def to_text(self) -> str:
        """This cache in the text format; ``parse_calibration_cache`` reads it back equal."""
        return write_calibration_cache(self.scales, self.trt_version, self.algorithm)


def float_to_hex(scale: float) -> str:
    """The cache encoding of ``scale``: float32 bits as lowercase hex, no ``0x``, no padding.

    Raises:
        CalibrationCacheError: ``scale`` is not finite and positive after rounding to float32.
    """
    if not math.isfinite(scale) or scale <= 0.0:
        raise CalibrationCacheError(f"scale must be finite and positive, got {scale!r}")
    try:
        packed = struct.pack("<f", scale)
    except OverflowError as exc:
        raise CalibrationCacheError(f"scale {scale!r} overflows float32") from exc
    (bits,) = struct.unpack("<I", packed)
    if bits == 0:
        raise CalibrationCacheError(f"scale {scale!r} rounds to 0 in float32")
    return f"{bits:x}"


def hex_to_float(text: str) -> float:
    """Decode one cache value (1-8 hex digits) to the float32 scale it encodes.

    Raises:
        CalibrationCacheError: ``text`` is not 1-8 hex digits, or encodes a value that is not a
            finite positive number (zero, negative, infinity, NaN).
    """
    if _HEX.fullmatch(text) is None:
        raise CalibrationCacheError(f"scale {text!r} is not 1-8 hexadecimal digits")
    (value,) = struct.unpack("<f", struct.pack("<I", int(text, 16)))
    if not math.isfinite(value) or value <= 0.0:
        raise CalibrationCacheError(f"scale {text!r} decodes to {value!r}, not finite and > 0")
    return float(value)


def _check_name(name: str) -> None:
    if not name:
        raise CalibrationCacheError("tensor name is empty")
    if "\n" in name or "\r" in name:
        raise CalibrationCacheError(f"tensor name {name!r} contains a line break")


def write_calibration_cache(
    scales: Mapping[str, float],
    trt_version: int = DEFAULT_TRT_VERSION,
    algorithm: str = DEFAULT_ALGORITHM,
) -> str:
    """Format ``scales`` (tensor name -> scale, not amax) as a TensorRT calibration cache.

    Lines follow the mapping's order; every line, the header included, ends with ``\\n``.

    Raises:
        CalibrationCacheError: a bad version or algorithm, an empty name or one with a line
            break, or a scale that is not finite and positive in float32.
    """
    if type(trt_version) is not int or trt_version < 0:  # bool is an int subclass: refused
        raise CalibrationCacheError(f"trt_version must be a non-negative int, got {trt_version!r}")
    header = f"TRT-{trt_version}-{algorithm}"
    if _HEADER.fullmatch(header) is None:
        raise CalibrationCacheError(f"algorithm {algorithm!r} is not a calibrator name")
    lines = [header]
    for name, scale in scales.items():
        _check_name(name)
        try:
            encoded = float_to_hex(float(scale))
        except CalibrationCacheError as exc:
            raise CalibrationCacheError(f"tensor {name!r}: {exc}") from exc
        lines.append(f"{name}{_SEPARATOR}{encoded}")
    return "\n".join(lines) + "\n"


def parse_calibration_cache(text: str | bytes) -> CalibrationCache:
    """Parse a calibration cache written by TensorRT, by the NVIDIA Q/DQ translator or by
    ``write_calibration_cache``.

    Accepts ``\\n`` or ``\\r\\n`` line ends and a missing final line end. Each line is split on
    its last ``": "`` (names may contain ``:``).

    Raises:
        CalibrationCacheError: undecodable bytes, an empty cache, a bad header, a line without
            ``": "``, an empty name, a value that is not 1-8 hex digits or not a finite positive
            float32, a blank line before the end, or a name listed twice. The message gives
            the 1-based line number.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CalibrationCacheError(f"cache is not UTF-8 text: {exc}") from exc
    # Split on "\n" only: str.splitlines would also split inside names on \x1c, \u2028, ...
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line.removesuffix("\r") for line in lines]
    if not lines:
        raise CalibrationCacheError("cache is empty (no header line)")
    header = _HEADER.fullmatch(lines[0])
    if header is None:
        raise CalibrationCacheError(
            f"line 1: header {lines[0]!r} is not 'TRT-<version>-<algorithm>'"
        )
    scales: dict[str, float] = {}
    for number, line in enumerate(lines[1:], start=2):
        name, separator, encoded = line.rpartition(_SEPARATOR)
        if not separator:
            raise CalibrationCacheError(f"line {number}: {line!r} is not '<name>: <hex>'")
        if not name:
            raise CalibrationCacheError(f"line {number}: empty tensor name")
        try:
            value = hex_to_float(encoded)
        except CalibrationCacheError as exc:
            raise CalibrationCacheError(f"line {number} ({name!r}): {exc}") from exc
        if name in scales:
            raise CalibrationCacheError(f"line {number}: tensor {name!r} is listed twice")
        scales[name] = value
    return CalibrationCache(int(header.group(1)), header.group(2), scales)


def layer_precisions_arg(nodes: Iterable[str], precision: str = "fp16") -> str:
    """The ``trtexec --layerPrecisions`` value ``name1:fp16,name2:fp16`` for ``nodes``.

    Duplicates are dropped (first occurrence kept); no trailing comma; an empty input gives
    ``""``. trtexec splits the list on ``,``, so a name containing one cannot be expressed.

    Raises:
        ValueError: ``precision`` is not one of ``LAYER_PRECISIONS``, a name is empty, or a
            name contains ``,`` or a line break.
    """
    if precision not in LAYER_PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(LAYER_PRECISIONS)}, got {precision!r}")
    seen: dict[str, None] = {}
    for name in nodes:
        if not name or any(c in name for c in ",\n\r"):
            raise ValueError(f"layer name {name!r} cannot be passed to --layerPrecisions")
        seen.setdefault(name, None)
    return ",".join(f"{name}:{precision}" for name in seen)
