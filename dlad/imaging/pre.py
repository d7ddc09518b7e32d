"""Pre-processing reference: YUV to RGB, letterbox, colour order, INT8 ``DLA_HWC4`` quantisation.

This module is the numpy reference the daemon runs on CPU-only hosts and the oracle the CUDA
kernels are tested against, so every arithmetic step is specified precisely enough to be
reproduced bit for bit on a GPU (see :func:`letterbox` and :func:`quantize_hwc4`).

Two deliberate differences from NVIDIA's cuDLA YOLOv5 sample (``docs/reference/cudla.md`` §5.1):

* quantisation rounds to nearest with ties away from zero (what the DLA does), where the sample
  truncates;
* the fourth ``DLA_HWC4`` channel and every row-padding byte are written as zero, where the sample
  reads past the end of a three-plane buffer.

All functions raise :class:`ValueError` (never ``assert``) for malformed input: wrong dtype,
shape, channel count or non-positive sizes and scales.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dlad import _native
from dlad.protocol import PIXEL_FORMATS, PixelFormat, frame_size

__all__ = [
    "HWC4_ROW_ALIGN_BYTES",
    "Letterbox",
    "PixelFormat",
    "dequantize_hwc4",
    "hwc4_layout",
    "letterbox",
    "letterbox_frame",
    "letterbox_geometry",
    "normalize_chw16",
    "quantize_hwc4",
    "round_half_away_from_zero",
    "to_rgb",
    "yuv_to_rgb",
]

HWC4_ROW_ALIGN_BYTES = 64
"""Row pitch alignment of ``DLA_HWC4`` tensors on Orin (32 on Xavier); docs/reference/cudla.md
§3.3."""

_U8 = npt.NDArray[np.uint8]
_I8 = npt.NDArray[np.int8]
_F32 = npt.NDArray[np.float32]


def round_half_away_from_zero(x: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
    """Round to the nearest integer, ties away from zero (C ``round``/CUDA ``roundf``).

    ``numpy.round`` rounds ties to even; the DLA and this project round ties away from zero. The
    result is exact for every finite input: ``x - trunc(x)`` is computed without rounding error,
    unlike the tempting ``floor(x + 0.5)``, which misrounds ``0.49999997``. Same dtype as ``x``.
    """
    t = np.trunc(x)
    return t + np.copysign(np.abs(x - t) >= 0.5, x).astype(x.dtype)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Letterbox:
    """Geometry of one letterbox: source ``(src_w, src_h)`` scaled by ``scale`` and placed at
    ``(pad_x, pad_y)`` on a ``(dst_w, dst_h)`` canvas.

    Canvas coordinates relate to source coordinates by ``x_canvas = x_src * scale + pad_x`` (and
    likewise for ``y``), in continuous pixel-edge coordinates: pixel ``i`` spans ``[i, i + 1)``.
    """

    scale: float
    pad_x: int
    pad_y: int
    src_w: int
    src_h: int
    dst_w: int
    dst_h: int

    @property
    def new_w(self) -> int:
        """Width of the resized image on the canvas: ``round_half_up(src_w * scale)``."""
        return _scaled_extent(self.src_w, self.scale, self.dst_w)

    @property
    def new_h(self) -> int:
        """Height of the resized image on the canvas: ``round_half_up(src_h * scale)``."""
        return _scaled_extent(self.src_h, self.scale, self.dst_h)

    def to_original(self, boxes_xyxy: npt.ArrayLike) -> _F32:
        """Map ``[..., 4]`` ``x1, y1, x2, y2`` canvas boxes to source-image pixels.

        Undoes the padding and scale, then clips x to ``[0, src_w]`` and y to ``[0, src_h]``
        (edges, not pixel centres, so a box can cover the whole image). Returns a new float32
        array of the same shape. Raises ValueError if the last axis is not 4.
        """
        b = _as_boxes(boxes_xyxy).astype(np.float64)
        out = np.empty_like(b)
        out[..., 0::2] = (b[..., 0::2] - self.pad_x) / self.scale
        out[..., 1::2] = (b[..., 1::2] - self.pad_y) / self.scale
        np.clip(out[..., 0::2], 0.0, self.src_w, out=out[..., 0::2])
        np.clip(out[..., 1::2], 0.0, self.src_h, out=out[..., 1::2])
        return out.astype(np.float32)

    def to_canvas(self, boxes_xyxy: npt.ArrayLike) -> _F32:
        """Map ``[..., 4]`` source-image boxes to canvas pixels (no clipping).

        Inverse of :meth:`to_original` for boxes inside the source image. Returns a new float32
        array. Raises ValueError if the last axis is not 4.
        """
        b = _as_boxes(boxes_xyxy).astype(np.float64)
        out = np.empty_like(b)
        out[..., 0::2] = b[..., 0::2] * self.scale + self.pad_x
        out[..., 1::2] = b[..., 1::2] * self.scale + self.pad_y
        return out.astype(np.float32)


def _as_boxes(boxes: npt.ArrayLike) -> npt.NDArray[np.generic]:
    b = np.asarray(boxes)
    if b.ndim < 1 or b.shape[-1] != 4:
        raise ValueError(f"boxes must have a last axis of 4 (x1, y1, x2, y2), got {b.shape}")
    return b


def _scaled_extent(src: int, scale: float, dst: int) -> int:
    # Half-up rounding, clamped to [1, dst] (dlad/native/frame_rules.hpp: one rule for every path)
    return _native.scaled_extent(src, scale, dst)


def _int_at_least(x: object, low: int) -> int | None:
    """``int(x)`` if ``x`` is an integer (not a bool) ``>= low``, else None."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= low:
        return int(x)
    return None


