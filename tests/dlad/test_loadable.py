"""Emulated DLA loadable: descriptor formulas against docs/reference/cudla.md §3.3, the container's
round trip, and one typed error for every way a file can be wrong."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlad.families.yolov5 import ANCHORS
from dlad.imaging.post import pack_chw16, pack_chw32
from dlad.imaging.pre import hwc4_layout
from dlad.loadable import (
    FORMAT_VERSION,
    MAGIC,
    DataCategory,
    DataFormat,
    DataType,
    Loadable,
    LoadableCoreError,
    LoadableCorruptError,
    LoadableError,
    LoadableVersionError,
    PixelFormat,
    PixelMapping,
    TensorDescriptor,
    TensorFormat,
    check_descriptor,
    chw_vectorized,
    descriptor_for,
    dla_linear,
    hwc4_input,
    loadable_bytes,
    read_loadable,
    write_loadable,
)
from dlad.models import DEMO

# ----------------------------------------------------------------- independent formula references


def _pad_until(x: int, ok: Callable[[int], bool]) -> int:
    """Smallest value >= x for which ok() holds, found by counting (no round-up arithmetic)."""
    while not ok(x):
        x += 1
    return x


def ref_hwc4(c: int, h: int, w: int, elem: int, n: int = 1) -> tuple[int, int, int]:
    """docs/reference/cudla.md §3.3: C' = {1, 4, 4} for C = {1, 3, 4}; rows padded so the pitch
    is a multiple of 64 bytes on Orin. Returns (padded width, row pitch, size)."""
    cp = {1: 1, 3: 4, 4: 4}[c]
    wp = _pad_until(w, lambda x: (x * cp * elem) % 64 == 0)
    return wp, wp * cp * elem, n * h * wp * cp * elem


def ref_chw(c: int, h: int, w: int, vec: int, elem: int, n: int = 1) -> int:
    """docs/reference/cudla.md §3.3: [N][ceil(C/V)][H][W][V], C padded to the next multiple of V."""
    groups = _pad_until(1, lambda g: g * vec >= c)
    return n * groups * h * w * vec * elem


def ref_linear(c: int, h: int, w: int, elem: int, n: int = 1) -> tuple[int, int]:
    """docs/reference/cudla.md §3.3: [N][C][H][roundUp(W, 64 / elem)]. Returns (row pitch, size)."""
    wp = _pad_until(w, lambda x: (x * elem) % 64 == 0)
    return wp * elem, n * c * h * wp * elem


# ----------------------------------------------------------------- enums


def test_enum_values_are_cudla_and_tensorrt_values() -> None:
    assert {m.name: m.value for m in DataType} == {
        "UNKNOWN": 0, "FLOAT": 1, "HALF": 2, "INT16": 3, "INT8": 4, "UINT8": 5, "UINT16": 6,
    }  # fmt: skip
    assert {m.name: m.value for m in DataFormat} == {
        "UNKNOWN": 0, "NCHW": 1, "NHWC": 2, "NCxHWx": 3,
    }  # fmt: skip
    assert {m.name: m.value for m in DataCategory} == {
        "IMAGE": 0, "WEIGHT": 1, "FEATURE": 2, "PLANAR": 3, "BIAS": 4,
    }  # fmt: skip
    assert {m.name: m.value for m in PixelMapping} == {"PITCH_LINEAR": 0, "BLOCK_LINEAR": 1}
    assert (PixelFormat.R8, PixelFormat.R16_F, PixelFormat.A16B16G16R16_F) == (0, 5, 8)
    assert (PixelFormat.A8B8G8R8, PixelFormat.FEATURE, PixelFormat.UNKNOWN) == (12, 36, 37)
    assert {m.name: m.value for m in TensorFormat} == {
        "CHW16": 4, "CHW32": 5, "DLA_LINEAR": 9, "DLA_HWC4": 10,
    }  # fmt: skip


# ----------------------------------------------------------------- descriptor formulas


def test_yolov5s_672_descriptors() -> None:
    inp = hwc4_input("images", 3, 672, 672, scale=0.0078721)
    assert inp.size == 672 * 672 * 4 == 1_806_336
    assert inp.stride == (1, 672 * 4, 0, 0, 0, 0, 0, 0)
    assert (inp.n, inp.c, inp.h, inp.w) == (1, 3, 672, 672)
    assert (inp.data_format, inp.data_type, inp.data_category) == (
        DataFormat.NHWC, DataType.INT8, DataCategory.IMAGE,
    )  # fmt: skip
    assert inp.pixel_format == PixelFormat.A8B8G8R8
    assert inp.buffer_shape == (1, 672, 672, 4)

    p3 = chw_vectorized("s8", 255, 84, 84, vec=16)
    assert p3.data_type == DataType.HALF
    assert p3.tensor_format == TensorFormat.CHW16
    assert p3.size == 16 * 84 * 84 * 16 * 2 == 3_612_672
    assert p3.stride == (2, 84 * 16 * 2, 84 * 84 * 16 * 2, 0, 0, 0, 0, 0)
    assert (p3.data_format, p3.data_category, p3.pixel_format) == (
        DataFormat.NCxHWx, DataCategory.FEATURE, PixelFormat.FEATURE,
    )  # fmt: skip
    assert p3.buffer_shape == (1, 16, 84, 84, 16)

    p5 = chw_vectorized("s32", 255, 21, 21, vec=32, scale=0.05)
    assert p5.data_type == DataType.INT8
    assert p5.tensor_format == TensorFormat.CHW32
    assert p5.size == 8 * 21 * 21 * 32 == 112_896
    assert p5.stride == (1, 21 * 32, 21 * 21 * 32, 0, 0, 0, 0, 0)


def test_hwc4_width_that_needs_padding() -> None:
    d = hwc4_input("images", 3, 200, 300)
    assert ref_hwc4(3, 200, 300, 1) == (304, 1216, 200 * 1216)
    assert (d.stride[1], d.size, d.buffer_shape) == (1216, 200 * 1216, (1, 200, 304, 4))
    g = hwc4_input("gray", 1, 10, 65)  # C' = 1: 64 pixels a 64-byte row, 65 -> 128
    assert (g.stride[1], g.size, g.pixel_format) == (128, 1280, PixelFormat.R8)
    f = hwc4_input("half", 4, 2, 9, data_type=DataType.HALF)  # 8 bytes a pixel, 8 pixels a row
    assert (f.stride, f.size) == ((2, 128, 0, 0, 0, 0, 0, 0), 256)
    assert f.pixel_format == PixelFormat.A16B16G16R16_F


def test_descriptors_match_the_public_cudla_print() -> None:
    """cuda-samples issue #192 printed cudlaModuleGetAttributes for an int8 HWC4 input
    [1, 4, 512, 960] and an int8 DLA_LINEAR output [1, 64, 32, 60]; the factories reproduce
    every printed field."""
    inp = hwc4_input("input", 4, 512, 960)
    assert (inp.size, inp.data_format, inp.data_type, inp.data_category) == (1966080, 2, 4, 0)
    assert (inp.pixel_format, inp.pixel_mapping, inp.stride[:4]) == (12, 0, (1, 3840, 0, 0))
    out = dla_linear("M0_519", 64, 32, 60)
    assert (out.size, out.data_format, out.data_type, out.data_category) == (131072, 1, 4, 3)
    assert (out.pixel_format, out.pixel_mapping, out.stride[:4]) == (0, 0, (1, 64, 2048, 2048))


@settings(max_examples=80, deadline=None)
@given(
    c=st.sampled_from([1, 3, 4]),
    h=st.integers(1, 700),
    w=st.integers(1, 1000),
    n=st.integers(1, 4),
    half=st.booleans(),
)
def test_hwc4_formula_and_pre_layout_agree(c: int, h: int, w: int, n: int, half: bool) -> None:
    elem = 2 if half else 1
    d = hwc4_input("x", c, h, w, n=n, data_type=DataType.HALF if half else DataType.INT8)
    wp, pitch, size = ref_hwc4(c, h, w, elem, n)
    assert (d.size, d.stride) == (size, (elem, pitch, 0, 0, 0, 0, 0, 0))
    assert d.buffer_shape == (n, h, wp, 1 if c == 1 else 4)
    assert int(np.prod(d.buffer_shape)) * d.numpy_dtype.itemsize == d.size
    assert hwc4_layout(c, h, w, elem) == (wp, pitch, d.size // n)  # the pre-processing helper


@settings(max_examples=60, deadline=None)
@given(
    c=st.integers(1, 300),
    h=st.integers(1, 12),
    w=st.integers(1, 12),
    n=st.integers(1, 3),
    vec=st.sampled_from([16, 32]),
)
def test_chw_formula_and_post_packers_agree(c: int, h: int, w: int, n: int, vec: int) -> None:
    d = chw_vectorized("y", c, h, w, vec=vec, n=n, scale=None if vec == 16 else 0.1)  # type: ignore[arg-type]
    elem = 2 if vec == 16 else 1
    assert d.size == ref_chw(c, h, w, vec, elem, n)
    assert d.stride == (elem, w * vec * elem, h * w * vec * elem, 0, 0, 0, 0, 0)
    assert int(np.prod(d.buffer_shape)) * d.numpy_dtype.itemsize == d.size
    x = np.random.default_rng(c * 1000 + h * 10 + w).standard_normal((c, h, w))
    packed = pack_chw16(x) if vec == 16 else pack_chw32(x, 0.1)
    assert packed.shape == d.buffer_shape[1:]
    assert packed.dtype == d.numpy_dtype
    assert n * packed.nbytes == d.size


@settings(max_examples=60, deadline=None)
@given(c=st.integers(1, 600), h=st.integers(1, 300), w=st.integers(1, 2000), half=st.booleans())
def test_dla_linear_formula(c: int, h: int, w: int, half: bool) -> None:
    elem = 2 if half else 1
    d = dla_linear("z", c, h, w, data_type=DataType.HALF if half else DataType.INT8)
    pitch, size = ref_linear(c, h, w, elem)
    assert (d.size, d.stride) == (size, (elem, pitch, h * pitch, h * pitch, 0, 0, 0, 0))
    assert int(np.prod(d.buffer_shape)) * d.numpy_dtype.itemsize == d.size


@pytest.mark.parametrize(
    "make",
    [
        lambda: hwc4_input("x", 2, 8, 8),  # HWC4 takes 1, 3 or 4 channels
        lambda: hwc4_input("x", 3, 8, 8, data_type=DataType.FLOAT),
        lambda: chw_vectorized("x", 8, 8, 8, vec=16, data_type=DataType.INT8),  # CHW16 is fp16
        lambda: chw_vectorized("x", 8, 8, 8, vec=32, data_type=DataType.HALF),  # CHW32 is int8
        lambda: chw_vectorized("x", 8, 8, 8, vec=8),  # type: ignore[arg-type]
        lambda: dla_linear("x", 8, 8, 8, data_type=DataType.UINT8),
        lambda: dla_linear("x", 0, 8, 8),
        lambda: dla_linear("x", 8, 8193, 8),
        lambda: dla_linear("x", 8, 8, 8, n=4097),
        lambda: dla_linear("x", 8, 8, True),
        lambda: chw_vectorized("x", 8, 8, 8, vec=16, scale=0.5),  # scales are for INT8 only
        lambda: dla_linear("x", 8, 8, 8, scale=float("nan")),
        lambda: dla_linear("x", 8, 8, 8, scale=-1.0),
        lambda: dla_linear("", 8, 8, 8),
        lambda: dla_linear("a\0b", 8, 8, 8),
        lambda: dla_linear("n" * 81, 8, 8, 8),
        lambda: dla_linear("é" * 41, 8, 8, 8),  # 82 UTF-8 bytes
    ],
)
def test_bad_descriptors_raise_value_error(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011  # the factories' documented error
        make()


def test_name_limit_counts_utf8_bytes() -> None:
    assert dla_linear("n" * 80, 8, 8, 8).name == "n" * 80
    assert dla_linear("é" * 40, 8, 8, 8).name == "é" * 40  # 80 bytes


def test_check_descriptor_names_every_broken_field() -> None:
    good = chw_vectorized("out", 255, 20, 20, vec=32, scale=0.25)
    check_descriptor(good)
    assert descriptor_for(TensorFormat.CHW32, "out", n=1, c=255, h=20, w=20, scale=0.25) == good
    changes: dict[str, object] = {
        "size": good.size + 1,
        "data_format": DataFormat.NCHW,
        "data_category": DataCategory.PLANAR,
        "pixel_format": PixelFormat.R8,
        "pixel_mapping": PixelMapping.BLOCK_LINEAR,
        "stride": (1, 640, 12800, 12800, 0, 0, 0, 0),
    }
    for key, value in changes.items():
        with pytest.raises(ValueError, match=key):
            check_descriptor(dataclasses.replace(good, **{key: value}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CHW16"):  # CHW16 does not take INT8
        check_descriptor(dataclasses.replace(good, tensor_format=TensorFormat.CHW16))


def test_descriptor_dict_round_trip_and_strictness() -> None:
    d = hwc4_input("images", 3, 64, 64, scale=0.02)
    assert TensorDescriptor.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    bad: list[dict[str, Any]] = [
        {k: v for k, v in d.to_dict().items() if k != "scale"},
        {**d.to_dict(), "extra": 1},
        {**d.to_dict(), "data_type": "INT9"},
        {**d.to_dict(), "data_type": 4},
        {**d.to_dict(), "size": True},
        {**d.to_dict(), "size": -1},
        {**d.to_dict(), "stride": [1, 2, 3]},
        {**d.to_dict(), "stride": "12345678"},
        {**d.to_dict(), "scale": "0.02"},
    ]
    for item in bad:
        with pytest.raises(ValueError):  # noqa: PT011
            TensorDescriptor.from_dict(item)


# ----------------------------------------------------------------- loadables


def _small(**changes: Any) -> Loadable:
    """A valid 64x64 two-class loadable with FP16 CHW16 heads (~2 KB on disk)."""
    kw: dict[str, Any] = {
        "name": "tiny",
        "dla_core": 0,
        "inputs": (hwc4_input("images", 3, 64, 64, scale=0.0078),),
        "outputs": tuple(
            chw_vectorized(f"s{s}", 21, 64 // s, 64 // s, vec=16) for s in (8, 16, 32)
        ),
        "input_scale": 0.0078,
        "output_scales": {},
        "heads": "fp16",
        "num_classes": 2,
        "class_names": ("cat", "dog"),
        "anchors_px": ANCHORS,  # a numpy array is accepted
        "strides": (8, 16, 32),
        "image_size": (64, 64),
        "latency_us": 123.5,
        "sections": {"graph": bytes(range(200)), "latency": b'{"layers": []}'},
        "fp16_nodes": ("/model.24/m.0/Conv",),
        "latency_layers": {"count": 3},
        "provenance": {"manifest": "ab" * 32},
        "created": "2025-01-02T03:04:05+00:00",
    }
    kw.update(changes)
    return Loadable(**kw)


def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data area) of a file, parsed the way docs/loadable.md describes the layout."""
    magic, _, hlen = struct.unpack_from("<8sII", blob)
    assert magic == MAGIC
    start = -(-(16 + hlen) // 64) * 64
    return json.loads(blob[16 : 16 + hlen]), blob[start:-4]


def _frame(header: dict[str, Any] | bytes, data: bytes, version: int = FORMAT_VERSION) -> bytes:
    """Assemble a file from a header and a data area with a valid CRC (docs/loadable.md)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    head = MAGIC + struct.pack("<II", version, len(text)) + text
    body = head + bytes(-len(head) % 64) + data
    return body + struct.pack("<I", zlib.crc32(body))


def test_small_file_layout_matches_the_documentation() -> None:
    blob = loadable_bytes(_small())
    header, data = _split(blob)
    assert blob[:8] == b"DLADEMU\0"
    assert struct.unpack_from("<I", blob, 8)[0] == 3
    assert header["format"] == "dlad-emulated-loadable"
    assert header["version"] == 3
    assert header["family"] == "yolov5"
    assert _frame(json.dumps(header, sort_keys=True, separators=(",", ":")).encode(), data) == blob
    graph, latency = header["sections"]
    assert (graph["name"], graph["offset"], graph["size"]) == ("graph", 0, 200)
    assert (latency["name"], latency["offset"], latency["size"]) == ("latency", 256, 14)
    assert data[200:256] == bytes(56)
    assert header["data_size"] == len(data) == 270


_names = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=12)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False,
    allow_infinity=False) | _names, lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(_names, kids, max_size=3), max_leaves=8,
)  # fmt: skip


@st.composite
def loadables(draw: st.DrawFn) -> Loadable:
    nc, na, nl = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    strides = tuple(8 * 2**i for i in range(nl))
    size = (strides[-1] * draw(st.integers(1, 4)), strides[-1] * draw(st.integers(1, 4)))
    n = draw(st.integers(1, 2))
    s_in = draw(st.floats(1e-4, 1.0))
    if draw(st.booleans()):
        c = draw(st.sampled_from([1, 3, 4]))
        half = draw(st.booleans())
        dt = DataType.HALF if half else DataType.INT8
        inp = hwc4_input("in", c, *size, n=n, data_type=dt, scale=None if half else s_in)
    else:
        inp = dla_linear("in", 3, *size, n=n, scale=s_in)
    heads: Literal["int8", "fp16"] = draw(st.sampled_from(["int8", "fp16"]))
    scales = draw(st.lists(st.floats(1e-4, 10.0), min_size=nl, max_size=nl))
    outs = []
    for i, s in enumerate(strides):
        dims = (na * (5 + nc), size[0] // s, size[1] // s)
        if draw(st.booleans()):
            vec = 32 if heads == "int8" else 16
            outs.append(chw_vectorized(f"o{i}", *dims, vec=vec, n=n,  # type: ignore[arg-type]
                                       scale=scales[i] if heads == "int8" else None))  # fmt: skip
        else:
            dt = DataType.INT8 if heads == "int8" else DataType.HALF
            outs.append(dla_linear(f"o{i}", *dims, n=n, data_type=dt,
                                   scale=scales[i] if heads == "int8" else None))  # fmt: skip
    pair = st.tuples(st.floats(0.5, 600), st.floats(0.5, 600))
    level = st.lists(pair, min_size=na, max_size=na).map(tuple)
    anchors = tuple(draw(st.lists(level, min_size=nl, max_size=nl)))
    sections = draw(st.dictionaries(st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,10}", fullmatch=True),
                                    st.binary(max_size=300), max_size=3))  # fmt: skip
    sections["graph"] = draw(st.binary(min_size=1, max_size=500))
    return Loadable(
        name=draw(_names), dla_core=draw(st.integers(0, 1)), inputs=(inp,), outputs=tuple(outs),
        input_scale=s_in, output_scales={o.name: o.scale for o in outs if o.scale is not None},
        heads=heads, num_classes=nc, class_names=tuple(draw(st.lists(_names, min_size=nc,
        max_size=nc))), anchors_px=anchors, strides=strides, image_size=size,
        latency_us=draw(st.floats(0, 1e6)), sections=sections,
        fp16_nodes=tuple(draw(st.lists(_names, max_size=3))),
        latency_layers=draw(st.dictionaries(_names, _json, max_size=3)),
        provenance=draw(st.dictionaries(_names, _json, max_size=3)),
    )  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loadable=loadables())
def test_round_trip(loadable: Loadable) -> None:
    blob = loadable_bytes(loadable)
    back = read_loadable(blob, expect_core=loadable.dla_core)
    assert back == loadable
    assert list(back.sections) == list(loadable.sections)  # order is part of the format
    assert loadable_bytes(back) == blob  # canonical: one loadable, one byte string


def test_write_is_atomic_and_readable(tmp_path: Path) -> None:
    target = tmp_path / "m.dla0.loadable"
    target.write_bytes(b"old")
    assert write_loadable(target, _small()) == target
    assert read_loadable(target) == _small()
    assert os.listdir(tmp_path) == ["m.dla0.loadable"]  # no temporary file left behind
    assert target.stat().st_mode & 0o777 == 0o644
    with pytest.raises(OSError):  # noqa: PT011
        write_loadable(tmp_path / "missing" / "x.loadable", _small())
    assert os.listdir(tmp_path) == ["m.dla0.loadable"]


def test_every_single_byte_change_is_corruption() -> None:
    blob = loadable_bytes(_small())
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= 0xA5
        with pytest.raises(LoadableCorruptError):
            read_loadable(bytes(bad))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_byte_change_is_corruption(data: st.DataObject) -> None:
    blob = loadable_bytes(_small())
    pos = data.draw(st.integers(0, len(blob) - 1))
    bad = bytearray(blob)
    bad[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(LoadableCorruptError):
        read_loadable(bytes(bad))


def test_every_truncation_and_any_extension_is_corruption() -> None:
    blob = loadable_bytes(_small())
    for cut in range(len(blob)):
        with pytest.raises(LoadableCorruptError):
            read_loadable(blob[:cut])
    with pytest.raises(LoadableCorruptError, match="truncated"):
        read_loadable(blob[:-7])
    with pytest.raises(LoadableCorruptError, match="unexpected bytes"):
        read_loadable(blob + b"\0")


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "engine.bin"
    path.write_bytes(b"ftlo" + bytes(100))  # e.g. a TensorRT standalone loadable
    with pytest.raises(LoadableCorruptError, match=rf"{path}.*bad magic"):
        read_loadable(path)


@pytest.mark.parametrize("version", [0, 4, 2**32 - 1])
def test_other_versions(tmp_path: Path, version: int) -> None:
    header, data = _split(loadable_bytes(_small()))
    header["version"] = version
    path = tmp_path / "future.loadable"
    path.write_bytes(_frame(header, data, version=version))
    with pytest.raises(
        LoadableVersionError, match=rf"{path}.*version {version}.*reads version 1, 2, 3"
    ):
        read_loadable(path)


def test_version_1_files_decode_as_yolov5(tmp_path: Path) -> None:
    """Version 1 had no model family (every loadable was YOLOv5); it must not carry one."""
    header, data = _split(loadable_bytes(_small()))
    header["version"] = 1
    del header["family"]
    v1 = read_loadable(_frame(header, data, version=1))
    assert v1.family == "yolov5"
    assert dataclasses.replace(v1, created=_small().created) == _small()
    header["family"] = "yolov5"
    with pytest.raises(LoadableCorruptError, match=r"unknown \['family'\]"):
        read_loadable(_frame(header, data, version=1))
    # the bundled demo model is a version 1 file
    assert read_loadable(DEMO / "fp16_heads.dla0.emu").family == "yolov5"


def test_version_2_files_name_the_family_decoder(tmp_path: Path) -> None:
    """Version 2 called the family ``decoder``; version 3 calls it ``family``, and each refuses
    the other's key."""
    header, data = _split(loadable_bytes(_small()))
    assert (header["version"], header["family"]) == (3, "yolov5")
    header["version"] = 2
    header["decoder"] = header.pop("family")
    assert read_loadable(_frame(header, data, version=2)).family == "yolov5"
    header["family"] = "yolov5"
    with pytest.raises(LoadableCorruptError, match=r"unknown \['family'\]"):
        read_loadable(_frame(header, data, version=2))


def test_family_names_are_checked() -> None:
    assert _small(family="yolov9").family == "yolov9"  # a family this dlad lacks: not checked
    for bad in ("", "YOLO", "9x", "a" * 40, 5):
        with pytest.raises(ValueError, match="family"):
            _small(family=bad)


def test_the_family_checks_the_heads() -> None:
    """A known family's rules: a yolov5 loadable needs its anchors, one row per output, and
    ``na * (5 + nc)`` channels."""
    with pytest.raises(ValueError, match="needs anchors_px"):
        _small(anchors_px=())
    with pytest.raises(ValueError, match="3 outputs for 2 anchor levels"):
        _small(anchors_px=ANCHORS[:2])
    with pytest.raises(ValueError, match=r"has 21 channels, a yolov5 head of 3 classes"):
        _small(num_classes=3, class_names=("cat", "dog", "owl"))


def test_core_mismatch(tmp_path: Path) -> None:
    path = write_loadable(tmp_path / "m.dla1.loadable", _small(dla_core=1))
    assert read_loadable(path, expect_core=1).dla_core == 1
    assert read_loadable(path).dla_core == 1
    with pytest.raises(LoadableCoreError, match=rf"{path}: built for DLA core 1, loaded on core 0"):
        read_loadable(path, expect_core=0)
    with pytest.raises(ValueError, match="expect_core") as info:
        read_loadable(path, expect_core=2)
    assert not isinstance(info.value, LoadableError)  # a caller bug, not a bad file


def test_error_hierarchy() -> None:
    for cls in (LoadableCorruptError, LoadableVersionError, LoadableCoreError):
        assert issubclass(cls, LoadableError)
        assert issubclass(cls, ValueError)
    assert issubclass(LoadableError, ValueError)


def _mutate(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def apply(h: dict[str, Any]) -> None:
        h[key] = value

    return apply


def _mutate_io(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def apply(h: dict[str, Any]) -> None:
        h["outputs"][0][key] = value

    return apply


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (lambda h: h.pop("heads"), "missing"),
        (_mutate("unexpected", 1), "unknown"),
        (_mutate("dla_core", "0"), "dla_core"),
        (_mutate("dla_core", True), "dla_core"),
        (_mutate("dla_core", 2), "dla_core"),
        (_mutate("format", "onnx"), "format"),
        (_mutate("version", 1), "version"),
        (_mutate("heads", "int4"), "heads"),
        (_mutate("input_scale", -1.0), "input_scale"),
        (_mutate("class_names", ["a"]), "class names"),
        (_mutate("image_size", [64]), "image_size"),
        (_mutate("strides", [8, 16]), "strides"),
        (_mutate("anchors_px", [[[1, 2, 3]]]), "anchors_px"),
        (_mutate("created", "yesterday"), "isoformat"),
        (_mutate("output_scales", {"s8": 0.5}), "output_scales"),
        (_mutate("data_size", 1), "implies"),
        (_mutate_io("size", 3612672), "size="),
        (_mutate_io("stride", [2, 999, 0, 0, 0, 0, 0, 0]), "stride="),
        (_mutate_io("pixel_format", "R8"), "pixel_format="),
        (_mutate_io("data_type", "INT8"), "CHW16 on DLA takes HALF"),
        (_mutate_io("tensor_format", "DLA_HWC4"), "DLA_HWC4"),
        (lambda h: h["sections"][1].update(offset=200), "layout"),
        (lambda h: h["sections"][0].update(sha256="0" * 64), "sha256"),
        (lambda h: h["sections"].pop(0), "graph"),
    ],
)
def test_header_errors_under_a_valid_crc(
    mutation: Callable[[dict[str, Any]], None], message: str
) -> None:
    header, data = _split(loadable_bytes(_small()))
    mutation(header)
    if message == "graph":  # the graph section is gone: move the rest to the start
        data = data[256:]
        header["sections"][0]["offset"] = 0
        header["data_size"] = len(data)
    with pytest.raises(LoadableCorruptError, match=message):
        read_loadable(_frame(header, data), source_name="probe.loadable")


def test_section_bytes_and_padding_are_checked_under_a_valid_crc() -> None:
    header, data = _split(loadable_bytes(_small()))
    with pytest.raises(LoadableCorruptError, match="'graph' does not match its sha256"):
        read_loadable(_frame(header, b"\xff" + data[1:]))
    with pytest.raises(LoadableCorruptError, match="padding before section 'latency'"):
        read_loadable(_frame(header, data[:210] + b"\x01" + data[211:]))
    text = json.dumps(header).encode()
    head = MAGIC + struct.pack("<II", FORMAT_VERSION, len(text)) + text
    body = head + b"\x01" * (-len(head) % 64) + data
    with pytest.raises(LoadableCorruptError, match="padding after the header"):
        read_loadable(body + struct.pack("<I", zlib.crc32(body)))


@pytest.mark.parametrize(
    "header",
    [b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b""],
)
def test_malformed_header_text_under_a_valid_crc(header: bytes) -> None:
    _, data = _split(loadable_bytes(_small()))
    with pytest.raises(LoadableCorruptError, match="<bytes>: corrupt"):
        read_loadable(_frame(header, data))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_header_value_is_accepted_or_corrupt(data: st.DataObject) -> None:
    """Replacing any header value, or any descriptor value, with arbitrary JSON under a valid
    CRC either reads or raises LoadableCorruptError: no other exception escapes."""
    header, area = _split(loadable_bytes(_small()))
    target = header
    if data.draw(st.booleans()):
        target = header[data.draw(st.sampled_from(["inputs", "outputs"]))][0]
    target[data.draw(st.sampled_from(sorted(target)))] = data.draw(_json)
    with contextlib.suppress(LoadableCorruptError):
        read_loadable(_frame(header, area))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dla_core": 2}, "dla_core"),
        ({"heads": "int8"}, "heads"),
        ({"output_scales": {"s8": 0.5}}, "output_scales"),
        ({"sections": {"latency": b"{}"}}, "required"),
        ({"sections": {"graph": b""}}, "required"),
        ({"sections": {"graph": b"x", "Bad Name": b""}}, "section name"),
        ({"sections": {"graph": "text"}}, "bytes"),
        ({"input_scale": 0.5}, "input_scale"),
        ({"image_size": (96, 64)}, "image_size"),
        ({"strides": (8, 16)}, "strides must agree"),
        (
            {"outputs": (chw_vectorized("s8", 21, 4, 4, vec=16), *_small().outputs[1:])},
            "stride-8 head",
        ),
        ({"class_names": ("cat",)}, "class names"),
        ({"anchors_px": [[(1.0, 2.0)], [(1.0, 2.0), (3.0, 4.0)], [(1.0, 2.0)]]}, "same number"),
        ({"latency_us": float("inf")}, "latency_us"),
        ({"provenance": {"x": object()}}, "JSON"),
        ({"created": "not a date"}, "isoformat"),
        ({"inputs": ()}, "at least one input"),
        ({"inputs": (hwc4_input("s8", 3, 64, 64, scale=0.0078),)}, "unique"),
        ({"inputs": (hwc4_input("images", 3, 64, 64, n=2, scale=0.0078),)}, "batch size"),
        ({"inputs": (hwc4_input("images", 3, 64, 64),)}, "no scale"),
    ],
)
def test_loadable_invariants(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _small(**changes)


def test_outputs_must_be_dla_output_formats() -> None:
    out = hwc4_input("s8", 3, 8, 8, data_type=DataType.HALF)
    with pytest.raises(ValueError, match="cannot write DLA_HWC4"):
        _small(outputs=(out, *_small().outputs[1:]))


def test_int8_heads_and_frozen_copies() -> None:
    outs = tuple(
        chw_vectorized(f"s{s}", 21, 64 // s, 64 // s, vec=32, scale=0.01 * s) for s in (8, 16, 32)
    )
    scales = {o.name: o.scale for o in outs}
    loadable = _small(outputs=outs, heads="int8", output_scales=scales)
    assert dict(loadable.output_scales) == {"s8": 0.08, "s16": 0.16, "s32": 0.32}
    assert read_loadable(loadable_bytes(loadable)) == loadable
    with pytest.raises(TypeError):
        loadable.output_scales["s8"] = 1.0
    stored: tuple[object, object] = (loadable.class_names, loadable.anchors_px[0])
    assert all(isinstance(x, tuple) for x in stored)
    with pytest.raises(dataclasses.FrozenInstanceError):
        loadable.dla_core = 1  # type: ignore[misc]
    other = dataclasses.replace(loadable, dla_core=1)
    assert read_loadable(loadable_bytes(other), expect_core=1).dla_core == 1
