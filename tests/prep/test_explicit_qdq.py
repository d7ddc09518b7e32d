"""The explicit-quantization ONNX (prep/explicit_qdq.py) and the build's choice of path.

The emulated core built from the implicit path's inputs (PTQ ONNX + scales + fp16 nodes) and the
one built from the explicit Q/DQ ONNX alone must give the same integers on the same input: the
explicit ONNX then carries every scale, every FP16 node and every INT8 weight the implicit build
reads. The explicit ONNX is also checked as a graph (strongly typed, a Q/DQ on every INT8 tensor,
onnxruntime runs it), against TensorRT 11's explicit path (tests/prep/fake_tensorrt.py), and from
the build stage and the command line.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from prep import build_trt
from prep.build_trt import DlaBuildError, DlaBuildSpec, DlaSpecError, build_dla_loadable
from prep.cli import main
from prep.emulate_graph import EngineGraph, build_int8_graph
from prep.explicit_qdq import (
    ExplicitQdqError,
    emulated_graph_from_explicit,
    explicit_qdq_model,
    read_explicit_onnx,
    write_explicit_onnx,
)
from tests.prep.fake_tensorrt import DataType, FakeTensorRT, TensorFormat
from tests.prep.onnx_graphs import conv_net, conv_net_weights
from tests.prep.test_build_trt import HEADS, INTERNAL, run_build_stage, translated_toy, write_cache
from tests.prep.test_emulate_graph import calibrate, session, small_net

pytestmark = pytest.mark.timeout(120)

_ALIASES = frozenset({"QuantizeLinear", "DequantizeLinear", "Cast", "Identity"})


# ------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def small() -> tuple[onnx.ModelProto, dict[str, float]]:
    """The emulation tests' YOLO-like net (conv+SiLU, MaxPool, residual Add, Concat, Resize, two
    heads) with every tensor calibrated."""
    rng = np.random.default_rng(7)
    n, outs = small_net(rng)
    model = n.model(outs)
    return model, calibrate(model, rng.random((1, 3, 8, 8), dtype=np.float32))


def run_emulated(g: EngineGraph, qs: list[np.ndarray]) -> list[list[np.ndarray]]:
    """The emulated core's raw outputs (uint8 ``q + 128`` or float16) for int8 inputs ``qs``."""
    s = session(g.model)
    return [s.run(None, {g.input_name: (q.astype(np.int16) + 128).astype(np.uint8)}) for q in qs]


def fresh_inputs(shape: tuple[int, ...], count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-128, 128, shape).astype(np.int8) for _ in range(count)]


def assert_same_integers(a: EngineGraph, b: EngineGraph, seed: int) -> None:
    qs = fresh_inputs((1, *a.input_shape), 6, seed)
    got_a, got_b = run_emulated(a, qs), run_emulated(b, qs)
    for outs_a, outs_b in zip(got_a, got_b, strict=True):
        for x, y in zip(outs_a, outs_b, strict=True):
            assert x.dtype == y.dtype
            assert np.array_equal(x, y)
    # fresh inputs give outputs that vary: equality is not between two constants
    assert all(np.ptp(np.stack([o[i] for o in got_a]).astype(np.float32)) > 0 for i in range(2))


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    types = {i.name: i.data_type for i in g.initializer}
    types.update({v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info]})
    types.update({v.name: v.type.tensor_type.elem_type for v in g.output})
    return types


# --------------------------------------------------------------------- the same integers
@pytest.mark.parametrize(
    ("heads", "fp16"),
    [
        ("int8", []),
        ("fp16", []),
        ("int8", ["c1", "a1.sig", "a1.mul"]),  # an interior FP16 block read back in INT8
        ("fp16", ["cat", "up"]),  # FP16 Concat and Resize feeding the FP16 heads
    ],
)
def test_both_paths_give_the_same_integers(
    small: tuple[onnx.ModelProto, dict[str, float]], heads: Any, fp16: list[str]
) -> None:
    ptq, scales = small
    implicit = build_int8_graph(ptq, scales, fp16, heads=heads)
    explicit = explicit_qdq_model(ptq, scales, fp16, heads=heads)
    from_explicit = emulated_graph_from_explicit(
        onnx.load_from_string(explicit.SerializeToString())
    )
    assert [o.dtype for o in from_explicit.outputs] == [o.dtype for o in implicit.outputs]
    assert from_explicit.input_scale == implicit.input_scale
    assert_same_integers(implicit, from_explicit, seed=len(fp16))


