"""prep/build_trt.py against the recording TensorRT stand-in (tests/prep/fake_tensorrt.py).

The ONNX models are real (onnx.helper); the fake parser reads them with onnx, so layer and tensor
names, shapes and types are the ones TensorRT would see. Every test asserts the exact builder
configuration the product code produced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.abc
import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from prep import build_trt, stages
from prep.build_trt import (
    DlaBuildError,
    DlaBuildSpec,
    DlaSpecError,
    build_dla_loadable,
    dla_support_problem,
    load_fp16_layers,
    parse_trt_version,
    quantization_for,
    read_calibration_cache,
    resolve_input_shapes,
    tensorrt_available,
    trtexec_command,
    with_dynamic_batch,
    write_dynamic_batch_onnx,
)
from prep.pipeline import BuildConfig, ChainConfig
from tests.prep.fake_tensorrt import (
    CalibrationAlgoType,
    DataType,
    DeviceType,
    EngineCapability,
    FakeIInt8EntropyCalibrator2,
    FakeTensorRT,
    MemoryPoolType,
    TensorFormat,
)

HEADS = ("/model.24/m.0/Conv", "/model.24/m.1/Conv")
INTERNAL = (
    "/model.0/conv/Conv_output_0",
    "/model.0/act/Sigmoid_output_0",
    "/model.0/act/Mul_output_0",
    "/model.1/MaxPool_output_0",
)


# --------------------------------------------------------------------------- fixtures
def make_onnx(
    path: Path,
    *,
    dims: tuple[int | str, ...] = (1, 3, 32, 32),
    explicit: bool = False,
    seed: int = 0,
) -> Path:
    """A YOLO-shaped toy: Conv-SiLU stem, MaxPool, two 1x1 head convs (outputs s8, s16).

    ``explicit`` gives what TensorRT >= 11 needs: an INT8 input behind DequantizeLinear and FP16
    heads (Cast + FP16 weights), so precision is carried by the ONNX types.
    """
    rng = np.random.default_rng(seed)
    c = int(dims[1]) if isinstance(dims[1], int) else 3
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, c, 3, 3)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b0"),
    ]
    head_dtype = np.float16 if explicit else np.float32
    for i in (1, 2):
        w = rng.standard_normal((18, 8, 1, 1)).astype(head_dtype)
        weights.append(numpy_helper.from_array(w, f"w{i}"))
    nodes = []
    stem_in = "images"
    if explicit:
        weights += [
            numpy_helper.from_array(np.array(1 / 127, np.float32), "in_scale"),
            numpy_helper.from_array(np.array(0, np.int8), "in_zp"),
        ]
        nodes.append(
            helper.make_node(
                "DequantizeLinear", ["images", "in_scale", "in_zp"], ["images_f"], "/in/DQ"
            )
        )
        stem_in = "images_f"
    nodes += [
        helper.make_node(
            "Conv", [stem_in, "w0", "b0"], [INTERNAL[0]], "/model.0/conv/Conv", pads=[1, 1, 1, 1]
        ),
        helper.make_node("Sigmoid", [INTERNAL[0]], [INTERNAL[1]], "/model.0/act/Sigmoid"),
        helper.make_node("Mul", [INTERNAL[0], INTERNAL[1]], [INTERNAL[2]], "/model.0/act/Mul"),
        helper.make_node(
            "MaxPool", [INTERNAL[2]], [INTERNAL[3]], "/model.1/MaxPool", kernel_shape=[2, 2],
            strides=[2, 2],
        ),
    ]  # fmt: skip
    head_inputs = [INTERNAL[2], INTERNAL[3]]
    if explicit:
        for i, name in enumerate(list(head_inputs)):
            nodes.append(
                helper.make_node(
                    "Cast", [name], [f"{name}_h"], f"/model.24/Cast_{i}", to=TensorProto.FLOAT16
                )
            )
            head_inputs[i] = f"{name}_h"
    nodes += [
        helper.make_node("Conv", [head_inputs[0], "w1"], ["s8"], HEADS[0]),
        helper.make_node("Conv", [head_inputs[1], "w2"], ["s16"], HEADS[1]),
    ]
    in_type = TensorProto.INT8 if explicit else TensorProto.FLOAT
    out_type = TensorProto.FLOAT16 if explicit else TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "toy",
        [helper.make_tensor_value_info("images", in_type, list(dims))],
        [
            helper.make_tensor_value_info("s8", out_type, [dims[0], 18, *head_hw(dims, 1)]),
            helper.make_tensor_value_info("s16", out_type, [dims[0], 18, *head_hw(dims, 2)]),
        ],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def head_hw(dims: tuple[int | str, ...], stride: int) -> list[int | str]:
    return [d // stride if isinstance(d, int) else f"{d}/{stride}" for d in dims[2:]]


def hex_of(scale: float) -> str:
    """The translator's encoding: float32 bits as unpadded lowercase hex (independent of prep)."""
    return format(struct.unpack(">I", struct.pack(">f", scale))[0], "x")