def _canvas_size(size: object) -> tuple[int, int]:
    dims = size if isinstance(size, tuple) else (size, size)
    checked = [_int_at_least(d, 1) for d in dims]
    if len(checked) != 2 or checked[0] is None or checked[1] is None:
        raise ValueError(f"size must be a positive int or (height, width) ints, got {size!r}")
    return checked[1], checked[0]


def _check_image(image: object, channels: tuple[int, ...]) -> _U8:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise ValueError(f"image must be a uint8 numpy array, got {getattr(image, 'dtype', image)}")
    if image.ndim != 3 or image.shape[2] not in channels:
        raise ValueError(f"image must be H x W x C with C in {channels}, got shape {image.shape}")
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"image must not be empty, got shape {image.shape}")
    return image


def to_rgb(image: npt.NDArray[np.uint8], pixel_format: PixelFormat, colour: int = 0) -> _U8:
    """Return a C-contiguous ``H x W x 3`` uint8 RGB image.

    ``RGB`` input (``H x W x 3``) is returned as is when already contiguous; ``BGR`` has its
    channels reversed; ``GRAY`` (``H x W`` or ``H x W x 1``) is replicated to three channels;
    ``NV12`` and ``YUYV`` are converted by :func:`yuv_to_rgb` with ``colour``. Channel order
    does not affect :func:`letterbox` (it interpolates channels independently), so calling this
    on the smaller letterboxed canvas is cheaper and gives the identical result (not so for
    YUV, which is converted before it is resampled). Raises ValueError for an unknown format or
    a shape/dtype that does not match it.
    """
    if pixel_format in ("NV12", "YUYV"):
        return yuv_to_rgb(image, pixel_format, colour)
    if pixel_format == "GRAY":
        gray = _check_image(image[:, :, None] if getattr(image, "ndim", 0) == 2 else image, (1,))
        return np.ascontiguousarray(np.broadcast_to(gray, (*gray.shape[:2], 3)))
    if pixel_format not in ("RGB", "BGR"):
        raise ValueError(f"pixel_format must be one of {list(PIXEL_FORMATS)}, got {pixel_format!r}")
    color = _check_image(image, (3,))
    return np.ascontiguousarray(color[:, :, ::-1] if pixel_format == "BGR" else color)


def yuv_to_rgb(image: npt.NDArray[np.uint8], pixel_format: PixelFormat, colour: int = 0) -> _U8:
    """An ``NV12`` (``3H/2 x W``) or ``YUYV`` (``H x W x 2``) uint8 frame as ``H x W x 3``
    uint8 RGB; ``colour`` is its matrix and range (:func:`dlad.protocol.colour_code`: 0 is
    BT.601 limited range).

    Each pixel takes its own luma and its 2 x 2 (NV12) or 2 x 1 (YUYV) block's chroma, as
    FFmpeg's and the Jetson's converters do without chroma interpolation, and is converted in
    float32 with every step rounded and no fused multiply-add (the GPU pre kernel's
    ``yuv_rgb``), with the coefficients of ``dlad/native/frame_rules.hpp``::

        y = (float)(Y - y_offset) * ky;  u = (float)(U - 128);  v = (float)(V - 128)
        R = y + rv * v;  G = (y - gu * u) - gv * v;  B = y + bu * u

    each rounded half away from zero and clamped to 0..255. Raises ValueError for a shape,
    dtype or colour that does not fit.
    """
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:  # type: ignore[redundant-expr]
        raise ValueError(f"image must be a uint8 numpy array, got {getattr(image, 'dtype', image)}")
    if pixel_format not in ("NV12", "YUYV"):
        raise ValueError(f"pixel_format must be 'NV12' or 'YUYV', got {pixel_format!r}")
    if colour not in range(4):
        raise ValueError(f"colour must be a code 0..3, got {colour!r}")
    return _yuv_pixels(image, pixel_format, colour)


