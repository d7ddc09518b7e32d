"""``prep build --target emulated``: an emulated DLA loadable from the translator's outputs.

The loadable (``dlad.loadable``, docs/loadable.md) carries what the daemon's emulated core needs
and what cuDLA would report for a real one: the INT8/FP16 engine graph
(``prep.emulate_graph``), the I/O tensor descriptors in the DLA's real formats (``DLA_HWC4`` int8
input; ``CHW32`` int8 or ``CHW16`` fp16 heads), the input and output scales, the anchors and
strides, the class names, and the modelled per-frame DLA time (``prep.latency``).

Head precisions (the seed article's table): ``int8`` heads (``CHW32``, fastest), ``fp16`` heads
(``CHW16``, NVIDIA's sample default) and ``fp16`` heads with the last C3 block in FP16 as well
(:data:`LAST_C3_NODES`, the sample's ``_v2`` build).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnx

from dlad.loadable import (
    DataType,
    Loadable,
    TensorDescriptor,
    chw_vectorized,
    hwc4_input,
    write_loadable,
)
from prep.emulate_graph import EngineGraph, build_int8_graph
from prep.latency import estimate
from prep.onnx_static import head_nodes

Heads = Literal["int8", "fp16"]

#: The last C3 block's output conv and SiLU of YOLOv5 (``model.23.cv3``): the sample's ``_v2``
#: build runs them in FP16 for +0.2 mAP.
LAST_C3_NODES = ("/model.23/cv3/conv/Conv", "/model.23/cv3/act/Sigmoid", "/model.23/cv3/act/Mul")


@dataclass(frozen=True)
class ModelInfo:
    """What the detector is, beyond its graph (from the training checkpoint): ``family`` names
    its heads and post-processing (``dlad.families``; ``anchors_px`` empty for an anchor-free
    one)."""

    num_classes: int
    class_names: tuple[str, ...]
    anchors_px: tuple[tuple[tuple[float, float], ...], ...]
    strides: tuple[int, ...]
    image_size: int
    family: str = "yolov5"


@dataclass(frozen=True)
class Variant:
    """One build: a name, the head precision and extra FP16 nodes (``detect_branches``: every
    node of the layer the heads come from, a DFL family's box and class branches, as well)."""

    name: str
    heads: Heads
    extra_fp16: tuple[str, ...] = ()
    detect_branches: bool = False

    def fp16_nodes(self, ptq: onnx.ModelProto, translated: Iterable[str]) -> list[str]:
        """The variant's FP16 nodes in ``ptq``: the translator's, then its own."""
        extra = list(self.extra_fp16)
        if self.detect_branches:
            graph = ptq.graph
            producer = {o: n for n in graph.node for o in n.output}
            convs = head_nodes([o.name for o in graph.output], producer)
            # torch's exporter names a node by the modules it was called through: YOLOv5's
            # "/model.24/m.0/Conv", a DFL family's "/cv2.0/cv2.0.2/Conv" (RawHeads runs them)
            scopes = tuple({f"/{n.split('/')[1]}/" for n in convs if n.count("/") > 1})
            extra += [n.name for n in graph.node if n.name.startswith(scopes)]
        return sorted({*translated, *extra})


#: The seed article's head-precision table, in its order.
HEAD_VARIANTS = (
    Variant("int8_heads", "int8"),
    Variant("fp16_heads", "fp16"),
    Variant("fp16_heads_last_c3", "fp16", LAST_C3_NODES),
)
DFL_HEAD_VARIANTS = (
    *HEAD_VARIANTS[:2],
    Variant("fp16_heads_branches", "fp16", detect_branches=True),
)
"""A DFL family's table: its third row runs the Detect layer's box and class branches (the
two 3 x 3 convs before each head conv) in FP16 too, as YOLOv5's runs its last C3 block."""


def head_variants(family: str) -> tuple[Variant, ...]:
    """The head-precision variants built for a model of ``family``."""
    return HEAD_VARIANTS if family == "yolov5" else DFL_HEAD_VARIANTS


def read_translation(translate_dir: Path) -> tuple[onnx.ModelProto, dict[str, float], list[str]]:
    """The PTQ ONNX, INT8 scales and FP16 nodes the translator wrote into ``translate_dir``."""
    model = onnx.load(str(translate_dir / "model_noqdq.onnx"))
    config = json.loads((translate_dir / "model_precision_config.json").read_text())
    return model, dict(config["int8_tensor_scales"]), list(config["fp16_nodes"])


def build_loadable(
    ptq: onnx.ModelProto,
    scales: dict[str, float],
    fp16_nodes: Iterable[str],
    info: ModelInfo,
    *,
    core: int,
    variant: Variant,
    provenance: dict[str, Any] | None = None,
) -> tuple[Loadable, EngineGraph]:
    """Assemble one emulated loadable (not yet written).

    Raises:
        prep.emulate_graph.EmulationGraphError: a tensor the INT8 graph needs has no scale.
        ValueError: inconsistent geometry (``dlad.loadable.Loadable`` checks it).
    """
    fp16 = variant.fp16_nodes(ptq, fp16_nodes)
    graph = build_int8_graph(ptq, scales, fp16, heads=variant.heads)
    latency = estimate(ptq, fp16_nodes=fp16, heads=variant.heads)
    c, h, w = graph.input_shape
    inputs = (hwc4_input(graph.input_name, c, h, w, scale=graph.input_scale),)
    outputs: list[TensorDescriptor] = []
    for spec in graph.outputs:
        int8 = spec.dtype == "int8"
        outputs.append(
            chw_vectorized(
                spec.name,
                spec.channels,
                spec.height,
                spec.width,
                vec=32 if int8 else 16,
                data_type=DataType.INT8 if int8 else DataType.HALF,
                scale=spec.scale if int8 else None,
            )
        )
    by_op: dict[str, Any] = {op: round(row["time_us"], 3) for op, row in latency.by_op().items()}
    loadable = Loadable(
        name=f"{info.family}-{variant.name}",
        dla_core=core,
        inputs=inputs,
        outputs=tuple(outputs),
        input_scale=graph.input_scale,
        output_scales={s.name: float(s.scale) for s in graph.outputs if s.scale is not None},
        heads=variant.heads,
        num_classes=info.num_classes,
        class_names=info.class_names,
        anchors_px=info.anchors_px,
        strides=info.strides,
        image_size=(info.image_size, info.image_size),
        latency_us=float(latency.total_us),
        sections={"graph": graph.to_bytes()},
        fp16_nodes=tuple(fp16),
        family=info.family,
        latency_layers={"by_op_us": by_op, "layers": len(latency.layers)},
        provenance=provenance or {},
    )
    return loadable, graph


def build_variants(
    translate_dir: Path,
    info: ModelInfo,
    out_dir: Path,
    *,
    cores: Sequence[int],
    variants: Sequence[Variant] | None = None,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``{variant}.dla{core}.emu`` for every variant (default: the family's
    :func:`head_variants`) and core; returns name -> path."""
    ptq, scales, fp16 = read_translation(translate_dir)
    out: dict[str, Path] = {}
    for variant in head_variants(info.family) if variants is None else variants:
        loadable, _ = build_loadable(
            ptq, scales, fp16, info, core=cores[0], variant=variant, provenance=provenance
        )
        for core in cores:
            path = out_dir / f"{variant.name}.dla{core}.emu"
            core_loadable = loadable if core == loadable.dla_core else _on_core(loadable, core)
            write_loadable(path, core_loadable)
            out[f"{variant.name}.dla{core}"] = path
    return out


def _on_core(loadable: Loadable, core: int) -> Loadable:
    import dataclasses

    return dataclasses.replace(loadable, dla_core=core)
