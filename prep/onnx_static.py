"""An ONNX graph as TensorRT's builder sees it before choosing layers: static.

Shapes are inferred and constant subgraphs folded (onnx-graphsurgeon), repeatedly until nothing
changes: each fold can make more shapes, and so more folds, known. Ultralytics' ``chunk`` exports
as ``Shape -> Gather -> Div -> Slice``, which becomes a constant ``Split``. ``prep check-dla`` and
the latency model (``prep.latency_graph``) both read graphs through :func:`static_model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

__all__ = ["static_model"]


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
