"""ONNX export of float and QAT detectors: input ``images``, the three raw heads as outputs.

The QAT model exports with QuantizeLinear/DequantizeLinear pairs (int8, symmetric, zero point 0;
per-channel on weights with ``axis=0``). ModelOpt's quantizers leave float->float ``Cast`` nodes
in the traced graph (one per re-used input); they are identities and are removed here so that
the Q/DQ translator and TensorRT see each tensor under its producer's name.

The legacy TorchScript exporter (``dynamo=False``) is used on purpose: the dynamo exporter fails
on ModelOpt's quantizers with a data-dependent guard.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

HEAD_NAMES = ("s8", "s16", "s32")
INPUT_NAME = "images"
OPSET = 13


def export_onnx(
    model: nn.Module,
    path: Path,
    image_size: int,
    *,
    batch: int = 1,
    opset: int = OPSET,
) -> onnx.ModelProto:
    """Export ``model`` (float or quantized) with a static ``[batch, 3, S, S]`` input.

    Returns the cleaned model, which is also written to ``path``.
    """
    model = model.eval()
    x = torch.zeros(batch, 3, image_size, image_size)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # The TorchScript tracer warns about every data-dependent branch in the quantizers.
        warnings.simplefilter("ignore")
        raw = Path(tmp) / "model.onnx"
        torch.onnx.export(
            model,
            (x,),
            raw,
            opset_version=opset,
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=list(HEAD_NAMES),
            do_constant_folding=True,
        )
        proto = remove_identity_casts(onnx.load(str(raw)))
    onnx.checker.check_model(proto)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))
    return proto


def remove_identity_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop ``Cast`` nodes whose input already has the target type; rewire their consumers.

    A Cast that produces a graph output is kept (its name is part of the interface).
    """
    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    elem: dict[str, int] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        elem[vi.name] = vi.type.tensor_type.elem_type
    for init in g.initializer:
        elem[init.name] = init.data_type
    outputs = {o.name for o in g.output}
    rename: dict[str, str] = {}
    keep = []
    for node in g.node:
        if node.op_type == "Cast" and node.output[0] not in outputs:
            to = next(a.i for a in node.attribute if a.name == "to")
            src = rename.get(node.input[0], node.input[0])
            if elem.get(src) == to:
                rename[node.output[0]] = src
                continue
        keep.append(node)
    for node in keep:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del g.node[:]
    g.node.extend(keep)
    dropped = set(rename)
    kept_vi = [vi for vi in g.value_info if vi.name not in dropped]
    del g.value_info[:]
    g.value_info.extend(kept_vi)
    return model


def count_ops(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))