def write_cache(path: Path, scales: dict[str, float], header: str = "TRT-8600") -> Path:
    lines = [f"{header}-EntropyCalibration2"] + [f"{n}: {hex_of(s)}" for n, s in scales.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def translated_toy(tmp_path: Path) -> Path:
    """What the translate stage leaves for the toy: the PTQ ONNX, its FP16 nodes (the heads)
    and the calibration cache, in ``tmp_path/translate``."""
    tdir = tmp_path / "translate"
    tdir.mkdir()
    make_onnx(tdir / "model_noqdq.onnx")
    (tdir / "model_precision_config.json").write_text(json.dumps({"fp16_nodes": list(HEADS)}))
    write_cache(
        tdir / "model_precision_config_calib.cache",
        {"images": 0.01, **dict.fromkeys(INTERNAL, 0.05)},
    )
    return tdir


def run_build_stage(tmp_path: Path, **build: Any) -> tuple[dict[str, Path], dict[str, Any]]:
    """prep's build stage with ``[build]`` set to ``build``, on what ``tmp_path/translate`` holds
    (``translated_toy``), writing into ``tmp_path/build``."""
    chain = SimpleNamespace(
        cfg=ChainConfig(build=BuildConfig(**build)), dir=lambda stage: tmp_path / stage
    )
    out_dir = tmp_path / "build"
    out_dir.mkdir()
    return stages.run_build(cast("Any", chain), cast("Any", SimpleNamespace(out_dir=out_dir)))


@pytest.fixture
def onnx_path(tmp_path: Path) -> Path:
    return make_onnx(tmp_path / "toy_noqdq.onnx")


@pytest.fixture
def scales() -> dict[str, float]:
    rng = np.random.default_rng()
    names = ["images", *INTERNAL, "/model.99/ghost"]
    values = rng.uniform(1e-3, 2.0, len(names)).astype(np.float32)
    return {n: float(v) for n, v in zip(names, values, strict=True)}


@pytest.fixture
def cache_path(tmp_path: Path, scales: dict[str, float]) -> Path:
    return write_cache(tmp_path / "toy_precision_config_calib.cache", scales)


def build(fake: FakeTensorRT, spec: DlaBuildSpec, tmp_path: Path) -> build_trt.BuildReport:
    return build_dla_loadable(
        spec, tmp_path / "out" / "toy.dla", trt_module=fake, cuda_device_count=lambda: 1
    )


# --------------------------------------------------------------------------- the DLA configuration
@pytest.mark.parametrize("version", ["8.6.2.3", "10.3.0.30", "10.7.0.23"])
@pytest.mark.parametrize("core", [0, 1])
def test_int8_dla_standalone_config(
    tmp_path: Path, onnx_path: Path, cache_path: Path, version: str, core: int
) -> None:
    fake = FakeTensorRT(version)
    spec = DlaBuildSpec(onnx_path, cache_path, dla_core=core)
    report = build(fake, spec, tmp_path)

    bf, config, network = fake.BuilderFlag, fake.config, fake.network
    assert config is not None
    assert network is not None
    assert network.flags == (1 if version.startswith("8.") else 0)  # EXPLICIT_BATCH before 10
    assert config.default_device_type == DeviceType.DLA
    assert config.DLA_core == core
    assert fake.calls_to("config", "DLA_core=") == [(core,)]
    assert config.engine_capability == EngineCapability.DLA_STANDALONE
    assert config.flag_set == {bf.DIRECT_IO, bf.INT8, bf.FP16, bf.OBEY_PRECISION_CONSTRAINTS}
    assert fake.calls_to("config", "clear_flag") == [(bf.GPU_FALLBACK,)]
    assert config.pool_limits == {MemoryPoolType.DLA_MANAGED_SRAM: 1 << 20}
    assert config.profiles == []  # static ONNX: no profile needed
    (images,) = network.inputs
    assert (images.dtype, images.allowed_formats) == (DataType.INT8, 1 << TensorFormat.DLA_HWC4)
    assert [(o.name, o.dtype, o.allowed_formats) for o in network.outputs] == [
        ("s8", DataType.HALF, 1 << 4),
        ("s16", DataType.HALF, 1 << 4),
    ]
    assert isinstance(config.int8_calibrator, FakeIInt8EntropyCalibrator2)
    assert not fake.calls_to("trt", "Runtime")
    written = (tmp_path / "out" / "toy.dla").read_bytes()
    assert written == fake.blob
    assert written.endswith(f"core={core}".encode())
    assert report.loadable_bytes == len(written)
    assert report.dla_core == core
    assert report.builder_flags == ("DIRECT_IO", "INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS")
    assert report.io_formats == {"images": "int8:dla_hwc4", "s8": "fp16:chw16", "s16": "fp16:chw16"}
    assert report.num_layers == 6
    assert report.input_shapes == {"images": (1, 3, 32, 32)}
    assert report.int8_mode == "calibrator"
    assert (report.scales_applied, report.scales_unused) == (5, ("/model.99/ghost",))
    assert "fake builder: nothing was compiled" in report.warnings
    json.dumps(report.to_dict())


def test_int8_outputs_use_chw32(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    fake = FakeTensorRT()
    report = build(fake, DlaBuildSpec(onnx_path, cache_path, output_precision="int8"), tmp_path)
    assert fake.network is not None
    assert {(o.dtype, o.allowed_formats) for o in fake.network.outputs} == {
        (DataType.INT8, 1 << TensorFormat.CHW32)
    }
    assert report.io_formats["s8"] == "int8:chw32"


@pytest.mark.parametrize(
    ("input_format", "fmt"),
    [("fp16:chw16", TensorFormat.CHW16), ("fp16:dla_hwc4", TensorFormat.DLA_HWC4),
     ("fp16:dla_linear", TensorFormat.DLA_LINEAR)],
)  # fmt: skip
def test_pure_fp16_build(
    tmp_path: Path, onnx_path: Path, input_format: Any, fmt: TensorFormat
) -> None:
    fake = FakeTensorRT()
    report = build(fake, DlaBuildSpec(onnx_path, input_format=input_format), tmp_path)
    assert fake.config is not None
    assert fake.network is not None
    bf = fake.BuilderFlag
    assert fake.config.flag_set == {bf.DIRECT_IO, bf.FP16, bf.OBEY_PRECISION_CONSTRAINTS}
    assert fake.config.int8_calibrator is None
    assert (fake.network.inputs[0].dtype, fake.network.inputs[0].allowed_formats) == (
        DataType.HALF,
        1 << fmt,
    )
    assert report.int8_mode == "none"


def test_fp16_layers_pinned(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    fake = FakeTensorRT()
    build(fake, DlaBuildSpec(onnx_path, cache_path, fp16_layers=HEADS), tmp_path)
    assert fake.network is not None
    for layer in fake.network.layers:
        pinned = layer.name in HEADS
        assert layer.precision == (DataType.HALF if pinned else DataType.FLOAT)
        assert layer.output_types == ({0: DataType.HALF} if pinned else {})


def test_unknown_fp16_layers_rejected(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    spec = DlaBuildSpec(onnx_path, cache_path, fp16_layers=(HEADS[0], "/model.9/nope", "/x/Conv"))
    with pytest.raises(DlaBuildError, match=r"\['/model.9/nope', '/x/Conv'\]"):
        build(FakeTensorRT(), spec, tmp_path)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- INT8 scales
def test_calibrator_replays_exact_cache_bytes(
    tmp_path: Path, onnx_path: Path, cache_path: Path
) -> None:
    fake = FakeTensorRT()
    build(fake, DlaBuildSpec(onnx_path, cache_path), tmp_path)
    assert fake.config is not None
    calibrator = fake.config.int8_calibrator
    original = cache_path.read_bytes()
    assert fake.cache_read == original  # what the (fake) builder read during the build
    assert calibrator.read_calibration_cache() == original
    assert calibrator.get_batch(["images"]) is None
    assert fake.batch_read is None
    assert calibrator.get_batch_size() == 1
    assert calibrator.get_algorithm() == CalibrationAlgoType.ENTROPY_CALIBRATION_2
    calibrator.write_calibration_cache(b"TRT-0-EntropyCalibration2\n")
    assert cache_path.read_bytes() == original


def test_dynamic_range_path(
    tmp_path: Path, onnx_path: Path, cache_path: Path, scales: dict[str, float]
) -> None:
    fake = FakeTensorRT()
    spec = DlaBuildSpec(onnx_path, cache_path, int8_scales="dynamic_range")
    report = build(fake, spec, tmp_path)
    assert fake.config is not None
    assert fake.network is not None
    assert fake.config.int8_calibrator is None
    assert not fake.calls_to("config", "int8_calibrator=")
    tensors = {t.name: t for t in fake.network.inputs}
    tensors |= {o.name: o for layer in fake.network.layers for o in layer.outputs}
    for name, tensor in tensors.items():
        if name in scales:
            amax = float(np.float32(scales[name])) * 127.0
            assert tensor.dynamic_range == pytest.approx((-amax, amax), rel=1e-12)
        else:
            assert tensor.dynamic_range is None
    assert report.int8_mode == "dynamic_range"
    assert report.scales_unused == ("/model.99/ghost",)
    assert any("TRT-8600" in w and "TRT-100300" in w for w in report.warnings)


def test_cache_reader_keeps_exact_bytes(tmp_path: Path, scales: dict[str, float]) -> None:
    path = write_cache(tmp_path / "c.cache", scales, header="TRT-100300")
    cache, raw = read_calibration_cache(path)
    assert cache.trt_version == 100300
    assert cache.scales == scales  # float32 values survive the hex encoding exactly
    assert raw == path.read_bytes()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("TRT-8600-MinMaxCalibration\nimages: 3c010204\n", "expected EntropyCalibration2"),
        ("images: 3c010204\n", "header"),
        ("TRT-8600-EntropyCalibration2\nimages 3c010204\n", "not '<name>: <hex>'"),
        ("TRT-8600-EntropyCalibration2\nimages: 3c01020g\n", "hexadecimal"),
        ("TRT-8600-EntropyCalibration2\na: 3c010204\na: 3c010204\n", "twice"),
        ("TRT-8600-EntropyCalibration2\na: bf800000\n", "not finite and > 0"),
    ],
)
def test_bad_cache_is_a_spec_error(tmp_path: Path, onnx_path: Path, text: str, match: str) -> None:
    (tmp_path / "bad.cache").write_text(text)
    with pytest.raises(DlaSpecError, match=match):
        read_calibration_cache(tmp_path / "bad.cache")
    fake = FakeTensorRT()
    with pytest.raises(DlaSpecError, match=match):
        build(fake, DlaBuildSpec(onnx_path, tmp_path / "bad.cache"), tmp_path)
    assert fake.calls == []  # inputs are checked before TensorRT is touched


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("version", "why"),
    [
        ("8.5.2.2", "predates 8.6"),
        ("10.8.0.43", "10.7 was the last"),
        ("10.16.1", "10.7 was the last"),
        ("11.0.0", "11.0-11.3"),
        ("11.3.0", "11.0-11.3"),
        ("11.4.0", "Windows on ARM"),
        ("ten", "cannot read"),
    ],
)
def test_unsupported_versions(
    tmp_path: Path, onnx_path: Path, cache_path: Path, version: str, why: str
) -> None:
    fake = FakeTensorRT(version)
    with pytest.raises(DlaBuildError, match=why):
        build(fake, DlaBuildSpec(onnx_path, cache_path), tmp_path)
    assert fake.calls == []  # refused before any TensorRT object exists


@pytest.mark.parametrize("version", [(8, 6, 0), (10, 3, 0), (10, 7, 0), (11, 4, 1), (12, 0, 0)])
def test_supported_versions(version: tuple[int, int, int]) -> None:
    assert dla_support_problem(version) is None


@pytest.mark.parametrize(
    ("version", "path"),
    [("8.6.2.3", "implicit"), ("10.3.0.30", "implicit"), ("10.7.0", "implicit"),
     ("11.4.1", "explicit"), ("11.4.1.7", "explicit"), ("12.0", "explicit")],
)  # fmt: skip
def test_quantization_follows_the_tensorrt_found(version: str, path: str) -> None:
    """JetPack 6 (TensorRT 10.3) keeps the stripped ONNX + cache; 11 has only Q/DQ."""
    assert quantization_for(version) == path
    assert quantization_for(version, "auto") == path
    assert quantization_for(version, path) == path
    other = "explicit" if path == "implicit" else "implicit"
    with pytest.raises(DlaBuildError, match=f"use quantization '{path}'"):
        quantization_for(version, other)  # type: ignore[arg-type]


def test_quantization_choice_errors() -> None:
    with pytest.raises(DlaSpecError, match="quantization='int8'"):
        quantization_for("10.3.0", "int8")  # type: ignore[arg-type]
    with pytest.raises(DlaBuildError, match="cannot read the TensorRT version"):
        quantization_for("unknown")


def test_version_parsing() -> None:
    assert parse_trt_version("10.3.0.30") == (10, 3, 0)
    assert parse_trt_version("11.4") == (11, 4, 0)
    for bad in ("", "10.x", "v10"):
        with pytest.raises(DlaBuildError):
            parse_trt_version(bad)


def test_no_dla_cores(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    with pytest.raises(DlaBuildError, match="needs a Jetson Orin"):
        build(FakeTensorRT(num_dla_cores=0), DlaBuildSpec(onnx_path, cache_path), tmp_path)
    with pytest.raises(DlaBuildError, match="DLA core 1 requested; 1 present"):
        build(
            FakeTensorRT(num_dla_cores=1), DlaBuildSpec(onnx_path, cache_path, dla_core=1), tmp_path
        )


def test_no_cuda_device_stops_before_builder(
    tmp_path: Path, onnx_path: Path, cache_path: Path
) -> None:
    fake = FakeTensorRT()
    with pytest.raises(DlaBuildError, match="no CUDA device"):
        build_dla_loadable(
            DlaBuildSpec(onnx_path, cache_path), tmp_path / "x", trt_module=fake,
            cuda_device_count=lambda: 0,
        )  # fmt: skip
    assert fake.calls == []


def test_missing_tensorrt_is_a_build_error(
    tmp_path: Path, onnx_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(DlaBuildError, match=r"not importable.*DLA loadables are built on a Jet"):
        build_dla_loadable(DlaBuildSpec(onnx_path, input_format="fp16:chw16"), tmp_path / "x")
    with pytest.raises(DlaBuildError, match=r"not importable.*built on the device that runs it"):
        build_dla_loadable(DlaBuildSpec(onnx_path, device="gpu"), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_parser_errors_surface(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    fake = FakeTensorRT(unsupported_ops=frozenset({"MaxPool"}))
    with pytest.raises(DlaBuildError, match="No importer registered for op: MaxPool") as err:
        build(fake, DlaBuildSpec(onnx_path, cache_path), tmp_path)
    assert "node 3 (/model.1/MaxPool)" in str(err.value)
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07not an onnx model")
    with pytest.raises(DlaBuildError, match="ONNX parse failed"):
        build(FakeTensorRT(), DlaBuildSpec(tmp_path / "junk.onnx", cache_path), tmp_path)


def test_build_failure_reports_logger_errors(
    tmp_path: Path, onnx_path: Path, cache_path: Path
) -> None:
    fake = FakeTensorRT(build_error="DLA compiler: layer /model.1/MaxPool unsupported")
    with pytest.raises(DlaBuildError, match=r"DLA compiler: layer /model\.1/MaxPool unsupported"):
        build(fake, DlaBuildSpec(onnx_path, cache_path), tmp_path)
    assert not (tmp_path / "out" / "toy.dla").exists()


def test_hwc4_needs_1_3_or_4_channels(tmp_path: Path, cache_path: Path) -> None:
    onnx_path = make_onnx(tmp_path / "c8.onnx", dims=(1, 8, 32, 32))
    with pytest.raises(DlaBuildError, match="8 channels; DLA_HWC4 takes 1, 3 or 4"):
        build(FakeTensorRT(), DlaBuildSpec(onnx_path, cache_path), tmp_path)
    build(FakeTensorRT(), DlaBuildSpec(onnx_path, cache_path, input_format="int8:chw32"), tmp_path)


# --------------------------------------------------------------------------- shapes
def test_dynamic_batch_becomes_static_profile(tmp_path: Path, cache_path: Path) -> None:
    onnx_path = make_onnx(tmp_path / "dyn.onnx", dims=("N", 3, 32, 32))
    fake = FakeTensorRT()
    report = build(fake, DlaBuildSpec(onnx_path, cache_path, batch=2), tmp_path)
    assert fake.config is not None
    (profile,) = fake.config.profiles
    assert profile.shapes == {"images": ((2, 3, 32, 32),) * 3}
    assert fake.config.calibration_profile == [profile]
    assert fake.config.int8_calibrator.get_batch_size() == 2
    assert report.input_shapes == {"images": (2, 3, 32, 32)}


def test_dynamic_spatial_dims(tmp_path: Path, cache_path: Path) -> None:
    onnx_path = make_onnx(tmp_path / "dyn.onnx", dims=(1, 3, "H", "W"))
    with pytest.raises(DlaSpecError, match=r"dynamic dims \[2, 3\]"):
        build(FakeTensorRT(), DlaBuildSpec(onnx_path, cache_path), tmp_path)
    fake = FakeTensorRT()
    spec = DlaBuildSpec(onnx_path, cache_path, input_shapes={"images": (1, 3, 64, 48)})
    build(fake, spec, tmp_path)
    assert fake.config is not None
    assert fake.config.profiles[0].shapes == {"images": ((1, 3, 64, 48),) * 3}
    bad = DlaBuildSpec(onnx_path, cache_path, input_shapes={"images": (1, 4, 64, 48)})
    with pytest.raises(DlaSpecError, match="contradicts"):
        build(FakeTensorRT(), bad, tmp_path)
    unknown = DlaBuildSpec(onnx_path, cache_path, input_shapes={"image": (1, 3, 64, 48)})
    with pytest.raises(DlaSpecError, match="not network inputs"):
        build(FakeTensorRT(), unknown, tmp_path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=2, max_size=5), st.data())
def test_resolve_shapes_property(dims: list[int], data: st.DataObject) -> None:
    dynamic = data.draw(st.lists(st.booleans(), min_size=len(dims), max_size=len(dims)))
    declared = tuple(-1 if d else v for v, d in zip(dims, dynamic, strict=True))
    spec = DlaBuildSpec(Path("m.onnx"), input_format="fp16:chw16", input_shapes={"x": tuple(dims)})
    shapes, is_dynamic = resolve_input_shapes([("x", declared)], spec)
    assert shapes == {"x": tuple(dims)}
    assert is_dynamic == any(dynamic)
    only_batch = (-1, *dims[1:]) if dynamic[0] else tuple(dims)
    plain = DlaBuildSpec(Path("m.onnx"), input_format="fp16:chw16", batch=dims[0])
    assert resolve_input_shapes([("x", only_batch)], plain)[0] == {"x": tuple(dims)}


# --------------------------------------------------------------------------- TensorRT 11
@pytest.mark.parametrize("direct_io", [True, False])
def test_trt11_explicit_build(tmp_path: Path, direct_io: bool) -> None:
    onnx_path = make_onnx(tmp_path / "qdq_fp16.onnx", explicit=True)
    fake = FakeTensorRT("11.4.1", direct_io_in_11=direct_io)
    spec = DlaBuildSpec(onnx_path, fp16_layers=HEADS, quantization="explicit")
    report = build(fake, spec, tmp_path)
    assert fake.config is not None
    assert fake.network is not None
    assert not hasattr(fake.BuilderFlag, "INT8")
    assert not hasattr(fake, "IInt8EntropyCalibrator2")
    assert fake.network.flags == 0
    assert fake.config.flag_set == ({fake.BuilderFlag.DIRECT_IO} if direct_io else set())
    assert fake.config.engine_capability == EngineCapability.DLA_STANDALONE
    assert not fake.calls_to("tensor", "dtype=")  # the ONNX decides types in TRT 11
    assert not fake.calls_to("layer", "set_output_type")
    assert fake.network.inputs[0].allowed_formats == 1 << TensorFormat.DLA_HWC4
    assert {o.allowed_formats for o in fake.network.outputs} == {1 << TensorFormat.CHW16}
    assert report.int8_mode == "explicit"
    assert report.builder_flags == (("DIRECT_IO",) if direct_io else ())


def test_trt11_refuses_implicit_and_checks_types(tmp_path: Path, onnx_path: Path) -> None:
    fake = FakeTensorRT("11.4.1")
    with pytest.raises(DlaBuildError, match=r"strongly typed.*quantization='explicit'"):
        build(fake, DlaBuildSpec(onnx_path, input_format="fp16:chw16"), tmp_path)
    explicit = make_onnx(tmp_path / "qdq_fp16.onnx", explicit=True)
    spec = DlaBuildSpec(explicit, fp16_layers=("/model.0/conv/Conv",), quantization="explicit")
    with pytest.raises(DlaBuildError, match="not FP16 in the ONNX"):
        build(FakeTensorRT("11.4.1"), spec, tmp_path)
    spec = DlaBuildSpec(explicit, quantization="explicit", output_precision="int8")
    with pytest.raises(DlaBuildError, match=r"s8 is .* int8:chw32 needs int8"):
        build(FakeTensorRT("11.4.1"), spec, tmp_path)
    with pytest.raises(DlaBuildError, match=r"needs TensorRT >= 11\.4\.1"):
        build(FakeTensorRT("10.3.0"), DlaBuildSpec(explicit, quantization="explicit"), tmp_path)


# --------------------------------------------------------------------------- the GPU engine
def build_gpu(fake: FakeTensorRT, spec: DlaBuildSpec, tmp_path: Path) -> build_trt.BuildReport:
    return build_dla_loadable(
        spec, tmp_path / "out" / "toy.gpu.engine", trt_module=fake, cuda_device_count=lambda: 1
    )


@pytest.mark.parametrize("version", ["8.6.2.3", "10.3.0.30", "10.9.0"])
def test_gpu_engine_config(tmp_path: Path, onnx_path: Path, cache_path: Path, version: str) -> None:
    # No DLA, and 10.9 is past DLA support: the GPU engine builds all the same.
    fake = FakeTensorRT(version, num_dla_cores=0)
    spec = DlaBuildSpec(
        onnx_path, cache_path, fp16_layers=HEADS, device="gpu", max_batch=6, workspace_mib=64
    )
    report = build_gpu(fake, spec, tmp_path)
    bf, config, network = fake.BuilderFlag, fake.config, fake.network
    assert config is not None
    assert network is not None
    # INT8 + FP16 under obeyed constraints (implicit mode), nothing of the DLA's
    assert config.flag_set == {bf.INT8, bf.FP16, bf.OBEY_PRECISION_CONSTRAINTS}
    assert config.default_device_type == DeviceType.GPU
    assert config.engine_capability == EngineCapability.STANDARD
    assert not fake.calls_to("config", "DLA_core=")
    assert not fake.calls_to("config", "clear_flag")
    assert not fake.calls_to("config", "default_device_type=")
    assert config.pool_limits == {MemoryPoolType.WORKSPACE: 64 << 20}
    # the ONNX fixes batch 1: the network sees a dynamic batch, and one profile 1 / 6 / 6
    (images,) = network.inputs
    assert images.shape == (-1, 3, 32, 32)
    (profile,) = config.profiles
    assert profile.shapes == {"images": ((1, 3, 32, 32), (6, 3, 32, 32), (6, 3, 32, 32))}
    assert fake.calls_to("profile", "set_shape") == [
        ("images", (1, 3, 32, 32), (6, 3, 32, 32), (6, 3, 32, 32))
    ]
    assert config.calibration_profile == [profile]
    assert config.int8_calibrator.get_batch_size() == 6  # the profile's opt batch
    assert fake.cache_read == cache_path.read_bytes()
    # FP16 linear NCHW in and out
    linear = 1 << TensorFormat.LINEAR
    assert (images.dtype, images.allowed_formats) == (DataType.HALF, linear)
    assert [(o.name, o.dtype, o.allowed_formats, o.shape) for o in network.outputs] == [
        ("s8", DataType.HALF, linear, (-1, 18, 32, 32)),
        ("s16", DataType.HALF, linear, (-1, 18, 16, 16)),
    ]
    for layer in network.layers:  # the translator's fp16 layers, pinned
        pinned = layer.name in HEADS
        assert layer.precision == (DataType.HALF if pinned else DataType.FLOAT)
        assert layer.output_types == ({0: DataType.HALF} if pinned else {})
    assert not fake.calls_to("trt", "Runtime")
    engine = tmp_path / "out" / "toy.gpu.engine"
    assert engine.read_bytes() == fake.blob == b"FAKE-ENGINE gpu"
    assert report.dla_core is None
    assert report.max_batch == 6
    assert report.input_shapes == {"images": (6, 3, 32, 32)}
    assert report.io_formats == dict.fromkeys(["images", "s8", "s16"], "fp16:chw")
    assert report.int8_mode == "calibrator"
    assert any("batch dim was made dynamic" in w for w in report.warnings)
    assert report.metadata_path == tmp_path / "out" / "toy.gpu.engine.json"
    json.dumps(report.to_dict())


def test_gpu_engine_sidecar(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    from dlad.devices.tensorrt_gpu import engine_metadata_path, read_engine_metadata

    spec = DlaBuildSpec(onnx_path, cache_path, fp16_layers=HEADS, device="gpu", max_batch=4)
    engine = tmp_path / "out" / "toy.gpu.engine"
    stale = engine_metadata_path(engine)
    stale.parent.mkdir()
    stale.write_text('{"format": "dlad-tensorrt-gpu", "version": 1, "engine_sha256": "0"}')
    report = build_gpu(FakeTensorRT("10.3.0.30"), spec, tmp_path)
    blob = engine.read_bytes()
    meta = read_engine_metadata(engine, blob)  # the daemon's reader accepts what prep wrote
    assert meta is not None
    assert report.metadata_path == stale
    created = meta.pop("created")
    assert created.endswith("+00:00")
    onnx_sha = hashlib.sha256(onnx_path.read_bytes()).hexdigest()
    assert meta == {
        "format": "dlad-tensorrt-gpu",
        "version": 1,
        "engine": "toy.gpu.engine",
        "engine_sha256": hashlib.sha256(blob).hexdigest(),
        "engine_bytes": len(blob),
        "tensorrt_version": "10.3.0.30",
        "max_batch": 4,
        "inputs": [{
            "name": "images", "shape": [-1, 3, 32, 32], "dtype": "HALF", "format": "LINEAR",
            "profile": {"min": [1, 3, 32, 32], "opt": [4, 3, 32, 32], "max": [4, 3, 32, 32]},
        }],
        "outputs": [
            {"name": "s8", "shape": [-1, 18, 32, 32], "dtype": "HALF", "format": "LINEAR"},
            {"name": "s16", "shape": [-1, 18, 16, 16], "dtype": "HALF", "format": "LINEAR"},
        ],
        "precision": {
            "quantization": "implicit", "int8_mode": "calibrator",
            "builder_flags": ["INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS"],
            "fp16_layers": list(HEADS),
        },
        "onnx": {"name": onnx_path.name, "sha256": onnx_sha},
    }  # fmt: skip


def test_gpu_build_failure_keeps_the_previous_engine_and_sidecar(
    tmp_path: Path, onnx_path: Path, cache_path: Path
) -> None:
    spec = DlaBuildSpec(onnx_path, cache_path, device="gpu")
    report = build_gpu(FakeTensorRT(), spec, tmp_path)
    assert report.metadata_path is not None
    before = (report.out_path.read_bytes(), report.metadata_path.read_bytes())
    with pytest.raises(DlaBuildError, match="out of memory"):
        build_gpu(FakeTensorRT(build_error="out of memory"), spec, tmp_path)
    assert (report.out_path.read_bytes(), report.metadata_path.read_bytes()) == before


def test_gpu_engine_with_a_dynamic_onnx_and_no_cache(tmp_path: Path) -> None:
    onnx_path = make_onnx(tmp_path / "dyn.onnx", dims=("N", 3, 32, 32))
    fake = FakeTensorRT()
    report = build_gpu(fake, DlaBuildSpec(onnx_path, device="gpu", max_batch=1), tmp_path)
    assert fake.config is not None
    assert fake.config.flag_set == {
        fake.BuilderFlag.FP16,
        fake.BuilderFlag.OBEY_PRECISION_CONSTRAINTS,
    }
    assert fake.config.profiles[0].shapes == {"images": ((1, 3, 32, 32),) * 3}
    assert fake.config.calibration_profile == []  # no INT8: nothing to calibrate
    assert report.int8_mode == "none"
    assert not any("made dynamic" in w for w in report.warnings)  # it already was


def test_gpu_shapes_come_from_max_batch(tmp_path: Path, cache_path: Path) -> None:
    onnx_path = make_onnx(tmp_path / "hw.onnx", dims=("N", 3, "H", "W"))
    spec = DlaBuildSpec(onnx_path, cache_path, device="gpu", max_batch=2,
                        input_shapes={"images": (2, 3, 64, 48)})  # fmt: skip
    fake = FakeTensorRT()
    build_gpu(fake, spec, tmp_path)
    assert fake.config is not None
    assert fake.config.profiles[0].shapes == {
        "images": ((1, 3, 64, 48), (2, 3, 64, 48), (2, 3, 64, 48))
    }
    wrong = DlaBuildSpec(onnx_path, cache_path, device="gpu", max_batch=2,
                         input_shapes={"images": (4, 3, 64, 48)})  # fmt: skip
    with pytest.raises(DlaSpecError, match=r"the GPU engine's batch is max_batch=2"):
        build_gpu(FakeTensorRT(), wrong, tmp_path)
    static = DlaBuildSpec(Path("m.onnx"), device="gpu")
    with pytest.raises(DlaSpecError, match="fixed batch; the GPU engine's profile needs a dynamic"):
        resolve_input_shapes([("images", (1, 3, 32, 32))], static)


def test_gpu_on_trt11_checks_the_onnx_types(tmp_path: Path) -> None:
    explicit = make_onnx(tmp_path / "qdq_fp16.onnx", explicit=True)  # INT8 input, FP16 heads
    spec = DlaBuildSpec(explicit, device="gpu", quantization="explicit")
    with pytest.raises(DlaBuildError, match=r"GPU formats:\n  images is .* fp16:chw needs fp16"):
        build_gpu(FakeTensorRT("11.4.1"), spec, tmp_path)


def test_the_fake_builder_refuses_dynamic_inputs_without_a_fitting_profile(
    tmp_path: Path, cache_path: Path
) -> None:
    """The strictness test_gpu_engine_config relies on (tests/prep/fake_tensorrt.py)."""
    fake = FakeTensorRT()
    dyn = make_onnx(tmp_path / "dyn.onnx", dims=("N", 3, 32, 32))
    parse = fake.Builder(build_trt._make_logger(fake))
    network = parse.create_network(0)
    fake.OnnxParser(network, parse.logger).parse(dyn.read_bytes())
    config = parse.create_builder_config()
    assert parse.build_serialized_network(network, config) is None
    profile = parse.create_optimization_profile()
    profile.set_shape("images", (1, 3, 32, 32), (4, 3, 32, 32), (2, 3, 32, 32))  # opt > max
    config.add_optimization_profile(profile)
    assert parse.build_serialized_network(network, config) is None
    errors = [m for _, m in parse.logger.messages if "profile" in m]
    assert "no optimization profile has been defined" in errors[0]
    assert "does not fit images" in errors[1]


def test_with_dynamic_batch(onnx_path: Path) -> None:
    original = onnx_path.read_bytes()
    data, changed = with_dynamic_batch(original)
    assert changed
    model = onnx.load_from_string(data)
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch"
        assert not dims[0].HasField("dim_value")
        assert all(d.HasField("dim_value") for d in dims[1:])
    assert len(model.graph.value_info) == 0
    again, changed_again = with_dynamic_batch(data)
    assert (again, changed_again) == (data, False)  # already dynamic: the same bytes back
    with pytest.raises(DlaSpecError, match="not an ONNX model"):
        with_dynamic_batch(b"\xff\xff\xff not onnx")


# --------------------------------------------------------------------------- spec validation
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dla_core": 2}, "dla_core"),
        ({"dla_core": True}, "dla_core"),
        ({"device": "cpu"}, "device"),
        ({"input_format": "int8:hwc"}, "input_format"),
        ({"output_precision": "fp32"}, "output_precision"),
        ({"calibration_cache": None}, "need INT8 scales"),
        ({"calibration_cache": None, "output_precision": "int8", "input_format": "fp16:chw16"},
         "need INT8 scales"),
        ({"quantization": "explicit"}, "calibration_cache must be None"),
        ({"dla_sram_mib": 2.0}, "1 MiB"),
        ({"dla_sram_mib": 0.3}, "power of two"),
        ({"dla_sram_mib": 1 / 512}, "4 KiB"),
        ({"batch": 0}, "batch"),
        ({"batch": 4097}, "batch"),
        ({"fp16_layers": ("a", "a")}, "twice"),
        ({"fp16_layers": ("",)}, "non-empty"),
        ({"workspace_mib": 0}, "workspace"),
        ({"input_shapes": {"images": (1, 0, 2)}}, "positive"),
        ({"max_batch": 0}, r"max_batch=0; the GPU engine's profile takes 1\.\.64"),
        ({"max_batch": 65}, "max_batch=65"),
        ({"max_batch": True}, "max_batch=True"),
        ({"max_batch": 2.0}, "max_batch=2.0"),
        ({"device": "gpu", "batch": 2}, "batch=2 is the DLA's static batch"),
    ],
)  # fmt: skip
def test_spec_validation(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"onnx_path": "m.onnx", "calibration_cache": "c.cache"}
    with pytest.raises(DlaSpecError, match=match):
        DlaBuildSpec(**(base | kwargs))


def test_missing_files_are_spec_errors(tmp_path: Path, onnx_path: Path) -> None:
    with pytest.raises(DlaSpecError, match="cannot read ONNX model"):
        build(
            FakeTensorRT(),
            DlaBuildSpec(tmp_path / "none.onnx", input_format="fp16:chw16"),
            tmp_path,
        )
    with pytest.raises(DlaSpecError, match="cannot read calibration cache"):
        build(FakeTensorRT(), DlaBuildSpec(onnx_path, tmp_path / "none.cache"), tmp_path)


def test_load_fp16_layers(tmp_path: Path) -> None:
    config = {
        "int8_tensor_scales": {"images": 0.0078},
        "fp16_nodes": [HEADS[0], HEADS[1], HEADS[0]],
    }
    (tmp_path / "m_precision_config.json").write_text(json.dumps(config, indent=4))
    assert load_fp16_layers(tmp_path / "m_precision_config.json") == HEADS
    for bad in ("{", '{"fp16_nodes": "x"}', "[1]", '{"fp16_nodes": [1]}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(DlaSpecError):
            load_fp16_layers(tmp_path / "bad.json")


# --------------------------------------------------------------------------- trtexec
def test_trtexec_command_int8(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    spec = DlaBuildSpec(onnx_path, cache_path, fp16_layers=HEADS, dla_core=1)
    per_layer = f"{HEADS[0]}:fp16,{HEADS[1]}:fp16"
    assert trtexec_command(spec, tmp_path / "y.dla") == [
        "trtexec",
        f"--onnx={onnx_path}",
        f"--saveEngine={tmp_path / 'y.dla'}",
        "--int8",
        "--fp16",
        f"--calib={cache_path}",
        "--precisionConstraints=obey",
        f"--layerPrecisions={per_layer}",
        f"--layerOutputTypes={per_layer}",
        "--useDLACore=1",
        "--buildDLAStandalone",
        "--inputIOFormats=int8:dla_hwc4",
        "--outputIOFormats=fp16:chw16,fp16:chw16",
        "--memPoolSize=dlaSRAM:1",
    ]


def test_trtexec_command_variants(tmp_path: Path, cache_path: Path) -> None:
    dyn = make_onnx(tmp_path / "dyn.onnx", dims=("N", 3, 32, 32))
    cmd = trtexec_command(DlaBuildSpec(dyn, cache_path, output_precision="int8"), tmp_path / "o")
    shapes = "images:1x3x32x32"
    assert {f"--minShapes={shapes}", f"--optShapes={shapes}", f"--maxShapes={shapes}"} <= set(cmd)
    assert "--outputIOFormats=int8:chw32,int8:chw32" in cmd
    fp16 = trtexec_command(
        DlaBuildSpec(dyn, input_format="fp16:chw16", dla_sram_mib=0.5), tmp_path / "o"
    )
    assert "--int8" not in fp16
    assert {"--fp16", "--memPoolSize=dlaSRAM:512K"} <= set(fp16)
    explicit = make_onnx(tmp_path / "e.onnx", explicit=True)
    cmd11 = trtexec_command(DlaBuildSpec(explicit, quantization="explicit"), tmp_path / "o")
    assert not {c for c in cmd11 if c.startswith(("--int8", "--fp16", "--calib", "--precision"))}
    assert "--buildDLAStandalone" in cmd11
    gpu = trtexec_command(
        DlaBuildSpec(dyn, cache_path, device="gpu", workspace_mib=64), tmp_path / "o"
    )
    assert not any("DLA" in c or "dlaSRAM" in c for c in gpu)
    assert "--memPoolSize=workspace:64" in gpu
    with pytest.raises(DlaSpecError, match="cannot be given to trtexec"):
        trtexec_command(DlaBuildSpec(dyn, cache_path, fp16_layers=("a,b",)), tmp_path / "o")


def test_trtexec_command_gpu(tmp_path: Path, onnx_path: Path, cache_path: Path) -> None:
    static = DlaBuildSpec(onnx_path, cache_path, fp16_layers=HEADS, device="gpu", max_batch=5)
    with pytest.raises(DlaSpecError, match="fixed batch"):
        trtexec_command(static, tmp_path / "m.gpu.engine")  # trtexec cannot rebatch it
    dyn = write_dynamic_batch_onnx(onnx_path, tmp_path / "m_gpu.onnx")
    spec = dataclasses.replace(static, onnx_path=dyn)
    per_layer = f"{HEADS[0]}:fp16,{HEADS[1]}:fp16"
    assert trtexec_command(spec, tmp_path / "m.gpu.engine") == [
        "trtexec",
        f"--onnx={dyn}",
        f"--saveEngine={tmp_path / 'm.gpu.engine'}",
        "--minShapes=images:1x3x32x32",
        "--optShapes=images:5x3x32x32",
        "--maxShapes=images:5x3x32x32",
        "--int8",
        "--fp16",
        f"--calib={cache_path}",
        "--precisionConstraints=obey",
        f"--layerPrecisions={per_layer}",
        f"--layerOutputTypes={per_layer}",
        "--inputIOFormats=fp16:chw",
        "--outputIOFormats=fp16:chw,fp16:chw",
    ]
    fake = FakeTensorRT()  # the Python build of the same spec sets the same profile
    build_gpu(fake, spec, tmp_path)
    assert fake.config is not None
    assert fake.config.profiles[0].shapes["images"] == (
        (1, 3, 32, 32),
        (5, 3, 32, 32),
        (5, 3, 32, 32),
    )


@pytest.mark.parametrize("output_precision", ["fp16", "int8"])
def test_trtexec_matches_python_config(
    tmp_path: Path, onnx_path: Path, cache_path: Path, output_precision: Any
) -> None:
    spec = DlaBuildSpec(onnx_path, cache_path, fp16_layers=HEADS, output_precision=output_precision)
    fake = FakeTensorRT()
    build(fake, spec, tmp_path)
    cmd = trtexec_command(spec, tmp_path / "o")
    assert fake.config is not None
    assert fake.network is not None
    flags = fake.config.flag_set
    assert ("--int8" in cmd) == (fake.BuilderFlag.INT8 in flags)
    assert ("--fp16" in cmd) == (fake.BuilderFlag.FP16 in flags)
    assert f"--useDLACore={fake.config.DLA_core}" in cmd
    out_fmt = fake.network.outputs[0].allowed_formats
    word = {1 << TensorFormat.CHW16: "fp16:chw16", 1 << TensorFormat.CHW32: "int8:chw32"}[out_fmt]
    assert f"--outputIOFormats={word},{word}" in cmd
    pinned = sorted(layer.name for layer in fake.network.layers if layer.output_types)
    assert f"--layerPrecisions={','.join(f'{n}:fp16' for n in pinned)}" in cmd


# --------------------------------------------------------------------------- probes
def test_tensorrt_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert tensorrt_available() is None
    monkeypatch.setitem(sys.modules, "tensorrt", FakeTensorRT("10.3.0.30"))
    assert tensorrt_available() == "10.3.0.30"


def test_tensorrt_available_survives_os_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class BrokenLibs(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> None:
            if name == "tensorrt":
                raise OSError("libnvonnxparser.so.11: cannot open shared object file")

    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenLibs(), *sys.meta_path])
    assert tensorrt_available() is None


def test_cuda_probe_never_raises() -> None:
    count = build_trt._cuda_device_count()
    assert count is None or count >= 0
