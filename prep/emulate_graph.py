"""The emulated DLA core's INT8 graph, built from the Q/DQ translator's outputs.

``build_int8_graph`` takes the PTQ ONNX model (no Q/DQ, FP32 weights), the per-tensor INT8 scales
and the FP16 node list (``prep.translate``) and writes the arithmetic a TensorRT DLA build of them
performs back into the graph as QuantizeLinear/DequantizeLinear (Q/DQ) nodes, which onnxruntime
fuses into its integer CPU kernels. ``dlad.devices.int8_engine.Int8Engine`` runs the result.

**Semantics emulated** (``s`` = a scale; every scale is used as float32, as TensorRT does):

* Every node is INT8 unless it is in ``fp16_nodes`` (or is a head node and ``heads="fp16"``).
* The graph input holds the DLA's input bytes: int8 ``q`` (quantised with the ``images`` scale by
  ``dlad.imaging.pre.quantize_hwc4``), carried as uint8 ``q + 128``, then dequantised.
* A tensor produced by an INT8 node that has a scale is stored in INT8: ``q = clamp(round(x / s),
  -128, 127)``, read back as ``q * s``. INT8 ``Conv`` outputs must have a scale. A tensor without
  one (produced by a non-Conv INT8 node) is stored in FP16 and only FP16 nodes may read it.
* INT8 ``Conv``: weights per output channel, symmetric, ``s_w = max|w| / 127`` (an all-zero
  channel takes the largest scale of its siblings, or 1/127), ``w_q = clamp(round_half_away(w /
  s_w), -127, 127)``; bias ``int32 round_half_away(b / (s_in * s_w))`` (saturated to int32) behind
  a DequantizeLinear whose scale is exactly ``float32(s_in) * float32(s_w)``, as TensorRT folds it.
  onnxruntime fuses ``DQ(x), DQ(w), DQ(b) -> Conv -> Q`` into ``QLinearConv``: an int32
  accumulation requantised by ``s_in * s_w / s_out``.
* Other INT8 ops (Sigmoid, Mul, Add, Concat, MaxPool, Resize, ...) compute on dequantised
  inputs and quantise their output (onnxruntime fuses most into QLinearSigmoid, QLinearMul,
  QLinearAdd, QLinearConcat or runs them on uint8 directly); inputs with different scales are
  requantised to the output scale.
* An FP16 node reads every activation input as ``fp16(value)`` (Cast to FLOAT16 and back;
  an INT8 input becomes ``fp16(q * s)``, TensorRT's int8->fp16 reformat), uses float constant
  inputs (weights, bias) rounded to fp16 (except Resize/Upsample geometry), computes in fp32 and
  rounds its output to fp16 (Cast pair): fp16 storage with a wide accumulator. An INT8 reader of
  an FP16 node's output quantises the fp16 value with the tensor's scale.
* Outputs: ``heads="int8"``: ``QuantizeLinear`` with the head's scale, uint8 ``q + 128``;
  ``heads="fp16"``: the head nodes run in FP16 and the output is ``float16``.

**Rounding.** Rounding done here (weights, bias) is half away from zero, as on the DLA. Activation
rounding happens in onnxruntime's kernels, which round half to even; the two differ only on exact
ties of ``x / s``. INT8 activations use uint8 with zero point 128 instead of int8 with zero point
0 (``activation_dtype="uint8"``, the default): ``q_u8 = q_s8 + 128`` for every value, saturation
included, because 128 is an integer, and onnxruntime's x86 INT8 kernels are fast only for uint8
activations (int8 activations are not fused and run slower than fp32; ``"int8"`` builds that
TensorRT-style graph for comparison). Weights stay int8 at zero point 0, as TensorRT stores them;
onnxruntime's uint8 x int8 kernels saturate on x86 CPUs without VNNI (``vpmaddubsw`` adds pairs
of products in int16), so the engine re-encodes them as uint8 at zero point 128 on such hosts,
which is exact everywhere (``dlad/devices/int8_layout.py``; the integers are the same either way).

**The same placement, written for TensorRT** (``target="tensorrt"``; ``prep.explicit_qdq``): the
graph above is what a TensorRT >= 11 explicit-quantization build is given, with three changes of
form and none of placement. INT8 tensors are int8 at zero point 0 (``activation_dtype="int8"``);
an FP16 node's tensors are really FP16 (its activation inputs ``Cast`` to FLOAT16, its float
constants stored as float16, its outputs float16, strongly typed), and an INT8 reader of an FP16
tensor gets ``Cast`` to FLOAT before its ``QuantizeLinear``; an INT8 Conv's bias stays the float
bias (TensorRT quantises it to int32 with ``s_in * s_w`` itself). ``input_dtype="float16"`` (the
GPU engine) takes an FP16 input and quantises it with the input's scale first. Every rule of
which tensor is INT8, which node is FP16 and which scale applies is the one above, in this
module, for both targets.

No onnxruntime is needed to build a graph; :func:`optimized_op_counts` uses it to show which
kernels a graph actually runs on.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dlad.devices.int8_engine import OutputSpec
from dlad.imaging.pre import round_half_away_from_zero
from prep.onnx_static import head_nodes as heads_of

if TYPE_CHECKING:
    import onnx

__all__ = [
    "EmulationGraphError",
    "EngineGraph",
    "build_int8_graph",
    "optimized_op_counts",
]

HeadPrecision = Literal["int8", "fp16"]
ActivationDType = Literal["uint8", "int8"]
GraphTarget = Literal["emulated", "tensorrt"]
InputDType = Literal["int8", "float16"]
QuantizedWeights = Mapping[str, tuple[np.ndarray, np.ndarray]]
"""Conv node name -> (int8 weights, per-output-channel float32 scales)."""

MIN_OPSET = 13  # per-channel DequantizeLinear (axis) needs opset 13
_WEIGHTED_OPS = frozenset({"ConvTranspose", "Gemm", "MatMul"})
_GEOMETRY_INPUTS: dict[str, frozenset[int]] = {
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
}
"""Float constant inputs that are geometry (roi, scales), not data: never rounded to fp16."""

_INT32_MAX = 2**31 - 1


class EmulationGraphError(ValueError):
    """The PTQ model and its precision config cannot be emulated; the message names the node or
    tensor at fault and what would fix it."""


@dataclass(frozen=True)
class EngineGraph:
    """The engine's graph and its I/O description.

    Attributes:
        model: the ONNX model (passes the ONNX checker): input ``input_name`` uint8 (or int8,
            see ``activation_dtype``) ``[1, C, H, W]``; outputs as ``outputs`` says.
        input_name: the graph input's name (the PTQ model's).
        input_scale: the input's INT8 scale.
        input_shape: ``(C, H, W)``.
        outputs: one spec per graph output, in graph order.
        int8_nodes: names of the nodes emulated in INT8.
        fp16_nodes: names of the nodes emulated in FP16.
        activation_dtype: ``"uint8"`` (zero point 128) or ``"int8"`` (zero point 0).
    """

    model: onnx.ModelProto
    input_name: str
    input_scale: float
    input_shape: tuple[int, int, int]
    outputs: list[OutputSpec]
    int8_nodes: tuple[str, ...] = ()
    fp16_nodes: tuple[str, ...] = ()
    activation_dtype: ActivationDType = "uint8"

    def to_bytes(self) -> bytes:
        """The serialized model (what ``Int8Engine`` takes)."""
        return bytes(self.model.SerializeToString())


# ----------------------------------------------------------------------------- helpers
def _default_opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _static_dims(vi: Any) -> list[int] | None:
    dims = vi.type.tensor_type.shape.dim if vi.type.tensor_type.HasField("shape") else None
    if dims is None or any(not d.HasField("dim_value") for d in dims):
        return None
    return [int(d.dim_value) for d in dims]


def _weight_scales(w: np.ndarray) -> np.ndarray:
    """Per-output-channel ``max|w| / 127`` (float32); all-zero channels borrow a sibling's."""
    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1).astype(np.float32)
    scales = amax / np.float32(127.0)
    fallback = scales.max() if scales.max() > 0 else np.float32(1.0 / 127.0)
    return np.where(scales > 0, scales, fallback).astype(np.float32)


