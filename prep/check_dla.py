"""``prep check-dla``: which layers of an ONNX graph an Orin DLA runs, and why not where not.

    prep check-dla MODEL.onnx [--json out.json] [--all]

The graph is first made static as TensorRT's builder makes it (``prep.onnx_static``: shapes
inferred, constant subgraphs folded), ``Identity`` an alias, Q/DQ pairs transparent (they set a
tensor's precision, not a layer). Each remaining node is one layer, checked against the
documented DLA rules of TensorRT 10.x on Orin (DLA 3.x): the "DLA Supported Layers and
Restrictions" page, the per-layer DLA notes of ``NvInfer.h`` at v10.3.0, and the builder's own
messages where the page is silent (``docs/check-dla.md`` lists every rule with its source).
Where TensorRT versions disagree (``Div``, ``Pow``, unary ops other than ``Abs``) the Orin
JetPack 6 answer (TensorRT 10.3) is taken: the layer falls back.

Printed: one row per layer (name, op, output shape, GFLOP, where it runs and the rule that
decides), then the share of layers and of FLOPs on the DLA and the number of DLA subgraphs (a
cuDLA standalone loadable is one subgraph of the whole network: dlad serves a model only when
every layer runs on the DLA).

Exit status: 0 every layer runs on the DLA; 1 some do not; 2 bad arguments or an unreadable,
dynamic or malformed graph.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import onnx

__all__ = ["CheckError", "DlaCheck", "LayerVerdict", "add_parser", "check_graph", "run"]

MAX_DIM = 8192
"""DLA limit on each of C, H, W."""
MAX_BATCH = 4096
_ALIASES = frozenset({"Identity", "QuantizeLinear", "DequantizeLinear"})
_SHUFFLES = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze"})
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Max", "Min"})
_ACTIVATIONS = frozenset({"Relu", "Sigmoid", "Tanh", "LeakyRelu"})


class CheckError(ValueError):
    """The graph cannot be checked (unreadable, dynamic shapes, a malformed node)."""


@dataclass(frozen=True)
class LayerVerdict:
    """One layer: ``dla`` whether the DLA runs it, ``reason`` the rule that decides (for a
    layer it runs, a caveat or ""), ``flops`` its floating-point operations at batch 1."""

    name: str
    op: str
    shape: tuple[int, ...]
    flops: float
    dla: bool
    reason: str = ""


@dataclass
class DlaCheck:
    """The verdict on a whole graph."""

    layers: list[LayerVerdict]
    subgraphs: int  # connected runs of DLA layers: TensorRT would make one loadable of each
    notes: list[str] = field(default_factory=list)

    @property
    def all_on_dla(self) -> bool:
        return all(layer.dla for layer in self.layers)

    @property
    def flops_on_dla(self) -> float:
        """The share of the graph's FLOPs that run on the DLA (1.0 for an empty graph)."""
        total = sum(layer.flops for layer in self.layers)
        on = sum(layer.flops for layer in self.layers if layer.dla)
        return on / total if total else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [asdict(layer) for layer in self.layers],
            "layers_on_dla": sum(layer.dla for layer in self.layers),
            "layers_total": len(self.layers),
            "flops_on_dla": self.flops_on_dla,
            "dla_subgraphs": self.subgraphs,
            "all_on_dla": self.all_on_dla,
            "notes": self.notes,
        }


# ----------------------------------------------------------------------------- the graph


@dataclass
class _Graph:
    model: onnx.ModelProto
    shapes: dict[str, tuple[int, ...]]
    consts: dict[str, Any]  # name -> numpy array
    producer: dict[str, Any]  # tensor -> node
    consumers: dict[str, list[Any]]  # tensor -> nodes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes.get(name, ())

    def source(self, name: str) -> str:
        """``name`` through Identity and Q/DQ to the tensor that holds the values."""
        node = self.producer.get(name)
        while node is not None and node.op_type in _ALIASES and node.input:
            name = node.input[0]
            node = self.producer.get(name)
        return name

    def const(self, name: str) -> Any:
        """The value of a constant input (through aliases), or None."""
        if not name:
            return None
        return self.consts.get(self.source(name), self.consts.get(name))

    def neighbours(self, node: Any) -> list[Any]:
        """The layers feeding ``node`` and fed by it, through aliases."""
        out = []
        for t in node.input:
            producer = self.producer.get(self.source(t)) if t else None
            if producer is not None:
                out.append(producer)
        stack = list(node.output)
        while stack:
            for user in self.consumers.get(stack.pop(), []):
                if user.op_type in _ALIASES:
                    stack.extend(user.output)
                else:
                    out.append(user)
        return out