@pytest.fixture(scope="module")
def translated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A legacy-exporter Q/DQ net through the translator: what the translate stage writes."""
    from prep.translate import translate, write_outputs

    tdir = tmp_path_factory.mktemp("translate")
    result = translate(conv_net(conv_net_weights(np.random.default_rng(3))))
    write_outputs(result, tdir, "model")
    return tdir


def test_translator_outputs_give_the_same_integers(translated: Path, tmp_path: Path) -> None:
    """The build stage's inputs (PTQ ONNX, the calibration cache's scales, the fp16 nodes):
    the emulated build of each path, as ``prep build`` writes them, on the same inputs."""
    config = json.loads((translated / "model_precision_config.json").read_text())
    ptq = onnx.load(str(translated / "model_noqdq.onnx"))
    implicit = build_int8_graph(
        ptq, config["int8_tensor_scales"], config["fp16_nodes"], heads="fp16"
    )
    path = write_explicit_onnx(
        translated / "model_noqdq.onnx",
        translated / "model_precision_config_calib.cache",
        config["fp16_nodes"],
        tmp_path / "model_qdq.onnx",
    )
    assert_same_integers(implicit, emulated_graph_from_explicit(path), seed=11)


# ------------------------------------------------------------------------ the graph itself
def test_the_explicit_onnx_is_strongly_typed_with_a_scale_on_every_int8_tensor(
    small: tuple[onnx.ModelProto, dict[str, float]],
) -> None:
    ptq, scales = small
    fp16 = ["c1", "a1.sig", "a1.mul"]
    model = explicit_qdq_model(ptq, scales, fp16, heads="fp16")
    onnx.checker.check_model(model, full_check=True)
    types = elem_types(model)
    assert types["images"] == TensorProto.INT8
    assert {types[o.name] for o in model.graph.output} == {TensorProto.FLOAT16}
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in model.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    half_nodes = {*fp16, "head0", "head1"}
    compute = [n for n in model.graph.node if n.op_type not in _ALIASES]
    assert {n.name for n in compute} == {n.name for n in ptq.graph.node}
    for n in compute:
        floats = [x for x in [*n.input, *n.output] if x and x not in consts]
        if n.name in half_nodes:  # FP16 nodes: FLOAT16 activations and weights, in and out
            data = [x for x in n.input if x in consts and consts[x].dtype.kind == "f"]
            assert {types[x] for x in floats} == {TensorProto.FLOAT16}, n.name
            assert all(consts[x].dtype == np.float16 for x in data if n.op_type == "Conv"), n.name
            continue
        for x in n.input:  # INT8 nodes read every activation through DQ(Q(.)) or DQ(input)
            if x and x not in consts:
                dq = producer[x]
                assert dq.op_type == "DequantizeLinear", (n.name, x)
                if dq.input[0] in consts:  # an INT8 weight
                    assert (n.op_type, list(n.input).index(x)) == ("Conv", 1)
                    continue
                assert dq.input[0] == "images" or producer[dq.input[0]].op_type in {
                    "QuantizeLinear", "Identity",
                }  # fmt: skip
        if n.op_type == "Conv":  # DQ -> Conv -> Q: TensorRT's fused INT8 convolution
            w_dq = producer[n.input[1]]
            assert consts[w_dq.input[0]].dtype == np.int8
            assert next(a.i for a in w_dq.attribute if a.name == "axis") == 0
            assert consts[n.input[2]].dtype == np.float32  # the float bias
            assert {r.op_type for r in readers[n.output[0]]} == {"QuantizeLinear"}
    for n in model.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            assert consts[n.input[1]].dtype == np.float32
            assert consts[n.input[2]].dtype == np.int8
            assert not consts[n.input[2]].any()
    # every scale read back is the translator's, as float32, and every INT8 node's scale is there
    back = read_explicit_onnx(model)
    assert back.scales == {k: float(np.float32(scales[k])) for k in back.scales}
    int8_outputs = {o for n in ptq.graph.node if n.name not in half_nodes for o in n.output}
    assert int8_outputs <= set(back.scales)
    assert set(back.fp16_nodes) == half_nodes


@pytest.mark.parametrize("heads", ["int8", "fp16"])
def test_onnxruntime_runs_the_explicit_onnx(
    small: tuple[onnx.ModelProto, dict[str, float]], heads: Any
) -> None:
    """onnxruntime runs the Q/DQ graph as written (float Conv on dequantised values, float bias,
    FP16 ops through its casts) rather than the emulated core's integer kernels with an int32
    bias: the two agree to rounding. Tolerance: int8 heads within one step, >= 95% equal; fp16
    heads within 1% of the heads' range."""
    ptq, scales = small
    explicit = explicit_qdq_model(ptq, scales, ["cat"], heads=heads)
    emulated = build_int8_graph(ptq, scales, ["cat"], heads=heads)
    qs = fresh_inputs((1, 3, 8, 8), 4, seed=5)
    sx = session(explicit)
    for q, want in zip(qs, run_emulated(emulated, qs), strict=True):
        for got, ref in zip(sx.run(None, {"images": q}), want, strict=True):
            if heads == "int8":
                assert got.dtype == np.int8
                diff = np.abs(got.astype(np.int16) - (ref.astype(np.int16) - 128))
                assert diff.max() <= 1
                assert (diff == 0).mean() >= 0.95
            else:
                assert got.dtype == np.float16
                span = float(np.abs(ref.astype(np.float32)).max())
                assert np.abs(got.astype(np.float32) - ref.astype(np.float32)).max() <= 0.01 * span


