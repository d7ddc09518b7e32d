"""TensorRT calibration cache text format and the --layerPrecisions argument."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.calib_cache import (
    CalibrationCache,
    CalibrationCacheError,
    float_to_hex,
    hex_to_float,
    layer_precisions_arg,
    parse_calibration_cache,
    write_calibration_cache,
)

# Positive finite float32 values, subnormals included (their hex has fewer than 8 digits).
F32_SCALES = st.floats(
    min_value=0.0,
    exclude_min=True,
    allow_nan=False,
    allow_infinity=False,
    allow_subnormal=True,
    width=32,
)
NAMES = st.text(
    alphabet=st.characters(exclude_characters="\n\r", exclude_categories=["Cs"]),
    min_size=1,
    max_size=30,
)


def numpy_hex(value: float) -> str:
    """Independent encoding: the float32's bits through numpy, as unpadded lowercase hex."""
    return format(int(np.array(value, dtype=np.float32).view(np.uint32)), "x")


def test_known_encodings() -> None:
    assert float_to_hex(1.0) == "3f800000"
    assert float_to_hex(1 / 127) == "3c010204"
    assert float_to_hex(2.0**-149) == "1"  # smallest subnormal: no zero padding
    assert hex_to_float("3f800000") == 1.0
    assert hex_to_float("3C010204") == float(np.float32(1 / 127))


def test_parses_the_reference_sample() -> None:
    text = (
        "TRT-8600-EntropyCalibration2\n"
        "images: 3c00f9f4\n"
        "/model.0/act/Mul_output_0: 3e6c9314\n"
        "/model.2/concat/Concat_output_0: 3e0798da\n"
    )
    cache = parse_calibration_cache(text)
    assert cache.trt_version == 8600
    assert cache.algorithm == "EntropyCalibration2"
    assert list(cache.scales) == [
        "images",
        "/model.0/act/Mul_output_0",
        "/model.2/concat/Concat_output_0",
    ]
    assert cache.scales["images"] == pytest.approx(1 / 127.03, rel=1e-4)
    assert cache.to_text() == text


@settings(max_examples=100)
@given(scales=st.dictionaries(NAMES, F32_SCALES, max_size=8), version=st.integers(0, 10**6))
def test_round_trip_is_exact_for_float32(scales: dict[str, float], version: int) -> None:
    text = write_calibration_cache(scales, trt_version=version)
    lines = text.split("\n")
    assert lines[0] == f"TRT-{version}-EntropyCalibration2"
    assert lines[-1] == ""
    assert lines[1:-1] == [f"{name}: {numpy_hex(v)}" for name, v in scales.items()]
    cache = parse_calibration_cache(text)
    assert cache == CalibrationCache(version, "EntropyCalibration2", scales)
    assert list(cache.scales) == list(scales)  # file order kept
    assert cache.to_text() == text


@settings(max_examples=100)
@given(value=st.floats(min_value=1e-37, max_value=1e38))
def test_float64_scales_round_to_nearest_float32(value: float) -> None:
    cache = parse_calibration_cache(write_calibration_cache({"t": value}))
    assert cache.scales["t"] == float(np.float32(value))


@pytest.mark.parametrize("name", ["a:b", "a: b", "x:", "x: ", " lead", "tail ", "ünï: cödé"])
def test_names_split_on_last_separator(name: str) -> None:
    assert parse_calibration_cache(write_calibration_cache({name: 0.5})).scales == {name: 0.5}