def _load(path: Path) -> _Graph:
    import numpy as np
    import onnx
    from onnx import numpy_helper, shape_inference

    from prep.onnx_static import static_model

    try:
        model = onnx.load(str(path))
    except (OSError, onnx.onnx_cpp2py_export.checker.ValidationError, ValueError) as e:
        raise CheckError(f"cannot read {path}: {e}") from e
    except Exception as e:  # protobuf's DecodeError: not an ONNX file
        raise CheckError(f"{path} is not an ONNX model: {e}") from e
    try:
        model = shape_inference.infer_shapes(static_model(model), strict_mode=True)
    except Exception as e:  # graphsurgeon and shape inference raise their own classes
        raise CheckError(f"{path}: shapes cannot be inferred: {e}") from e
    shapes: dict[str, tuple[int, ...]] = {}
    for vi in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise CheckError(
                f"{path}: tensor {vi.name!r} has a dynamic shape "
                f"({[d.dim_param or d.dim_value for d in dims]}); the DLA runs static shapes only: "
                "export with a fixed batch and image size"
            )
        shapes[vi.name] = tuple(d.dim_value for d in dims)
    consts: dict[str, Any] = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    consts[node.output[0]] = numpy_helper.to_array(a.t)
    for name, value in consts.items():
        shapes.setdefault(name, tuple(np.shape(value)))
    producer: dict[str, Any] = {}
    consumers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for o in node.output:
            producer[o] = node
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    return _Graph(model, shapes, consts, producer, consumers)


def _attr(node: Any, name: str, default: Any) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# ----------------------------------------------------------------------------- FLOPs


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 0


def _flops(g: _Graph, node: Any) -> float:
    out = g.shape(node.output[0]) if node.output else ()
    if node.op_type in ("Conv", "ConvTranspose"):
        w = g.shape(node.input[1])
        if len(w) != 4:
            return 0.0
        group = int(_attr(node, "group", 1))
        spatial = _numel(out[2:]) if node.op_type == "Conv" else _numel(g.shape(node.input[0])[2:])
        cout = w[0] if node.op_type == "Conv" else w[1] * group
        cin_per_group = w[1] if node.op_type == "Conv" else w[0] // group
        return 2.0 * cout * spatial * cin_per_group * w[2] * w[3]
    if node.op_type in ("MatMul", "Gemm"):
        a, b = g.shape(node.input[0]), g.shape(node.input[1])
        if len(a) < 2 or len(b) < 2:
            return 0.0
        k = a[-1] if not (node.op_type == "Gemm" and _attr(node, "transA", 0)) else a[-2]
        return 2.0 * _numel(out) * k
    if node.op_type in ("MaxPool", "AveragePool"):
        kernel = _attr(node, "kernel_shape", [1, 1])
        return float(_numel(out) * math.prod(kernel))
    if node.op_type == "Softmax":
        return 5.0 * _numel(out)
    return float(_numel(out))


# ----------------------------------------------------------------------------- rules

_Rule = Callable[[_Graph, Any], tuple[bool, str]]


def _rank4(g: _Graph, node: Any) -> str:
    """Why ``node``'s data tensors are not 4-D, or ""."""
    for t in (node.input[0], *node.output):
        if t and len(g.shape(t)) != 4:
            return (f"a {len(g.shape(t))}-D tensor ({t}): the DLA takes 4-D [N, C, H, W] tensors "
                    "(TensorRT inserts a shuffle that the DLA cannot run)")  # fmt: skip
    return ""