# ------------------------------------------------------------------ TensorRT 11 (the fake)
def _cache_of(scales: dict[str, float], path: Path) -> Path:
    return write_cache(path, {k: float(np.float32(v)) for k, v in scales.items()})


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_tensorrt_11_takes_the_explicit_onnx_for_the_dla(
    small: tuple[onnx.ModelProto, dict[str, float]], tmp_path: Path, precision: Any
) -> None:
    ptq, scales = small
    onnx.save(ptq, str(tmp_path / "noqdq.onnx"))
    qdq = write_explicit_onnx(
        tmp_path / "noqdq.onnx", _cache_of(scales, tmp_path / "c.cache"), ["cat"],
        tmp_path / "qdq.onnx", output_precision=precision,
    )  # fmt: skip
    fake = FakeTensorRT("11.4.1")
    spec = DlaBuildSpec(
        qdq, fp16_layers=("cat",), quantization="explicit", output_precision=precision
    )
    report = build_dla_loadable(
        spec, tmp_path / "m.dla0", trt_module=fake, cuda_device_count=lambda: 1
    )
    assert report.int8_mode == "explicit"
    assert fake.network is not None
    (images,) = fake.network.inputs
    assert (images.dtype, images.allowed_formats) == (DataType.INT8, 1 << TensorFormat.DLA_HWC4)
    vec = TensorFormat.CHW32 if precision == "int8" else TensorFormat.CHW16
    assert {o.allowed_formats for o in fake.network.outputs} == {1 << vec}
    assert not fake.calls_to("tensor", "dtype=")
    assert not fake.calls_to("config", "int8_calibrator=")


def test_tensorrt_11_takes_the_explicit_onnx_for_the_gpu(
    small: tuple[onnx.ModelProto, dict[str, float]], tmp_path: Path
) -> None:
    ptq, scales = small
    onnx.save(ptq, str(tmp_path / "noqdq.onnx"))
    qdq = write_explicit_onnx(
        tmp_path / "noqdq.onnx", _cache_of(scales, tmp_path / "c.cache"), [],
        tmp_path / "gpu_qdq.onnx", device="gpu",
    )  # fmt: skip
    fake = FakeTensorRT("11.4.1", num_dla_cores=0)
    spec = DlaBuildSpec(qdq, device="gpu", quantization="explicit", max_batch=4)
    build_dla_loadable(spec, tmp_path / "m.engine", trt_module=fake, cuda_device_count=lambda: 1)
    assert fake.network is not None
    (images,) = fake.network.inputs
    assert (images.dtype, images.shape) == (DataType.HALF, (-1, 3, 8, 8))
    # the FP16 input is quantised with the input's scale, as the DLA's bytes are
    back = read_explicit_onnx(qdq)
    assert back.input_dtype == "float16"
    assert back.scales["images"] == float(np.float32(scales["images"]))


