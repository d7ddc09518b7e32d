"""Small ONNX graphs built in code for the Q/DQ translator tests.

``GraphBuilder(qdq=False)`` drops every quantizer, so one builder function gives both the Q/DQ
(QAT) model and its float twin: the independent reference the translated model is run against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import onnx
from onnx import helper, numpy_helper

ZeroPointStyle = Literal["initializer", "constant_node", "cast", "absent"]


class GraphBuilder:
    """Builds an opset-13 ONNX graph the way the legacy torch exporter lays out Q/DQ."""

    def __init__(
        self,
        *,
        qdq: bool = True,
        constant_nodes: bool = False,
        zero_point_style: ZeroPointStyle = "initializer",
        opset: int = 13,
    ) -> None:
        self.qdq = qdq
        self.constant_nodes = constant_nodes
        self.zero_point_style = zero_point_style
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []

    def input(self, name: str, shape: Sequence[int]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))
        return name

    def output(self, name: str, rank: int = 4) -> None:
        shape = [None] * rank  # unknown sizes; shape inference fills them in
        self.outputs.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))

    def const(self, name: str, value: Any, *, as_node: bool | None = None) -> str:
        """An initializer, or a ``Constant`` node output (as modelopt's exporter emits)."""
        array = np.asarray(value)
        if self.constant_nodes if as_node is None else as_node:
            tensor = numpy_helper.from_array(array, name=f"{name}_value")
            self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
        else:
            self.initializers.append(numpy_helper.from_array(array, name=name))
        return name

    def node(
        self, op: str, inputs: Sequence[str], name: str, output: str | None = None, **attrs: Any
    ) -> str:
        out = output or f"{name}_output_0"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def qdq_pair(
        self,
        x: str,
        scale: Any,
        name: str,
        *,
        zero_point: Any = 0,
        zero_point_dtype: type = np.int8,
        dq_scale: Any = None,
        axis: int | None = None,
        output: str | None = None,
    ) -> str:
        """``x -> QuantizeLinear -> DequantizeLinear``; returns the DQ output (or ``x``)."""
        if not self.qdq:
            return x
        scale_arr = np.asarray(scale, dtype=np.float32)
        zp: np.ndarray = np.full(scale_arr.shape, zero_point).astype(zero_point_dtype)
        s = self.const(f"{name}/scale", scale_arr)
        s_dq = s if dq_scale is None else self.const(f"{name}/dq_scale", np.float32(dq_scale))
        if self.zero_point_style == "absent":
            zp_name = ""
        elif self.zero_point_style == "cast":
            # fold=False modelopt exports: Cast(Constant(float zeros), to=INT8 or UINT8)
            raw = self.const(f"{name}/zp_float", zp.astype(np.float32), as_node=True)
            to = helper.np_dtype_to_tensor_dtype(np.dtype(zero_point_dtype))
            zp_name = self.node("Cast", [raw], f"{name}/Cast", to=to)
        else:
            zp_name = self.const(
                f"{name}/zero_point", zp, as_node=self.zero_point_style == "constant_node"
            )
        kw: dict[str, Any] = {} if axis is None else {"axis": axis}
        q_inputs = [x, s] + ([zp_name] if zp_name else [])
        dq_inputs = [f"{name}/q"] + ([s_dq, zp_name] if zp_name else [s_dq])
        self.nodes.append(
            helper.make_node("QuantizeLinear", q_inputs, [f"{name}/q"], name=f"{name}/Q", **kw)
        )
        out = output or f"{name}/dq"
        self.nodes.append(
            helper.make_node("DequantizeLinear", dq_inputs, [out], name=f"{name}/DQ", **kw)
        )
        return out

    def weight(self, name: str, w: np.ndarray, *, scales: Any = None) -> str:
        """A weight, per-channel Q/DQ'd (axis 0) with max-calibrated scales unless given."""
        if not self.qdq:
            return self.const(name, w, as_node=False)
        if scales is None:
            scales = max_scales(w)
        tensor = self.const(name, w, as_node=self.constant_nodes)
        return self.qdq_pair(tensor, scales, f"{name}_quantizer", axis=0)

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, "test", self.inputs, self.outputs, initializer=self.initializers
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 7  # what torch's opset-13 export writes; TensorRT 8.6 parses it
        onnx.checker.check_model(model)
        return model


def max_scales(w: np.ndarray) -> np.ndarray:
    """Per-output-channel max(|w|)/127, as a max-calibrated weight quantizer stores it."""
    return (np.abs(w).reshape(w.shape[0], -1).max(axis=1) / 127.0).astype(np.float32)


def conv(
    b: GraphBuilder,
    x: str,
    w: np.ndarray,
    bias: np.ndarray | None,
    name: str,
    output: str | None = None,
) -> str:
    """A 'same'-padded Conv with a per-channel Q/DQ'd weight."""
    inputs = [x, b.weight(f"{name}.weight", w)]
    if bias is not None:
        inputs.append(b.const(f"{name}.bias", bias, as_node=False))
    pad = w.shape[-1] // 2
    return b.node("Conv", inputs, f"{name}/Conv", output, pads=[pad] * 4)


def silu(b: GraphBuilder, x: str, name: str) -> str:
    sig = b.node("Sigmoid", [x], f"{name}/Sigmoid")
    return b.node("Mul", [x, sig], f"{name}/Mul")


# Scales of the activation quantizers in ``conv_net`` (chosen, not calibrated: the translator
# must copy them, whatever they are).
NET_SCALES = {
    "images": 0.0079,
    "/act1/Mul_output_0": 0.031,
    "/cat/Concat_output_0": 0.047,
    "/head/Conv_output_0": 0.21,
}


def conv_net_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    return {
        "c1.w": w(8, 3, 3, 3),
        "c1.b": w(8),
        "c2.w": w(8, 8, 1, 1),
        "c2.b": w(8),
        "head.w": w(6, 16, 1, 1),
        "head.b": w(6),
        "aux.w": w(4, 16, 3, 3),
    }


def conv_net(
    weights: dict[str, np.ndarray],
    *,
    qdq: bool = True,
    constant_nodes: bool = False,
    zero_point_style: ZeroPointStyle = "initializer",
) -> onnx.ModelProto:
    """images -> Conv+SiLU (A) -> Conv+SiLU -> MaxPool -> Concat(A, .) (C) -> two heads.

    Head ``s8`` = Conv(C) with an output Q/DQ (the DQ output is the graph output); head ``s16``
    = Conv(C) without one. Activation Q/DQ on ``images``, ``A`` (before c2) and ``C``; every
    Conv weight per-channel Q/DQ'd.
    """
    b = GraphBuilder(qdq=qdq, constant_nodes=constant_nodes, zero_point_style=zero_point_style)
    x = b.input("images", [1, 3, 12, 12])
    x = b.qdq_pair(x, NET_SCALES["images"], "/c1/input_quantizer")
    a = silu(b, conv(b, x, weights["c1.w"], weights["c1.b"], "/c1"), "/act1")
    a_q = b.qdq_pair(a, NET_SCALES["/act1/Mul_output_0"], "/c2/input_quantizer")
    c2 = silu(b, conv(b, a_q, weights["c2.w"], weights["c2.b"], "/c2"), "/act2")
    pool = b.node("MaxPool", [c2], "/pool/MaxPool", kernel_shape=[3, 3], pads=[1] * 4)
    cat = b.node("Concat", [a, pool], "/cat/Concat", axis=1)
    cat_q = b.qdq_pair(cat, NET_SCALES["/cat/Concat_output_0"], "/head/input_quantizer")
    head = conv(b, cat_q, weights["head.w"], weights["head.b"], "/head", None if qdq else "s8")
    b.qdq_pair(head, NET_SCALES["/head/Conv_output_0"], "/head/output_quantizer", output="s8")
    b.output("s8")
    cat_q2 = b.qdq_pair(cat, NET_SCALES["/cat/Concat_output_0"], "/aux/input_quantizer")
    b.node("Conv", [cat_q2, b.weight("aux.weight", weights["aux.w"])], "/aux/Conv", "s16")
    b.output("s16")
    return b.model()


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``model`` on onnxruntime's CPU provider, in graph-output order."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return [np.asarray(o) for o in session.run(None, feeds)]
