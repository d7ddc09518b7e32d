"""Q/DQ -> PTQ translator: a QAT ONNX model with QuantizeLinear/DequantizeLinear pairs becomes a
plain FP32 ONNX model plus the per-tensor INT8 scales a TensorRT DLA build consumes (DLA takes
no Q/DQ network, so QAT's scales travel as a calibration cache; ``docs/reference/cudla.md`` §2).

1. **Normalise.** Shape inference; ``Constant`` nodes and ``Cast``/``Identity`` of constants
   (the legacy torch exporter's zero points) become initializers; ``Identity`` and
   same-type ``Cast`` nodes are removed (each would be a scale-less tensor between a quantized
   tensor and its other readers); unnamed nodes are named ``<op>_<index>`` (``fp16_nodes`` lists
   node names). ``rename_node_outputs`` renames every tensor but the graph outputs to its
   producer's name (``<name>_<idx>`` for outputs after the first).
2. **Extract scales, remove Q/DQ.** Zero points must be int8 zeros (none means uint8: refused),
   Q and DQ scales and axes equal, no blocked quantization. A constant Q input is a weight: its
   scale is dropped after, with ``calibration_type="max"``, a check that ``max(|w|)/127`` per
   channel along ``axis`` equals the scale within ``weight_scale_rtol`` (relative; all-zero
   channels accept any scale): TensorRT re-derives weight scales that way. Any other Q input
   keeps its scalar scale (not amax) under its own name; per-channel activation scales are
   refused; two quantizers of one tensor keep the larger scale (reported). DQ readers are
   rewired to the Q input. A DQ output that is a graph output keeps its name and the scale: the
   Q input takes the name (an ``Identity`` carries it when the Q input is graph I/O itself).
3. **Fold BatchNormalization** into a preceding ``Conv`` whose output only the BN reads
   (``w' = w*k``, ``b' = (b - mean)*k + beta``, ``k = gamma/sqrt(var + eps)``); the Conv then
   produces the BN's output tensor, so the scale-bearing name survives.
4. **Infer missing scales** over ``DEFAULT_INFERENCE_OPS`` (+ ``Concat`` if
   ``infer_concat_scales``, + ``Mul`` if ``infer_mul_scales``, + ``extra_ops``): a pass in
   topological order, then one in reverse; constants never get scales. Downstream (``out`` =
   output 0, ``in0`` = input 0):
     * ``Concat``: ``out`` = max of the input scales, replacing its own; when only some inputs
       are known ``out``'s own scale joins the max (the NVIDIA translator lets a smaller known
       input lower it, clipping the unknown inputs);
     * ``Sigmoid`` read only by ``Mul`` nodes (SiLU), ``out`` unknown, ``Mul`` in the op set:
       ``out`` = 1/127 (its range is [0, 1]); no other downstream Sigmoid rule;
     * other ops: ``out`` = ``in0`` when ``in0`` is known and ``out`` is not.
   Backward, where ``out`` is known:
     * ``Concat``: every input without a scale gets ``out``;
     * ``Mul``: if exactly one input is known, the other gets ``(out / known) / 127``
       (amax_out = amax_a * amax_b);
     * ``Sigmoid`` (``in0`` unknown, not SiLU): ``in0 = ln(y / (1 - y)) / 127`` with
       ``y = out*127``, only when ``0.5 < y < 1`` (else there is no positive finite logit);
     * other ops (``in0`` unknown): ``in0`` = ``out``.
   The NVIDIA translator fires the Concat and Mul backward rules only when input 0 is unknown;
   here any unknown input does, so results do not depend on input order. ``Resize`` has a rule
   only when listed in ``extra_ops``; YOLOv5's ``Resize -> Concat`` needs none, since the Concat
   backward rule gives the Resize output the Concat's scale.
5. **Report what is missing**: graph inputs and first node outputs of float (or unknown) type
   without a scale, except tensors computed only from constants and shapes (Resize scales,
   reshape targets). Their readers go to ``fp16_nodes``; for a graph output or a ``Conv``'s
   output, its producer too, since it cannot emit INT8 (YOLOv5 heads without output
   quantizers: the sample's FP16 heads; TensorRT runs a conv whose output has no range in
   FP16). Other INT8 nodes may produce a tensor without a scale: it is stored in FP16.
6. **Export** (initializers, topological order, the input's IR version and opsets) and run
   ``onnx.checker.check_model``. Scales of tensors that no longer exist are dropped.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from prep.calib_cache import DEFAULT_TRT_VERSION, layer_precisions_arg, write_calibration_cache

if TYPE_CHECKING:
    import onnx

__all__ = [
    "DEFAULT_INFERENCE_OPS",
    "MissingScale",
    "TranslationError",
    "TranslationOutputs",
    "TranslationReport",
    "TranslationResult",
    "translate",
    "write_outputs",
]

_LOG = logging.getLogger(__name__)

DEFAULT_INFERENCE_OPS = frozenset(
    {"MaxPool", "Flatten", "Relu", "Pad", "Transpose", "Reshape", "Squeeze", "Sigmoid"}
)
"""Ops whose scales propagate between input 0 and output 0 in every translation."""

SILU_SIGMOID_SCALE = 1.0 / 127.0
"""Scale given to the Sigmoid of a SiLU (its output lies in [0, 1])."""

# onnx_graphsurgeon has no type information; these aliases say what a value is at our boundary.
Graph = Any
Node = Any
Tensor = Any


class TranslationError(ValueError):
    """The model cannot be translated; the message names the node or tensor at fault."""


@dataclass(frozen=True)
class MissingScale:
    """A tensor left without an INT8 scale.

    Attributes:
        tensor: its name in the PTQ model.
        producer: the node producing it, ``None`` for a graph input.
        consumers: the nodes reading it (all of them are in ``fp16_nodes``).
        is_graph_output: it is a model output (its producer is then in ``fp16_nodes`` too).
    """

    tensor: str
    producer: str | None
    consumers: tuple[str, ...]
    is_graph_output: bool


@dataclass(frozen=True)
class TranslationReport:
    """What a translation did.

    Attributes:
        activation_quantizers: Q/DQ pairs whose scale was kept (activations, graph inputs).
        weight_quantizers: Q/DQ pairs on constants, whose scale was dropped.
        inferred: tensor -> the rule that gave (or replaced) its scale.
        missing: tensors still without a scale, in graph order.
        scale_conflicts: tensor -> the different scales its quantizers had (the largest kept).
        folded_batchnorms: BatchNormalization nodes folded into their Conv.
        unfolded_batchnorms: BatchNormalization nodes left in the graph (no foldable Conv).
        dropped_scales: scales of tensors that BN folding removed.
    """

    activation_quantizers: int
    weight_quantizers: int
    inferred: dict[str, str] = field(default_factory=dict)
    missing: tuple[MissingScale, ...] = ()
    scale_conflicts: dict[str, tuple[float, ...]] = field(default_factory=dict)
    folded_batchnorms: tuple[str, ...] = ()
    unfolded_batchnorms: tuple[str, ...] = ()
    dropped_scales: tuple[str, ...] = ()

    def log(self, logger: logging.Logger = _LOG) -> None:
        """Log a summary and each missing tensor at INFO, conflicts and unfolded BNs at WARNING."""
        logger.info(
            "Q/DQ: %d activation, %d weight quantizers; %d scales inferred, %d missing, "
            "%d BatchNormalization folded",
            *(self.activation_quantizers, self.weight_quantizers, len(self.inferred)),
            *(len(self.missing), len(self.folded_batchnorms)),
        )
        for name, scales in self.scale_conflicts.items():
            logger.warning("tensor %s has Q/DQ scales %s; kept the largest", name, scales)
        for miss in self.missing:
            logger.info(
                "no INT8 scale for %s (%s): FP16 for its consumers %s%s",
                miss.tensor,
                "graph input" if miss.producer is None else f"output of {miss.producer}",
                list(miss.consumers),
                " and its producer (a graph output)" if miss.is_graph_output else "",
            )
        for name in self.unfolded_batchnorms:
            logger.warning("BatchNormalization %s follows no foldable Conv", name)


@dataclass(frozen=True)
class TranslationResult:
    """The PTQ model and its precision configuration.

    Attributes:
        model: the ONNX model without Q/DQ (FP32 weights, BN folded); passes the ONNX checker.
        int8_tensor_scales: tensor name -> scale (amax/127), only tensors of ``model``.
        fp16_nodes: node names of ``model`` to build in FP16 (tensors without a scale).
        missing: the tensors without a scale (details in ``report.missing``).
        report: the structured account of the translation.
        trt_version: the TensorRT version number for the calibration cache header.
    """

    model: onnx.ModelProto
    int8_tensor_scales: dict[str, float]
    fp16_nodes: list[str]
    missing: list[str]
    report: TranslationReport
    trt_version: int = DEFAULT_TRT_VERSION

    def precision_config(self) -> dict[str, Any]:
        """``{"int8_tensor_scales": {...}, "fp16_nodes": [...]}``, the NVIDIA JSON layout."""
        return {"int8_tensor_scales": dict(self.int8_tensor_scales), "fp16_nodes": self.fp16_nodes}

    def calibration_cache(self) -> str:
        """The TensorRT calibration cache text (see ``prep.calib_cache``)."""
        return write_calibration_cache(self.int8_tensor_scales, self.trt_version)

    def layer_precisions(self) -> str:
        """The ``trtexec --layerPrecisions`` value putting ``fp16_nodes`` in FP16."""
        return layer_precisions_arg(self.fp16_nodes, "fp16")


@dataclass(frozen=True)
class TranslationOutputs:
    """Paths written by ``write_outputs``."""

    onnx: Path
    precision_config: Path
    calibration_cache: Path
    layer_arg: Path


# ----------------------------------------------------------------------------- graph helpers
def _is_const(tensor: Tensor) -> bool:
    import onnx_graphsurgeon as gs

    return isinstance(tensor, gs.Constant)


def _is_var(tensor: Tensor) -> bool:
    import onnx_graphsurgeon as gs

    return isinstance(tensor, gs.Variable) and not tensor.is_empty()


def _values(tensor: Tensor) -> np.ndarray | None:
    return np.asarray(tensor.values) if _is_const(tensor) else None


def _is_graph_io(graph: Graph, tensor: Tensor) -> bool:
    return any(tensor is t for t in (*graph.inputs, *graph.outputs))


def _replace_uses(old: Tensor, new: Tensor) -> None:
    """Make every node reading ``old`` read ``new`` (graph outputs are not touched)."""
    for consumer in list(old.outputs):
        for index, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer.inputs[index] = new


def _np_dtype(onnx_type: int) -> np.dtype | None:
    import onnx

    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))
    except (KeyError, TypeError, ValueError):
        return None


def _var_dtype(tensor: Tensor) -> np.dtype | None:
    try:
        return None if tensor.dtype is None else np.dtype(tensor.dtype)
    except TypeError:
        return None


_CONSTANT_ATTRS = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _folded_value(node: Node) -> np.ndarray | None:
    """The value of a ``Constant`` node, or of ``Cast``/``Identity`` applied to a constant."""
    if node.op == "Constant":
        if "value" in node.attrs:
            return _values(node.attrs["value"])
        key = next((k for k in _CONSTANT_ATTRS if k in node.attrs), None)  # sparse/strings: None
        return None if key is None else np.asarray(node.attrs[key], dtype=_CONSTANT_ATTRS[key])
    if node.op not in ("Cast", "Identity") or not node.inputs:
        return None
    value = _values(node.inputs[0])
    if value is None or node.op == "Identity":
        return value
    dtype = _np_dtype(node.attrs.get("to", 0))
    return None if dtype is None else value.astype(dtype)


def _normalise(graph: Graph) -> None:
    """Step 1: constants to initializers, identity Cast/Identity removed, nodes named."""
    graph.toposort()
    for node in list(graph.nodes):
        if len(node.outputs) != 1 or _is_graph_io(graph, node.outputs[0]):
            continue
        out = node.outputs[0]
        value = _folded_value(node)
        if value is not None:
            node.outputs.clear()
            out.to_constant(np.asarray(value))
        elif node.op == "Identity" or (
            node.op == "Cast"
            and _var_dtype(node.inputs[0]) is not None
            and _var_dtype(node.inputs[0]) == _np_dtype(node.attrs.get("to", 0))
        ):
            _replace_uses(out, node.inputs[0])
            node.outputs.clear()
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    taken = {n.name for n in graph.nodes}
    for index, node in enumerate(graph.nodes):
        if not node.name:
            node.name = f"{node.op}_{index}"
            while node.name in taken:
                node.name += "_"
            taken.add(node.name)


def _rename_node_outputs(graph: Graph) -> None:
    taken = {t.name for t in (*graph.inputs, *graph.outputs)}
    taken |= {name for name, t in graph.tensors().items() if _is_const(t)}
    for node in graph.nodes:
        for index, out in enumerate(node.outputs):
            if not _is_var(out) or _is_graph_io(graph, out):
                continue
            name = node.name if index == 0 else f"{node.name}_{index}"
            if name in taken:
                raise TranslationError(
                    f"rename_node_outputs: tensor name {name!r} (node {node.name!r}) is taken; "
                    "node names must be unique and differ from graph I/O and constant names"
                )
            taken.add(name)
            out.name = name


# ----------------------------------------------------------------------------- Q/DQ removal
def _qparams(node: Node) -> tuple[np.ndarray, int]:
    """(scale, axis) of a Q or DQ node, validated: int8, symmetric, not blocked."""
    where = f"{node.op} {node.name!r}"
    scale = _values(node.inputs[1]) if len(node.inputs) > 1 else None
    if scale is None or scale.dtype.kind != "f" or scale.ndim > 1:
        raise TranslationError(f"{where}: the scale must be a 0-D or 1-D float constant")
    if not np.all(np.isfinite(scale) & (scale > 0)):
        raise TranslationError(f"{where}: scales must be finite and positive, got {scale}")
    if node.attrs.get("block_size", 0):
        raise TranslationError(f"{where}: blocked quantization is not supported")
    if len(node.inputs) > 2 and not node.inputs[2].is_empty():
        zero_point = _values(node.inputs[2])
        if zero_point is None or zero_point.dtype != np.int8:
            kind = "not a constant" if zero_point is None else f"of type {zero_point.dtype}"
            raise TranslationError(
                f"{where}: zero point {kind}; DLA INT8 needs signed int8 (uint8 is unsupported)"
            )
        if np.any(zero_point != 0):
            raise TranslationError(f"{where}: non-zero zero point {zero_point} (asymmetric)")
    elif node.op == "QuantizeLinear" and _np_dtype(node.attrs.get("output_dtype", 0)) != np.int8:
        raise TranslationError(f"{where}: no int8 zero point, so the output is uint8")
    return scale, int(node.attrs.get("axis", 1))


def _verify_weight_scales(
    q: Node, weight: np.ndarray, scale: np.ndarray, axis: int, rtol: float
) -> None:
    magnitude = np.abs(weight.astype(np.float64))
    if scale.size == 1:
        amax = np.array([magnitude.max(initial=0.0)])
    else:
        axis = axis + weight.ndim if axis < 0 else axis
        if not 0 <= axis < weight.ndim or weight.shape[axis] != scale.size:
            raise TranslationError(
                f"QuantizeLinear {q.name!r}: {scale.size} scales do not fit weight shape "
                f"{weight.shape} along axis {axis}"
            )
        amax = magnitude.max(axis=tuple(i for i in range(weight.ndim) if i != axis))
    derived = amax / 127.0
    given = scale.astype(np.float64).reshape(-1)
    relative = np.abs(derived - given) / np.maximum(derived, given)
    bad = (amax > 0) & (relative > rtol)
    if np.any(bad):
        c = int(np.argmax(np.where(bad, relative, 0.0)))
        raise TranslationError(
            f"weight quantizer {q.name!r} (tensor {q.inputs[0].name!r}): {int(bad.sum())} of "
            f"{given.size} scales differ from max(|w|)/127 by more than rtol={rtol} (channel "
            f"{c}: max(|w|)/127={derived[c]:.6g}, scale={given[c]:.6g}). TensorRT re-derives "
            "weight scales as per-channel max(|w|)/127, so weights must be max-calibrated "
            "(after QAT too); calibration_type='histogram' skips this check"
        )


_Extracted = tuple[dict[str, float], int, int, dict[str, tuple[float, ...]]]


def _remove_qdq(graph: Graph, calibration_type: str, rtol: float) -> _Extracted:
    """Step 2. Returns (scales, activation count, weight count, conflicts)."""
    import onnx_graphsurgeon as gs

    quantizers = [n for n in graph.nodes if n.op == "QuantizeLinear"]
    if not quantizers and not any(n.op == "DequantizeLinear" for n in graph.nodes):
        raise TranslationError("the model has no QuantizeLinear/DequantizeLinear nodes")
    scales: dict[str, float] = {}
    seen: dict[str, list[float]] = {}
    activations = weights = 0
    for q in quantizers:
        scale, axis = _qparams(q)
        dequantizers = list(q.outputs[0].outputs)
        kinds = [n.op for n in dequantizers]
        if not kinds or set(kinds) != {"DequantizeLinear"} or _is_graph_io(graph, q.outputs[0]):
            raise TranslationError(
                f"QuantizeLinear {q.name!r} must feed only DequantizeLinear nodes; it feeds "
                f"{kinds}{' and a graph output' if _is_graph_io(graph, q.outputs[0]) else ''}"
            )
        for dq in dequantizers:
            dq_scale, dq_axis = _qparams(dq)
            if (
                dq_scale.shape != scale.shape
                or not np.array_equal(dq_scale, scale)
                or (scale.size > 1 and dq_axis != axis)
            ):
                raise TranslationError(
                    f"QuantizeLinear {q.name!r} and DequantizeLinear {dq.name!r} differ in "
                    f"scale ({scale} vs {dq_scale}) or axis ({axis} vs {dq_axis})"
                )
        x = q.inputs[0]
        if _is_const(x):
            weights += 1
            if calibration_type == "max":
                _verify_weight_scales(q, np.asarray(x.values), scale, axis, rtol)
        elif scale.size != 1:
            raise TranslationError(
                f"QuantizeLinear {q.name!r}: per-channel quantization of activation {x.name!r}; "
                "a calibration cache holds one scale per tensor"
            )
        else:
            activations += 1
            seen.setdefault(x.name, []).append(float(scale.reshape(-1)[0]))
            scales[x.name] = max(seen[x.name])
        for dq in dequantizers:
            y = dq.outputs[0]
            _replace_uses(y, x)
            dq.outputs.clear()
            if not any(y is t for t in graph.outputs):
                continue
            if _is_const(x) or _is_graph_io(graph, x):
                # The output name must survive and x cannot take it: an Identity carries it.
                graph.nodes.append(gs.Node("Identity", name=dq.name, inputs=[x], outputs=[y]))
                if x.name in scales:
                    scales[y.name] = scales[x.name]
            else:
                if x.name in scales:
                    scales[y.name] = scales.pop(x.name)
                    seen[y.name] = seen.pop(x.name)
                x.name = y.name
                graph.outputs[[t is y for t in graph.outputs].index(True)] = x
        q.outputs.clear()
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    orphans = [n.name for n in graph.nodes if n.op == "DequantizeLinear"]
    if orphans:  # e.g. weights stored as int8: their float values are not in the model
        raise TranslationError(f"DequantizeLinear without QuantizeLinear is unsupported: {orphans}")
    conflicts = {k: tuple(v) for k, v in seen.items() if len(set(v)) > 1}
    return scales, activations, weights, conflicts


# ----------------------------------------------------------------------------- BN folding
def _fold_batchnorms(graph: Graph) -> tuple[list[str], list[str]]:
    """Step 3. Returns the (folded, left) BatchNormalization node names."""
    import onnx_graphsurgeon as gs

    folded: list[str] = []
    left: list[str] = []
    taken = set(graph.tensors())
    for bn in [n for n in graph.nodes if n.op == "BatchNormalization"]:
        x = bn.inputs[0]
        conv = x.inputs[0] if len(x.inputs) == 1 and x.inputs[0].op == "Conv" else None
        params = [_values(t) for t in bn.inputs[1:5]]
        weight = _values(conv.inputs[1]) if conv is not None else None
        bias = None
        if conv is not None and weight is not None:
            bias = _values(conv.inputs[2]) if len(conv.inputs) > 2 else np.zeros(weight.shape[0])
        if (
            conv is None
            or weight is None
            or bias is None
            or len(x.outputs) != 1
            or len(bn.outputs) != 1
            or _is_graph_io(graph, x)
            or any(p is None or p.size != weight.shape[0] for p in params)
        ):
            left.append(bn.name)
            continue
        gamma, beta, mean, var = (np.asarray(p, np.float64).reshape(-1) for p in params)
        k = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        new = {
            "weight": weight.astype(np.float64) * k.reshape((-1,) + (1,) * (weight.ndim - 1)),
            "bias": (bias.astype(np.float64) - mean) * k + beta,
        }
        for index, (suffix, values) in enumerate(new.items(), start=1):
            name = f"{conv.name}.bn_folded_{suffix}"
            while name in taken:
                name += "_"
            taken.add(name)
            constant = gs.Constant(name, np.ascontiguousarray(values.astype(weight.dtype)))
            if index < len(conv.inputs):
                conv.inputs[index] = constant
            else:
                conv.inputs.append(constant)
        y = bn.outputs[0]
        bn.outputs.clear()
        conv.outputs[0] = y  # the BN's (scale-bearing) output name survives
        folded.append(bn.name)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return folded, left


# ----------------------------------------------------------------------------- scale inference
def _infer_scales(graph: Graph, scales: dict[str, float], ops: frozenset[str]) -> dict[str, str]:
    """Step 4. Fills ``scales`` in place; returns tensor -> rule for each scale it set."""
    inferred: dict[str, str] = {}

    def known(tensor: Tensor) -> bool:
        return _is_var(tensor) and tensor.name in scales

    def put(tensor: Tensor, value: float, rule: str) -> None:
        if _is_var(tensor) and math.isfinite(value) and value > 0:
            scales[tensor.name] = value
            inferred[tensor.name] = rule

    silu_sigmoids: set[str] = set()
    nodes = [n for n in graph.nodes if n.op in ops and n.outputs and _is_var(n.outputs[0])]
    for node in nodes:
        out = node.outputs[0]
        if node.op == "Concat":
            variables = [t for t in node.inputs if _is_var(t)]
            inputs = [scales[t.name] for t in variables if known(t)]
            if inputs and len(inputs) < len(variables) and known(out):
                inputs.append(scales[out.name])  # never clip an unknown input below out's range
            if inputs and scales.get(out.name) != max(inputs):
                put(out, max(inputs), "Concat: max of input scales")
        elif node.op == "Sigmoid":
            readers = {c.op for c in out.outputs}
            if not known(out) and "Mul" in ops and readers == {"Mul"}:
                put(out, SILU_SIGMOID_SCALE, "Sigmoid before Mul (SiLU): 1/127")
                silu_sigmoids.add(out.name)
        elif node.inputs and known(node.inputs[0]) and not known(out):
            put(out, scales[node.inputs[0].name], f"{node.op}: output = input")
    for node in reversed(nodes):
        out = node.outputs[0]
        if not known(out):
            continue
        s_out = scales[out.name]
        if node.op == "Concat":
            for tensor in node.inputs:
                if not known(tensor):
                    put(tensor, s_out, "Concat (backward): input = output")
        elif node.op == "Mul":
            pair = [t for t in node.inputs if _is_var(t)]
            if len(pair) == 2 and known(pair[0]) != known(pair[1]):
                have, need = pair if known(pair[0]) else pair[::-1]
                put(need, s_out / scales[have.name] / 127.0, "Mul (backward): out/known/127")
        elif not node.inputs or known(node.inputs[0]):
            continue
        elif node.op == "Sigmoid":
            y = s_out * 127.0
            if out.name not in silu_sigmoids and 0.5 < y < 1.0:
                put(node.inputs[0], math.log(y / (1.0 - y)) / 127.0, "Sigmoid (backward): logit")
        else:
            put(node.inputs[0], s_out, f"{node.op} (backward): input = output")
    return inferred


def _find_missing(graph: Graph, scales: dict[str, float]) -> list[MissingScale]:
    """Step 5: graph inputs and first node outputs of float (or unknown) type without a scale,
    except those computed only from constants and shapes (TensorRT folds them)."""
    static: set[str] = set()
    for node in graph.nodes:  # topological order
        inputs = [t for t in node.inputs if not t.is_empty()]
        if node.op in ("Shape", "Size") or (
            inputs and all(_is_const(t) or t.name in static for t in inputs)
        ):
            static.update(t.name for t in node.outputs)
    candidates = [(t, None) for t in graph.inputs] + [
        (n.outputs[0], n.name) for n in graph.nodes if n.outputs
    ]
    missing: list[MissingScale] = []
    for tensor, producer in candidates:
        dtype = _var_dtype(tensor) if _is_var(tensor) else None
        if not _is_var(tensor) or tensor.name in scales or tensor.name in static:
            continue
        if dtype is None or dtype.kind == "f":
            consumers = tuple(c.name for c in tensor.outputs)
            is_output = any(tensor is t for t in graph.outputs)
            missing.append(MissingScale(tensor.name, producer, consumers, is_output))
    return missing


# ----------------------------------------------------------------------------- entry points
def translate(
    model: onnx.ModelProto | str | os.PathLike[str],
    *,
    infer_concat_scales: bool = True,
    infer_mul_scales: bool = True,
    extra_ops: Iterable[str] = (),
    rename_node_outputs: bool = False,
    calibration_type: Literal["max", "histogram"] = "max",
    weight_scale_rtol: float = 1e-3,
    trt_version: int = DEFAULT_TRT_VERSION,
) -> TranslationResult:
    """Translate a Q/DQ (QAT) ONNX model into a PTQ model plus INT8 scales (module docstring).

    Args:
        model: a ``ModelProto`` (left unmodified) or the path of an ``.onnx`` file.
        infer_concat_scales: add ``Concat`` to the scale-inference op set.
        infer_mul_scales: add ``Mul`` (and with it the SiLU Sigmoid rule) to the op set.
        extra_ops: further op types propagated like single-input ops (``"Resize"``,
            ``"AveragePool"``, ...).
        rename_node_outputs: rename tensors to their producer node's name (not graph outputs).
        calibration_type: ``"max"`` checks weight scales against max(|w|)/127;
            ``"histogram"`` skips the check.
        weight_scale_rtol: relative tolerance of that check.
        trt_version: TensorRT version number for the calibration cache header.

    Raises:
        TranslationError: no Q/DQ nodes; a uint8, asymmetric, blocked or per-channel-activation
            quantizer; Q and DQ scales that differ; a Q node feeding anything but
            DequantizeLinear, or a DequantizeLinear not fed by one; weight scales that are not
            max-calibrated; a rename collision; an input or result that shape inference or the
            ONNX checker rejects; a bad option.
        OSError: ``model`` is a path that cannot be read.
    """
    import onnx
    import onnx_graphsurgeon as gs

    if calibration_type not in ("max", "histogram"):
        raise TranslationError(f"calibration_type must be max or histogram: {calibration_type!r}")
    if not (math.isfinite(weight_scale_rtol) and weight_scale_rtol >= 0):
        raise TranslationError(f"weight_scale_rtol must be >= 0, got {weight_scale_rtol!r}")
    if type(trt_version) is not int or trt_version < 0:
        raise TranslationError(f"trt_version must be a non-negative int, got {trt_version!r}")
    ops = DEFAULT_INFERENCE_OPS | frozenset(
        [extra_ops] if isinstance(extra_ops, str) else extra_ops
    )
    ops |= {"Concat"} if infer_concat_scales else set()
    ops |= {"Mul"} if infer_mul_scales else set()

    if isinstance(model, onnx.ModelProto):
        proto = model
    else:
        path = os.fspath(model)
        with open(path, "rb") as f:  # OSError for a file that cannot be read
            data = f.read()
        try:
            proto = onnx.load_from_string(data)
        except Exception as exc:  # protobuf's DecodeError has no stable import path
            raise TranslationError(f"{path} is not an ONNX model: {exc}") from exc
        if not proto.graph.node:
            raise TranslationError(f"{path} is not an ONNX model: it has no graph nodes")
    try:
        proto = onnx.shape_inference.infer_shapes(proto)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise TranslationError(f"ONNX shape inference rejects the input model: {exc}") from exc
    graph = gs.import_onnx(proto)
    _normalise(graph)
    if rename_node_outputs:
        _rename_node_outputs(graph)
    scales, activations, weights, conflicts = _remove_qdq(
        graph, calibration_type, weight_scale_rtol
    )
    folded, left = _fold_batchnorms(graph)
    present = {name for name, t in graph.tensors().items() if _is_var(t)}
    dropped = tuple(name for name in scales if name not in present)
    scales = {name: value for name, value in scales.items() if name in present}
    inferred = _infer_scales(graph, scales, ops)
    missing = _find_missing(graph, scales)
    fp16: dict[str, None] = {}
    convs = {n.name for n in graph.nodes if n.op == "Conv"}
    for miss in missing:
        fp16.update(dict.fromkeys(miss.consumers))
        if miss.producer is not None and (miss.is_graph_output or miss.producer in convs):
            fp16[miss.producer] = None

    out = gs.export_onnx(graph.cleanup(remove_unused_graph_inputs=False).toposort())
    try:
        onnx.checker.check_model(out)
    except onnx.checker.ValidationError as exc:
        raise TranslationError(f"the translated model fails the ONNX checker: {exc}") from exc
    report = TranslationReport(
        activation_quantizers=activations,
        weight_quantizers=weights,
        inferred=inferred,
        missing=tuple(missing),
        scale_conflicts={k: v for k, v in conflicts.items() if k in present},
        folded_batchnorms=tuple(folded),
        unfolded_batchnorms=tuple(left),
        dropped_scales=dropped,
    )
    report.log()
    missing_names = [m.tensor for m in missing]
    return TranslationResult(out, scales, list(fp16), missing_names, report, trt_version)


def write_outputs(
    result: TranslationResult, out_dir: str | os.PathLike[str], stem: str
) -> TranslationOutputs:
    """Write ``{stem}_noqdq.onnx``, ``{stem}_precision_config.json`` (``json.dump`` of
    ``result.precision_config()`` with ``indent=4``), ``{stem}_precision_config_calib.cache``
    and ``{stem}_precision_config_layer_arg.txt`` (the ``--layerPrecisions`` value, no newline)
    into ``out_dir``, created if needed; existing files are replaced.

    Raises:
        ValueError: ``stem`` is empty or holds a path separator; a node name that the layer
            argument cannot hold; ``prep.calib_cache.CalibrationCacheError`` (a ValueError) for
            a scale or name the cache cannot hold. Nothing is written in these cases.
        OSError: the files cannot be written.
    """
    import onnx

    if not stem or any(sep in stem for sep in ("/", "\\", os.sep)):
        raise ValueError(f"stem must be a plain file name stem, got {stem!r}")
    # Build every text first so that a bad name fails before anything is written.
    texts = (
        json.dumps(result.precision_config(), indent=4),
        result.calibration_cache(),
        result.layer_precisions(),
    )
    directory = Path(out_dir)
    paths = TranslationOutputs(
        onnx=directory / f"{stem}_noqdq.onnx",
        precision_config=directory / f"{stem}_precision_config.json",
        calibration_cache=directory / f"{stem}_precision_config_calib.cache",
        layer_arg=directory / f"{stem}_precision_config_layer_arg.txt",
    )
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(result.model, os.fspath(paths.onnx))
    text_paths = (paths.precision_config, paths.calibration_cache, paths.layer_arg)
    for path, text in zip(text_paths, texts, strict=True):
        path.write_text(text, encoding="utf-8")
    return paths