def test_tensorrt_11_refuses_an_asymmetric_qdq(
    small: tuple[onnx.ModelProto, dict[str, float]], tmp_path: Path
) -> None:
    ptq, scales = small
    model = explicit_qdq_model(ptq, scales, [], heads="fp16")
    zp = next(i for i in model.graph.initializer if i.name.startswith("activation_zero_point"))
    zp.CopyFrom(numpy_helper.from_array(np.array(3, np.int8), zp.name))
    onnx.save(model, str(tmp_path / "bad.onnx"))
    spec = DlaBuildSpec(tmp_path / "bad.onnx", quantization="explicit")
    with pytest.raises(DlaBuildError, match="asymmetric"):
        build_dla_loadable(
            spec, tmp_path / "m", trt_module=FakeTensorRT("11.4.1"), cuda_device_count=lambda: 1
        )
    with pytest.raises(ExplicitQdqError, match="zero point 0"):
        read_explicit_onnx(model)


# ------------------------------------------------------------------------------- errors
def test_reader_errors(small: tuple[onnx.ModelProto, dict[str, float]]) -> None:
    ptq, scales = small
    model = explicit_qdq_model(ptq, scales, [], heads="int8")
    twice = copy.deepcopy(model)  # a second quantiser of one tensor, at another scale
    twice.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "other"))
    twice.graph.node.append(
        helper.make_node(
            "QuantizeLinear", ["c0_out", "other", "activation_zero_point"], ["c0_out/q2"]
        )
    )
    with pytest.raises(ExplicitQdqError, match="quantised with scales"):
        read_explicit_onnx(twice)
    mixed = copy.deepcopy(model)
    out = mixed.graph.output[1]
    mixed.graph.node.append(helper.make_node("Cast", [out.name], ["h"], to=TensorProto.FLOAT16))
    mixed.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT16, None))
    with pytest.raises(ExplicitQdqError, match="must all be int8 or all float16"):
        read_explicit_onnx(mixed)


def test_writer_errors(translated: Path, tmp_path: Path) -> None:
    config = json.loads((translated / "model_precision_config.json").read_text())
    ptq, cache = translated / "model_noqdq.onnx", translated / "model_precision_config_calib.cache"
    # the translator left head s16 without a scale: it cannot be an INT8 output
    with pytest.raises(ExplicitQdqError, match="s16"):
        write_explicit_onnx(
            ptq, cache, config["fp16_nodes"], tmp_path / "x.onnx", output_precision="int8"
        )
    with pytest.raises(ExplicitQdqError, match="fp16_nodes names no node"):
        write_explicit_onnx(ptq, cache, ["nope"], tmp_path / "x.onnx")
    (tmp_path / "bad.cache").write_text("not a cache\n")
    with pytest.raises(DlaSpecError):
        write_explicit_onnx(ptq, tmp_path / "bad.cache", [], tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


# -------------------------------------------------------------- the build stage and the CLI
def _use_fake(monkeypatch: pytest.MonkeyPatch, version: str | None) -> FakeTensorRT | None:
    fake = None if version is None else FakeTensorRT(version)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(build_trt, "_cuda_device_count", lambda: 1)
    return fake


def test_without_tensorrt_the_stage_writes_both_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_fake(monkeypatch, None)
    tdir = translated_toy(tmp_path)
    outputs, metrics = run_build_stage(tmp_path, targets=("dla",))
    build = tmp_path / "build"
    assert metrics["skipped"] == "TensorRT not installed"
    assert outputs["qdq_onnx"] == build / "model_qdq.onnx"
    commands = json.loads((build / "trtexec_commands.json").read_text())
    assert set(commands) == {"dla0", "dla1", "dla0_explicit", "dla1_explicit"}
    for core in (0, 1):
        implicit, explicit = commands[f"dla{core}"], commands[f"dla{core}_explicit"]
        assert f"--onnx={tdir / 'model_noqdq.onnx'}" in implicit
        assert f"--calib={tdir / 'model_precision_config_calib.cache'}" in implicit
        assert {"--int8", "--fp16"} <= set(implicit)
        assert f"--onnx={build / 'model_qdq.onnx'}" in explicit
        assert not [a for a in explicit if a.startswith(("--int8", "--fp16", "--calib", "--prec"))]
        for cmd in (implicit, explicit):
            assert f"--saveEngine={build / f'model.dla{core}.loadable'}" in cmd
            assert "--inputIOFormats=int8:dla_hwc4" in cmd
    back = read_explicit_onnx(build / "model_qdq.onnx")
    assert set(back.fp16_nodes) == set(HEADS)
    assert back.scales == {
        "images": float(np.float32(0.01)),
        **dict.fromkeys(INTERNAL, float(np.float32(0.05))),
    }


@pytest.mark.parametrize(("version", "mode"), [("10.3.0.30", "implicit"), ("11.4.1", "explicit")])
def test_the_stage_takes_the_path_of_the_tensorrt_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, mode: str
) -> None:
    fake = _use_fake(monkeypatch, version)
    assert fake is not None
    translated_toy(tmp_path)
    outputs, metrics = run_build_stage(tmp_path, targets=("dla",), cores=(1,))
    assert (metrics["tensorrt"], metrics["quantization"]) == (version, mode)
    (report,) = metrics["built"]
    assert report["quantization"] == mode
    key = "dla1" if mode == "implicit" else "dla1_explicit"
    assert list(json.loads((tmp_path / "build/trtexec_commands.json").read_text())) == [key]
    assert outputs[key].read_bytes() == b"FAKE-LOADABLE core=1"
    assert fake.network is not None
    assert fake.network.inputs[0].dtype == DataType.INT8
    if mode == "explicit":
        assert not hasattr(fake.BuilderFlag, "INT8")
        assert "qdq_onnx" in outputs
    else:
        assert fake.cache_read is not None  # the calibrator replayed the cache
        assert "qdq_onnx" not in outputs


