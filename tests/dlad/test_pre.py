"""Letterbox, colour order and DLA_HWC4 quantisation against slow independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlad.imaging.pre import (
    Letterbox,
    dequantize_hwc4,
    hwc4_layout,
    letterbox,
    quantize_hwc4,
    round_half_away_from_zero,
    to_rgb,
)

F32 = np.float32


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _spec_resize_pixel(img: np.ndarray, xd: int, yd: int, scale: float) -> list[int]:
    """One output pixel, written from letterbox's docstring with float32 scalars (the formula a
    CUDA kernel implements); used to check the vectorised code bit for bit."""
    s = F32(scale)
    src_h, src_w = img.shape[:2]

    def axis(d: int, n: int) -> tuple[int, int, np.float32, np.float32]:
        xs = (F32(d) + F32(0.5)) / s - F32(0.5)
        xs = min(max(xs, F32(0.0)), F32(n - 1))
        i0 = math.floor(xs)
        f = F32(xs - F32(i0))
        return i0, min(i0 + 1, n - 1), F32(F32(1.0) - f), f

    x0, x1, gx, fx = axis(xd, src_w)
    y0, y1, gy, fy = axis(yd, src_h)
    out = []
    for c in range(img.shape[2]):
        p = img[:, :, c].astype(F32)
        top = F32(F32(gx * p[y0, x0]) + F32(fx * p[y0, x1]))
        bot = F32(F32(gx * p[y1, x0]) + F32(fx * p[y1, x1]))
        v = F32(F32(gy * top) + F32(fy * bot))
        fl = math.floor(v)
        out.append(min(fl + (1 if v - F32(fl) >= 0.5 else 0), 255))
    return out


def _bilinear_f64(img: np.ndarray, xd: int, yd: int, scale: float) -> np.ndarray:
    """Textbook half-pixel bilinear in float64, independent of the float32 recipe."""
    h, w = img.shape[:2]
    xs = min(max((xd + 0.5) / scale - 0.5, 0.0), w - 1.0)
    ys = min(max((yd + 0.5) / scale - 0.5, 0.0), h - 1.0)
    x0, y0 = math.floor(xs), math.floor(ys)
    x1, y1 = min(x0 + 1, w - 1), min(y0 + 1, h - 1)
    ax, ay = xs - x0, ys - y0
    p = img.astype(np.float64)
    return (1 - ay) * ((1 - ax) * p[y0, x0] + ax * p[y0, x1]) + ay * (
        (1 - ax) * p[y1, x0] + ax * p[y1, x1]
    )


sizes = st.integers(1, 40)


@settings(max_examples=60, deadline=None)
@given(
    src_h=sizes,
    src_w=sizes,
    dst=st.one_of(st.integers(1, 32), st.tuples(st.integers(1, 32), st.integers(1, 32))),
    channels=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_letterbox_matches_per_pixel_references(
    src_h: int, src_w: int, dst: int | tuple[int, int], channels: int, seed: int
) -> None:
    img = _rng(seed).integers(0, 256, (src_h, src_w, channels), dtype=np.uint8)
    canvas, lb = letterbox(img, dst, pad_value=114)
    dst_h, dst_w = (dst, dst) if isinstance(dst, int) else dst

    # Geometry, straight from the definition.
    scale = min(dst_w / src_w, dst_h / src_h)
    new_w = min(dst_w, max(1, math.floor(src_w * scale + 0.5)))
    new_h = min(dst_h, max(1, math.floor(src_h * scale + 0.5)))
    assert lb == Letterbox(
        scale, (dst_w - new_w) // 2, (dst_h - new_h) // 2, src_w, src_h, dst_w, dst_h
    )
    assert (lb.new_w, lb.new_h) == (new_w, new_h)
    assert new_w == dst_w or new_h == dst_h  # the binding side fills the canvas
    assert canvas.shape == (dst_h, dst_w, channels)
    assert canvas.dtype == np.uint8
    assert canvas.flags.c_contiguous

    region = np.zeros((dst_h, dst_w), dtype=bool)
    region[lb.pad_y : lb.pad_y + new_h, lb.pad_x : lb.pad_x + new_w] = True
    assert (canvas[~region] == 114).all()

    inner = canvas[region].reshape(new_h, new_w, channels)
    for yd in range(new_h):
        for xd in range(new_w):
            assert list(inner[yd, xd]) == _spec_resize_pixel(img, xd, yd, scale), (xd, yd)
            # float32 vs float64 may disagree by one step exactly at a rounding boundary.
            ref = _bilinear_f64(img, xd, yd, scale)
            assert np.abs(inner[yd, xd].astype(np.float64) - ref).max() <= 0.5 + 1e-3


@pytest.mark.parametrize(("h", "w"), [(1, 300), (300, 1), (1, 1), (2, 500), (640, 3)])
def test_letterbox_extreme_aspect_ratios(h: int, w: int) -> None:
    img = _rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    canvas, lb = letterbox(img, 64)
    assert canvas.shape == (64, 64, 3)
    assert lb.new_w >= 1
    assert lb.new_h >= 1
    assert max(lb.new_w, lb.new_h) == 64
    # The odd pixel of padding goes right/bottom.
    assert lb.pad_x == (64 - lb.new_w) // 2
    assert lb.pad_y == (64 - lb.new_h) // 2
    for yd in range(0, lb.new_h, 7):
        for xd in range(0, lb.new_w, 5):
            got = canvas[lb.pad_y + yd, lb.pad_x + xd]
            assert list(got) == _spec_resize_pixel(img, xd, yd, lb.scale)


def test_letterbox_same_size_is_identity_and_pad_value() -> None:
    img = _rng(1).integers(0, 256, (48, 48, 3), dtype=np.uint8)
    canvas, lb = letterbox(img, 48, pad_value=0)
    np.testing.assert_array_equal(canvas, img)
    assert (lb.scale, lb.pad_x, lb.pad_y) == (1.0, 0, 0)
    canvas, lb = letterbox(img[:30], (48, 48), pad_value=7)
    assert lb.pad_y == 9
    assert lb.new_h == 30
    np.testing.assert_array_equal(canvas[9:39], img[:30])
    assert (canvas[:9] == 7).all()
    assert (canvas[39:] == 7).all()


@pytest.mark.parametrize(
    ("src_hw", "dst", "new_wh", "pad_xy"),
    [
        ((2, 1), 5, (3, 5), (1, 0)),  # 1 * 2.5 = 2.5 rounds half up to 3 (not to even 2)
        ((1, 2), 5, (5, 3), (0, 1)),
        ((480, 640), 672, (672, 504), (0, 84)),
        ((1080, 1920), 672, (672, 378), (0, 147)),
        ((1, 1000), (9, 10), (10, 1), (0, 4)),  # never thinner than one pixel
    ],
)
def test_letterbox_geometry_cases(
    src_hw: tuple[int, int],
    dst: int | tuple[int, int],
    new_wh: tuple[int, int],
    pad_xy: tuple[int, int],
) -> None:
    _, lb = letterbox(np.zeros((*src_hw, 3), np.uint8), dst)
    assert (lb.new_w, lb.new_h) == new_wh
    assert (lb.pad_x, lb.pad_y) == pad_xy


def test_letterbox_padding_split_puts_extra_pixel_right() -> None:
    img = np.zeros((10, 21, 3), dtype=np.uint8)  # scale 1, 11 px of vertical padding
    canvas, lb = letterbox(img, 21, pad_value=200)
    assert (lb.pad_y, lb.new_h) == (5, 10)
    assert (canvas[:5] == 200).all()
    assert (canvas[15:] == 200).all()
    assert (canvas[5:15] == 0).all()


@settings(max_examples=50, deadline=None)
@given(
    src_w=st.integers(1, 4000),
    src_h=st.integers(1, 4000),
    dst=st.integers(32, 1280),
    seed=st.integers(0, 2**32 - 1),
)
def test_box_mapping_round_trip(src_w: int, src_h: int, dst: int, seed: int) -> None:
    scale = min(dst / src_w, dst / src_h)
    nw = min(dst, max(1, math.floor(src_w * scale + 0.5)))
    nh = min(dst, max(1, math.floor(src_h * scale + 0.5)))
    lb = Letterbox(scale, (dst - nw) // 2, (dst - nh) // 2, src_w, src_h, dst, dst)
    rng = _rng(seed)
    xy = rng.uniform(0, 1, (20, 4)) * [src_w, src_h, src_w, src_h]
    boxes = np.concatenate([np.minimum(xy[:, :2], xy[:, 2:]), np.maximum(xy[:, :2], xy[:, 2:])], 1)
    back = lb.to_original(lb.to_canvas(boxes))
    np.testing.assert_allclose(back, boxes, rtol=1e-5, atol=1e-3 * max(1.0, 1 / scale))
    canvas_boxes = lb.to_canvas(boxes)
    np.testing.assert_allclose(canvas_boxes[:, 0], boxes[:, 0] * scale + lb.pad_x, rtol=1e-5)
    assert back.dtype == np.float32


def test_to_original_clips_to_image_edges() -> None:
    lb = Letterbox(scale=0.5, pad_x=10, pad_y=20, src_w=100, src_h=60, dst_w=70, dst_h=70)
    out = lb.to_original([[0.0, 0.0, 70.0, 70.0], [20.0, 30.0, 30.0, 40.0]])
    np.testing.assert_allclose(out, [[0, 0, 100, 60], [20, 20, 40, 40]])
    with pytest.raises(ValueError, match="last axis"):
        lb.to_original(np.zeros((3, 5)))


def test_to_rgb_formats_and_channel_order_commutes_with_letterbox() -> None:
    bgr = _rng(2).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    rgb = to_rgb(bgr, "BGR")
    np.testing.assert_array_equal(rgb, bgr[:, :, ::-1])
    assert rgb.flags.c_contiguous
    assert to_rgb(rgb, "RGB") is rgb
    a, _ = letterbox(to_rgb(bgr, "BGR"), 64)
    b, _ = letterbox(bgr, 64)
    np.testing.assert_array_equal(a, to_rgb(b, "BGR"))

    gray = bgr[:, :, 0]
    g3 = to_rgb(gray, "GRAY")
    assert g3.shape == (37, 53, 3)
    assert (g3 == gray[:, :, None]).all()
    np.testing.assert_array_equal(to_rgb(gray[:, :, None], "GRAY"), g3)
    lg, _ = letterbox(gray[:, :, None], 64)
    l3, _ = letterbox(g3, 64)
    np.testing.assert_array_equal(to_rgb(lg, "GRAY"), l3)


@pytest.mark.parametrize(
    ("image", "fmt"),
    [
        (np.zeros((4, 4, 3), np.float32), "RGB"),
        (np.zeros((4, 4, 1), np.uint8), "RGB"),
        (np.zeros((4, 4, 3), np.uint8), "GRAY"),
        (np.zeros((4, 4, 3), np.uint8), "YUV"),
        (np.zeros((0, 4, 3), np.uint8), "BGR"),
    ],
)
def test_to_rgb_rejects_bad_input(image: np.ndarray, fmt: str) -> None:
    with pytest.raises(ValueError, match=r"image|pixel_format"):
        to_rgb(image, fmt)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("image", "size", "pad"),
    [
        (np.zeros((4, 4, 3), np.int16), 8, 114),
        (np.zeros((4, 4, 2), np.uint8), 8, 114),
        (np.zeros((4, 4), np.uint8), 8, 114),
        (np.zeros((4, 0, 3), np.uint8), 8, 114),
        (np.zeros((4, 4, 3), np.uint8), 0, 114),
        (np.zeros((4, 4, 3), np.uint8), (8, -1), 114),
        (np.zeros((4, 4, 3), np.uint8), (8, 8, 8), 114),
        (np.zeros((4, 4, 3), np.uint8), 8, 256),
    ],
)
def test_letterbox_rejects_bad_input(image: np.ndarray, size: object, pad: int) -> None:
    with pytest.raises(ValueError, match=r"image|size|pad_value"):
        letterbox(image, size, pad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- quantisation


def test_round_half_away_from_zero() -> None:
    x = np.array([-2.5, -1.5, -0.5, -0.49, 0.0, 0.49999997, 0.5, 1.5, 2.5, 126.5], np.float32)
    np.testing.assert_array_equal(round_half_away_from_zero(x), [-3, -2, -1, 0, 0, 0, 1, 2, 3, 127])
    assert round_half_away_from_zero(x).dtype == np.float32


def test_hwc4_layout() -> None:
    assert hwc4_layout(3, 672, 672, 1) == (672, 672 * 4, 672 * 672 * 4)
    assert hwc4_layout(3, 10, 20, 1) == (32, 128, 1280)
    assert hwc4_layout(4, 2, 17, 2) == (24, 192, 384)  # fp16: 8-pixel granularity
    assert hwc4_layout(1, 3, 10, 1) == (64, 64, 192)  # C' = 1: 64-pixel granularity
    assert hwc4_layout(1, 1, 65, 2) == (96, 192, 192)
    for bad in [(2, 1, 1, 1), (3, 1, 1, 4), (3, 0, 1, 1), (3, 1, 0, 1)]:
        with pytest.raises(ValueError, match=r"channels|elem_size|positive"):
            hwc4_layout(*bad)


def _quant_ref(p: int, scale: float) -> int:
    """The documented float32 recipe, one scalar at a time."""
    q = float(F32(F32(p) / F32(255.0)) / F32(scale))  # >= 0: "away from zero" is "up"
    r = math.floor(q) + (1 if q - math.floor(q) >= 0.5 else 0)
    return max(-128, min(127, r))


@settings(max_examples=40, deadline=None)
@given(
    h=st.integers(1, 12),
    w=st.integers(1, 40),
    channels=st.sampled_from([1, 3]),
    scale=st.floats(1e-3, 0.05),
    seed=st.integers(0, 2**32 - 1),
)
def test_quantize_hwc4_values_and_layout(
    h: int, w: int, channels: int, scale: float, seed: int
) -> None:
    img = _rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)
    q = quantize_hwc4(img, scale)
    w_pad, pitch, size = hwc4_layout(channels, h, w, 1)
    cp = 1 if channels == 1 else 4
    assert q.shape == (h, w_pad, cp)
    assert q.dtype == np.int8
    assert q.flags.c_contiguous
    assert q.nbytes == size
    assert q.shape[1] * cp == pitch
    lut = np.array([_quant_ref(p, scale) for p in range(256)])
    np.testing.assert_array_equal(q[:, :w, :channels], lut[img])
    # Against exact rational arithmetic: within half a step (plus float32 slack) unless saturated.
    exact = img.astype(np.float64) / 255.0 / float(F32(scale))
    unsat = exact < 127
    assert (np.abs(q[:, :w, :channels] - exact)[unsat] <= 0.5 + 1e-4).all()
    assert (q[:, :w, :channels][~unsat] == 127).all()
    assert (q[:, w:] == 0).all()
    if channels == 3:
        assert (q[:, :, 3] == 0).all()


def test_quantize_ties_round_away_from_zero() -> None:
    scale = 2.0 / 255.0  # p / 255 / scale is exactly p / 2 in float32 for many odd p
    p = np.arange(256, dtype=np.uint8)
    qf = (p.astype(np.float32) / F32(255.0)) / F32(scale)
    ties = qf - np.floor(qf) == 0.5
    assert ties.sum() > 10
    q = quantize_hwc4(p.reshape(16, 16, 1), scale).reshape(16, 64)[:, :16].reshape(-1)
    np.testing.assert_array_equal(q[ties], np.ceil(qf[ties]))  # e.g. 0.5 -> 1, 2.5 -> 3
    assert q[1] == 1
    assert q[5] == 3


def test_quantize_saturates_without_wrapping() -> None:
    img = np.full((2, 3, 3), 255, np.uint8)
    img[0, 0] = (0, 1, 128)
    q = quantize_hwc4(img, 1e-3)
    assert q[0, 0, 0] == 0
    assert q[0, 0, 1] == 4
    assert q[0, 0, 2] == 127
    assert (q[1, :3, :3] == 127).all()


def test_quantize_row_pitch_override_and_dequantize() -> None:
    img = _rng(5).integers(0, 256, (4, 20, 3), dtype=np.uint8)
    scale = 0.00787209
    q = quantize_hwc4(img, scale, row_pitch_px=48)
    assert q.shape == (4, 48, 4)
    assert (q[:, 20:] == 0).all()
    np.testing.assert_array_equal(q[:, :32], quantize_hwc4(img, scale))
    x = dequantize_hwc4(q, scale, 20)
    assert x.shape == (4, 20, 3)
    assert x.dtype == np.float32
    np.testing.assert_allclose(x, img / 255.0, atol=scale / 2 + 1e-6)
    with pytest.raises(ValueError, match="row_pitch_px"):
        quantize_hwc4(img, scale, row_pitch_px=19)
    with pytest.raises(ValueError, match="input_scale"):
        quantize_hwc4(img, 0.0)
    with pytest.raises(ValueError, match="input_scale"):
        quantize_hwc4(img, float("nan"))
    with pytest.raises(ValueError, match="cannot hold"):
        dequantize_hwc4(q, scale, 49)
