"""An ONNX graph as TensorRT's builder sees it before choosing layers: static.

Shapes are inferred and constant subgraphs folded (onnx-graphsurgeon), repeatedly until nothing
changes: each fold can make more shapes, and so more folds, known. Ultralytics' ``chunk`` exports
as ``Shape -> Gather -> Div -> Slice``, which becomes a constant ``Split``. ``prep check-dla`` and
the latency model (``prep.latency_graph``) both read graphs through :func:`static_model`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

__all__ = ["head_nodes", "static_model"]


def head_nodes(outputs: Iterable[str], producer: Mapping[str, onnx.NodeProto]) -> list[str]:
    """The nodes that compute a model's heads (the ones ``heads="fp16"`` runs in FP16): each
    output's producer and, where that is a ``Concat`` (a DFL family's head: its box and class
    convs side by side), the producers of its inputs. ``producer``: tensor -> its node."""
    found: dict[str, None] = {}
    for out in outputs:
        node = producer.get(out)
        if node is None:
            continue
        found[node.name] = None
        if node.op_type == "Concat":
            found.update((producer[t].name, None) for t in node.input if t in producer)
    return list(found)


def static_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its constant subgraphs folded and its shapes inferred (a new model).
    Raises what onnx-graphsurgeon and onnx's shape inference raise for a malformed graph."""
    import onnx_graphsurgeon as gs
    from onnx import shape_inference

    count = -1
    while count != len(model.graph.node):
        count = len(model.graph.node)
        graph = gs.import_onnx(shape_inference.infer_shapes(model))
        graph.fold_constants().cleanup().toposort()
        model = gs.export_onnx(graph)
    return shape_inference.infer_shapes(model)
