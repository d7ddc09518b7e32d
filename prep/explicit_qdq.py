"""The explicit-quantization ONNX a TensorRT >= 11 build takes, and the way back.

TensorRT 11 removed implicit INT8 (the INT8 builder flag, calibrators, dynamic ranges): a
strongly typed network takes its precision from the graph alone. :func:`explicit_qdq_model`
writes the translator's outputs (PTQ ONNX + per-tensor scales + FP16 nodes) as that graph. The
placement is the emulated core's (``prep.emulate_graph``, ``target="tensorrt"``), so one set of
rules decides, for both TensorRT generations, which tensor is INT8 and with which scale:

* the input: int8 ``[1, C, H, W]`` (the DLA's ``DLA_HWC4`` bytes) followed by DequantizeLinear
  with the input's scale; for the GPU engine, FP16, Cast to FLOAT and quantised with that scale;
* every tensor the DLA stores in INT8 (an INT8 node's output that has a scale) is written by a
  QuantizeLinear and read by a DequantizeLinear with its scale (float32, zero point int8 0), once
  per tensor: DQ -> Conv -> Q around every INT8 Conv (TensorRT's fused INT8 convolution), the
  SiLU's Conv output quantised once and read by both its Sigmoid and its Mul, a residual Add's
  inputs and a Concat's inputs each at their own scale and the output at its own (the
  translator gives a Concat the largest input scale, so inputs requantise only where they
  differ);
* INT8 Conv weights: int8 initializers (``round_half_away(w / s_w)``, ``s_w = max|w| / 127`` per
  output channel, the DLA's rounding) behind a per-channel (``axis=0``) DequantizeLinear; the
  bias stays float (TensorRT rounds it to int32 at ``s_in * s_w`` as the emulation does);
* FP16 nodes (``fp16_nodes``, and the heads when the outputs are FP16): FLOAT16 tensors, their
  float constants stored as float16, their activation inputs Cast to FLOAT16; an INT8 reader of
  their output Casts it to FLOAT and quantises it;
* outputs: FP16 heads are float16 tensors; INT8 heads are the int8 ``QuantizeLinear`` output.

:func:`read_explicit_onnx` goes back: it reads the scales from the Q/DQ nodes, the FP16 nodes
from the tensor types and the INT8 weights from their DequantizeLinear, and returns the implicit
path's inputs, so the emulated core can be built from either form
(:func:`emulated_graph_from_explicit`) and the two compared integer for integer.

Nothing here needs TensorRT; ``onnx`` and ``numpy`` are imported when a function runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from prep.emulate_graph import (
    EmulationGraphError,
    EngineGraph,
    HeadPrecision,
    InputDType,
    build_int8_graph,
)

if TYPE_CHECKING:
    import onnx

__all__ = [
    "ExplicitQdqError",
    "ImplicitInputs",
    "emulated_graph_from_explicit",
    "explicit_qdq_model",
    "read_explicit_onnx",
    "write_explicit_onnx",
]

_FLOAT, _INT8, _FLOAT16 = 1, 3, 10  # onnx.TensorProto element types
_FLOATS = frozenset({_FLOAT, _FLOAT16})


class ExplicitQdqError(ValueError):
    """An explicit Q/DQ ONNX cannot be written or read back; the message names the node or
    tensor at fault."""


@dataclass(frozen=True)
class ImplicitInputs:
    """What an explicit Q/DQ ONNX says, in the implicit path's terms.

    Attributes:
        ptq: the Q/DQ-free float model (float32 input and outputs, names as in the explicit ONNX).
        scales: tensor name -> INT8 scale (float32 values), input included.
        fp16_nodes: the nodes whose outputs are FLOAT16.
        heads: ``"int8"`` (int8 outputs) or ``"fp16"`` (float16 outputs).
        input_dtype: the explicit ONNX's input type, ``"int8"`` or ``"float16"``.
        quantized_weights: INT8 Conv name -> (int8 weights, per-output-channel scales).
    """

    ptq: onnx.ModelProto
    scales: dict[str, float]
    fp16_nodes: tuple[str, ...]
    heads: HeadPrecision
    input_dtype: InputDType
    quantized_weights: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


# ----------------------------------------------------------------------------- writing
def explicit_qdq_model(
    ptq: onnx.ModelProto | str | os.PathLike[str],
    scales: Mapping[str, float],
    fp16_nodes: Iterable[str],
    *,
    heads: HeadPrecision,
    input_dtype: InputDType = "int8",
) -> onnx.ModelProto:
    """The strongly typed explicit-quantization model of the translator's outputs (module
    docstring). Raises :class:`ExplicitQdqError` for what the emulated core's graph refuses
    (``prep.emulate_graph.build_int8_graph``: a missing scale, an unknown FP16 node, ...) or a
    result that fails the ONNX checker's full type check."""
    import onnx

    try:
        graph = build_int8_graph(
            ptq, scales, fp16_nodes, heads=heads, target="tensorrt", input_dtype=input_dtype
        )
        onnx.checker.check_model(graph.model, full_check=True)
    except (EmulationGraphError, onnx.checker.ValidationError) as exc:
        raise ExplicitQdqError(f"no explicit Q/DQ model: {exc}") from exc
    except onnx.shape_inference.InferenceError as exc:
        raise ExplicitQdqError(f"the explicit Q/DQ model is not well typed: {exc}") from exc
    return graph.model


