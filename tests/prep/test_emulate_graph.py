"""The emulated DLA core's INT8 graph: semantics against numpy and torch references, the uint8
(zero point 128) = int8 (zero point 0) equivalence, kernel fusion, FP16 nodes and errors."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto, helper, numpy_helper

from dlad.devices.int8_engine import Int8Engine
from dlad.imaging.post import unpack_chw16, unpack_chw32_int8
from dlad.imaging.pre import dequantize_hwc4, quantize_hwc4, round_half_away_from_zero
from prep.emulate_graph import (
    EmulationGraphError,
    EngineGraph,
    build_int8_graph,
    optimized_op_counts,
)


# ------------------------------------------------------------------------------------ helpers
def session(model: onnx.ModelProto | bytes, *, optimize: bool = True) -> Any:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def engine(g: EngineGraph) -> Int8Engine:
    return Int8Engine(
        g.to_bytes(), input_scale=g.input_scale, input_shape=g.input_shape, outputs=g.outputs
    )


def heads_of(g: EngineGraph, packed: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Logical ``[C, H, W]`` float heads from the engine's packed outputs."""
    return [
        unpack_chw32_int8(p, s.channels, s.scale) if s.scale else unpack_chw16(p, s.channels)
        for s, p in zip(g.outputs, packed, strict=True)
    ]


class Net:
    """A Q/DQ-free float ONNX model built node by node (what the translator emits)."""

    def __init__(self, rng: np.random.Generator, shape: Sequence[int]) -> None:
        self.rng = rng
        self.shape = list(shape)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.outputs: list[str] = []
        self.params: dict[str, np.ndarray] = {}

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        self.params[name] = value
        return name

    def conv(self, name: str, x: str, cin: int, cout: int, k: int = 1, bias: bool = True) -> str:
        w = self.rng.normal(0, 1 / np.sqrt(cin * k * k), (cout, cin, k, k)).astype(np.float32)
        inputs = [x, self.const(f"{name}.w", w)]
        if bias:
            inputs.append(self.const(f"{name}.b", self.rng.normal(0, 0.3, cout).astype(np.float32)))
        out = f"{name}_out"
        pads = [k // 2] * 4
        self.nodes.append(
            helper.make_node("Conv", inputs, [out], name=name, kernel_shape=[k, k], pads=pads)
        )
        return out

    def op(self, op: str, inputs: Sequence[str], name: str, **attrs: Any) -> str:
        out = f"{name}_out"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def silu(self, x: str, name: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x], f"{name}.sig")], f"{name}.mul")

    def model(self, outputs: Sequence[str], opset: int = 13) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "net",
            [helper.make_tensor_value_info("images", TensorProto.FLOAT, self.shape)],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        return onnx.shape_inference.infer_shapes(model)


def calibrate(model: onnx.ModelProto, images: np.ndarray) -> dict[str, float]:
    """``max|x| / 127`` of every float tensor (1/127 for Sigmoid outputs, as the translator)."""
    probe = copy.deepcopy(model)
    names = [o for n in probe.graph.node for o in n.output]
    listed = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in listed)
    sess = session(probe)
    outs = sess.run(names, {"images": images})
    scales = {n: float(np.abs(v).max()) / 127 for n, v in zip(names, outs, strict=True)}
    scales.update({n.output[0]: 1 / 127 for n in model.graph.node if n.op_type == "Sigmoid"})
    scales["images"] = 1 / 127
    return scales


# --------------------------------------------------------------------- numpy reference (spec)
def q(x: np.ndarray, s: float) -> np.ndarray:
    """Symmetric int8 quantisation, ties to even (onnxruntime's kernels)."""
    return np.clip(np.rint(np.asarray(x, np.float64) / np.float32(s)), -128, 127)