def _yuv_pixels(
    image: _U8, pixel_format: str, colour: int, rows: npt.NDArray[np.intp] | None = None,
    cols: npt.NDArray[np.intp] | None = None,
) -> _U8:  # fmt: skip
    """The RGB of the pixels at ``rows x cols`` (None: all) of a YUV frame, each converted as
    :func:`yuv_to_rgb` says, through tables of the same float32 steps: R of (Y, V), B of (Y,
    U) and ``y - gu * u`` of (Y, U), then ``G = t - gv * v`` a pixel."""
    height, width = frame_size(pixel_format, image.shape)
    if pixel_format == "NV12":
        luma, uv = image[:height], image[height:].reshape(height // 2, width // 2, 2)
        if rows is None or cols is None:
            uv = uv.repeat(2, axis=0).repeat(2, axis=1)
        else:
            luma = luma.take(rows, axis=0).take(cols, axis=1)
            uv = uv.take(rows // 2, axis=0).take(cols // 2, axis=1)
    else:
        luma = image[:, :, 0]
        uv = image.reshape(height, width // 2, 4)[:, :, 1::2]
        if rows is None or cols is None:
            uv = uv.repeat(2, axis=1)
        else:
            luma = luma.take(rows, axis=0).take(cols, axis=1)
            uv = uv.take(rows, axis=0).take(cols // 2, axis=1)
    r_of, b_of, t_of, gv = _yuv_tables(colour)
    yi = luma.astype(np.intp) << 8
    u, v = np.ascontiguousarray(uv[:, :, 0]), np.ascontiguousarray(uv[:, :, 1])
    yu, yv = yi | u, yi | v
    out = np.empty((*luma.shape, 3), np.uint8)
    out[:, :, 0] = r_of.take(yv)
    out[:, :, 2] = b_of.take(yu)
    g = t_of.take(yu)
    g -= gv * (v.astype(np.float32) - np.float32(128))
    out[:, :, 1] = np.clip(round_half_away_from_zero(g), 0, 255)
    return out


@functools.lru_cache(maxsize=4)
def _yuv_tables(colour: int) -> tuple[_U8, _U8, _F32, np.float32]:
    """:func:`_yuv_pixels`' tables for a colour code, indexed ``(Y << 8) | C``."""
    ky, rv, gu, gv, bu, y_offset = (np.float32(c) for c in _native.yuv_coefficients(colour))
    levels = np.arange(256)
    y = (levels[:, None] - int(y_offset)).astype(np.float32) * ky  # [Y, 1]
    c = (levels[None, :] - 128).astype(np.float32)  # [1, U or V]

    def u8(x: _F32) -> _U8:
        out: _U8 = np.clip(round_half_away_from_zero(x), 0, 255).astype(np.uint8).reshape(-1)
        return out

    t: _F32 = (y - gu * c).astype(np.float32).reshape(-1)
    return u8(y + rv * c), u8(y + bu * c), t, gv


def letterbox(
    image: npt.NDArray[np.uint8],
    size: int | tuple[int, int],
    pad_value: int = 114,
) -> tuple[_U8, Letterbox]:
    """Resize ``image`` (``H x W x C`` uint8, C = 1 or 3) to fit a canvas, keeping aspect ratio.

    ``size`` is the canvas side, or ``(height, width)``. Geometry: ``scale = min(dst_w / src_w,
    dst_h / src_h)`` (float64); ``new_w = clamp(floor(src_w * scale + 0.5), 1, dst_w)`` (same for
    h); ``pad_x = (dst_w - new_w) // 2`` on the left, so the odd pixel of padding (if any) goes to
    the right, and likewise top/bottom. The padding is filled with ``pad_value``.

    Sampling is bilinear with half-pixel centres, as OpenCV ``INTER_LINEAR`` but in plain float32
    without its fixed-point weights, and with the single ``scale`` on both axes (so the image
    content is exactly where :meth:`Letterbox.to_original` says). For an output column
    ``xd`` in ``[0, new_w)`` (relative to ``pad_x``), every step in IEEE float32, round to
    nearest, **no fused multiply-add** (CUDA: ``__fadd_rn``/``__fdiv_rn``/``__fmul_rn`` or
    ``--fmad=false``)::

        s  = (float)scale                       # float64 -> float32, host side
        xs = ((float)xd + 0.5f) / s - 0.5f
        xs = fminf(fmaxf(xs, 0.0f), (float)(src_w - 1))
        x0 = (int)floorf(xs);  x1 = min(x0 + 1, src_w - 1)
        fx = xs - (float)x0;   gx = 1.0f - fx

    and the same for rows (``ys, y0, y1, fy, gy``). With ``p`` the source pixel as float::

        top = gx * p[y0][x0] + fx * p[y0][x1]
        bot = gx * p[y1][x0] + fx * p[y1][x1]
        v   = gy * top + fy * bot
        out = (uint8) min(roundf(v), 255.0f)    # roundf: ties away from zero

    Returns ``(canvas, geometry)``: a new C-contiguous ``dst_h x dst_w x C`` uint8 array and its
    :class:`Letterbox`. Raises ValueError for a non-uint8 or empty image, C not in {1, 3}, a
    non-positive canvas size, or ``pad_value`` outside 0..255.
    """
    _check_image(image, (1, 3))
    if _int_at_least(pad_value, 0) is None or pad_value > 255:
        raise ValueError(f"pad_value must be an int in 0..255, got {pad_value!r}")
    src_h, src_w, channels = image.shape
    geometry = letterbox_geometry(src_w, src_h, size)
    dst_w, dst_h, new_w, new_h = geometry.dst_w, geometry.dst_h, geometry.new_w, geometry.new_h
    canvas = np.full((dst_h, dst_w, channels), pad_value, dtype=np.uint8)
    resized = _resize_bilinear(image, new_w, new_h, np.float32(geometry.scale))
    canvas[geometry.pad_y : geometry.pad_y + new_h, geometry.pad_x : geometry.pad_x + new_w] = (
        resized
    )
    return canvas, geometry


def letterbox_frame(
    image: npt.NDArray[np.uint8],
    pixel_format: PixelFormat,
    size: int | tuple[int, int],
    colour: int = 0,
    pad_value: int = 114,
) -> tuple[_U8, Letterbox]:
    """The letterboxed RGB canvas of a frame in any of :data:`dlad.protocol.PIXEL_FORMATS`:
    ``letterbox(to_rgb(image, pixel_format, colour), size, pad_value)``, the same bytes, with a
    YUV frame converted only at the source pixels the bilinear taps read (what the GPU pre
    kernel does). Raises ValueError as :func:`to_rgb` and :func:`letterbox` do."""
    if pixel_format not in ("NV12", "YUYV"):
        return letterbox(to_rgb(image, pixel_format, colour), size, pad_value)
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:  # type: ignore[redundant-expr]
        raise ValueError(f"image must be a uint8 numpy array, got {getattr(image, 'dtype', image)}")
    if _int_at_least(pad_value, 0) is None or pad_value > 255:
        raise ValueError(f"pad_value must be an int in 0..255, got {pad_value!r}")
    if colour not in range(4):
        raise ValueError(f"colour must be a code 0..3, got {colour!r}")
    height, width = frame_size(pixel_format, image.shape)
    g = letterbox_geometry(width, height, size)
    scale = np.float32(g.scale)
    x0, x1, gx, fx = _axis_weights(g.new_w, width, scale)
    y0, y1, gy, fy = _axis_weights(g.new_h, height, scale)
    cols, rows = np.union1d(x0, x1), np.union1d(y0, y1)
    taps = _yuv_pixels(image, pixel_format, colour, rows, cols)
    at = np.searchsorted  # each tap's place among the converted rows and columns
    xw = (at(cols, x0), at(cols, x1), gx, fx)
    resized = _bilinear(taps, xw, (at(rows, y0), at(rows, y1), gy, fy))
    canvas = np.full((g.dst_h, g.dst_w, 3), pad_value, dtype=np.uint8)
    canvas[g.pad_y : g.pad_y + g.new_h, g.pad_x : g.pad_x + g.new_w] = resized
    return canvas, g


def letterbox_geometry(src_w: int, src_h: int, size: int | tuple[int, int]) -> Letterbox:
    """The :class:`Letterbox` that :func:`letterbox` uses for a ``src_w x src_h`` image (see
    its docstring for the formulas), without touching pixels. Raises ValueError for
    non-positive sizes."""
    dst_w, dst_h = _canvas_size(size)
    if _int_at_least(src_w, 1) is None or _int_at_least(src_h, 1) is None:
        raise ValueError(f"image size must be positive, got {src_w} x {src_h}")
    # dlad/native/frame_rules.hpp: the C++ plane's GPU chain draws frames with the same rule
    scale, pad_x, pad_y, _, _ = _native.letterbox_geometry(int(src_w), int(src_h), dst_w, dst_h)
    return Letterbox(
        scale=scale,
        pad_x=pad_x,
        pad_y=pad_y,
        src_w=int(src_w),
        src_h=int(src_h),
        dst_w=dst_w,
        dst_h=dst_h,
    )


def _axis_weights(
    n_dst: int, n_src: int, scale: np.float32
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], _F32, _F32]:
    """Source indices and weights for one axis, exactly the float32 steps documented above."""
    xs = (np.arange(n_dst, dtype=np.float32) + np.float32(0.5)) / scale - np.float32(0.5)
    xs = np.minimum(np.maximum(xs, np.float32(0.0)), np.float32(n_src - 1))
    x0f = np.floor(xs)
    x0 = x0f.astype(np.intp)
    x1 = np.minimum(x0 + 1, n_src - 1)
    fx = xs - x0f
    return x0, x1, np.float32(1.0) - fx, fx


_Weights = tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], _F32, _F32]


def _resize_bilinear(image: _U8, new_w: int, new_h: int, scale: np.float32) -> _U8:
    xw = _axis_weights(new_w, image.shape[1], scale)
    return _bilinear(image, xw, _axis_weights(new_h, image.shape[0], scale))


def _bilinear(image: _U8, xw: _Weights, yw: _Weights) -> _U8:
    """``image`` sampled at the taps and weights of each axis (:func:`_axis_weights`)."""
    (x0, x1, gx, fx), (y0, y1, gy, fy) = xw, yw
    gx3, fx3 = gx[None, :, None], fx[None, :, None]
    # Every product and sum is its own float32 op (numpy never fuses multiply-add), matching the
    # no-FMA formula in letterbox's docstring; in-place ops only avoid allocations.
    rows0 = np.take(image, y0, axis=0)
    rows1 = np.take(image, y1, axis=0)

    def lerp_x(rows: _U8) -> _F32:
        acc = np.take(rows, x0, axis=1).astype(np.float32)
        acc *= gx3
        right = np.take(rows, x1, axis=1).astype(np.float32)
        right *= fx3
        acc += right
        return acc

    v = lerp_x(rows0)
    v *= gy[:, None, None]
    bot = lerp_x(rows1)
    bot *= fy[:, None, None]
    v += bot
    # v >= 0, so half-away-from-zero is floor(v) + (frac >= 0.5), computed exactly.
    fl = np.floor(v)
    v -= fl
    fl += v >= np.float32(0.5)
    np.minimum(fl, np.float32(255.0), out=fl)
    return fl.astype(np.uint8)


def hwc4_layout(c: int, h: int, w: int, elem_size: int) -> tuple[int, int, int]:
    """Layout of one ``DLA_HWC4`` image (N = 1) on Orin: ``[H][W_padded][C']``.

    ``C' = 1`` for ``c == 1`` and 4 for ``c`` in {3, 4}; the row pitch is rounded up to 64 bytes,
    so ``W_padded = roundUp(w, 64 / (C' * elem_size))`` (16 pixels for int8 RGB).
    Returns ``(w_padded, row_pitch_bytes, size_bytes)``. Raises ValueError for ``c`` not in
    {1, 3, 4}, ``elem_size`` not in {1, 2} (int8, fp16), or non-positive ``h``/``w``.
    """
    if c not in (1, 3, 4):
        raise ValueError(f"DLA_HWC4 supports 1, 3 or 4 channels, got {c}")
    if elem_size not in (1, 2):
        raise ValueError(f"elem_size must be 1 (int8) or 2 (fp16), got {elem_size}")
    if h < 1 or w < 1:
        raise ValueError(f"h and w must be positive, got h={h}, w={w}")
    c_padded = 1 if c == 1 else 4
    align_px = HWC4_ROW_ALIGN_BYTES // (c_padded * elem_size)
    w_padded = -(-w // align_px) * align_px
    row_pitch = w_padded * c_padded * elem_size
    return w_padded, row_pitch, h * row_pitch


def _is_array(x: object, dtype: type[np.generic], ndim: int) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == dtype and x.ndim == ndim


def _check_scale(input_scale: float) -> np.float32:
    s = np.float32(input_scale)
    if not (math.isfinite(input_scale) and s > 0):
        raise ValueError(f"input_scale must be a finite positive number, got {input_scale!r}")
    return s


def quantize_hwc4(
    canvas_rgb_uint8: npt.NDArray[np.uint8],
    input_scale: float,
    row_pitch_px: int | None = None,
) -> _I8:
    """Normalise and quantise an RGB (or 1-channel) canvas into an int8 ``DLA_HWC4`` tensor.

    Per pixel value ``p`` (float32 ops, correctly rounded, as a CUDA kernel would do them)::

        q = roundf(((float)p / 255.0f) / (float)input_scale)      # ties away from zero
        out = (int8) clamp(q, -128, 127)

    Ties round away from zero because that is what the DLA does (TensorRT issue #2222);
    pytorch-quantization rounds ties to even, NVIDIA's sample truncates. Because ``p`` is uint8
    the 256 possible results are computed once as a lookup table.

    Layout ``[H][W_padded][C']``: C = 3 gives C' = 4 with the fourth channel 0; C = 1 gives C' = 1.
    ``W_padded`` is ``row_pitch_px`` if given, else :func:`hwc4_layout`'s; padding bytes are 0.
    Returns a new C-contiguous int8 array. Raises ValueError for a non-uint8 canvas, C not in
    {1, 3}, a non-finite or non-positive scale, or ``row_pitch_px < W``.
    """
    _check_image(canvas_rgb_uint8, (1, 3))
    s = _check_scale(input_scale)
    h, w, c = canvas_rgb_uint8.shape
    w_padded, _, _ = hwc4_layout(c, h, w, 1)
    if row_pitch_px is not None:
        if _int_at_least(row_pitch_px, w) is None:
            raise ValueError(f"row_pitch_px must be an int >= width {w}, got {row_pitch_px!r}")
        w_padded = row_pitch_px
    lut = (np.arange(256, dtype=np.float32) / np.float32(255.0)) / s
    lut_q = np.clip(round_half_away_from_zero(lut), -128, 127).astype(np.int8)
    c_padded = 1 if c == 1 else 4
    out = np.zeros((h, w_padded, c_padded), dtype=np.int8)
    out[:, :w, :c] = lut_q[canvas_rgb_uint8]
    return out


def normalize_chw16(canvas_rgb_uint8: npt.NDArray[np.uint8]) -> npt.NDArray[np.float16]:
    """An RGB (or 1-channel) canvas as the fp16 ``CHW16`` input of an FP16 loadable:
    ``[1][H][W][16]``, lane ``c`` = ``(float)p / 255.0f`` rounded to the nearest fp16 (ties to
    even), lanes ``C..15`` zero. Raises ValueError for a non-uint8 canvas or C not in {1, 3}.
    """
    _check_image(canvas_rgb_uint8, (1, 3))
    h, w, c = canvas_rgb_uint8.shape
    out = np.zeros((1, h, w, 16), dtype=np.float16)
    out[0, :, :, :c] = (canvas_rgb_uint8.astype(np.float32) / np.float32(255.0)).astype(np.float16)
    return out


def dequantize_hwc4(
    tensor: npt.NDArray[np.int8], input_scale: float, width: int, channels: int = 3
) -> _F32:
    """Inverse of :func:`quantize_hwc4` up to rounding: ``H x width x channels`` float32 ``q * s``.

    The values approximate ``pixel / 255``. Drops the row padding and the fourth channel.
    Raises ValueError for a non-int8 or non-3-D tensor, ``channels`` not in {1, 3}, a tensor
    narrower than ``width`` or with fewer channels than ``channels``, or a bad scale.
    """
    s = _check_scale(input_scale)
    if not _is_array(tensor, np.int8, 3):
        raise ValueError("tensor must be a 3-D int8 array [H][W_padded][C']")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if tensor.shape[1] < width or tensor.shape[2] < channels or width < 1:
        raise ValueError(f"tensor {tensor.shape} cannot hold width {width} x {channels} channels")
    return tensor[:, :width, :channels].astype(np.float32) * s