def write_explicit_onnx(
    ptq_path: Path,
    calibration_cache: Path,
    fp16_nodes: Iterable[str],
    out_path: Path,
    *,
    device: Literal["dla", "gpu"] = "dla",
    output_precision: Literal["fp16", "int8"] = "fp16",
) -> Path:
    """Write the explicit Q/DQ ONNX of the translator's outputs to ``out_path`` (atomically) and
    return it. The scales are the calibration cache's, the file the implicit path gives
    TensorRT, so both paths carry the same numbers. ``device="dla"``: int8 input, outputs as
    ``output_precision`` says (``fp16`` -> FP16 heads, ``int8`` -> INT8 heads); ``"gpu"``: FP16
    input and FP16 heads, the batch dim made dynamic (``prep.build_trt.with_dynamic_batch``).
    Raises ``prep.build_trt.DlaSpecError`` for an unreadable file or cache and
    :class:`ExplicitQdqError` for a model the explicit form cannot take."""
    import onnx
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

    from prep.build_trt import (
        DlaSpecError,
        _read_file,
        _write_atomic,
        read_calibration_cache,
        with_dynamic_batch,
    )

    cache, _ = read_calibration_cache(Path(calibration_cache))
    try:
        ptq = onnx.load_from_string(_read_file(Path(ptq_path), "ONNX model"))
    except (DecodeError, ValueError) as exc:
        raise DlaSpecError(f"{ptq_path}: cannot read ONNX ({exc})") from exc
    gpu = device == "gpu"
    model = explicit_qdq_model(
        ptq,
        cache.scales,
        fp16_nodes,
        heads="fp16" if gpu else output_precision,
        input_dtype="float16" if gpu else "int8",
    )
    data = model.SerializeToString()
    if gpu:
        data, _ = with_dynamic_batch(data)
    _write_atomic(Path(out_path), data)
    return Path(out_path)