def _conv(g: _Graph, node: Any) -> tuple[bool, str]:
    kernel = list(_attr(node, "kernel_shape", g.shape(node.input[1])[2:]))
    strides = list(_attr(node, "strides", [1, 1]))
    dilations = list(_attr(node, "dilations", [1, 1]))
    pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    group = int(_attr(node, "group", 1))
    if len(kernel) != 2:
        return False, "the DLA runs 2-D convolutions only"
    if node.op_type == "ConvTranspose":
        cout = g.shape(node.input[1])[1] * group
        if group != 1 or any(d != 1 for d in dilations) or any(pads):
            return False, "a DLA deconvolution has groups 1, dilation 1 and no padding"

        def fits(k: int, s: int) -> bool:
            return (1 <= k <= 32 and 1 <= s <= 32) or (k in (64, 96, 128) and s == 1)

        if not all(fits(k, s) for k, s in zip(kernel, strides, strict=True)):
            return False, f"deconvolution kernel {kernel} / stride {strides} out of the DLA's range"
        if not 1 <= cout <= MAX_DIM:
            return False, f"{cout} output maps: the DLA takes 1..{MAX_DIM}"
        return True, ""
    cout = g.shape(node.input[1])[0]
    if any(not 1 <= k <= 32 for k in kernel):
        return False, f"kernel {kernel}: a DLA convolution kernel is 1..32"
    if any(not 1 <= s <= 8 for s in strides):
        return False, f"stride {strides}: a DLA convolution stride is 1..8"
    if any(not 0 <= p <= 31 or p >= kernel[i % 2] for i, p in enumerate(pads)):
        return False, f"padding {pads}: the DLA takes 0..31 and less than the kernel {kernel}"
    if any(not 1 <= d <= 32 for d in dilations):
        return False, f"dilation {dilations}: the DLA takes 1..32"
    if not 1 <= cout <= MAX_DIM or group > MAX_DIM:
        return False, f"{cout} output maps, {group} groups: the DLA takes at most {MAX_DIM}"
    return True, ""


def _pool(g: _Graph, node: Any) -> tuple[bool, str]:
    kernel = list(_attr(node, "kernel_shape", []))
    strides = list(_attr(node, "strides", [1] * len(kernel)))
    pads = list(_attr(node, "pads", [0] * 2 * len(kernel)))
    if len(kernel) != 2 or any(not 1 <= k <= 8 for k in kernel):
        return False, f"pooling window {kernel}: the DLA takes 2-D windows of 1..8"
    if any(not 1 <= s <= 16 for s in strides):
        return False, f"pooling stride {strides}: the DLA takes 1..16"
    if any(not 0 <= p <= 7 for p in pads):
        return False, f"pooling padding {pads}: the DLA takes 0..7"
    if any(d != 1 for d in _attr(node, "dilations", [1, 1])):
        return False, "the DLA pools without dilation"
    return True, ""


def _activation(g: _Graph, node: Any) -> tuple[bool, str]:
    if node.op_type == "LeakyRelu":
        return True, "Leaky ReLU: listed by the current guide, not by TensorRT 10.3's NvInfer.h"
    return True, ""


def _clip(g: _Graph, node: Any) -> tuple[bool, str]:
    lo = g.const(node.input[1]) if len(node.input) > 1 else _attr(node, "min", None)
    hi = g.const(node.input[2]) if len(node.input) > 2 else _attr(node, "max", None)
    if lo is None or hi is None or float(lo) != 0.0 or not 1.0 <= float(hi) <= 127.0:
        return False, "the DLA's clipped ReLU clips to [0, m] with a constant m in 1..127"
    return True, ""


def _broadcast_ok(x: Sequence[int], y: Sequence[int]) -> bool:
    if tuple(x) == tuple(y) or math.prod(y) == 1:
        return True
    return len(y) == 4 and y[0] in (1, x[0]) and y[1] == x[1] and y[2] == y[3] == 1


def _elementwise(g: _Graph, node: Any) -> tuple[bool, str]:
    if len(node.input) != 2:
        return False, f"{len(node.input)} operands: a DLA element-wise layer takes 2"
    out = g.shape(node.output[0])
    for t in node.input:
        shape = g.shape(t)
        if g.const(t) is None and len(shape) != 4:
            return False, _rank4(g, node) or f"{t} is not 4-D"
        if not _broadcast_ok(out, shape):
            return False, (f"operand {t} {list(shape)} broadcast to {list(out)}: the DLA takes "
                           "equal shapes, one value, or one value per channel")  # fmt: skip
    return True, ""


