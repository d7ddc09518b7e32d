"""Q/DQ → PTQ translator: scale extraction, inference rules, errors, BN folding, outputs."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.calib_cache import parse_calibration_cache
from prep.translate import TranslationError, translate, write_outputs
from tests.prep.onnx_graphs import (
    NET_SCALES,
    GraphBuilder,
    ZeroPointStyle,
    conv,
    conv_net,
    conv_net_weights,
    max_scales,
    run,
    silu,
)

SCALES = st.floats(min_value=2**-13, max_value=1.0, allow_nan=False, width=32)
RULES = settings(max_examples=40, deadline=None)
A, C = "/act1/Mul_output_0", "/cat/Concat_output_0"


def f32(value: float) -> float:
    return float(np.float32(value))


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


def weights4(rng: np.random.Generator, out: int = 4, inp: int = 2) -> np.ndarray:
    return (rng.standard_normal((out, inp, 1, 1)) * 0.5).astype(np.float32)


# ------------------------------------------------------------------------------------ the net
@pytest.mark.parametrize(
    ("constant_nodes", "zero_point_style"),
    [(False, "initializer"), (True, "constant_node"), (True, "cast")],
)
def test_conv_net_scales_and_numerics(
    rng: np.random.Generator, constant_nodes: bool, zero_point_style: ZeroPointStyle
) -> None:
    """Scales are the Q/DQ scales under the exporter's names (heads included), the gaps are
    filled by the rules, and the PTQ model computes what the float twin computes."""
    weights = conv_net_weights(rng)
    qdq_model = conv_net(weights, constant_nodes=constant_nodes, zero_point_style=zero_point_style)
    before = qdq_model.SerializeToString()
    result = translate(qdq_model)
    assert qdq_model.SerializeToString() == before  # the caller's model is left alone

    s = {name: f32(v) for name, v in NET_SCALES.items()}
    expected = {
        "images": s["images"],
        A: s[A],
        C: s[C],  # A's smaller scale must not lower it: MaxPool's range is unknown there
        "s8": s["/head/Conv_output_0"],  # DQ output that is a graph output keeps its name
        "/act1/Sigmoid_output_0": 1 / 127,
        "/act2/Sigmoid_output_0": 1 / 127,
        "/c1/Conv_output_0": s[A],  # Mul backward: (A / (1/127)) / 127
        "/pool/MaxPool_output_0": s[C],  # Concat backward
        "/act2/Mul_output_0": s[C],  # MaxPool backward
        "/c2/Conv_output_0": s[C],
    }
    assert result.int8_tensor_scales == pytest.approx(expected, rel=1e-12)
    assert result.missing == ["s16"]
    assert result.fp16_nodes == ["/aux/Conv"]  # the producer of an output without a scale
    assert result.report.missing[0].is_graph_output
    assert result.report.activation_quantizers == 5
    assert result.report.weight_quantizers == 4

    model = result.model
    onnx.checker.check_model(model)
    assert not {"QuantizeLinear", "DequantizeLinear", "Constant", "Cast"} & set(ops(model))
    assert [i.name for i in model.graph.input] == ["images"]
    assert [o.name for o in model.graph.output] == ["s8", "s16"]
    assert model.ir_version == qdq_model.ir_version
    names = {t for n in model.graph.node for t in [*n.input, *n.output]}
    assert set(result.int8_tensor_scales) <= names | {"images"}
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(initializers["aux.weight"], weights["aux.w"])

    x = rng.standard_normal((1, 3, 12, 12)).astype(np.float32)
    got = run(model, {"images": x})
    want = run(conv_net(weights, qdq=False), {"images": x})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)  # same float graph


def test_rename_node_outputs(rng: np.random.Generator) -> None:
    plain = translate(conv_net(conv_net_weights(rng)))
    renamed = translate(conv_net(conv_net_weights(rng)), rename_node_outputs=True)
    # Each tensor takes its producer's name; graph I/O keep theirs.
    expected = {
        (k if k in ("images", "s8") else k.removesuffix("_output_0")): v
        for k, v in plain.int8_tensor_scales.items()
    }
    assert renamed.int8_tensor_scales == expected
    nodes = {n.name for n in renamed.model.graph.node}
    assert {n.output[0] for n in renamed.model.graph.node} - {"s8", "s16"} <= nodes
    assert [o.name for o in renamed.model.graph.output] == ["s8", "s16"]


def test_rename_extra_outputs_and_collisions() -> None:
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 4, 2, 2]), 0.05, "q")
    b.nodes.append(onnx.helper.make_node("Split", [x], ["p0", "p1"], name="split", axis=1))
    r0 = b.node("Relu", ["p0"], "relu", "r0")
    r1 = b.node("Relu", ["p1"], "relu", "r1")  # a duplicate node name
    b.node("Add", [r0, r1], "add", "y")
    b.output("y")
    with pytest.raises(TranslationError, match=r"'relu' .* is taken"):
        translate(b.model(), rename_node_outputs=True)
    b.nodes[-2].name = "relu_b"
    result = translate(b.model(), rename_node_outputs=True)
    split = next(n for n in result.model.graph.node if n.op_type == "Split")
    assert list(split.output) == ["split", "split_1"]
    assert result.int8_tensor_scales == {"x": f32(0.05)}
    assert result.missing == ["split", "relu", "relu_b", "y"]


def test_write_outputs(rng: np.random.Generator, tmp_path: Path) -> None:
    result = translate(conv_net(conv_net_weights(rng)), trt_version=8502)
    paths = write_outputs(result, tmp_path / "out", "yolo")
    assert paths.onnx.name == "yolo_noqdq.onnx"
    assert onnx.load(str(paths.onnx)).graph == result.model.graph
    text = paths.precision_config.read_text()
    assert text == json.dumps(
        {"int8_tensor_scales": result.int8_tensor_scales, "fp16_nodes": result.fp16_nodes},
        indent=4,
    )
    cache = parse_calibration_cache(paths.calibration_cache.read_text())
    assert paths.calibration_cache.name == "yolo_precision_config_calib.cache"
    assert cache.trt_version == 8502
    assert cache.algorithm == "EntropyCalibration2"
    assert cache.scales == {k: f32(v) for k, v in result.int8_tensor_scales.items()}
    assert paths.layer_arg.read_text() == "/aux/Conv:fp16"
    with pytest.raises(ValueError, match="stem"):
        write_outputs(result, tmp_path, "a/b")


def test_report_is_logged(rng: np.random.Generator, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="prep.translate"):
        translate(conv_net(conv_net_weights(rng)))
    assert any("s16" in r.getMessage() and "/aux/Conv" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------ rules
def _two_inputs(b: GraphBuilder) -> tuple[str, str]:
    return b.input("in1", [1, 2, 4, 4]), b.input("in2", [1, 2, 4, 4])


@RULES
@given(s1=SCALES, s2=SCALES, s_out=SCALES)
def test_concat_all_inputs_known_takes_their_max(s1: float, s2: float, s_out: float) -> None:
    b = GraphBuilder()
    in1, in2 = _two_inputs(b)
    cat = b.node("Concat", [b.qdq_pair(in1, s1, "q1"), b.qdq_pair(in2, s2, "q2")], "cat", axis=1)
    b.node("Relu", [b.qdq_pair(cat, s_out, "q3")], "relu", "y")
    b.output("y")
    scales = translate(b.model()).int8_tensor_scales
    assert scales == {"in1": s1, "in2": s2, "cat_output_0": max(s1, s2), "y": max(s1, s2)}


@RULES
@given(s1=SCALES, s_out=SCALES, known_first=st.booleans())
def test_concat_backward_fills_every_unknown_input(
    s1: float, s_out: float, known_first: bool
) -> None:
    b = GraphBuilder()
    in1, in2 = _two_inputs(b)
    known, unknown = b.qdq_pair(in1, s1, "q1"), b.node("Relu", [in2], "r")
    parts = [known, unknown] if known_first else [unknown, known]
    cat = b.node("Concat", parts, "cat", axis=1)
    b.node("Relu", [b.qdq_pair(cat, s_out, "q3")], "relu", "y")
    b.output("y")
    scales = translate(b.model()).int8_tensor_scales
    out = max(s1, s_out)  # the known input may raise the output's scale, never lower it
    assert scales == {"in1": s1, "in2": out, "r_output_0": out, "cat_output_0": out, "y": out}
    off = translate(b.model(), infer_concat_scales=False)
    assert "r_output_0" in off.missing
    assert "cat" in off.fp16_nodes


@RULES
@given(s_in=SCALES, s_out=SCALES)
def test_silu_sigmoid_is_1_over_127_and_mul_backward_recovers_conv_output(
    s_in: float, s_out: float
) -> None:
    rng = np.random.default_rng(7)
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), s_in, "q_in")
    act = silu(b, conv(b, x, weights4(rng), None, "/c"), "/act")
    b.node("Relu", [b.qdq_pair(act, s_out, "q_out")], "relu", "y")
    b.output("y")
    result = translate(b.model())
    scales = result.int8_tensor_scales
    assert scales["/act/Sigmoid_output_0"] == 1 / 127
    assert scales["/c/Conv_output_0"] == pytest.approx(s_out, rel=1e-12)
    assert scales["/act/Mul_output_0"] == s_out
    assert "/act/Sigmoid_output_0" not in result.missing

    off = translate(b.model(), infer_mul_scales=False)  # no SiLU rule, no logit for 1/127
    assert {"/c/Conv_output_0", "/act/Sigmoid_output_0"} <= set(off.missing)
    assert {"/act/Sigmoid", "/act/Mul"} <= set(off.fp16_nodes)
    miss = {m.tensor: m for m in off.report.missing}["/c/Conv_output_0"]
    assert miss.producer == "/c/Conv"
    assert set(miss.consumers) == {"/act/Sigmoid", "/act/Mul"}


@RULES
@given(s_a=SCALES, s_out=SCALES, known_first=st.booleans())
def test_mul_backward_formula(s_a: float, s_out: float, known_first: bool) -> None:
    b = GraphBuilder()
    in1, in2 = _two_inputs(b)
    known, unknown = b.qdq_pair(in1, s_a, "qa"), b.node("Relu", [in2], "r")
    mul = b.node("Mul", [known, unknown] if known_first else [unknown, known], "mul")
    b.node("Relu", [b.qdq_pair(mul, s_out, "q_out")], "relu", "y")
    b.output("y")
    scales = translate(b.model()).int8_tensor_scales
    other = s_out / s_a / 127.0  # amax_out = amax_a * amax_b
    assert scales["r_output_0"] == pytest.approx(other, rel=1e-12)
    assert scales["in2"] == pytest.approx(other, rel=1e-12)  # Relu backward


@RULES
@given(s=SCALES)
def test_maxpool_and_resize_propagate_downstream(s: float) -> None:
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), s, "q")
    pool = b.node("MaxPool", [x], "pool", kernel_shape=[3, 3], pads=[1] * 4, strides=[1, 1])
    up_scales = b.const("up_scales", np.array([1, 1, 2, 2], np.float32))
    up = b.node("Resize", [pool, "", up_scales], "up", mode="nearest")
    b.node("Relu", [up], "relu", "y")
    b.output("y")
    with_resize = translate(b.model(), extra_ops=["Resize"])
    assert with_resize.int8_tensor_scales == {
        "x": s,
        "pool_output_0": s,
        "up_output_0": s,
        "y": s,
    }
    assert with_resize.fp16_nodes == []
    default = translate(b.model())
    assert default.missing == ["up_output_0", "y"]  # no Resize rule by default
    assert default.fp16_nodes == ["relu"]  # consumer of up, producer of the output y


@RULES
@given(s=SCALES)
def test_maxpool_backward(s: float) -> None:
    b = GraphBuilder()
    pool = b.node("MaxPool", [b.input("x", [1, 2, 4, 4])], "pool", kernel_shape=[2, 2])
    b.node("Relu", [b.qdq_pair(pool, s, "q")], "relu", "y")
    b.output("y")
    assert translate(b.model()).int8_tensor_scales == {"x": s, "pool_output_0": s, "y": s}


@RULES
@given(y=st.floats(min_value=0.5, max_value=1.5, exclude_min=True))
def test_sigmoid_logit_backward(y: float) -> None:
    s_out = y / 127.0
    b = GraphBuilder()
    sig = b.node("Sigmoid", [b.input("x", [1, 2, 4, 4])], "sig")
    b.node("Relu", [b.qdq_pair(sig, s_out, "q")], "relu", "y")
    b.output("y")
    result = translate(b.model())
    y32 = f32(s_out) * 127.0
    if 0.5 < y32 < 1.0:
        expected = math.log(y32 / (1.0 - y32)) / 127.0
        assert result.int8_tensor_scales["x"] == pytest.approx(expected, rel=1e-12)
    else:  # saturated (or rounded onto 0.5): no positive finite logit, the input stays FP16
        assert result.missing == ["x"]
        assert result.fp16_nodes == ["sig"]


def test_extracted_scale_conflict_keeps_the_largest() -> None:
    b = GraphBuilder()
    x = b.input("x", [1, 2, 4, 4])
    a = b.node("Relu", [b.qdq_pair(x, 0.1, "qa")], "a", "ya")
    c = b.node("Relu", [b.qdq_pair(x, 0.3, "qb")], "c", "yc")
    b.output(a)
    b.output(c)
    result = translate(b.model())
    assert result.int8_tensor_scales["x"] == f32(0.3)
    assert result.report.scale_conflicts == {"x": (f32(0.1), f32(0.3))}


def test_identity_casts_are_removed_so_scales_flow() -> None:
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), 0.05, "q")
    cast = b.node("Cast", [x], "cast", to=onnx.TensorProto.FLOAT)
    b.node("Relu", [cast], "relu", "y")
    b.output("y")
    result = translate(b.model())
    assert "Cast" not in ops(result.model)
    assert result.int8_tensor_scales == {"x": f32(0.05), "y": f32(0.05)}


def test_quantized_graph_input_as_graph_output_keeps_both_names() -> None:
    b = GraphBuilder()
    b.qdq_pair(b.input("x", [1, 2, 4, 4]), 0.05, "q", output="y")
    b.output("y")
    result = translate(b.model())
    assert ops(result.model) == ["Identity"]
    assert result.int8_tensor_scales == {"x": f32(0.05), "y": f32(0.05)}


def test_unquantized_graph_input_consumers_go_fp16(rng: np.random.Generator) -> None:
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), 0.05, "q")
    z = b.input("z", [1, 2, 4, 4])
    b.node("Relu", [b.qdq_pair(b.node("Add", [x, z], "add"), 0.1, "q2")], "relu", "y")
    b.output("y")
    result = translate(b.model())
    assert result.missing == ["z"]
    assert result.fp16_nodes == ["add"]
    assert result.report.missing[0].producer is None


# ------------------------------------------------------------------------------------ BN folding
@pytest.mark.parametrize("with_bias", [False, True])
def test_batchnorm_is_folded_into_conv(rng: np.random.Generator, with_bias: bool) -> None:
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.4).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32) if with_bias else None
    bn = [
        rng.uniform(0.5, 2.0, 4).astype(np.float32),  # gamma
        rng.standard_normal(4).astype(np.float32),  # beta
        rng.standard_normal(4).astype(np.float32),  # mean
        rng.uniform(0.1, 3.0, 4).astype(np.float32),  # var
    ]

    def build(qdq: bool) -> onnx.ModelProto:
        b = GraphBuilder(qdq=qdq)
        x = b.qdq_pair(b.input("x", [1, 3, 8, 8]), 0.02, "q_in")
        y = conv(b, x, w, bias, "/c")
        params = [b.const(f"bn.{i}", p) for i, p in enumerate(bn)]
        y = b.node("BatchNormalization", [y, *params], "/bn", "/bn/out", epsilon=1e-3)
        b.node("Relu", [b.qdq_pair(y, 0.07, "q_bn")], "relu", "y")
        b.output("y")
        return b.model()

    result = translate(build(True))
    assert "BatchNormalization" not in ops(result.model)
    assert result.report.folded_batchnorms == ("/bn",)
    conv_node = next(n for n in result.model.graph.node if n.op_type == "Conv")
    assert list(conv_node.output) == ["/bn/out"]  # the scale-bearing name survives
    assert result.int8_tensor_scales["/bn/out"] == f32(0.07)
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    (got,) = run(result.model, {"x": x})
    (want,) = run(build(False), {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batchnorm_without_conv_is_left_and_reported() -> None:
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), 0.05, "q")
    params = [b.const(f"bn.{i}", np.ones(2, np.float32)) for i in range(4)]
    b.node("BatchNormalization", [x, *params], "bn", "y")
    b.output("y")
    result = translate(b.model())
    assert "BatchNormalization" in ops(result.model)
    assert result.report.unfolded_batchnorms == ("bn",)


# ------------------------------------------------------------------------------------ errors
def _act_qdq_model(
    *, style: ZeroPointStyle = "initializer", scale: Any = 0.05, **qdq_kwargs: Any
) -> onnx.ModelProto:
    b = GraphBuilder(zero_point_style=style)
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), scale, "act", **qdq_kwargs)
    b.node("Relu", [x], "relu", "y")
    b.output("y")
    return b.model()


def test_model_without_qdq_is_refused(rng: np.random.Generator) -> None:
    with pytest.raises(TranslationError, match="no QuantizeLinear"):
        translate(conv_net(conv_net_weights(rng), qdq=False))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_point": 3}, "non-zero zero point"),
        ({"zero_point_dtype": np.uint8}, "uint8"),
        ({"style": "absent"}, "uint8"),
        ({"dq_scale": 0.06}, "differ in scale"),
        ({"scale": [0.05, 0.06], "axis": 1}, "per-channel"),
    ],
)
def test_bad_activation_quantizers_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TranslationError, match=match) as info:
        translate(_act_qdq_model(**kwargs))
    assert "act/" in str(info.value)  # names the node


def test_weight_scales_must_be_max_calibrated(rng: np.random.Generator) -> None:
    w = weights4(rng, out=6)

    def model(scales: np.ndarray) -> onnx.ModelProto:
        b = GraphBuilder()
        x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), 0.05, "q")
        y = b.node("Conv", [x, b.weight("w", w, scales=scales)], "conv", "y")
        b.output(y)
        return b.model()

    exact = max_scales(w)
    translate(model(exact * np.float32(1 + 5e-4)))  # within rtol=1e-3
    clipped = exact.copy()
    clipped[2] *= np.float32(0.8)  # e.g. a histogram-calibrated channel
    with pytest.raises(TranslationError, match=r"w_quantizer/Q.*channel 2"):
        translate(model(clipped))
    translate(model(clipped), calibration_type="histogram")
    translate(model(clipped), weight_scale_rtol=0.3)


def test_all_zero_weight_channel_accepts_any_scale(rng: np.random.Generator) -> None:
    w = weights4(rng)
    w[1] = 0.0
    scales = max_scales(w)
    scales[1] = 1.0  # what modelopt writes for a zero amax
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), 0.05, "q")
    b.node("Conv", [x, b.weight("w", w, scales=scales)], "conv", "y")
    b.output("y")
    assert translate(b.model()).int8_tensor_scales == {"x": f32(0.05)}


def test_quantize_without_dequantize_is_refused() -> None:
    b = GraphBuilder()
    s = b.const("s", np.float32(0.1))
    zp = b.const("zp", np.int8(0))
    b.nodes.append(onnx.helper.make_node("QuantizeLinear", ["x", s, zp], ["q"], name="Q"))
    b.input("x", [1, 2])
    b.outputs.append(onnx.helper.make_tensor_value_info("q", onnx.TensorProto.INT8, [1, 2]))
    with pytest.raises(TranslationError, match="'Q' must feed only DequantizeLinear"):
        translate(b.model())


def test_dequantize_without_quantize_is_refused() -> None:
    b = GraphBuilder()
    x = b.qdq_pair(b.input("x", [1, 2, 4, 4]), 0.05, "q")
    w_int8 = b.const("w_int8", np.ones((3, 2, 1, 1), np.int8))
    w = b.node("DequantizeLinear", [w_int8, b.const("w_scale", np.float32(0.01))], "w_dq")
    b.node("Conv", [x, w], "conv", "y")
    b.output("y")
    with pytest.raises(TranslationError, match=r"DequantizeLinear without.*'w_dq'"):
        translate(b.model())


def test_bad_options_are_refused(rng: np.random.Generator) -> None:
    model = conv_net(conv_net_weights(rng))
    with pytest.raises(TranslationError, match="calibration_type"):
        translate(model, calibration_type="entropy")  # type: ignore[arg-type]
    with pytest.raises(TranslationError, match="trt_version"):
        translate(model, trt_version=-1)


# ------------------------------------------------------------------------------------ modelopt
@pytest.mark.slow
@pytest.mark.parametrize("opset", [13, 17])
def test_modelopt_export_translates(opset: int, tmp_path: Path) -> None:
    """The exporter the project uses (modelopt + legacy torch.onnx, with and without constant
    folding): scales equal the quantizers' amax/127 under torch's tensor names, and the PTQ
    model computes what the module computes with its quantizers disabled."""
    import copy
    import warnings

    import modelopt.torch.quantization as mtq
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1)
            self.c2 = nn.Conv2d(8, 8, 1)
            self.c3 = nn.Conv2d(16, 5, 1)
            self.act = nn.SiLU()
            self.pool = nn.MaxPool2d(5, 1, 2)
            self.up = nn.Upsample(scale_factor=2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = self.act(self.c1(x))
            b = self.act(self.c2(a))
            return self.c3(self.up(torch.cat([a, self.pool(b)], 1)))

    torch.manual_seed(0)
    net = Net().eval()
    float_net = copy.deepcopy(net)  # the reference: same weights, no quantizers
    batches = [torch.randn(2, 3, 16, 16) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modelopt and the tracer warn about their internals
        net = mtq.quantize(net, mtq.INT8_DEFAULT_CFG, lambda m: [m(x) for x in batches])
        for fold in (True, False):
            path = tmp_path / f"fold{fold}.onnx"
            torch.onnx.export(
                net,
                (batches[0][:1],),
                str(path),
                opset_version=opset,
                dynamo=False,
                do_constant_folding=fold,
                input_names=["images"],
                output_names=["s8"],
            )
            result = translate(path)

            def scale(quantizer: torch.nn.Module) -> float:
                return f32(float(quantizer.amax) / 127.0)  # type: ignore[arg-type]

            got = result.int8_tensor_scales
            assert got["images"] == scale(net.c1.input_quantizer)
            assert got["/act/Mul_output_0"] == scale(net.c2.input_quantizer)
            assert got["/act/Sigmoid_output_0"] == 1 / 127
            assert got["/up/Resize_output_0"] == scale(net.c3.input_quantizer)  # Concat rule
            assert "QuantizeLinear" not in ops(result.model)
            assert result.report.weight_quantizers == 3

            x = torch.randn(1, 3, 16, 16)
            want = float_net(x).detach().numpy()
            (ptq,) = run(result.model, {"images": x.numpy()})
            np.testing.assert_allclose(ptq, want, rtol=1e-4, atol=1e-5)
