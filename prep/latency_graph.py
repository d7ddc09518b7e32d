"""Graph analysis for the DLA latency model (``prep.latency``): what the DLA compiler would make
of a PTQ ONNX graph, before any timing constant is applied.

* **Constants fold away**: ``Constant`` nodes and nodes whose inputs are all constant (an
  ``Identity`` of a weight) are not layers; an ``Identity`` of an activation is an alias.
* **Fusion.** A Conv's SDP stage absorbs what follows it: SiLU (``Sigmoid`` + ``Mul``), a single
  activation, a per-channel constant scale/bias, and one residual ``Add`` whose other operand was
  produced before the Conv, and last a pool (on the fly: the SDP streams into the pooling
  engine), as long as the precisions agree and no intermediate tensor is read elsewhere or is a
  graph output. DLA 3.14 fuses INT8 SiLU into the conv (seed article).
* **In-place Concat.** Producers write straight into the channel slices of the output, so a
  channel Concat of same-precision inputs whose channel counts fill whole surface atoms costs
  nothing; an input that cannot be placed (a graph input, one already in another Concat, a
  misaligned one) is copied.
* **Precision transitions.** A tensor read by a layer of the other precision is converted once
  per target precision by an inserted ``Reformat`` step.
* **Storage.** The graph input is INT8 ``DLA_HWC4``; every other tensor is stored in the
  precision of the layer producing it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prep.onnx_static import head_nodes as heads_of
from prep.onnx_static import static_model

if TYPE_CHECKING:
    import onnx

Precision = Literal["int8", "fp16"]

SUPPORTED_OPS = frozenset(
    {
        "Conv", "Sigmoid", "Mul", "Add", "Sub", "Relu", "LeakyRelu", "Clip", "Tanh",
        "Concat", "MaxPool", "AveragePool", "Resize", "Identity",
        "Split", "Slice", "Softmax", "Transpose", "Reshape",
    }
)  # fmt: skip
_MOVES = frozenset({"Transpose", "Reshape"})  # data movement, priced as a resize pass
_SOFTMAX_PASSES = 3  # max, exp and sum, divide: three SDP passes over the tensor
_ACTIVATIONS = frozenset({"Sigmoid", "Relu", "LeakyRelu", "Clip", "Tanh"})
_LUT_OPS = frozenset({"Sigmoid", "Tanh"})  # the SDP's lookup table; ReLU, clip: its ALUs
_POOLS = frozenset({"MaxPool", "AveragePool"})
_ELEMENTWISE = frozenset({"Mul", "Add", "Sub"})
ELT_BYTES: dict[str, int] = {"int8": 1, "fp16": 2}


class LatencyModelError(ValueError):
    """The graph or the arguments cannot be estimated (message says which node or name)."""


class UnsupportedOpError(LatencyModelError):
    """The graph holds ops the DLA (and so this model) does not run; ``nodes`` lists them."""

    def __init__(self, nodes: Sequence[tuple[str, str]]) -> None:
        self.nodes = tuple(nodes)
        listed = ", ".join(f"{name} ({op})" for name, op in self.nodes[:10])
        more = f" and {len(self.nodes) - 10} more" if len(self.nodes) > 10 else ""
        super().__init__(
            f"{len(self.nodes)} node(s) the DLA latency model does not support: {listed}{more}"
            f"; supported ops: {', '.join(sorted(SUPPORTED_OPS))}"
        )


@dataclass
class TensorInfo:
    """An activation tensor of one batch item, as the DLA stores it."""

    c: int
    h: int
    w: int
    precision: Precision
    image: bool = False  # the DLA_HWC4 graph input
    graph_io: bool = False

    def bytes(self, surface_atom_bytes: int) -> int:
        """Bytes of the surface: channels padded to ``surface_atom_bytes`` (HWC4: rows to 64 B)."""
        elt = ELT_BYTES[self.precision]
        if self.image:  # DLA_HWC4: C' = 1 or 4, rows of W padded to 64 bytes
            c4 = 1 if self.c == 1 else 4
            per_row = 64 // (c4 * elt)
            return self.h * (-(-self.w // per_row) * per_row) * c4 * elt
        atom = surface_atom_bytes // elt
        return -(-self.c // atom) * atom * self.h * self.w * elt

    def padded_elems(self, surface_atom_bytes: int) -> int:
        return self.bytes(surface_atom_bytes) // ELT_BYTES[self.precision]


@dataclass
class Step:
    """One hardware layer: what it reads/writes and what its engine has to do."""

    name: str
    op: str
    precision: Precision
    engine: Literal["conv", "sdp", "pdp", "resize", "copy"]
    reads: list[str] = field(default_factory=list)
    write: str | None = None
    macs: int = 0
    # Conv only: (output H*W, K, C_in per group, kh, kw, groups, C_in).
    geometry: tuple[int, int, int, int, int, int, int] = (0, 0, 0, 0, 0, 1, 0)
    weight_bytes: int = 0
    copies: list[str] = field(default_factory=list)  # Concat inputs copied into the output
    passes: int = 1  # SDP passes over the tensor (a Softmax makes three)
    lut: bool = False  # the SDP stage needs its lookup table (Sigmoid, Tanh, a fused SiLU)
    # Conv only: the tensor the SDP stage passes when a pool is fused on the fly (the conv's own
    # output, before pooling); None: the step's ``write``.
    sdp_tensor: str | None = None


@dataclass
class Row:
    """One line of the result: an ONNX node or an inserted ``Reformat``."""

    name: str
    op: str
    precision: Precision
    step: Step | None  # None: fused or in place, no cost of its own
    fused_into: str | None = None
    in_place: bool = False


@dataclass
class LatencyPlan:
    """A graph analysed once (shapes, fusion, precisions, buffers); cheap to cost many times."""

    rows: list[Row]
    tensors: dict[str, TensorInfo]
    buffer_of: dict[str, str]  # tensor -> buffer root (in-place Concat groups share one buffer)
    items: int  # the graph's own batch dimension
    surface_atom_bytes: int  # the value the in-place Concat decisions were made with


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _chw(name: str, dims: Sequence[int]) -> tuple[int, int, int, int]:
    if len(dims) < 2 or len(dims) > 4 or any(d <= 0 for d in dims):
        raise LatencyModelError(f"tensor {name!r} needs a static shape of rank 2-4, got {dims}")
    rest = [*dims[1:], 1, 1][:3]
    return dims[0], rest[0], rest[1], rest[2]


def plan_graph(
    model: onnx.ModelProto | str | Path,
    *,
    fp16_nodes: Iterable[str] = (),
    heads: Precision = "fp16",
    head_nodes: Sequence[str] | None = None,
    surface_atom_bytes: int = 32,
) -> LatencyPlan:
    """Analyse ``model`` for ``prep.latency.estimate_plan``; the arguments are those of
    ``prep.latency.estimate`` (``surface_atom_bytes``: see ``DlaParams``; it decides which
    Concats can be in place).

    Raises:
        UnsupportedOpError: a node the DLA does not run.
        LatencyModelError: unknown names in ``fp16_nodes``/``head_nodes``, a bad ``heads``, a
            tensor without a static shape, or a file that is not ONNX.
    """
    import onnx
    from google.protobuf.message import DecodeError

    if heads not in ("int8", "fp16"):
        raise LatencyModelError(f"heads must be 'int8' or 'fp16', got {heads!r}")
    if not isinstance(model, onnx.ModelProto):
        try:
            model = onnx.load(str(model), load_external_data=False)
        except (OSError, DecodeError, ValueError) as e:
            raise LatencyModelError(f"cannot read ONNX model {model}: {e}") from e
    # A graph that computes shapes (Ultralytics' chunk: Shape -> Gather -> Div -> Slice) is
    # folded as the builder folds it; any other keeps its node order, which the SRAM placement
    # follows. Ops that cannot be typed are reported below as unsupported, shapes that cannot
    # be inferred as "needs a static shape".
    if any(node.op_type == "Shape" for node in model.graph.node):
        try:
            model = static_model(model)
        except Exception as e:  # onnx-graphsurgeon and onnx raise their own classes
            raise LatencyModelError(f"the graph cannot be folded to static shapes: {e}") from e
    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    dims: dict[str, list[int]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        dims[vi.name] = [
            d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim
        ]
    consts: dict[str, list[int]] = {i.name: list(i.dims) for i in g.initializer}

    # Constant subgraphs (Constant, Identity of a weight, shape arithmetic) fold away at build.
    nodes: list[onnx.NodeProto] = []
    alias: dict[str, str] = {}
    for node in g.node:
        ins = [alias.get(i, i) for i in node.input if i]
        if node.op_type == "Constant" or (ins and all(i in consts for i in ins)):
            for o in node.output:
                consts[o] = consts[ins[0]] if node.op_type == "Identity" else dims.get(o, [])
            continue
        if node.op_type == "Identity":
            alias[node.output[0]] = ins[0]
            continue
        nodes.append(node)
    bad = [(n.name, n.op_type) for n in nodes if n.op_type not in SUPPORTED_OPS]
    if bad:
        raise UnsupportedOpError(bad)
    for i, node in enumerate(nodes):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
    names = {n.name for n in nodes}

    def res(t: str) -> str:
        return alias.get(t, t)

    graph_outputs = {res(o.name) for o in g.output}
    producer = {res(o): n for n in nodes for o in n.output}
    if head_nodes is None:
        head_nodes = heads_of(graph_outputs, producer)
    fp16 = set(fp16_nodes)
    unknown = sorted((fp16 | set(head_nodes)) - names)
    if unknown:
        raise LatencyModelError(f"no node named {', '.join(map(repr, unknown))} in the graph")
    prec: dict[str, Precision] = {n.name: "fp16" if n.name in fp16 else "int8" for n in nodes}
    for name in head_nodes:
        prec[name] = heads  # the head choice decides, whatever the translator listed

    pos = {res(o): k for k, n in enumerate(nodes) for o in n.output}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for t in dict.fromkeys(res(i) for i in n.input if i):
            users.setdefault(t, []).append(n)

    # Fusion chains: Conv -> [SiLU | activation | constant scale/bias | one residual Add]*.
    fused: dict[str, str] = {}
    chain_out: dict[str, str] = {}
    chain_lut: set[str] = set()
    pre_pool: dict[str, str] = {}  # host conv -> its output before a pool fused on the fly
    extra_reads: dict[str, list[str]] = {}
    const_bytes: dict[str, int] = {}
    for k, host in enumerate(nodes):
        if host.op_type != "Conv":
            continue
        cur, has_add = res(host.output[0]), False
        while cur not in graph_outputs:
            us = users.get(cur, [])
            if any(prec[u.name] != prec[host.name] for u in us):
                break
            sig = [u for u in us if u.op_type == "Sigmoid"]
            if len(us) == 2 and len(sig) == 1:
                mul = next(u for u in us if u is not sig[0])
                s_out = res(sig[0].output[0])
                if (
                    mul.op_type == "Mul"
                    and {res(i) for i in mul.input} == {cur, s_out}
                    and users.get(s_out) == [mul]
                    and s_out not in graph_outputs
                ):
                    fused[sig[0].name] = fused[mul.name] = host.name
                    cur = res(mul.output[0])
                    chain_lut.add(host.name)
                    continue
                break
            if len(us) != 1:
                break
            u = us[0]
            if u.op_type in _ACTIVATIONS and res(u.input[0]) == cur:
                fused[u.name], cur = host.name, res(u.output[0])
                if u.op_type in _LUT_OPS:
                    chain_lut.add(host.name)
                continue
            if u.op_type in _POOLS:
                # On-the-fly pooling: the SDP's output streams into the pooling engine, so the
                # conv writes the pooled tensor only. It ends the chain.
                pre_pool[host.name] = cur
                fused[u.name], cur = host.name, res(u.output[0])
                break
            if u.op_type in _ELEMENTWISE and len(u.input) == 2:
                other = [res(i) for i in u.input if res(i) != cur]
                if not other or other[0] in consts:
                    n_const = math.prod(consts[other[0]]) if other else 0
                    const_bytes[host.name] = const_bytes.get(host.name, 0) + 4 * n_const
                    fused[u.name], cur = host.name, res(u.output[0])
                    continue
                if u.op_type == "Add" and not has_add and pos.get(other[0], -1) < k:
                    extra_reads.setdefault(host.name, []).append(other[0])
                    fused[u.name], cur, has_add = host.name, res(u.output[0]), True
                    continue
            break
        chain_out[host.name] = cur

    # Tensors: shapes and the precision they are stored in.
    tensors: dict[str, TensorInfo] = {}
    items = 1
    for inp in g.input:
        if inp.name in consts:
            continue
        n_, c, h, w = _chw(inp.name, dims.get(inp.name, []))
        items = n_
        tensors[inp.name] = TensorInfo(c, h, w, "int8", image=c <= 4, graph_io=True)

    def add_tensor(name: str, precision: Precision) -> None:
        _, c, h, w = _chw(name, dims.get(name, []))
        tensors[name] = TensorInfo(c, h, w, precision, graph_io=name in graph_outputs)

    rows: list[Row] = []
    converted: dict[tuple[str, str], str] = {}

    def operand(t: str, p: Precision) -> str:
        """Name of ``t`` as layer precision ``p`` reads it; inserts a Reformat step if needed."""
        if tensors[t].precision == p:
            return t
        key = (t, p)
        if key not in converted:
            name = f"{t} -> {p}"
            src = tensors[t]
            tensors[name] = TensorInfo(src.c, src.h, src.w, p)
            step = Step(f"Reformat {name}", "Reformat", p, "sdp", reads=[t], write=name)
            rows.append(Row(step.name, "Reformat", p, step))
            converted[key] = name
        return converted[key]

    buffer_of: dict[str, str] = {}
    for node in nodes:
        p = prec[node.name]
        if node.name in fused:
            rows.append(Row(node.name, node.op_type, p, None, fused_into=fused[node.name]))
            continue
        op = node.op_type
        data_ins = [res(i) for i in node.input if i and res(i) not in consts]
        missing = [t for t in data_ins if t not in tensors]
        if missing:
            raise LatencyModelError(f"{node.name}: inputs {missing} have no known producer/shape")
        out = chain_out.get(node.name, res(node.output[0]))
        add_tensor(out, p)
        if op == "Conv":
            x = data_ins[0]
            ins = [operand(x, p)] + [operand(t, p) for t in extra_reads.get(node.name, [])]
            w_dims = consts.get(res(node.input[1]))
            if not w_dims or len(w_dims) != 4:
                raise LatencyModelError(f"{node.name}: Conv weight must be a constant 4-D tensor")
            k_out, cin_g, kh, kw = w_dims
            group = int(_attr(node, "group", 1))
            o = tensors[out]
            hw = o.h * o.w
            macs = hw * k_out * cin_g * kh * kw
            step = Step(node.name, op, p, "conv", reads=ins, write=out, macs=macs)
            if node.name in pre_pool:
                # The conv's own output shape: the SDP passes it, the pool writes ``out``.
                step.sdp_tensor = pre_pool[node.name]
                add_tensor(step.sdp_tensor, p)
                o = tensors[step.sdp_tensor]
                hw = o.h * o.w
                macs = hw * k_out * cin_g * kh * kw
                step.macs = macs
            step.lut = node.name in chain_lut
            step.geometry = (hw, k_out, cin_g, kh, kw, group, tensors[x].c)
            bias = 4 * k_out if len(node.input) > 2 and node.input[2] else 0
            step.weight_bytes = k_out * cin_g * kh * kw * ELT_BYTES[p] + bias
            step.weight_bytes += const_bytes.get(node.name, 0)
        elif op == "Concat":
            axis = int(_attr(node, "axis", 1))
            channel = axis in (1, -3) and len(dims[out]) == 4
            step = Step(node.name, op, p, "copy", write=None)
            buffer_of.setdefault(out, out)
            atom = surface_atom_bytes // ELT_BYTES[p]
            for j, t in enumerate(data_ins):
                t2 = operand(t, p)
                last = j == len(data_ins) - 1
                aligned = last or tensors[t2].c % atom == 0
                in_place = (
                    channel
                    and aligned
                    and not tensors[t2].graph_io
                    and buffer_of.get(t2, t2) == t2
                    and not tensors[out].graph_io
                )
                if in_place:
                    buffer_of[t2] = out
                else:
                    step.copies.append(t2)
            if step.copies:
                step.reads, step.write = list(step.copies), out
        elif op in ("Split", "Slice"):
            # A copy of each part: it reads its share of the input and writes the part.
            x = operand(data_ins[0], p)
            parts = [res(o) for o in node.output if o]
            for k, part in enumerate(parts):
                if part not in tensors:
                    add_tensor(part, p)
                share = f"{x}[{part}]"
                tensors[share] = TensorInfo(tensors[part].c, tensors[part].h, tensors[part].w,
                                            tensors[x].precision)  # fmt: skip
                buffer_of[share] = x
                piece = Step(node.name if k == 0 else f"{node.name}:{k}", op, p, "copy",
                             reads=[share], write=part)  # fmt: skip
                if k == 0:
                    step = piece
                else:
                    rows.append(Row(piece.name, op, p, piece))
        else:
            ins = [operand(t, p) for t in data_ins]
            engine: Literal["sdp", "pdp", "resize"] = (
                "pdp" if op in ("MaxPool", "AveragePool")
                else "resize" if op == "Resize" or op in _MOVES else "sdp"
            )  # fmt: skip
            step = Step(node.name, op, p, engine, reads=ins, write=out, lut=op in _LUT_OPS)
            if op == "Softmax":
                step.passes = _SOFTMAX_PASSES
        if step.write is None:
            rows.append(Row(node.name, op, p, None, in_place=True))
        else:
            rows.append(Row(node.name, op, p, step))
    # Buffers merged into a Concat point at the Concat's output; make every link direct.
    for t in list(buffer_of):
        root = t
        while buffer_of.get(root, root) != root:
            root = buffer_of[root]
        buffer_of[t] = root
    return LatencyPlan(rows, tensors, buffer_of, items, surface_atom_bytes)