def _div(g: _Graph, node: Any) -> tuple[bool, str]:
    hint = ""
    if g.const(node.input[1]) is not None:
        hint = "; the divisor is a constant: multiply by its reciprocal instead"
    return False, f"DLA cores do not support the {node.op_type.upper()} element-wise op{hint}"


def _concat(g: _Graph, node: Any) -> tuple[bool, str]:
    out = g.shape(node.output[0])
    axis = int(_attr(node, "axis", 1))
    if len(out) != 4:
        return False, _rank4(g, node)
    if axis % 4 != 1:
        return False, f"concatenation on axis {axis}: the DLA concatenates on C only"
    if len([t for t in node.input if t]) < 2:
        return False, "the DLA concatenates at least two inputs"
    return True, ""


def _resize(g: _Graph, node: Any) -> tuple[bool, str]:
    import numpy as np

    x, out = g.shape(node.input[0]), g.shape(node.output[0])
    if len(x) != 4:
        return False, _rank4(g, node)
    scales = g.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if scales is None or np.size(scales) == 0:
        if len(node.input) > 3 and g.const(node.input[3]) is not None:  # sizes: their ratios
            scales = np.array(out, np.float64) / np.array(x, np.float64)
        else:
            return False, "the DLA resizes by constant scales only"
    s = [float(v) for v in np.asarray(scales).ravel()]
    if len(s) != 4 or s[0] != 1 or s[1] != 1:
        return False, f"scales {s}: the DLA resizes H and W only"
    mode = _attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    top = 32 if mode == "nearest" else 4
    if mode not in ("nearest", "linear") or any(v != int(v) or not 1 <= v <= top for v in s[2:]):
        return False, (f"{mode} resize by {s[2:]}: the DLA upsamples by whole factors of 1..32 "
                       "(nearest) or 1..4 (linear)")  # fmt: skip
    ctm = _attr(node, "coordinate_transformation_mode", b"half_pixel")
    ctm = ctm.decode() if isinstance(ctm, bytes) else str(ctm)
    if mode == "nearest":
        nearest = _attr(node, "nearest_mode", b"round_prefer_floor")
        nearest = nearest.decode() if isinstance(nearest, bytes) else str(nearest)
        ok = {("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"),
              ("half_pixel", "round_prefer_ceil")}  # fmt: skip
        if (ctm, nearest) not in ok:
            return False, f"nearest resize with {ctm} / {nearest}: not a DLA combination"
    elif ctm not in ("half_pixel", "pytorch_half_pixel"):
        return False, f"linear resize with {ctm}: the DLA takes half_pixel"
    return True, ""


def _slice(g: _Graph, node: Any) -> tuple[bool, str]:
    if len(g.shape(node.input[0])) != 4:
        return False, _rank4(g, node)
    if node.op_type == "Split":
        sizes = node.input[1] if len(node.input) > 1 else ""
        if sizes and g.const(sizes) is None:
            return False, "split sizes must be build-time constants on the DLA"
        axes = [int(_attr(node, "axis", 0))]
    else:
        given = [t if i < len(node.input) else "" for i, t in enumerate(node.input[:5])]
        given += [""] * (5 - len(given))
        starts, ends, axes_t, steps_t = (g.const(t) for t in given[1:5])
        if (
            starts is None
            or ends is None
            or (given[3] and axes_t is None)
            or (given[4] and steps_t is None)
        ):
            return False, "slice starts, ends, axes and steps must be build-time constants"
        if steps_t is not None and any(int(v) != 1 for v in steps_t):
            return False, f"slice steps {list(steps_t)}: the DLA slices with stride 1"
        axes = [int(a) for a in axes_t] if axes_t is not None else list(range(len(starts)))
    if any(a % 4 == 0 for a in axes):
        return False, "slicing the batch dimension is not supported on the DLA"
    return True, ""