def test_the_stage_builds_the_explicit_gpu_engine_on_tensorrt_11(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _use_fake(monkeypatch, "11.4.1")
    assert fake is not None
    translated_toy(tmp_path)
    outputs, _ = run_build_stage(tmp_path, targets=("gpu",), max_batch=2)
    assert set(outputs) == {
        "gpu_qdq_onnx", "trtexec_commands", "gpu_explicit", "gpu_explicit_metadata",
    }  # fmt: skip
    assert fake.network is not None
    assert fake.network.inputs[0].dtype == DataType.HALF
    meta = json.loads(outputs["gpu_explicit_metadata"].read_text())
    assert (meta["precision"]["quantization"], meta["max_batch"]) == ("explicit", 2)


def _cli_files(tmp_path: Path) -> list[str]:
    tdir = translated_toy(tmp_path)
    return [
        "build", "--onnx", str(tdir / "model_noqdq.onnx"),
        "--calib", str(tdir / "model_precision_config_calib.cache"),
        "--precision-config", str(tdir / "model_precision_config.json"),
        "--out", str(tmp_path / "out" / "toy.dla0.loadable"),
    ]  # fmt: skip


@pytest.mark.parametrize("asked", [[], ["--quantization", "auto"], ["--quantization", "explicit"]])
def test_cli_builds_the_explicit_path_on_tensorrt_11(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: list[str]
) -> None:
    fake = _use_fake(monkeypatch, "11.4.1")
    assert fake is not None
    assert main([*_cli_files(tmp_path), *asked]) == 0
    qdq = tmp_path / "out" / "model_noqdq_qdq.onnx"
    assert read_explicit_onnx(qdq).heads == "fp16"
    assert fake.calls_to("parser", "parse")[0][1] == str(qdq)
    assert (tmp_path / "out" / "toy.dla0.loadable").read_bytes() == b"FAKE-LOADABLE core=0"


@pytest.mark.parametrize(
    ("version", "asked", "why"),
    [
        ("10.3.0.30", "explicit", "builds explicit Q/DQ networks for the DLA only from 11.4.1"),
        ("11.4.1", "implicit", "has no implicit INT8"),
    ],
)
def test_cli_refuses_a_path_the_tensorrt_found_lacks(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    version: str,
    asked: str,
    why: str,
) -> None:
    fake = _use_fake(monkeypatch, version)
    assert fake is not None
    assert main([*_cli_files(tmp_path), "--quantization", asked]) == 1
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert why in record.getMessage()
    assert record.exc_info is None
    assert "Traceback" not in capsys.readouterr().err
    assert fake.calls_to("parser", "parse") == []
    assert not (tmp_path / "out").exists()


def test_cli_quantization_belongs_to_onnx_builds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["build", "--quantization", "explicit", "--workdir", str(tmp_path)]) == 2
    assert "--quantization applies to --onnx" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()