def test_lenient_line_ends_and_bytes() -> None:
    text = "TRT-8502-EntropyCalibration2\r\na: 3F800000\r\nb: 40000000"
    cache = parse_calibration_cache(text.encode())
    assert cache.trt_version == 8502
    assert cache.scales == {"a": 1.0, "b": 2.0}
    assert parse_calibration_cache("TRT-1-MinMaxCalibration").scales == {}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("a: 3f800000\n", "line 1: header"),
        ("TRT-86x0-EntropyCalibration2\n", "line 1: header"),
        ("TRT-8600-\n", "line 1: header"),
        ("TRT-8600-EntropyCalibration2\nimages 3f800000\n", "line 2"),
        ("TRT-8600-EntropyCalibration2\n: 3f800000\n", "line 2: empty tensor name"),
        ("TRT-8600-EntropyCalibration2\na: 0x3f80000\n", "line 2.*hexadecimal"),
        ("TRT-8600-EntropyCalibration2\na: 13f800000\n", "line 2.*hexadecimal"),
        ("TRT-8600-EntropyCalibration2\na: zz\n", "line 2.*hexadecimal"),
        ("TRT-8600-EntropyCalibration2\na: \n", "line 2.*hexadecimal"),
        ("TRT-8600-EntropyCalibration2\na: 7f800000\n", "line 2.*inf"),
        ("TRT-8600-EntropyCalibration2\na: 7fc00000\n", "line 2.*nan"),
        ("TRT-8600-EntropyCalibration2\na: 0\n", "line 2.*0.0"),
        ("TRT-8600-EntropyCalibration2\na: 80000000\n", "line 2.*-0.0"),
        ("TRT-8600-EntropyCalibration2\na: bf800000\n", "line 2.*-1.0"),
        ("TRT-8600-EntropyCalibration2\na: 3f800000\n\nb: 3f800000\n", "line 3"),
        ("TRT-8600-EntropyCalibration2\na: 3f800000\na: 40000000\n", "line 3.*twice"),
    ],
)
def test_malformed_caches_are_refused(text: str, match: str) -> None:
    with pytest.raises(CalibrationCacheError, match=match):
        parse_calibration_cache(text)


def test_undecodable_bytes_are_refused() -> None:
    with pytest.raises(CalibrationCacheError, match="UTF-8"):
        parse_calibration_cache(b"TRT-8600-EntropyCalibration2\n\xff: 3f800000\n")


@pytest.mark.parametrize(
    ("scales", "kwargs", "match"),
    [
        ({"a": float("nan")}, {}, "'a'.*finite"),
        ({"a": float("inf")}, {}, "'a'.*finite"),
        ({"a": 0.0}, {}, "'a'.*positive"),
        ({"a": -0.5}, {}, "'a'.*positive"),
        ({"a": 1e39}, {}, "'a'.*overflows"),
        ({"a": 1e-50}, {}, "'a'.*rounds to 0"),
        ({"": 1.0}, {}, "empty"),
        ({"a\nb": 1.0}, {}, "line break"),
        ({"a\r": 1.0}, {}, "line break"),
        ({"a": 1.0}, {"trt_version": -1}, "trt_version"),
        ({"a": 1.0}, {"algorithm": "Entropy-2"}, "algorithm"),
        ({"a": 1.0}, {"algorithm": ""}, "algorithm"),
    ],
)
def test_unwritable_scales_are_refused(
    scales: dict[str, float], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(CalibrationCacheError, match=match):
        write_calibration_cache(scales, **kwargs)  # type: ignore[arg-type]


def test_cache_error_is_a_value_error() -> None:
    assert issubclass(CalibrationCacheError, ValueError)


def test_layer_precisions_arg() -> None:
    nodes = ["/model.24/m.0/Conv", "/model.24/m.1/Conv", "/model.24/m.0/Conv", "a:b"]
    assert layer_precisions_arg(nodes) == "/model.24/m.0/Conv:fp16,/model.24/m.1/Conv:fp16,a:b:fp16"
    assert layer_precisions_arg(["x"], "int8") == "x:int8"
    assert layer_precisions_arg([]) == ""
    for bad_name in ("", "a,b", "a\nb"):
        with pytest.raises(ValueError, match="layerPrecisions"):
            layer_precisions_arg([bad_name])
    with pytest.raises(ValueError, match="precision"):
        layer_precisions_arg(["x"], "half")
