"""NV12 and YUYV frames: the numpy reference (``yuv_to_rgb``) against FFmpeg's own conversion
(PyAV), its exact values, and a YUV frame served end to end, through the wire, the C++ plane
and the real INT8 core, to the detections of the same frame converted first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from dlad import _native, protocol
from dlad.imaging.pre import (
    letterbox,
    letterbox_frame,
    round_half_away_from_zero,
    to_rgb,
    yuv_to_rgb,
)
from dlad_client import Client, YuvFormat
from tests.dlad.serving import NUMERIC_DEMO, serve_config

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
COLOURS = [(c, r) for c in protocol.COLORSPACES for r in protocol.COLOR_RANGES]
_AV_COLORSPACE = {"bt601": av.video.reformatter.Colorspace.ITU601,
                  "bt709": av.video.reformatter.Colorspace.ITU709}  # fmt: skip
_AV_RANGE = {"limited": av.video.reformatter.ColorRange.MPEG,
             "full": av.video.reformatter.ColorRange.JPEG}  # fmt: skip


def _tiled(rng: np.random.Generator, h: int, w: int) -> tuple[npt.NDArray[np.uint8], ...]:
    """Random luma, and chroma constant over 8 x 8 pixel tiles (so that FFmpeg's chroma
    upsampling, which interpolates between samples, agrees with taking the block's own inside
    a tile), with the mask of the pixels whose neighbouring chroma samples are all the same."""
    luma = rng.integers(0, 256, (h, w), dtype=np.uint8)
    tiles = rng.integers(0, 256, (h // 8, w // 8, 2), dtype=np.uint8)
    chroma = tiles.repeat(4, 0).repeat(4, 1)  # one sample a 2 x 2 block
    same = np.ones(chroma.shape[:2], bool)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            same &= (np.roll(chroma, (dy, dx), (0, 1)) == chroma).all(-1)
    return luma, chroma, same.repeat(2, 0).repeat(2, 1)


def _nv12(luma: npt.NDArray[np.uint8], chroma: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    h, w = luma.shape
    return np.concatenate([luma, chroma.reshape(h // 2, w)])


def _yuyv(luma: npt.NDArray[np.uint8], chroma: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    h, w = luma.shape
    out = np.empty((h, w, 2), np.uint8)
    out[:, :, 0] = luma
    pairs = out.reshape(h, w // 2, 4)
    rows = chroma.repeat(2, 0)  # 4:2:2 has a chroma sample on every row
    pairs[:, :, 1], pairs[:, :, 3] = rows[:, :, 0], rows[:, :, 1]
    return out


@pytest.mark.parametrize(("colorspace", "color_range"), COLOURS)
@pytest.mark.parametrize("layout", ["NV12", "YUYV"])
def test_the_reference_is_ffmpegs_conversion(
    layout: str, colorspace: str, color_range: str
) -> None:
    """Where a pixel's chroma is its neighbours', the reference and FFmpeg's swscale differ
    by their rounding only: at most 3 levels, under 1.5 on average."""
    luma, chroma, inside = _tiled(np.random.default_rng(3), 64, 96)
    frame_bytes = _nv12(luma, chroma) if layout == "NV12" else _yuyv(luma, chroma)
    frame = av.VideoFrame.from_ndarray(
        frame_bytes, format=layout.lower().replace("yuyv", "yuyv422")
    )
    frame.colorspace, frame.color_range = _AV_COLORSPACE[colorspace], _AV_RANGE[color_range]
    ffmpeg = frame.to_ndarray(format="rgb24").astype(np.int32)
    ours = yuv_to_rgb(frame_bytes, layout, protocol.colour_code(colorspace, color_range))  # type: ignore[arg-type]
    diff = np.abs(ffmpeg - ours)[inside]
    assert diff.max() <= 3
    assert diff.mean() < 1.5
    # a different matrix is far off: the colour reached both converters
    other = protocol.colour_code("bt601" if colorspace == "bt709" else "bt709", color_range)
    assert np.abs(ffmpeg - yuv_to_rgb(frame_bytes, layout, other))[inside].max() > 10  # type: ignore[arg-type]


def test_grey_and_the_ends_of_the_range_are_exact() -> None:
    """U = V = 128 is grey: full range keeps Y, limited range stretches 16..235 to 0..255."""
    y = np.array([[0, 16, 126, 235, 255, 128]], np.uint8).repeat(2, 0)
    frame = np.concatenate([y, np.full((1, 6), 128, np.uint8)])
    full = yuv_to_rgb(frame, "NV12", protocol.colour_code("bt601", "full"))
    np.testing.assert_array_equal(full[..., 0], y)
    assert (full == full[..., :1]).all()
    limited = yuv_to_rgb(frame, "NV12", 0)
    np.testing.assert_array_equal(limited[0, :, 1], [0, 0, 128, 255, 255, 130])


@pytest.mark.parametrize("colour", [0, 3])  # BT.601 limited, BT.709 full: every branch
def test_the_tables_are_the_formula_for_every_yuv_triple(colour: int) -> None:
    """The reference converts through tables; each of the 2**24 (Y, U, V) gives what the
    float32 formula, step by step, gives (the GPU kernel's yuv_rgb)."""
    ky, rv, gu, gv, bu, off = (np.float32(c) for c in _native.yuv_coefficients(colour))
    yy, uu, vv = (a.reshape(-1) for a in np.meshgrid(*[np.arange(256)] * 3, indexing="ij"))
    y = (yy - int(off)).astype(np.float32) * ky
    u, v = (uu - 128).astype(np.float32), (vv - 128).astype(np.float32)
    want = np.stack([y + rv * v, (y - gu * u) - gv * v, y + bu * u], axis=-1)
    want = np.clip(round_half_away_from_zero(want), 0, 255).astype(np.uint8)
    frame = np.empty((1, yy.size, 2), np.uint8)  # YUYV: each pixel pair shares U and V
    frame[0, :, 0] = yy
    pairs = frame.reshape(1, -1, 4)
    for half in (0, 1):  # even pixels, then odd ones, carry the triple
        pairs[0, :, 1] = uu[half::2]
        pairs[0, :, 3] = vv[half::2]
        got = yuv_to_rgb(frame, "YUYV", colour)[0, half::2]
        np.testing.assert_array_equal(got, want[half::2])


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(["NV12", "YUYV"]), colour=st.integers(0, 3),
    h=st.integers(1, 90), w=st.integers(1, 90),
    canvas=st.sampled_from([(32, 32), (64, 96), (256, 256), (100, 60)]), seed=st.integers(0, 99),
)  # fmt: skip
def test_letterbox_frame_is_letterbox_of_the_converted_frame(
    layout: str, colour: int, h: int, w: int, canvas: tuple[int, int], seed: int
) -> None:
    """Converting only the pixels the taps read gives the bytes of converting them all."""
    shape = protocol.frame_shape(layout, 2 * h, 2 * w)
    frame = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    got, g = letterbox_frame(frame, layout, canvas, colour)  # type: ignore[arg-type]
    want, g2 = letterbox(yuv_to_rgb(frame, layout, colour), canvas)  # type: ignore[arg-type]
    assert g == g2
    np.testing.assert_array_equal(got, want)