@dataclass
class _Tensor:
    """How one activation tensor of the PTQ model is represented in the engine graph."""

    name: str
    producer: str | None  # None: the graph input
    int8: bool  # stored as INT8 (else FP16)
    raw: str  # the producer's float output in the new graph
    half: bool = False  # raw is typed FLOAT16 (an FP16 node's output, target "tensorrt")
    views: dict[str, str] = field(default_factory=dict)  # memoised "int8"/"fp16" readers


class _Builder:
    def __init__(
        self,
        model: onnx.ModelProto,
        scales: Mapping[str, float],
        activation_dtype: ActivationDType,
        target: GraphTarget = "emulated",
    ) -> None:
        from onnx import TensorProto

        self.model = model
        self.scales = scales
        self.trt = target == "tensorrt"
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.taken: set[str] = set()
        for node in model.graph.node:
            self.taken.update(node.input)
            self.taken.update(node.output)
            self.taken.add(node.name)
        self.taken.update(i.name for i in model.graph.initializer)
        self.taken.update(i.name for i in model.graph.input)
        unsigned = activation_dtype == "uint8"
        self.q_type = TensorProto.UINT8 if unsigned else TensorProto.INT8
        zp = np.array(128, np.uint8) if unsigned else np.array(0, np.int8)
        self.zero_point = self.const("activation_zero_point", zp)
        self.tensors: dict[str, _Tensor] = {}

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def const(self, base: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.fresh(base)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, order="C"), name))
        return name

    def add(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(
            helper.make_node(op, inputs, [output], name=self.fresh(f"{output}/{op}"), **attrs)
        )
        return output

    def scale(self, t: _Tensor, reader: str) -> str:
        s = self.scales.get(t.name)
        if s is None:
            src = "the graph input" if t.producer is None else f"the output of {t.producer!r}"
            raise EmulationGraphError(
                f"tensor {t.name!r} ({src}) has no INT8 scale but {reader} needs it in INT8: "
                f"give it a scale, or list {reader} in fp16_nodes"
            )
        key = f"scale:{t.name}"
        if key not in t.views:
            t.views[key] = self.const(f"{t.name}/scale", np.array(s, dtype=np.float32))
        return t.views[key]

    def quantize(self, t: _Tensor, src: str, reader: str, output: str | None = None) -> str:
        """``Q(src)`` with ``t``'s scale: the int8 (u8 + 128) representation of ``t``."""
        out = output or self.fresh(f"{t.name}/q")
        return self.add("QuantizeLinear", [src, self.scale(t, reader), self.zero_point], out)

    def int8_read(self, t: _Tensor, reader: str) -> str:
        """A float tensor holding ``q * s``: what an INT8 node reads for ``t``."""
        if "int8" not in t.views:
            q = t.raw if t.producer is None else self.quantize(t, self.q_source(t, reader), reader)
            out = self.fresh(f"{t.name}/dq")
            self.add("DequantizeLinear", [q, self.scale(t, reader), self.zero_point], out)
            t.views["int8"] = out
            t.views["q"] = q
        return t.views["int8"]

    def q_source(self, t: _Tensor, reader: str) -> str:
        """The float32 tensor a ``QuantizeLinear`` of ``t`` reads (the graph input excepted)."""
        from onnx import TensorProto

        if t.int8:
            return t.raw
        if not t.half:
            return self.fp16_read(t, reader)
        if "fp32" not in t.views:  # an FP16 tensor read in INT8: Cast, then the fp32 scale
            out = self.fresh(f"{t.name}/fp32")
            t.views["fp32"] = self.add("Cast", [t.raw], out, to=TensorProto.FLOAT)
        return t.views["fp32"]

    def fp16_read(self, t: _Tensor, reader: str) -> str:
        """What an FP16 node reads for ``t``: fp16-representable values, carried as float32
        (target ``"emulated"``) or as a FLOAT16 tensor (``"tensorrt"``)."""
        from onnx import TensorProto

        if "fp16" not in t.views:
            if t.half:
                t.views["fp16"] = t.views["half"] = t.raw
                return t.raw
            src = self.int8_read(t, reader) if t.int8 else t.raw
            half = self.add("Cast", [src], self.fresh(f"{t.name}/fp16"), to=TensorProto.FLOAT16)
            t.views["fp16"] = (
                half
                if self.trt
                else self.add("Cast", [half], self.fresh(f"{t.name}/fp32"), to=TensorProto.FLOAT)
            )
            t.views["half"] = half
        return t.views["fp16"]


# ----------------------------------------------------------------------------- entry points
def build_int8_graph(
    ptq: onnx.ModelProto | str | os.PathLike[str],
    scales: Mapping[str, float],
    fp16_nodes: Iterable[str],
    *,
    heads: HeadPrecision,
    head_nodes: Sequence[str] | None = None,
    activation_dtype: ActivationDType | None = None,
    target: GraphTarget = "emulated",
    input_dtype: InputDType = "int8",
    quantized_weights: QuantizedWeights | None = None,
) -> EngineGraph:
    """Build the emulated core's graph, or its TensorRT form (semantics in the module docstring).

    Args:
        ptq: the translator's Q/DQ-free model (``ModelProto``, left unmodified, or a path);
            one ``[1, C, H, W]`` float input with C in {1, 3, 4}, static ``[1, C, H, W]``
            outputs, default-domain opset >= 13.
        scales: tensor name -> INT8 scale (``int8_tensor_scales``).
        fp16_nodes: node names to run in FP16 (``fp16_nodes``).
        heads: ``"int8"``: outputs quantised with their scales (``CHW32``); ``"fp16"``: head
            nodes in FP16, float16 outputs (``CHW16``).
        head_nodes: the nodes producing the heads (default: ``prep.onnx_static.head_nodes``, the
            producers of the graph outputs, through a Concat to its inputs' producers);
            they run in FP16 when ``heads="fp16"``.
        activation_dtype: ``"uint8"`` (zero point 128, the fast path; the default for
            ``"emulated"``) or ``"int8"`` (zero point 0, TensorRT's layout, slow on onnxruntime's
            CPU kernels; for comparison, and the only one ``"tensorrt"`` takes).
        target: ``"emulated"`` (the emulated core's graph) or ``"tensorrt"`` (the strongly typed
            explicit-quantization form of the same placement, ``prep.explicit_qdq``).
        input_dtype: ``"int8"`` (the DLA's input bytes) or, for ``"tensorrt"`` only,
            ``"float16"`` (the GPU engine's input, quantised with the input's scale first).
        quantized_weights: INT8 Conv node name -> (int8 weights, per-output-channel scales), used
            instead of deriving them from the float weights (an explicit Q/DQ ONNX carries them).

    Raises:
        EmulationGraphError: unknown names in ``fp16_nodes`` or ``head_nodes``; a non-finite or
            non-positive scale; a bad ``target``, ``input_dtype`` or ``quantized_weights``
            entry; no scale for the input, for an INT8 Conv's input or output, for a
            tensor an INT8 node reads, or for a head when ``heads="int8"``; an INT8 Conv without
            constant weights; an INT8 ConvTranspose/Gemm/MatMul (unsupported: list it in
            ``fp16_nodes``); an input or output of the wrong shape; opset < 13; a model that
            shape inference or the ONNX checker rejects.
        OSError: ``ptq`` is a path that cannot be read.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if heads not in ("int8", "fp16"):
        raise EmulationGraphError(f"heads must be 'int8' or 'fp16', got {heads!r}")
    if target not in ("emulated", "tensorrt"):
        raise EmulationGraphError(f"target must be 'emulated' or 'tensorrt', got {target!r}")
    trt = target == "tensorrt"
    if activation_dtype is None:
        activation_dtype = "int8" if trt else "uint8"
    if activation_dtype not in ("uint8", "int8"):
        raise EmulationGraphError(f"activation_dtype must be uint8 or int8: {activation_dtype!r}")
    if trt and activation_dtype != "int8":
        raise EmulationGraphError("TensorRT's Q/DQ are int8 at zero point 0: activation_dtype int8")
    if input_dtype not in ("int8", "float16") or (input_dtype == "float16" and not trt):
        raise EmulationGraphError(
            f"input_dtype {input_dtype!r}: int8, or float16 for the tensorrt target only"
        )
    fp16_list = [fp16_nodes] if isinstance(fp16_nodes, str) else list(fp16_nodes)
    bad = {k: v for k, v in scales.items() if not (math.isfinite(v) and v > 0)}
    if bad:
        raise EmulationGraphError(f"scales must be finite and positive: {bad}")
    model = ptq if isinstance(ptq, onnx.ModelProto) else onnx.load(os.fspath(ptq))
    if _default_opset(model) < MIN_OPSET:
        raise EmulationGraphError(f"opset {_default_opset(model)} < {MIN_OPSET} is unsupported")
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise EmulationGraphError(f"ONNX shape inference rejects the model: {exc}") from exc
    graph = model.graph

    consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    nodes = []
    for node in graph.node:  # Constant nodes become initializers
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None:
            consts[node.output[0]] = numpy_helper.to_array(value)
        else:
            nodes.append(node)
    names = [n.name for n in nodes]
    unknown = sorted(set(fp16_list) - set(names))
    if unknown:
        raise EmulationGraphError(f"fp16_nodes names no node of the model: {unknown}")
    elem: dict[str, int] = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        elem[vi.name] = vi.type.tensor_type.elem_type

    inputs = [i for i in graph.input if i.name not in consts]
    if len(inputs) != 1:
        raise EmulationGraphError(f"the model must have one input, has {[i.name for i in inputs]}")
    in_vi = inputs[0]
    in_dims = _static_dims(in_vi)
    if in_dims is None or len(in_dims) != 4 or in_dims[0] != 1 or in_dims[1] not in (1, 3, 4):
        raise EmulationGraphError(f"input {in_vi.name!r} must be static [1, C, H, W], C in 1/3/4")
    if in_vi.name not in scales:
        raise EmulationGraphError(f"the input {in_vi.name!r} has no INT8 scale")

    out_names = [o.name for o in graph.output]
    if head_nodes is None:
        head_set = set(heads_of(out_names, {o: n for n in nodes for o in n.output}))
    else:
        head_set = set(head_nodes)
        unknown = sorted(head_set - set(names))
        if unknown:
            raise EmulationGraphError(f"head_nodes names no node of the model: {unknown}")
    fp16_set = set(fp16_list) | (head_set if heads == "fp16" else set())

    b = _Builder(model, scales, activation_dtype, target)
    for o in out_names:  # a head's producer writes a renamed raw tensor; the name is the output's
        b.taken.add(o)
    input_t = _Tensor(in_vi.name, None, True, in_vi.name)
    b.tensors[in_vi.name] = input_t
    if input_dtype == "float16":  # the GPU engine's FP16 input, quantised as the DLA's input is
        as_float = b.add("Cast", [in_vi.name], b.fresh(f"{in_vi.name}/fp32"), to=TensorProto.FLOAT)
        input_t.raw = b.quantize(input_t, as_float, "the input")
    static: set[str] = set()
    int8_names: list[str] = []

    def is_activation(name: str) -> bool:
        dtype = elem.get(name, TensorProto.FLOAT)
        return name in b.tensors and dtype in (TensorProto.FLOAT, TensorProto.UNDEFINED)

    for node in nodes:
        fp16 = node.name in fp16_set
        where = f"node {node.name!r} ({node.op_type})"
        live = [x for x in node.input if x and x not in consts and x not in static]
        if not live:
            static.update(node.output)  # computed from constants only: onnxruntime folds it
            b.nodes.append(node)
            continue
        if not fp16 and node.op_type in _WEIGHTED_OPS:
            raise EmulationGraphError(f"{where} has no INT8 emulation here; list it in fp16_nodes")
        new_inputs: list[str] = []
        for index, x in enumerate(node.input):
            geometry = index in _GEOMETRY_INPUTS.get(node.op_type, frozenset())
            if (
                x
                and x in static
                and trt
                and fp16
                and not geometry
                and elem.get(x) == TensorProto.FLOAT
            ):
                # a float computed from constants, read by an FP16 node: typed FLOAT16 too
                new_inputs.append(b.add("Cast", [x], b.fresh(f"{x}/fp16"), to=TensorProto.FLOAT16))
            elif not x or x in static:
                new_inputs.append(x)
            elif x in consts:
                new_inputs.append(_constant_input(b, node, index, x, consts, fp16=fp16))
            elif is_activation(x):
                t = b.tensors[x]
                new_inputs.append(b.fp16_read(t, where) if fp16 else b.int8_read(t, where))
            else:
                new_inputs.append(b.tensors[x].raw if x in b.tensors else x)
        if node.op_type == "Conv" and not fp16:
            new_inputs = _int8_conv_inputs(
                b, node, new_inputs, consts, where, quantized_weights=quantized_weights
            )
        new_outputs = []
        for o in node.output:
            raw = b.fresh(f"{o}/raw") if o in out_names else o
            new_outputs.append(raw)
            if not o:
                continue
            int8 = not fp16 and o in scales
            if node.op_type == "Conv" and not fp16 and not int8:
                if o in out_names:
                    raise _no_head_scale(o)
                raise EmulationGraphError(
                    f"{where}: its output {o!r} has no INT8 scale; give it one or list the node "
                    "in fp16_nodes"
                )
            b.tensors[o] = _Tensor(o, node.name, int8, raw, half=trt and fp16)
        if not fp16:
            int8_names.append(node.name)
        new = helper.make_node(
            node.op_type, new_inputs, new_outputs, name=node.name, domain=node.domain or None
        )
        new.attribute.extend(node.attribute)
        b.nodes.append(new)

    outputs = _emit_outputs(b, graph.output, heads, scales)
    if quantized_weights is not None and (
        unused := sorted(set(quantized_weights) - set(int8_names))
    ):
        raise EmulationGraphError(f"quantized_weights names no INT8 Conv: {unused}")
    c, h, w = in_dims[1:]
    in_type = TensorProto.FLOAT16 if input_dtype == "float16" else b.q_type
    new_input = helper.make_tensor_value_info(in_vi.name, in_type, [1, c, h, w])
    out_vis = [
        helper.make_tensor_value_info(
            s.name,
            b.q_type if s.dtype == "int8" else TensorProto.FLOAT16,
            [1, s.channels, s.height, s.width],
        )
        for s in outputs
    ]
    used = {x for n in b.nodes for x in n.input}
    inits = [
        numpy_helper.from_array(np.asarray(v, order="C"), k) for k, v in consts.items() if k in used
    ]
    new_graph = helper.make_graph(
        b.nodes, f"{graph.name or 'model'}_dla_int8", [new_input], out_vis, inits + b.initializers
    )
    new_model = helper.make_model(new_graph, opset_imports=list(model.opset_import))
    new_model.ir_version = model.ir_version
    new_model.doc_string = (
        f"dlad explicit-quantization graph for TensorRT: heads={heads}, input={input_dtype}"
        if trt
        else f"dlad emulated DLA INT8 graph: heads={heads}, activations={activation_dtype}"
    )
    try:
        onnx.checker.check_model(new_model)
    except onnx.checker.ValidationError as exc:
        raise EmulationGraphError(f"the engine graph fails the ONNX checker: {exc}") from exc
    return EngineGraph(
        model=new_model,
        input_name=in_vi.name,
        input_scale=float(np.float32(scales[in_vi.name])),
        input_shape=(c, h, w),
        outputs=outputs,
        int8_nodes=tuple(int8_names),
        fp16_nodes=tuple(n for n in names if n in fp16_set),
        activation_dtype=activation_dtype,
    )


def _constant_input(
    b: _Builder, node: Any, index: int, name: str, consts: dict[str, np.ndarray], *, fp16: bool
) -> str:
    """A constant input as the node will read it: fp16-rounded data for FP16 nodes."""
    value = consts[name]
    geometry = index in _GEOMETRY_INPUTS.get(node.op_type, frozenset())
    if fp16 and value.dtype.kind == "f" and not geometry:
        half = value.astype(np.float16)  # strongly typed (tensorrt): the FP16 tensor itself
        return b.const(f"{name}/fp16", half if b.trt else half.astype(value.dtype))
    return name


def _int8_conv_inputs(
    b: _Builder,
    node: Any,
    inputs: list[str],
    consts: dict[str, np.ndarray],
    where: str,
    *,
    quantized_weights: QuantizedWeights | None,
) -> list[str]:
    """Replace an INT8 Conv's float weight by INT8 constants behind a per-channel DQ, and (target
    ``"emulated"``) its bias by INT32 constants behind a DQ; ``"tensorrt"`` keeps the float bias."""
    x, w_name = node.input[0], node.input[1] if len(node.input) > 1 else ""
    if w_name not in consts:
        raise EmulationGraphError(f"{where}: INT8 Conv needs constant weights")
    w = consts[w_name].astype(np.float32)
    given = (quantized_weights or {}).get(node.name)
    if given is None:
        s_w = _weight_scales(w)
        w_q = np.clip(
            round_half_away_from_zero(w / s_w.reshape((-1,) + (1,) * (w.ndim - 1))), -127, 127
        )
    else:
        w_q, s_w = np.asarray(given[0]), np.asarray(given[1], dtype=np.float32)
        if w_q.shape != w.shape or s_w.shape != (w.shape[0],) or np.abs(w_q).max() > 127:
            raise EmulationGraphError(
                f"{where}: quantized_weights must be int8 {w.shape} in -127..127 and"
                f" {w.shape[0]} scales; got {w_q.shape} and {s_w.shape}"
            )
        if not (np.isfinite(s_w).all() and (s_w > 0).all()):
            raise EmulationGraphError(f"{where}: weight scales must be finite and positive")
    out = list(inputs)
    out[1] = _dequantized_const(b, f"{node.name}/weight", w_q.astype(np.int8), s_w)
    bias_name = node.input[2] if len(node.input) > 2 else ""
    if bias_name:
        if bias_name not in consts:
            raise EmulationGraphError(f"{where}: INT8 Conv needs a constant bias")
        if b.trt:
            return out  # TensorRT rounds the float bias to int32 at s_in * s_w itself
        s_in = np.float32(b.scales[x]) if x in b.scales else None
        if s_in is None:  # int8_read has already raised for a scale-less input
            raise EmulationGraphError(f"{where}: its input {x!r} has no INT8 scale")
        # The exact float32 product onnxruntime's QLinearConv uses for the accumulator.
        s_b = (s_in * s_w).astype(np.float32)
        bias = consts[bias_name].astype(np.float64) / s_b.astype(np.float64)
        b_q = np.clip(round_half_away_from_zero(bias), -_INT32_MAX - 1, _INT32_MAX)
        out[2] = _dequantized_const(b, f"{node.name}/bias", b_q.astype(np.int32), s_b)
    return out


def _dequantized_const(b: _Builder, prefix: str, q: np.ndarray, scale: np.ndarray) -> str:
    """A per-output-channel (``axis=0``) DequantizeLinear of the integer constant ``q``, zero
    points 0 of ``q``'s dtype, named ``{prefix}/{dtype}``; returns its output tensor's name."""
    out = b.fresh(f"{prefix}/dq")
    b.add(
        "DequantizeLinear",
        [
            b.const(f"{prefix}/{q.dtype}", q),
            b.const(f"{prefix}/scale", scale),
            b.const(f"{prefix}/zero_point", np.zeros(q.shape[0], q.dtype)),
        ],
        out,
        axis=0,
    )
    return out


def _no_head_scale(name: str) -> EmulationGraphError:
    return EmulationGraphError(
        f"head {name!r} has no output scale, so it cannot be an int8 (CHW32) output; use "
        "heads='fp16' or export the QAT model with head output quantizers"
    )


def _emit_outputs(
    b: _Builder, graph_outputs: Any, heads: HeadPrecision, scales: Mapping[str, float]
) -> list[OutputSpec]:
    from onnx import TensorProto

    specs: list[OutputSpec] = []
    for vi in graph_outputs:
        t = b.tensors.get(vi.name)
        dims = _static_dims(vi)
        if t is None or dims is None or len(dims) != 4 or dims[0] != 1:
            raise EmulationGraphError(
                f"output {vi.name!r} must be a computed static [1, C, H, W] tensor, got {dims}"
            )
        _, c, h, w = dims
        reader = f"the {heads} head output {vi.name!r}"
        if heads == "int8":
            if vi.name not in scales:
                raise _no_head_scale(vi.name)
            if "q" in t.views:  # also read inside the graph: one Q keeps the Conv fusable
                b.add("Identity", [t.views["q"]], vi.name)
            else:
                b.quantize(t, b.q_source(t, reader), reader, vi.name)
            specs.append(OutputSpec(vi.name, c, h, w, "int8", float(np.float32(scales[vi.name]))))
        else:
            if b.trt:  # the FP16 tensor itself (a Cast to FLOAT16 of an INT8 head)
                b.add("Identity", [b.fp16_read(t, reader)], vi.name)
            elif "half" in t.views:  # also read inside the graph by FP16 nodes
                b.add("Identity", [t.views["half"]], vi.name)
            else:
                src = b.int8_read(t, reader) if t.int8 else t.raw
                b.add("Cast", [src], vi.name, to=TensorProto.FLOAT16)
            specs.append(OutputSpec(vi.name, c, h, w, "fp16", None))
    return specs


def optimized_op_counts(
    model: onnx.ModelProto | bytes, *, level: Literal["extended", "all"] = "all"
) -> dict[str, int]:
    """Op type -> count in the graph onnxruntime actually runs (its optimized-model dump).

    ``level`` is the graph optimization level (the engine uses ``"all"``). Shows whether a
    ``Conv`` was fused into ``QLinearConv``. Raises onnxruntime's errors for an invalid model.
    """
    import onnx
    import onnxruntime as ort

    data = model if isinstance(model, bytes) else model.SerializeToString()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if level == "all"
        else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    )
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimized.onnx"
        opts.optimized_model_filepath = str(path)
        ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(path))
    counts: dict[str, int] = {}
    for node in optimized.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))