def conv_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """Stride-1 'same' convolution of ``x [C, H, W]`` in float64 (or int64 for ints)."""
    k = w.shape[2]
    xp = np.pad(x, ((0, 0), (k // 2, k // 2), (k // 2, k // 2)))
    y = np.einsum("chwij,ocij->ohw", sliding_window_view(xp, (k, k), axis=(1, 2)), w)
    return y if b is None else y + b.reshape(-1, 1, 1)


def int8_conv_ref(qx: np.ndarray, s_in: float, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """DLA INT8 conv: per-channel max weights, int32 bias, exact int accumulation -> float."""
    s_w = (np.abs(w).reshape(len(w), -1).max(1) / np.float32(127)).astype(np.float32)
    wq = np.clip(round_half_away_from_zero(w / s_w.reshape(-1, 1, 1, 1)), -127, 127)
    s_b = (np.float32(s_in) * s_w).astype(np.float64)
    bq = round_half_away_from_zero(b.astype(np.float64) / s_b)
    acc = conv_ref(qx.astype(np.int64), wq.astype(np.int64), bq.astype(np.int64))
    return acc * s_b.reshape(-1, 1, 1)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


# ------------------------------------------------------------------ a small YOLO-like network
def small_net(rng: np.random.Generator) -> tuple[Net, list[str]]:
    """conv+SiLU, a MaxPool branch, a residual Add, a Concat, an upsample and two heads."""
    n = Net(rng, [1, 3, 8, 8])
    a0 = n.silu(n.conv("c0", "images", 3, 8, 3), "a0")
    p0 = n.op("MaxPool", [a0], "pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    a1 = n.silu(n.conv("c1", a0, 8, 8), "a1")
    r = n.op("Add", [a1, p0], "add")
    cat = n.op("Concat", [r, a0], "cat", axis=1)
    scales = n.const("up.scales", np.array([1, 1, 2, 2], np.float32))
    up = n.op("Resize", [a1, "", scales], "up", mode="nearest")
    return n, [n.conv("head0", cat, 16, 21), n.conv("head1", up, 8, 5, bias=False)]


def small_net_ref(n: Net, s: dict[str, float], qin: np.ndarray) -> list[np.ndarray]:
    """The module docstring's semantics for :func:`small_net`, on int8 input ``q [3, 8, 8]``."""
    p = n.params

    def dq(t: str, x: np.ndarray) -> np.ndarray:
        return q(x, s[t]) * np.float32(s[t])

    def silu(pre: str, x: np.ndarray, name: str) -> np.ndarray:
        t = dq(pre, x)
        return dq(f"{name}.mul_out", t * dq(f"{name}.sig_out", sigmoid(t)))

    a0 = silu("c0_out", int8_conv_ref(qin, s["images"], p["c0.w"], p["c0.b"]), "a0")
    padded = np.pad(a0, ((0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    p0 = dq("pool_out", sliding_window_view(padded, (3, 3), axis=(1, 2)).max(axis=(3, 4)))
    qa0 = q(a0, s["a0.mul_out"])
    a1 = silu("c1_out", int8_conv_ref(qa0, s["a0.mul_out"], p["c1.w"], p["c1.b"]), "a1")
    r = dq("add_out", a1 + p0)
    cat = dq("cat_out", np.concatenate([r, a0]))
    up = dq("up_out", a1.repeat(2, axis=1).repeat(2, axis=2))
    h0 = int8_conv_ref(q(cat, s["cat_out"]), s["cat_out"], p["head0.w"], p["head0.b"])
    h1 = int8_conv_ref(q(up, s["up_out"]), s["up_out"], p["head1.w"], np.zeros(5, np.float32))
    return [q(h0, s["head0_out"]), q(h1, s["head1_out"])]


@pytest.fixture(scope="module")
def small() -> tuple[Net, list[str], dict[str, float]]:
    rng = np.random.default_rng(0)
    n, outs = small_net(rng)
    scales = calibrate(n.model(outs), rng.random((1, 3, 8, 8), dtype=np.float32))
    return n, outs, scales


# ------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def qdq_pair() -> dict[str, Any]:
    """``x -> Q -> DQ`` with the scale as an input, once int8 zero point 0, once uint8 128."""
    sessions = {}
    for name, zp in (("s8", np.int8(0)), ("u8", np.uint8(128))):
        zp_init = numpy_helper.from_array(np.array(zp), "zp")
        nodes = [
            helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"]),
        ]
        qtype = TensorProto.INT8 if name == "s8" else TensorProto.UINT8
        graph = helper.make_graph(
            nodes,
            name,
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, [None]),
                helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
            ],
            [
                helper.make_tensor_value_info("q", qtype, [None]),
                helper.make_tensor_value_info("y", TensorProto.FLOAT, [None]),
            ],
            [zp_init],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8  # readable by older onnxruntime releases too
        sessions[name] = session(model)
    return sessions


_scale = st.one_of(
    st.floats(2.0**-16, 1024.0, width=32),
    st.sampled_from([2.0**e for e in range(-12, 6)]),  # x / s exact: true ties
)


@settings(max_examples=100, deadline=None)
@given(
    scale=_scale,
    k=st.lists(st.integers(-400, 400), min_size=1, max_size=64),
    frac=st.lists(st.sampled_from([0.0, 0.5, -0.5, 0.4999999, 0.5000001, 0.25]), min_size=1),
    noise=st.lists(st.floats(-(2.0**20), 2.0**20, width=32), max_size=16),
)
def test_uint8_zero_point_128_is_int8_zero_point_0(
    qdq_pair: dict[str, Any], scale: float, k: list[int], frac: list[float], noise: list[float]
) -> None:
    """Value for value, ties and saturation included, onnxruntime quantises the same."""
    s = np.array(scale, dtype=np.float32)
    grid = (np.array(k) + np.resize(np.array(frac), len(k))) * s
    x = np.concatenate([grid, np.array(noise)]).astype(np.float32)
    q8, y8 = qdq_pair["s8"].run(None, {"x": x, "s": s})
    qu, yu = qdq_pair["u8"].run(None, {"x": x, "s": s})
    np.testing.assert_array_equal(qu.astype(np.int16) - 128, q8)
    np.testing.assert_array_equal(yu, y8)
    # and both are clamp(round_half_even(x / s), -128, 127)
    np.testing.assert_array_equal(q8, np.clip(np.rint(x / s), -128, 127))


def test_small_network_matches_numpy_reference(
    small: tuple[Net, list[str], dict[str, float]],
) -> None:
    """INT8 conv (per-channel weights, int32 bias), SiLU, MaxPool, Add, Concat, Resize and int8
    heads against an independent numpy model of the documented semantics. The two differ only
    where float rounding order moves a value across a rounding boundary: <= 1 step, rarely."""
    n, outs, scales = small
    g = build_int8_graph(n.model(outs), scales, [], heads="int8")
    eng = engine(g)
    rng = np.random.default_rng(1)
    for _ in range(3):
        canvas = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        hwc4 = quantize_hwc4(canvas, g.input_scale)
        qin = hwc4[:, :8, :3].transpose(2, 0, 1).astype(np.int64)
        heads = heads_of(g, eng.run(hwc4))
        got = [h / np.float32(s.scale) for h, s in zip(heads, g.outputs, strict=True)]
        want = small_net_ref(n, scales, qin)
        for a, b in zip(got, want, strict=True):
            diff = np.abs(np.rint(a) - b)
            assert diff.max() <= 1
            assert np.mean(diff == 0) >= 0.99


def test_int8_ops_run_as_integer_kernels(
    small: tuple[Net, list[str], dict[str, float]],
) -> None:
    """onnxruntime fuses every INT8 conv into QLinearConv with uint8 activations (and SiLU,
    Add, Concat into QLinear ops); with TensorRT-style int8 activations it does not."""
    n, outs, scales = small
    u8 = optimized_op_counts(build_int8_graph(n.model(outs), scales, [], heads="int8").model)
    assert u8.get("QLinearConv") == 4
    assert "Conv" not in u8
    assert u8.get("QLinearMul") == 2
    assert u8.get("QLinearSigmoid") == 2
    assert u8.get("QLinearAdd") == 1
    assert u8.get("QLinearConcat") == 1
    s8_graph = build_int8_graph(n.model(outs), scales, [], heads="int8", activation_dtype="int8")
    s8 = optimized_op_counts(s8_graph.model)
    assert s8.get("Conv") == 4
    assert "QLinearConv" not in s8
    fp16 = optimized_op_counts(build_int8_graph(n.model(outs), scales, [], heads="fp16").model)
    assert fp16.get("QLinearConv") == 2  # the two head convs run in float on fp16 values
    assert fp16.get("Conv", 0) + fp16.get("FusedConv", 0) == 2


def test_uint8_and_int8_graphs_compute_the_same(
    small: tuple[Net, list[str], dict[str, float]],
) -> None:
    """Both activation encodings, run as reference (unfused) arithmetic: identical heads."""
    n, outs, scales = small
    u8 = build_int8_graph(n.model(outs), scales, [], heads="int8")
    s8 = build_int8_graph(n.model(outs), scales, [], heads="int8", activation_dtype="int8")
    qin = np.random.default_rng(2).integers(-128, 128, (1, 3, 8, 8)).astype(np.int8)
    got_u8 = session(u8.model, optimize=False).run(None, {"images": (qin.view(np.uint8) ^ 0x80)})
    got_s8 = session(s8.model, optimize=False).run(None, {"images": qin})
    for a, b in zip(got_u8, got_s8, strict=True):
        np.testing.assert_array_equal(a.astype(np.int16) - 128, b)


def test_bias_is_int32_with_the_exact_accumulator_scale(
    small: tuple[Net, list[str], dict[str, float]],
) -> None:
    n, outs, scales = small
    g = build_int8_graph(n.model(outs), scales, [], heads="int8")
    inits = {i.name: numpy_helper.to_array(i) for i in g.model.graph.initializer}
    s_w = inits["c0/weight/scale"]
    w = n.params["c0.w"]
    np.testing.assert_array_equal(s_w, np.abs(w).reshape(8, -1).max(1) / np.float32(127))
    assert inits["c0/weight/int8"].dtype == np.int8
    assert np.abs(inits["c0/weight/int8"]).max() == 127
    assert inits["c0/bias/int32"].dtype == np.int32
    np.testing.assert_array_equal(inits["c0/bias/scale"], np.float32(scales["images"]) * s_w)


def fp16_net(rng: np.random.Generator, offset: float = 1000.0, size: int = 4) -> Net:
    """One 1x1 conv ``y``; with ``offset`` 1000 its outputs (fp16 spacing 0.5) visibly move."""
    n = Net(rng, [1, 3, size, size])
    w = (rng.random((4, 3, 1, 1)) + 0.3).astype(np.float32)
    b = (offset + rng.random(4)).astype(np.float32)
    inputs = ["images", n.const("c.w", w), n.const("c.b", b)]
    n.nodes.append(helper.make_node("Conv", inputs, ["y"], name="c"))
    return n


def fp16_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fp16 inputs, weights and bias, wide accumulation, fp16 output."""

    def h(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float16).astype(np.float32)

    return h(conv_ref(h(x), h(w), h(b)).astype(np.float32))


def run_on_random_canvas(g: EngineGraph, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The engine's logical heads and the dequantised ``[C, H, W]`` input it saw."""
    _, h, w = g.input_shape
    canvas = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    hwc4 = quantize_hwc4(canvas, g.input_scale)
    x = dequantize_hwc4(hwc4, g.input_scale, w).transpose(2, 0, 1)
    return heads_of(g, engine(g).run(hwc4)), x


def test_fp16_head_rounds_inputs_weights_and_outputs() -> None:
    n = fp16_net(np.random.default_rng(3))
    g = build_int8_graph(n.model(["y"]), {"images": 1 / 127}, [], heads="fp16")
    assert g.fp16_nodes == ("c",)
    assert g.outputs[0].dtype == "fp16"
    (got,), x = run_on_random_canvas(g, 4)
    want16 = fp16_ref(x, n.params["c.w"], n.params["c.b"])
    want32 = conv_ref(x.astype(np.float64), n.params["c.w"], n.params["c.b"])
    # Equal to the fp16 model but where fp32 summation order crosses an fp16 rounding boundary.
    assert np.mean(got == want16) >= 0.95
    assert np.abs(got - want16).max() <= 0.5
    assert np.abs(got - want32).max() >= 0.1  # fp32 arithmetic would give other values


def test_interior_fp16_node_read_in_int8_and_fp16_output_in_int8() -> None:
    """FP16 conv ``c`` feeds INT8 conv ``d`` and is itself an int8 head: both read Q(fp16 y),
    which differs from Q(fp32 y) here (so the engine is seen to round to fp16)."""
    rng = np.random.default_rng(5)
    n = fp16_net(rng, offset=0.0, size=16)
    w_d = rng.normal(0, 0.5, (2, 4, 1, 1)).astype(np.float32)
    n.nodes.append(helper.make_node("Conv", ["y", n.const("d.w", w_d)], ["z"], name="d"))
    scales = {"images": 1 / 127, "y": 4.0 / 127, "z": 6.0 / 127}
    g = build_int8_graph(n.model(["z", "y"]), scales, ["c"], heads="int8")
    assert (g.fp16_nodes, g.int8_nodes) == (("c",), ("d",))
    (z, y), x = run_on_random_canvas(g, 6)
    y16 = fp16_ref(x, n.params["c.w"], n.params["c.b"])
    y32 = conv_ref(x.astype(np.float64), n.params["c.w"], n.params["c.b"])
    qy = q(y16, scales["y"])
    assert np.any(qy != q(y32, scales["y"]))
    np.testing.assert_array_equal(np.rint(y / np.float32(scales["y"])), qy)
    want_z = q(int8_conv_ref(qy, scales["y"], w_d, np.zeros(2, np.float32)), scales["z"])
    diff = np.abs(np.rint(z / np.float32(scales["z"])) - want_z)
    assert diff.max() <= 1
    assert np.mean(diff == 0) >= 0.99


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("drop", "fp16", "heads", "message"),
    [
        ("images", [], "int8", "input 'images' has no INT8 scale"),
        ("c0_out", [], "int8", r"'c0'.*output 'c0_out' has no INT8 scale"),
        ("a0.mul_out", [], "int8", r"'a0.mul_out' .*no INT8 scale but node 'pool'"),
        ("cat_out", [], "int8", r"'cat_out' .*no INT8 scale but node 'head0' \(Conv\)"),
        ("head0_out", [], "int8", "head 'head0_out' has no output scale"),
        (None, ["nope"], "int8", r"fp16_nodes names no node.*'nope'"),
    ],
)
def test_missing_scales_and_unknown_names_are_clear_errors(
    small: tuple[Net, list[str], dict[str, float]],
    drop: str | None,
    fp16: list[str],
    heads: Any,
    message: str,
) -> None:
    n, outs, scales = small
    partial = {k: v for k, v in scales.items() if k != drop}
    with pytest.raises(EmulationGraphError, match=message):
        build_int8_graph(n.model(outs), partial, fp16, heads=heads)


def test_fp16_nodes_and_heads_need_no_scales(
    small: tuple[Net, list[str], dict[str, float]],
) -> None:
    n, outs, scales = small
    no_head = {k: v for k, v in scales.items() if k not in ("head0_out", "head1_out")}
    g = build_int8_graph(n.model(outs), no_head, [], heads="fp16")
    assert [s.dtype for s in g.outputs] == ["fp16", "fp16"]
    # an FP16 conv (and its SiLU) need no output scale; their INT8 readers use a1's
    no_c1 = {k: v for k, v in scales.items() if k != "c1_out"}
    g = build_int8_graph(n.model(outs), no_c1, ["c1", "a1.sig", "a1.mul"], heads="int8")
    assert {"c1", "a1.sig", "a1.mul"} <= set(g.fp16_nodes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_nodes": ["nope"]}, "head_nodes names no node"),
        ({"heads": "int4"}, "heads must be"),
        ({"activation_dtype": "int16"}, "activation_dtype"),
    ],
)
def test_bad_options(
    small: tuple[Net, list[str], dict[str, float]], kwargs: dict[str, Any], message: str
) -> None:
    n, outs, scales = small
    args: dict[str, Any] = {"heads": "int8", **kwargs}
    with pytest.raises(EmulationGraphError, match=message):
        build_int8_graph(n.model(outs), scales, [], **args)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale_values(small: tuple[Net, list[str], dict[str, float]], bad: float) -> None:
    n, outs, scales = small
    with pytest.raises(EmulationGraphError, match="finite and positive"):
        build_int8_graph(n.model(outs), {**scales, "c1_out": bad}, [], heads="int8")


def test_unsupported_models() -> None:
    n = fp16_net(np.random.default_rng(8))
    scales = {"images": 1 / 127, "y": 1.0}
    with pytest.raises(EmulationGraphError, match="opset 12"):
        build_int8_graph(n.model(["y"], opset=12), scales, [], heads="int8")
    g = Net(np.random.default_rng(9), [1, 3, 4, 4])
    flat = g.op("Flatten", ["images"], "flat")
    g.nodes.append(
        helper.make_node(
            "Gemm", [flat, g.const("w", np.ones((48, 2), np.float32))], ["y"], name="fc"
        )
    )
    with pytest.raises(EmulationGraphError, match=r"'fc' \(Gemm\) has no INT8 emulation"):
        build_int8_graph(
            g.model(["y"]), {"images": 0.1, "flat_out": 0.1, "y": 1.0}, [], heads="int8"
        )


# ------------------------------------------------------------------ end to end against torch
class DlaSiLU(torch.nn.Module):
    """SiLU as the DLA computes it from the scales: the conv output in INT8 at its scale, the
    Sigmoid output in INT8 at 1/127 (a torch reference, independent of onnxruntime)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(np.float32(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.clamp(torch.round(x / self.scale), -128, 127) * self.scale
        return t * torch.clamp(torch.round(torch.sigmoid(t) * 127), -128, 127) / 127


def _module_of(tensor: str, suffix: str) -> str:
    """'/model.2/m/m.0/cv1/conv/Conv_output_0' -> 'model.2.m.0.cv1' (torch export scopes)."""
    scope = tensor[1 : -len(suffix)]
    return re.sub(r"(\w+)/\1\.(\d+)", r"\1.\2", scope).replace("/", ".")


@pytest.fixture(scope="module")
def qat_yolo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """YOLOv5n (random weights, 3 classes) at 64x64 through QAT quantize + calibrate, export
    and translate; also its FP32 twin (BN folded).

    With default BatchNorm settings a random YOLOv5 is either dead (a few warm-up batches barely
    move the running statistics; the heads do not depend on the image) or, with exact statistics,
    chaotic (one rounding flip in an early layer fans out until the heads differ by tens of
    steps, between any two implementations, even torch float32 vs float64). Exact statistics
    (momentum None) and BN gamma 0.3 keep it input dependent and tame enough to compare."""
    from prep import qat
    from prep.export import export_onnx
    from prep.model import YOLOv5
    from prep.translate import translate

    torch.manual_seed(0)
    model = YOLOv5("n", 3)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None
            torch.nn.init.constant_(m.weight, 0.3)
    gen = torch.Generator().manual_seed(1)
    qat.warm_up_batchnorm(model, [torch.rand(4, 3, 64, 64, generator=gen) for _ in range(4)])
    fp32 = copy.deepcopy(model).eval().fuse()
    qmodel, _ = qat.quantize(model.eval(), qat.QATConfig())
    qat.calibrate(qmodel, [torch.rand(2, 3, 64, 64, generator=gen) for _ in range(2)])
    path = tmp_path_factory.mktemp("qat") / "qat.onnx"
    export_onnx(qmodel, path, 64)
    result = translate(path)
    return {
        "fp32": fp32,
        "qmodel": qmodel,
        "ptq": result.model,
        "scales": result.int8_tensor_scales,
        "fp16_nodes": result.fp16_nodes,
    }


def _images(g: EngineGraph, count: int, seed: int) -> list[tuple[np.ndarray, Any]]:
    """Fresh random canvases as DLA_HWC4 bytes and as the dequantised torch input."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        hwc4 = quantize_hwc4(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), g.input_scale)
        x = torch.from_numpy(dequantize_hwc4(hwc4, g.input_scale, 64)).permute(2, 0, 1)[None]
        out.append((hwc4, x))
    return out


def _steps(
    got: list[np.ndarray], want: Sequence[torch.Tensor], g: EngineGraph, scales: dict[str, float]
) -> np.ndarray:
    """``|got - want|`` in units of each head's output scale, all heads flattened."""
    return np.concatenate(
        [
            (np.abs(a - w[0].detach().numpy()) / np.float32(scales[s.name])).ravel()
            for a, w, s in zip(got, want, g.outputs, strict=True)
        ]
    )


@pytest.mark.slow
def test_int8_heads_agree_with_torch_fake_quant(qat_yolo: dict[str, Any]) -> None:
    """Engine vs the QAT model, errors in head quantisation steps, on fresh random images.

    * vs the plain fake-quant QAT model: mean <= 1.5 steps, >= 95% within 3 steps, and no more
      than twice (+0.25 step) the fake-quant model's own distance from FP32 (the INT8 noise
      floor of this network). The fake-quant model quantises conv inputs only; the DLA also
      stores each conv output (at its SiLU's scale, clipping large negative inputs) and each
      Sigmoid (at 1/127) in INT8, and quantises biases to int32 (measured on the trained demo
      model, YOLOv5n 320: mean 0.2-0.5 step, >= 99% within 3 steps);
    * vs a torch reference of those DLA semantics (the QAT model with :class:`DlaSiLU`):
      mean <= 0.75 step, >= 99.9% within 3 steps.
    """
    scales = qat_yolo["scales"]
    g = build_int8_graph(qat_yolo["ptq"], scales, qat_yolo["fp16_nodes"], heads="int8")
    eng = engine(g)
    qmodel, fp32 = qat_yolo["qmodel"], qat_yolo["fp32"]
    dla = copy.deepcopy(qmodel)
    suffix = "/conv/Conv_output_0"
    replaced = [n for n in scales if n.endswith(suffix)]
    for name in replaced:
        dla.get_submodule(_module_of(name, suffix)).act = DlaSiLU(scales[name])
    assert len(replaced) == 57
    runs = []
    for hwc4, x in _images(g, 2, seed=11):
        got = heads_of(g, eng.run(hwc4))
        with torch.no_grad():
            fake_out = qmodel(x)
            fake = _steps(got, fake_out, g, scales)
            floor = _steps([h[0].numpy() for h in fake_out], fp32(x), g, scales)
            exact = _steps(got, dla(x), g, scales)
        assert fake.mean() <= 1.5
        assert np.mean(fake <= 3) >= 0.95
        assert fake.mean() <= 2 * floor.mean() + 0.25
        assert exact.mean() <= 0.75
        assert np.mean(exact <= 3) >= 0.999
        runs.append(got)
    # The heads depend on the image: the agreement above is not about constants.
    moved = _steps(runs[0], [torch.from_numpy(h)[None] for h in runs[1]], g, scales)
    assert moved.mean() >= 1


@pytest.mark.slow
def test_fp16_heads_agree_with_torch(qat_yolo: dict[str, Any]) -> None:
    """heads='fp16': head convs on fp16 inputs/weights, fp16 output, no output quantisation;
    vs the DLA-semantics torch model with fp16 head convs: mean <= 0.75 int8 step."""
    scales = qat_yolo["scales"]
    g = build_int8_graph(qat_yolo["ptq"], scales, qat_yolo["fp16_nodes"], heads="fp16")
    assert [s.dtype for s in g.outputs] == ["fp16"] * 3
    eng = engine(g)
    dla = copy.deepcopy(qat_yolo["qmodel"])
    suffix = "/conv/Conv_output_0"
    for name in (n for n in scales if n.endswith(suffix)):
        dla.get_submodule(_module_of(name, suffix)).act = DlaSiLU(scales[name])

    def h(t: torch.Tensor) -> torch.Tensor:
        return t.half().float()

    def fp16_head(conv: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            xq = h(conv.input_quantizer(x))
            return h(torch.nn.functional.conv2d(xq, h(conv.weight), h(conv.bias)))

        return run

    detect = dla.model[24]
    detect.forward = lambda xs: [fp16_head(c)(x) for c, x in zip(detect.m, xs, strict=True)]
    for hwc4, x in _images(g, 2, seed=12):
        got = heads_of(g, eng.run(hwc4))
        with torch.no_grad():
            err = _steps(got, dla(x), g, scales)
        assert err.mean() <= 0.75
        assert np.mean(err <= 2) >= 0.999