def test_nv12_and_yuyv_of_the_same_picture_are_the_same_rgb() -> None:
    luma, chroma, _ = _tiled(np.random.default_rng(4), 16, 24)
    for colour in range(4):
        np.testing.assert_array_equal(yuv_to_rgb(_nv12(luma, chroma), "NV12", colour),
                                      yuv_to_rgb(_yuyv(luma, chroma), "YUYV", colour))  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "shape"),
    [("NV12", (6, 4, 1)), ("NV12", (5, 4)), ("NV12", (6, 5)), ("YUYV", (4, 5, 2)),
     ("YUYV", (4, 4, 3)), ("NV12", (0, 4))],
)  # fmt: skip
def test_a_shape_that_is_not_the_layouts_is_refused(layout: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=layout):
        yuv_to_rgb(np.zeros(shape, np.uint8), layout, 0)  # type: ignore[arg-type]


def test_a_yuv_frame_letterboxes_as_its_rgb_does() -> None:
    """to_rgb converts before it resamples: the letterbox of a YUV frame is its RGB's."""
    luma, chroma, _ = _tiled(np.random.default_rng(5), 48, 64)
    nv12 = _nv12(luma, chroma)
    canvas, _ = letterbox(to_rgb(nv12, "NV12", 1), 32)
    np.testing.assert_array_equal(canvas, letterbox(yuv_to_rgb(nv12, "NV12", 1), 32)[0])


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A numeric-mode daemon (the real INT8 core) serving the bundled demo model."""
    with serve_config(NUMERIC_DEMO, tmp_path_factory.mktemp("yuv")) as ep:
        yield ep


def _camera_frame(fmt: str, colorspace: str, color_range: str) -> npt.NDArray[np.uint8]:
    """The bundled image as a camera's decoder gives it (FFmpeg's RGB -> YUV)."""
    rgb = np.asarray(Image.open(ROOT / "dlad/models/demo/images/000001.jpg").convert("RGB"))
    rgb = np.ascontiguousarray(rgb[: rgb.shape[0] // 2 * 2, : rgb.shape[1] // 2 * 2])
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    yuv = frame.reformat(format="nv12" if fmt == "NV12" else "yuyv422",
                         dst_colorspace=_AV_COLORSPACE[colorspace],
                         dst_color_range=_AV_RANGE[color_range])  # fmt: skip
    return np.asarray(yuv.to_ndarray(), np.uint8)


@pytest.mark.parametrize("shm", [False, True], ids=["message", "shm"])
@pytest.mark.parametrize(
    ("fmt", "colorspace", "color_range"),
    [("NV12", "bt601", "limited"), ("NV12", "bt709", "full"), ("YUYV", "bt709", "limited")],
)
def test_a_yuv_frame_is_served_as_its_rgb_is(
    endpoint: str, fmt: str, colorspace: str, color_range: str, shm: bool
) -> None:
    """The daemon converts a YUV frame with the letterbox: its detections are those of the
    same frame converted by the reference and sent as RGB, bit for bit."""
    frame = _camera_frame(fmt, colorspace, color_range)
    yuv = YuvFormat(fmt, colorspace, color_range)  # type: ignore[arg-type]
    rgb = yuv_to_rgb(frame, fmt, protocol.colour_code(colorspace, color_range))  # type: ignore[arg-type]
    slots = {"shm_slots": 2, "shm_slot_bytes": 1 << 21} if shm else {}
    with Client(endpoint, timeout_s=60, **slots) as client:  # type: ignore[arg-type]
        got = client.detect(frame, pixel_format=yuv)
        want = client.detect(rgb)
    assert len(got) > 0
    np.testing.assert_array_equal(got.detections, want.detections)


def test_a_yuv_frame_of_odd_width_is_refused_before_it_is_sent(endpoint: str) -> None:
    with Client(endpoint) as client, pytest.raises(ValueError, match="even"):
        client.detect(np.zeros((6, 5), np.uint8), pixel_format="NV12")
