"""The torch GPU engine's program: the float model rebuilt from an emulated loadable's integers,
exported with ``torch.export`` as a ``.pt2``.

``prep torch-export --loadable X.emu --out X.pt2 [--max-batch 16]`` writes what
``dlad.devices.torch_gpu.TorchGpu`` serves. It starts from the loadable, not from a checkpoint,
so the GPU computes the same model as the DLA cores, weight for weight:

1. :func:`graph_convs` reads every ``Conv`` of the loadable's INT8 graph
   (``prep/emulate_graph.py``) and its float parameters *from the integers the DLA runs*: an
   INT8 conv's weight is ``int8 * scale`` per output channel (``<node>/weight/int8`` and
   ``/scale`` behind a DequantizeLinear), its bias ``int32 * scale`` (``<node>/bias/...``), both
   computed in float64 and rounded once to float32; an FP16 conv (the heads of an ``fp16``
   loadable) holds its fp16-rounded float weights directly.
2. :func:`reconstruct_model` builds the fused :class:`prep.model.YOLOv5` of the variant the
   first conv's width implies (:func:`infer_variant`), with the loadable's classes and anchors,
   maps each graph Conv to its module by the ONNX exporter's scope name (``/model.2/m/m.0/cv1/
   conv/Conv`` is ``model.2.m.0.cv1.conv``, :func:`module_path`), checks kernel, stride, padding,
   groups and shape, and loads the parameters. Every conv of the model must get one and every
   graph Conv must be used, or :class:`TorchExportError` names the ones left over.
3. :class:`Hwc4Detector` wraps it for the DLA's input: ``DLA_HWC4`` int8 frames
   ``[B, H, W', C']`` in, ``q[..., :W, :3] * input_scale`` (float32, rounded to fp16), the model
   in FP16 on channels-last activations (the input's own layout), the heads in contiguous
   float32 ``[B, C, H, W]`` out, in ``loadable.outputs`` order.
4. :func:`export_torch` exports it with ``torch.export.export`` (batch dimension dynamic,
   1..``max_batch``; on the CPU, in FP16: export traces with fake tensors, and CPU kernels exist
   for every op if the program is run there) and saves it with ``torch.export.save``, the
   metadata that ``dlad.devices.torch_gpu`` documents and checks stored as its extra file
   ``dlad.json``, atomically.

The program is device-neutral: ``TorchGpu`` moves it to the GPU when it loads it. A ``.pt2`` is
tied to the torch version's serialisation format; export it with the torch that will load it
(``bench/torch_gpu_batches.py`` exports on the GPU host itself).

Errors: :class:`TorchExportError` (a ValueError) for a loadable this cannot rebuild,
``dlad.loadable.LoadableError`` (a ValueError) for a file that is no loadable, OSError for a file
that cannot be read or written, :class:`TorchExportFailure` (a RuntimeError) when torch.export
itself fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from dlad.devices.torch_gpu import METADATA_FILE, frame_shape, program_metadata
from dlad.loadable import Loadable, read_loadable
from prep.model import STRIDES, VARIANTS, YOLOv5, _channels

__all__ = [
    "ConvParams",
    "Hwc4Detector",
    "TorchExportError",
    "TorchExportFailure",
    "export_torch",
    "graph_convs",
    "infer_variant",
    "module_path",
    "reconstruct_model",
]

_PASS_THROUGH = frozenset({"Identity", "Cast"})
"""Nodes between a constant and a Conv that leave its float value as it is (an fp16-rounded
weight cast to float and back is the same number)."""


class TorchExportError(ValueError):
    """The loadable's graph cannot be rebuilt as a YOLOv5: the message names the node or module
    at fault."""


class TorchExportFailure(RuntimeError):
    """``torch.export`` could not export the rebuilt model (a torch limitation, not the input)."""


@dataclass(frozen=True)
class ConvParams:
    """One graph Conv: its float32 parameters (from the integers) and its geometry."""

    node: str
    weight: np.ndarray
    bias: np.ndarray | None
    strides: tuple[int, ...]
    pads: tuple[int, ...]
    dilations: tuple[int, ...]
    group: int


# ----------------------------------------------------------------------------- the graph


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _constant(
    name: str,
    producers: Mapping[str, onnx.NodeProto],
    inits: Mapping[str, onnx.TensorProto],
    what: str,
) -> np.ndarray:
    """The float value of the constant ``name`` feeds a Conv with: an initializer, or a
    DequantizeLinear of initializers (``(q - zero_point) * scale`` along its axis), through any
    Identity/Cast nodes; computed in float64."""
    seen = 0
    while name not in inits and name in producers and producers[name].op_type in _PASS_THROUGH:
        name, seen = producers[name].input[0], seen + 1
        if seen > 16:
            break
    if name in inits:
        return np.asarray(numpy_helper.to_array(inits[name]), dtype=np.float64)
    node = producers.get(name)
    if node is None or node.op_type != "DequantizeLinear":
        op = "a graph input" if node is None else f"a {node.op_type} node"
        raise TorchExportError(
            f"{what} comes from {op} ({name!r}), not an initializer or a DequantizeLinear of one"
        )
    missing = [i for i in node.input if i and i not in inits]
    if missing:
        raise TorchExportError(f"{what}: DequantizeLinear {node.name!r} reads non-constants "
                               f"{missing}")  # fmt: skip
    q = numpy_helper.to_array(inits[node.input[0]]).astype(np.float64)
    scale = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
    zero = (
        numpy_helper.to_array(inits[node.input[2]]).astype(np.float64)
        if len(node.input) > 2 and node.input[2]
        else np.zeros_like(scale)
    )
    if scale.ndim == 1 and q.ndim > 0:  # per-axis: broadcast along ``axis`` (ONNX default 1)
        axis = int(_attrs(node).get("axis", 1)) % q.ndim
        shape = [1] * q.ndim
        shape[axis] = -1
        if q.shape[axis] != scale.size:
            raise TorchExportError(
                f"{what}: {scale.size} scales for {q.shape[axis]} channels on axis {axis}"
            )
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return (q - zero) * scale


def graph_convs(graph: bytes) -> list[ConvParams]:
    """Every Conv of an INT8 emulation graph, in graph order, with float32 parameters rebuilt
    from the integers it stores (module docstring). Raises TorchExportError for a graph that is
    not ONNX or a Conv whose parameters are not constants."""
    try:
        model = onnx.load_from_string(graph)
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise TorchExportError(f"the loadable's graph is not an ONNX model: {exc}") from exc
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    out = []
    for node in g.node:
        if node.op_type != "Conv":
            continue
        if len(node.input) < 2:
            raise TorchExportError(f"Conv {node.name!r} has no weight input")
        a = _attrs(node)
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise TorchExportError(f"Conv {node.name!r}: auto_pad {a['auto_pad']!r} is not used "
                                   "by YOLOv5's export")  # fmt: skip
        weight = _constant(node.input[1], producers, inits, f"Conv {node.name!r} weight")
        bias = (
            _constant(node.input[2], producers, inits, f"Conv {node.name!r} bias")
            if len(node.input) > 2 and node.input[2]
            else None
        )
        if weight.ndim != 4 or (bias is not None and bias.shape != (weight.shape[0],)):
            raise TorchExportError(
                f"Conv {node.name!r}: weight {weight.shape} and bias "
                f"{None if bias is None else bias.shape} are not a 2-D convolution's"
            )
        spatial = weight.ndim - 2
        out.append(
            ConvParams(
                node=node.name,
                weight=weight.astype(np.float32),
                bias=None if bias is None else bias.astype(np.float32),
                strides=tuple(a.get("strides", [1] * spatial)),
                pads=tuple(a.get("pads", [0] * 2 * spatial)),
                dilations=tuple(a.get("dilations", [1] * spatial)),
                group=int(a.get("group", 1)),
            )
        )
    if not out:
        raise TorchExportError("the loadable's graph has no Conv nodes")
    return out


def module_path(node_name: str, modules: Mapping[str, object]) -> str | None:
    """The qualified name (in ``modules``) of the module an ONNX node name's scopes denote, or
    None if none or several fit.

    The TorchScript exporter names a node ``/<scope>/.../<Op>``, one scope per *called* module,
    each the module's qualified name from its first non-numeric atom on (``model.2``, ``m``,
    ``m.0``, ``cv1``, ``conv``): a scope either extends the path so far, or restates its tail
    (``m.0`` after ``m``). Both readings are tried against ``modules``.
    """
    scopes = node_name.strip("/").split("/")[:-1]  # the last part is the op
    if not scopes or not all(scopes):
        return None
    path: list[str] = []
    for scope in scopes:
        atoms = scope.split(".")
        candidates = [path + atoms] + [
            path[:-k] + atoms for k in range(1, len(path) + 1) if path[-k:] == atoms[:k]
        ]
        found = {".".join(c) for c in candidates if ".".join(c) in modules}
        if len(found) != 1:
            return None
        path = found.pop().split(".")
    return ".".join(path)


def infer_variant(convs: Sequence[ConvParams]) -> str:
    """The YOLOv5 size whose stem (``model.0.conv``, the first Conv, 3 input channels) has the
    graph's first Conv's output channels. Raises TorchExportError if none has."""
    first = convs[0]
    by_width = {_channels(64, v.width): name for name, v in VARIANTS.items()}
    c_out, c_in = first.weight.shape[:2]
    if c_in != 3 or c_out not in by_width:
        known = ", ".join(f"{n}: {c}" for c, n in by_width.items())
        raise TorchExportError(
            f"the first Conv {first.node!r} maps 3 channels to one of the YOLOv5 stems ({known}); "
            f"it maps {c_in} to {c_out}"
        )
    return by_width[c_out]


def _load_conv(module: nn.Conv2d, p: ConvParams, path: str) -> None:
    k = tuple(module.kernel_size)
    want = {
        "weight": tuple(module.weight.shape),
        "strides": tuple(module.stride),
        "pads": (*module.padding, *module.padding),
        "dilations": tuple(module.dilation),
        "group": module.groups,
    }
    got = {
        "weight": p.weight.shape,
        "strides": p.strides,
        "pads": p.pads,
        "dilations": p.dilations,
        "group": p.group,
    }
    diff = [f"{key} {got[key]} (model: {want[key]})" for key in want if got[key] != want[key]]
    if diff:
        raise TorchExportError(
            f"Conv {p.node!r} does not fit {path} (kernel {k}): " + "; ".join(diff)
        )
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(p.weight))
        if module.bias is not None:
            bias = np.zeros(p.weight.shape[0], np.float32) if p.bias is None else p.bias
            module.bias.copy_(torch.from_numpy(bias))
        elif p.bias is not None and np.any(p.bias):
            raise TorchExportError(f"Conv {p.node!r} has a bias, {path} has none")


def reconstruct_model(loadable: Loadable) -> YOLOv5:
    """The fused float32 YOLOv5 (eval mode) whose every conv holds the parameters
    ``loadable``'s graph computes with (module docstring). Raises TorchExportError if the graph
    and the model do not correspond conv for conv."""
    if tuple(loadable.strides) != STRIDES[: len(loadable.strides)] or len(loadable.strides) != 3:
        raise TorchExportError(
            f"loadable {loadable.name!r} has heads at strides {loadable.strides}; YOLOv5 has "
            f"{STRIDES}"
        )
    convs = graph_convs(loadable.sections["graph"])
    variant = infer_variant(convs)
    model = YOLOv5(variant, loadable.num_classes, loadable.anchors_px).fuse().eval()
    modules = dict(model.named_modules())
    targets = {name for name, m in modules.items() if isinstance(m, nn.Conv2d)}
    loaded: dict[str, str] = {}
    unmatched: list[str] = []
    for p in convs:
        path = module_path(p.node, modules)
        module = modules.get(path) if path is not None else None
        if path is None or not isinstance(module, nn.Conv2d):
            unmatched.append(p.node)
            continue
        if path in loaded:
            raise TorchExportError(f"Convs {loaded[path]!r} and {p.node!r} both map to {path}")
        _load_conv(module, p, path)
        loaded[path] = p.node
    if unmatched:
        raise TorchExportError(
            f"{len(unmatched)} graph Conv(s) match no convolution of YOLOv5{variant} "
            f"({loadable.num_classes} classes): {unmatched[:8]}"
        )
    if missing := sorted(targets - set(loaded)):
        raise TorchExportError(
            f"the graph has no Conv for {len(missing)} convolution(s) of YOLOv5{variant}: "
            f"{missing[:8]} (a graph of another model, or a truncated one)"
        )
    return model


# ----------------------------------------------------------------------------- the program


class Hwc4Detector(nn.Module):
    """A fused YOLOv5 (heads at strides 8/16/32) behind the DLA's input: takes a ``DLA_HWC4``
    int8 batch ``[B, H, W', C']`` as ``quantize_hwc4`` writes it for ``loadable``, returns the
    heads as float32 ``[B, C, H, W]`` in ``loadable.outputs`` order, computing in FP16 (float32
    with ``fp16=False``). Raises TorchExportError for a loadable whose input is not 3-channel.
    """

    input_scale: torch.Tensor

    def __init__(self, model: nn.Module, loadable: Loadable, *, fp16: bool = True) -> None:
        super().__init__()
        inp = loadable.inputs[0]
        if inp.c != 3:
            raise TorchExportError(f"input {inp.name!r} has {inp.c} channels; YOLOv5 takes 3")
        self.dtype = torch.float16 if fp16 else torch.float32
        # The weights are saved in the default layout (torch.export.save warns about
        # channels-last ones); TorchGpu makes them channels-last when it loads the program.
        self.model = model.to(self.dtype).eval()
        self.register_buffer("input_scale", torch.tensor(loadable.input_scale, dtype=torch.float32))
        self.width = inp.w
        self.order = tuple(STRIDES.index(s) for s in loadable.strides)

    def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # q * s in float32 (exact for int8 q, one rounding), then rounded to the model's
        # precision: the dequantised input the DLA's first conv reads, as fp16.
        x = q[:, :, : self.width, :3].to(torch.float32) * self.input_scale
        # Channels-last (NHWC), the input's own layout: cuDNN's fp16 tensor-core kernels, and
        # the CPU's fp16 kernels (several times over), are fastest on it.
        x = x.permute(0, 3, 1, 2).to(self.dtype, memory_format=torch.channels_last)
        heads = self.model(x)
        return tuple(heads[i].to(torch.float32).contiguous() for i in self.order)


def _export(detector: nn.Module, loadable: Loadable, max_batch: int) -> Any:
    example_batch = min(2, max_batch)  # 2: a batch of 1 would specialise the dimension
    example = torch.zeros((example_batch, *frame_shape(loadable)), dtype=torch.int8)
    dynamic = {"q": {0: torch.export.Dim("batch", min=1, max=max_batch)}} if max_batch > 1 else None
    try:
        return torch.export.export(detector, (example,), dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # torch.export's errors share no base class
        raise TorchExportFailure(
            f"torch {torch.__version__} could not export {loadable.name!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def export_torch(
    loadable_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    max_batch: int = 16,
) -> Path:
    """Export the model of the emulated loadable at ``loadable_path`` as a ``.pt2`` at
    ``out_path`` (module docstring), for batches of 1..``max_batch``; returns ``out_path``.
    Its directory is created if missing; the file is replaced atomically.

    Raises ValueError for ``max_batch < 1``; OSError if the loadable cannot be read or the
    output written; ``LoadableError`` for a file that is no valid emulated loadable;
    TorchExportError for one this cannot rebuild; TorchExportFailure if torch.export fails.
    """
    raw: object = max_batch  # checked as untyped: callers need not be type-checked
    if not isinstance(raw, int) or isinstance(raw, bool) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    src = Path(loadable_path)
    data = src.read_bytes()
    loadable = read_loadable(data, source_name=str(src))
    model = reconstruct_model(loadable)
    program = _export(Hwc4Detector(model, loadable), loadable, max_batch)
    meta = program_metadata(
        loadable,
        max_batch=max_batch,
        source=src.name,
        source_sha256=hashlib.sha256(data).hexdigest(),
        variant=model.variant,
        torch_version=str(torch.__version__),
    )
    target = Path(out_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp.pt2", dir=target.parent)
    os.close(fd)
    try:
        torch.export.save(program, tmp, extra_files={METADATA_FILE: json.dumps(meta, indent=1)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target