def _softmax(g: _Graph, node: Any) -> tuple[bool, str]:
    x = g.shape(node.input[0])
    if len(x) != 4:
        return False, _rank4(g, node)
    axis = int(_attr(node, "axis", -1)) % 4
    if axis == 0:
        return False, "softmax over the batch axis: the DLA takes C, H or W"
    others = [x[i] for i in (1, 2, 3) if i != axis]
    if all(o == 1 for o in others):
        if x[axis] > MAX_DIM:
            return False, f"softmax over {x[axis]} values: the DLA takes at most {MAX_DIM}"
        return True, ""
    if x[axis] > 1024:
        return False, (f"softmax over {x[axis]} values with other dims {others}: the DLA takes "
                       "at most 1024 then")  # fmt: skip
    return True, "approximated on the DLA (the error grows toward 1024 values)"


def _shuffle(g: _Graph, node: Any) -> tuple[bool, str]:
    if reason := _rank4(g, node):
        return False, reason
    if node.op_type == "Reshape":
        if g.const(node.input[1]) is None:
            return False, "a reshape to a shape computed at run time"
        near = {n.op_type for n in g.neighbours(node)} & {"Slice", "Split", "Concat"}
        if near:
            return False, (f"a reshape directly connected to {'/'.join(sorted(near))}: "
                           "this version of DLA does not support it")  # fmt: skip
    if node.op_type == "Transpose":
        perm = list(_attr(node, "perm", [3, 2, 1, 0]))
        if perm[0] != 0:
            return False, f"transpose {perm} moves the batch dimension"
    return True, ""


def _reduce(g: _Graph, node: Any) -> tuple[bool, str]:
    if node.op_type != "ReduceMax":
        return False, f"{node.op_type}: the DLA reduces with MAX only"
    if reason := _rank4(g, node):
        return False, reason
    axes = _attr(node, "axes", None)
    if axes is None and len(node.input) > 1:
        axes = g.const(node.input[1])
    if axes is None or any(int(a) % 4 == 0 for a in axes):
        return False, "a reduction over the batch axis: the DLA reduces C, H and W"
    return True, ""


def _matmul(g: _Graph, node: Any) -> tuple[bool, str]:
    if g.const(node.input[1]) is None:
        return False, ("MatMul of two activations is unsupported on the DLA (it runs weights "
                       "only, as a convolution)")  # fmt: skip
    return False, "a MatMul with constant weights runs on the DLA as a 1x1 Conv: rewrite it so"


def _four_d(g: _Graph, node: Any) -> tuple[bool, str]:
    """A layer the DLA runs on 4-D tensors (BatchNormalization as a Scale, Abs as a Unary)."""
    reason = _rank4(g, node)
    return not reason, reason


_RULES: Mapping[str, _Rule] = {
    "Conv": _conv, "ConvTranspose": _conv, "MaxPool": _pool, "AveragePool": _pool,
    **dict.fromkeys(_ACTIVATIONS, _activation), "Clip": _clip,
    **dict.fromkeys(_ELEMENTWISE, _elementwise), "Div": _div, "Pow": _div,
    "Concat": _concat, "Resize": _resize, "Slice": _slice, "Split": _slice,
    "Softmax": _softmax, **dict.fromkeys(_SHUFFLES, _shuffle),
    "ReduceMax": _reduce, "ReduceMean": _reduce, "ReduceSum": _reduce, "ReduceMin": _reduce,
    "MatMul": _matmul, "Gemm": _matmul, "BatchNormalization": _four_d, "Abs": _four_d,
}  # fmt: skip


def _general(g: _Graph, node: Any) -> str:
    """A general restriction ``node`` breaks (static shapes, dims, types), or ""."""
    for t in (*node.input, *node.output):
        if not t or g.const(t) is not None:
            continue
        shape = g.shape(t)
        if len(shape) >= 3 and any(d > MAX_DIM for d in shape[-3:]):
            return f"{t} {list(shape)}: a DLA tensor's C, H and W are at most {MAX_DIM}"
        if len(shape) > 3 and _numel(shape[:-3]) > MAX_BATCH:
            return f"{t} {list(shape)}: a DLA batch is at most {MAX_BATCH}"
    return ""


