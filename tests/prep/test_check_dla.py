"""``prep check-dla``: each documented DLA rule on a small graph, and the verdicts on whole
detectors (YOLOv5 runs on the DLA layer for layer; YOLO11's attention does not, and says why)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from prep.check_dla import CheckError, check_graph
from prep.cli import main

pytestmark = pytest.mark.timeout(120)


def _graph(tmp_path: Path, nodes: list[Any], x: list[int], y: list[int],
           inits: dict[str, np.ndarray] | None = None) -> Path:  # fmt: skip
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )  # fmt: skip
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _verdict(tmp_path: Path, *args: Any, **kw: Any) -> tuple[bool, str]:
    result = check_graph(_graph(tmp_path, *args, **kw))
    (layer,) = [layer for layer in result.layers if layer.op != "Constant"][-1:]
    return layer.dla, layer.reason


W = np.zeros((8, 4, 3, 3), np.float32)


@pytest.mark.parametrize(
    ("attrs", "dla", "why"),
    [
        ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, True, ""),
        ({"kernel_shape": [3, 3], "strides": [9, 9]}, False, "stride [9, 9]"),
        ({"kernel_shape": [3, 3], "pads": [3, 3, 3, 3]}, False, "less than the kernel"),
        ({"kernel_shape": [3, 3], "dilations": [33, 33]}, False, "dilation"),
    ],
)
def test_convolution_rules(tmp_path: Path, attrs: dict[str, Any], dla: bool, why: str) -> None:
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    size = 300 if attrs.get("dilations") else 32
    got = _verdict(tmp_path, [node], [1, 4, size, size], [1, 8, None, None], {"w": W})
    assert got[0] is dla
    assert why in got[1]


def test_an_activation_matmul_falls_back_and_a_weight_matmul_wants_a_conv(tmp_path: Path) -> None:
    mm = helper.make_node("MatMul", ["x", "x2"], ["y"])
    t = helper.make_node("Transpose", ["x"], ["x2"], perm=[0, 1, 3, 2])
    dla, why = _verdict(tmp_path, [t, mm], [1, 2, 8, 8], [1, 2, 8, 8])
    assert not dla
    assert "two activations" in why
    weights = helper.make_node("MatMul", ["x", "w"], ["y"])
    dla, why = _verdict(tmp_path, [weights], [1, 2, 8, 8], [1, 2, 8, 4],
                        {"w": np.zeros((8, 4), np.float32)})  # fmt: skip
    assert not dla
    assert "1x1 Conv" in why


@pytest.mark.parametrize(
    ("x", "axis", "dla", "why"),
    [
        ([1, 1, 1, 8000], -1, True, ""),
        ([1, 1, 1, 9000], -1, False, "at most 8192"),
        ([1, 2, 400, 400], -1, True, "approximated"),
        ([1, 2, 400, 2000], -1, False, "at most 1024"),
        ([4, 2, 8, 8], 0, False, "batch axis"),
        ([2, 8, 8], -1, False, "3-D tensor"),
    ],
)
def test_softmax_rules(tmp_path: Path, x: list[int], axis: int, dla: bool, why: str) -> None:
    node = helper.make_node("Softmax", ["x"], ["y"], axis=axis)
    got = _verdict(tmp_path, [node], x, x)
    assert got[0] is dla
    assert why in got[1]


def test_elementwise_rules(tmp_path: Path) -> None:
    add = helper.make_node("Add", ["x", "b"], ["y"])
    per_channel = {"b": np.zeros((1, 4, 1, 1), np.float32)}
    assert _verdict(tmp_path, [add], [1, 4, 8, 8], [1, 4, 8, 8], per_channel) == (True, "")
    per_row = {"b": np.zeros((1, 1, 8, 1), np.float32)}
    dla, why = _verdict(tmp_path, [add], [1, 4, 8, 8], [1, 4, 8, 8], per_row)
    assert not dla
    assert "one value per channel" in why
    scalar = {"b": np.array(2.0, np.float32)}
    div = helper.make_node("Div", ["x", "b"], ["y"])
    dla, why = _verdict(tmp_path, [div], [1, 4, 8, 8], [1, 4, 8, 8], scalar)
    assert not dla
    assert "DIV" in why
    assert "reciprocal" in why
    mul = helper.make_node("Mul", ["x", "b"], ["y"])
    assert _verdict(tmp_path, [mul], [1, 4, 8, 8], [1, 4, 8, 8], scalar) == (True, "")


def test_concat_resize_slice_and_reshape_rules(tmp_path: Path) -> None:
    cat_w = helper.make_node("Concat", ["x", "x"], ["y"], axis=3)
    assert "C only" in _verdict(tmp_path, [cat_w], [1, 4, 8, 8], [1, 4, 8, 16])[1]
    scales = {"s": np.array([1, 1, 2, 2], np.float32)}
    up = helper.make_node(
        "Resize", ["x", "", "s"], ["y"], mode="nearest",
        coordinate_transformation_mode="asymmetric", nearest_mode="floor",
    )  # fmt: skip
    assert _verdict(tmp_path, [up], [1, 4, 8, 8], [1, 4, 16, 16], scales) == (True, "")
    half = {"s": np.array([1, 1, 0.5, 0.5], np.float32)}
    assert not _verdict(tmp_path, [up], [1, 4, 8, 8], [1, 4, 4, 4], half)[0]
    cut = {"a": np.array([0]), "b": np.array([2]), "ax": np.array([1]), "st": np.array([2])}
    sl = helper.make_node("Slice", ["x", "a", "b", "ax", "st"], ["y"])
    assert "stride 1" in _verdict(tmp_path, [sl], [1, 4, 8, 8], [1, 1, 8, 8], cut)[1]
    split = helper.make_node("Split", ["x"], ["p", "q"], axis=1, num_outputs=2)
    reshape = helper.make_node("Reshape", ["p", "shape"], ["y"])
    dla, why = _verdict(tmp_path, [split, reshape], [1, 4, 8, 8], [1, 2, 4, 16],
                        {"shape": np.array([1, 2, 4, 16])})  # fmt: skip
    assert not dla
    assert "directly connected to Split" in why


def test_a_dynamic_graph_and_a_bad_file_are_refused(tmp_path: Path) -> None:
    node = helper.make_node("Relu", ["x"], ["y"])
    with pytest.raises(CheckError, match="dynamic shape"):
        check_graph(_graph(tmp_path, [node], ["n", 4, 8, 8], ["n", 4, 8, 8]))  # type: ignore[list-item]
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert main(["check-dla", str(bad)]) == 2
    assert main(["check-dla", str(tmp_path / "missing.onnx")]) == 2


def test_yolov5_runs_on_the_dla_layer_for_layer(tmp_path: Path, capsys: Any) -> None:
    from prep.export import export_onnx
    from prep.model import YOLOv5

    path = tmp_path / "yolov5n.onnx"
    export_onnx(YOLOv5("n", 80).eval(), path, 128)
    report = tmp_path / "report.json"
    assert main(["check-dla", str(path), "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["all_on_dla"]
    assert doc["dla_subgraphs"] == 1
    assert doc["flops_on_dla"] == 1.0
    assert "every layer runs on the DLA" in capsys.readouterr().out


def test_yolo11n_attention_is_what_stops_it_and_the_rules_say_why(tmp_path: Path) -> None:
    from prep.export import export_onnx
    from prep.families import prep_family

    path = tmp_path / "yolo11n.onnx"
    export_onnx(prep_family("yolo11").build("n", 80).eval(), path, 160)
    result = check_graph(path)
    off = {(layer.op, layer.reason.split(" (")[0].split(":")[0])
           for layer in result.layers if not layer.dla}  # fmt: skip
    assert all("/attn/" in layer.name for layer in result.layers if not layer.dla)
    assert off == {("MatMul", "MatMul of two activations is unsupported on the DLA"),
                   ("Reshape", "a reshape directly connected to Split")}  # fmt: skip
    assert 0.95 < result.flops_on_dla < 1.0


@pytest.mark.parametrize("size", ["n", "s"])
@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_with_the_dla_attention_yolo11_and_yolo26_run_on_the_dla(
    tmp_path: Path, family: str, size: str
) -> None:
    """At 640, where attention has 400 tokens (the rewrite tiles them by resizes of at most
    32): every layer on the DLA, one subgraph."""
    from prep.export import export_onnx
    from prep.families import prep_family
    from prep.families.dla_attention import dla_legal

    path = tmp_path / f"{family}{size}.onnx"
    export_onnx(dla_legal(prep_family(family).build(size, 80)).eval(), path, 640)
    result = check_graph(path)
    assert [layer.name for layer in result.layers if not layer.dla] == []
    assert result.subgraphs == 1