# ----------------------------------------------------------------------------- reading back
def read_explicit_onnx(model: onnx.ModelProto | str | os.PathLike[str]) -> ImplicitInputs:
    """The implicit path's inputs an explicit Q/DQ ONNX carries (module docstring).

    Follows ``Cast`` (float <-> float16), ``Identity`` and activation Q/DQ pairs back to the
    tensor they carry; a QuantizeLinear's scale is that tensor's scale. Raises
    :class:`ExplicitQdqError` when a Q/DQ is not symmetric int8 (zero point int8 0), an
    activation scale is not one positive number, a tensor is quantised with two scales, the
    input is not int8 (or float16) ``[1, C, H, W]``, the outputs mix int8 and float16, or a
    weight DequantizeLinear feeds anything but a Conv's weight input.
    """
    import onnx
    from onnx import helper, numpy_helper

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(os.fspath(model))
    model = onnx.shape_inference.infer_shapes(model)
    graph = model.graph
    consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    nodes = []
    for node in graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None:
            consts[node.output[0]] = numpy_helper.to_array(value)
        else:
            nodes.append(node)
    elem = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in [*graph.input, *graph.value_info, *graph.output]
    }
    producer = {o: n for n in nodes for o in n.output}
    inputs = [i for i in graph.input if i.name not in consts]
    if len(inputs) != 1 or elem[inputs[0].name] not in (_INT8, _FLOAT16):
        raise ExplicitQdqError("the explicit model needs one int8 (or float16) input")
    in_name = inputs[0].name
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in _dims(inputs[0])]
    if len(dims) != 4 or dims[0] not in (1, -1) or min(dims[1:]) < 1:
        raise ExplicitQdqError(f"input {in_name!r} must be [1, C, H, W], is {dims}")

    def where(node: Any) -> str:
        return f"node {node.name!r} ({node.op_type})"

    def is_alias(node: Any) -> bool:
        """A node that only carries a tensor: a float <-> float16 Cast, an Identity, or an
        activation Q or DQ (not a weight's DQ)."""
        if node.op_type == "Cast":
            return elem.get(node.input[0]) in _FLOATS and _attr(node, "to") in _FLOATS
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            return node.input[0] not in consts
        return node.op_type == "Identity"

    def carried(name: str) -> str:
        while name in producer and is_alias(producer[name]):
            name = producer[name].input[0]
        return name

    def qparams(node: Any) -> np.ndarray:
        if len(node.input) < 3 or node.input[2] not in consts:
            raise ExplicitQdqError(f"{where(node)}: needs a constant int8 zero point")
        zp = consts[node.input[2]]
        if zp.dtype != np.int8 or np.any(zp != 0):
            raise ExplicitQdqError(f"{where(node)}: TensorRT takes int8 zero point 0, got {zp}")
        if node.input[1] not in consts:
            raise ExplicitQdqError(f"{where(node)}: needs a constant scale")
        scale = consts[node.input[1]].astype(np.float32)
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ExplicitQdqError(f"{where(node)}: scales must be finite and positive")
        return scale

    scales: dict[str, float] = {}
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # the weight DQ's output -> (q, s)
    for node in nodes:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        scale = qparams(node)
        if node.input[0] in consts:  # a weight: int8 constant behind a per-channel DQ
            q = consts[node.input[0]]
            axis = _attr(node, "axis", 1)
            if node.op_type != "DequantizeLinear" or q.dtype != np.int8 or axis != 0:
                raise ExplicitQdqError(f"{where(node)}: weights are int8 behind an axis-0 DQ")
            weights[node.output[0]] = (q, np.broadcast_to(scale, (q.shape[0],)).copy())
            continue
        if scale.size != 1:
            raise ExplicitQdqError(f"{where(node)}: activation scales are per tensor")
        if node.op_type == "DequantizeLinear" and node.input[0] != in_name:
            continue  # reads a QuantizeLinear, whose scale it repeats
        tensor, value = carried(node.input[0]), float(scale.reshape(()))
        if scales.setdefault(tensor, value) != value:
            raise ExplicitQdqError(
                f"tensor {tensor!r} is quantised with scales {scales[tensor]} and {value}"
            )

    # The graph outputs: the tensors their Q / Cast / Identity carry get the outputs' names.
    out_types = {elem.get(o.name) for o in graph.output}
    if out_types not in ({_INT8}, {_FLOAT16}):
        raise ExplicitQdqError("the outputs must all be int8 or all float16")
    heads: HeadPrecision = "int8" if out_types == {_INT8} else "fp16"
    rename: dict[str, str] = {}
    for out in graph.output:
        tensor = carried(out.name)
        if tensor == in_name or tensor in consts:
            raise ExplicitQdqError(f"output {out.name!r} is not computed")
        rename[tensor] = out.name

    new_nodes, inits, fp16_nodes = [], [], []
    quantized: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    used_consts: set[str] = set()
    for node in nodes:
        if is_alias(node) or node.output[0] in weights:
            continue
        new_inputs = []
        for index, x in enumerate(node.input):
            if x in weights:
                if node.op_type != "Conv" or index != 1:
                    raise ExplicitQdqError(f"{where(node)}: reads the weight DQ {x!r}")
                q, s = weights[x]
                quantized[node.name] = (q, s)
                w = q.astype(np.float32) * s.reshape((-1,) + (1,) * (q.ndim - 1))
                inits.append(numpy_helper.from_array(w.astype(np.float32), x))
                new_inputs.append(x)
            elif x in consts:
                used_consts.add(x)
                new_inputs.append(x)
            else:
                src = carried(x) if x else x
                new_inputs.append(rename.get(src, src))
        new = helper.make_node(
            node.op_type,
            new_inputs,
            [rename.get(o, o) for o in node.output],
            name=node.name,
            domain=node.domain or None,
        )
        new.attribute.extend(node.attribute)
        new_nodes.append(new)
        if any(elem.get(o) == _FLOAT16 for o in node.output):
            fp16_nodes.append(node.name)
    for name in sorted(used_consts):
        value = consts[name]
        as_float = value.astype(np.float32) if value.dtype == np.float16 else value
        inits.append(numpy_helper.from_array(as_float, name))
    c, h, w = dims[1:]
    new_graph = helper.make_graph(
        new_nodes,
        graph.name or "model",
        [helper.make_tensor_value_info(in_name, onnx.TensorProto.FLOAT, [1, c, h, w])],
        [
            helper.make_tensor_value_info(o.name, onnx.TensorProto.FLOAT, _static(o))
            for o in graph.output
        ],
        inits,
    )
    ptq = helper.make_model(new_graph, opset_imports=list(model.opset_import))
    ptq.ir_version = model.ir_version
    return ImplicitInputs(
        ptq=ptq,
        scales={rename.get(k, k): v for k, v in scales.items()},
        fp16_nodes=tuple(fp16_nodes),
        heads=heads,
        input_dtype="int8" if elem[in_name] == _INT8 else "float16",
        quantized_weights=quantized,
    )


def emulated_graph_from_explicit(
    model: onnx.ModelProto | str | os.PathLike[str],
) -> EngineGraph:
    """The emulated core's graph (``prep.emulate_graph``, uint8 activations) built from an
    explicit Q/DQ ONNX alone: its scales, FP16 nodes, head precision and INT8 weights. Raises
    :class:`ExplicitQdqError` (reading) or ``EmulationGraphError`` (building)."""
    r = read_explicit_onnx(model)
    return build_int8_graph(
        r.ptq, r.scales, r.fp16_nodes, heads=r.heads, quantized_weights=r.quantized_weights
    )


def _attr(node: Any, name: str, default: int | None = None) -> int | None:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _dims(vi: Any) -> Any:
    return vi.type.tensor_type.shape.dim


def _static(vi: Any) -> list[int]:
    """An output's dims with a dynamic batch read as 1 (the emulated core's batch)."""
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in _dims(vi)]
    return [1 if i == 0 and d < 0 else d for i, d in enumerate(dims)]