def check_graph(path: Path) -> DlaCheck:
    """Check every layer of the ONNX graph at ``path``. Raises CheckError."""
    g = _load(path)
    verdicts: list[LayerVerdict] = []
    on: dict[str, bool] = {}
    for node in g.model.graph.node:
        if node.op_type in _ALIASES or node.op_type == "Constant":
            continue
        rule = _RULES.get(node.op_type)
        name = node.name or (node.output[0] if node.output else node.op_type)
        try:
            if general := _general(g, node):
                dla, reason = False, general
            elif rule is None:
                dla, reason = False, f"no DLA support for {node.op_type}"
            else:
                dla, reason = rule(g, node)
        except (IndexError, TypeError, ValueError) as e:
            raise CheckError(f"{path}: node {name!r} ({node.op_type}) is malformed: {e}") from e
        out = g.shape(node.output[0]) if node.output else ()
        verdicts.append(LayerVerdict(name, node.op_type, out, _flops(g, node), dla, reason))
        on[name] = dla
    return DlaCheck(verdicts, _subgraphs(g, on))


def _subgraphs(g: _Graph, on: Mapping[str, bool]) -> int:
    """Connected components of DLA layers (edges through aliases)."""
    parent: dict[str, str] = {n: n for n, dla in on.items() if dla}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for node in g.model.graph.node:
        name = node.name or (node.output[0] if node.output else node.op_type)
        if name not in parent:
            continue
        for other in g.neighbours(node):
            o = other.name or (other.output[0] if other.output else other.op_type)
            if o in parent:
                parent[find(name)] = find(o)
    return len({find(n) for n in parent})


# ----------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``check-dla`` on an ``add_subparsers()`` object; returns the new parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "check-dla",
        help="which layers of an ONNX graph an Orin DLA runs, and why not",
        description="Per layer: does the DLA (Orin, TensorRT 10.x) run it, and which rule says "
        "not; the share of layers and FLOPs on the DLA (docs/check-dla.md).",
    )
    p.add_argument("onnx", type=Path, help="the ONNX graph (static shapes; Q/DQ or not)")
    p.add_argument("--json", type=Path, help="also write the verdicts as JSON here")
    p.add_argument("--all", action="store_true", help="list every layer, not only the GPU ones")
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``prep check-dla`` for parsed ``args``; returns the exit status (module docstring)."""
    out = out or sys.stdout
    try:
        if not args.onnx.is_file():
            raise CheckError(f"no such file: {args.onnx}")
        result = check_graph(args.onnx)
    except CheckError as e:
        print(f"prep check-dla: {e}", file=sys.stderr)
        return 2
    print_report(result, out, show_all=args.all)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"onnx": str(args.onnx), **result.to_dict()}, indent=2))
        print(f"wrote {args.json}", file=out)
    return 0 if result.all_on_dla else 1


def print_report(result: DlaCheck, out: TextIO, *, show_all: bool = False) -> None:
    """The layer table (the layers off the DLA, or all), then the summary lines."""
    rows = [layer for layer in result.layers if show_all or not layer.dla or layer.reason]
    if rows:
        width = max(len("layer"), *(len(layer.name) for layer in rows))
        print(f"{'layer':<{width}}  {'op':<13} {'output':<18} {'GFLOP':>7}  where  why", file=out)
        for layer in rows:
            shape = "x".join(map(str, layer.shape))
            where = "DLA" if layer.dla else "GPU"
            print(f"{layer.name:<{width}}  {layer.op:<13} {shape:<18} {layer.flops / 1e9:>7.3f}  "
                  f"{where:<5}  {layer.reason}", file=out)  # fmt: skip
        print("", file=out)
    n = len(result.layers)
    on = sum(layer.dla for layer in result.layers)
    print(f"on the DLA: {on} of {n} layers, {result.flops_on_dla:.1%} of "
          f"{sum(layer.flops for layer in result.layers) / 1e9:.2f} GFLOP; "
          f"{result.subgraphs} DLA subgraph(s)", file=out)  # fmt: skip
    if result.all_on_dla:
        print("every layer runs on the DLA: one cuDLA standalone loadable", file=out)
    else:
        ops = sorted({layer.op for layer in result.layers if not layer.dla})
        print(f"not on the DLA: {', '.join(ops)} (a standalone loadable needs every layer on "
              "the DLA: rewrite these or cut the graph before them)", file=out)  # fmt: skip
