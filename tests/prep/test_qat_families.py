"""QAT, export, translation and the emulated INT8 core for the DFL families (YOLOv8, YOLO11,
YOLO26): the same recipe and sharing rules as YOLOv5, on Ultralytics' blocks (C2f / C3k2 split
and concatenation, residual additions, SPPF, attention in DLA layers)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from dlad.devices.int8_engine import Int8Engine
from dlad.imaging.post import unpack_chw16, unpack_chw32_int8
from dlad.imaging.pre import dequantize_hwc4, quantize_hwc4
from prep import qat
from prep.emulate_graph import build_int8_graph
from prep.export import export_onnx
from prep.families.dfl import build_model
from prep.onnx_static import head_nodes
from prep.translate import translate

pytestmark = pytest.mark.slow

SIZE = 64


def _tame(model: Any) -> Any:
    """Exact BN statistics and BN gamma 0.3: a random network whose heads depend on the image
    without being chaotic (``tests/prep/test_emulate_graph.py`` says why)."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None
            torch.nn.init.constant_(m.weight, 0.3)
    gen = torch.Generator().manual_seed(1)
    qat.warm_up_batchnorm(model, [torch.rand(4, 3, SIZE, SIZE, generator=gen) for _ in range(4)])
    return model.eval()


@pytest.fixture(scope="module", params=["yolov8", "yolo11", "yolo26"])
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.manual_seed(0)
    model = _tame(build_model(request.param, "n", 3))
    qmodel, groups = qat.quantize(model, qat.QATConfig())
    gen = torch.Generator().manual_seed(3)
    qat.calibrate(qmodel, [torch.rand(2, 3, SIZE, SIZE, generator=gen) for _ in range(2)])
    qat.set_head_output_quant(qmodel, True)
    path = tmp_path_factory.mktemp(request.param) / "qat.onnx"
    export_onnx(qmodel, path, SIZE)
    result = translate(path, extra_ops=("Resize", "Split"))
    return SimpleNamespace(
        family=request.param, model=model, qmodel=qmodel, groups=groups, result=result
    )


def test_the_deployable_form_is_the_same_function(quantized: Any) -> None:
    """``fuse`` (BN folded, attention in DLA layers, static splits, Add / Concat modules)
    changes no output beyond float rounding, and leaves the trained model as it was."""
    fused = copy.deepcopy(quantized.model).fuse()
    x = torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for a, b in zip(quantized.model(x), fused(x), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in quantized.model.modules())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())


def test_split_concat_and_residual_share_one_scale(quantized: Any) -> None:
    """In the first C2f / C3k2 block, the split's parts, the bottleneck's residual addition
    and the concatenation read by the block's output conv share one quantizer."""
    group = next(g for g in quantized.groups if "model.2.cv2.conv" in g)
    assert {"model.2.m.0.cv1.conv", "model.2.m.0.addop"} <= set(group)
    modules = dict(quantized.qmodel.named_modules())
    ids = {
        id(modules[n].input_quantizer)
        for n in group
        if not modules[n].input_quantizer._disabled
    }  # fmt: skip
    assert len(ids) == 1
    names = [n for g in quantized.groups for n in g]
    assert len(names) == len(set(names))


def test_the_translation_gives_every_tensor_outside_attention_a_scale(quantized: Any) -> None:
    """No scale conflicts; only attention's product and softmax (and the convs feeding them)
    go to FP16; a Split's input and parts carry one scale."""
    result = quantized.result
    assert result.report.scale_conflicts == {}
    assert all("/attn/" in n for n in result.fp16_nodes), result.fp16_nodes
    if quantized.family == "yolov8":  # no attention
        assert result.fp16_nodes == []
    else:
        assert any(n.endswith("/attn/Softmax") for n in result.fp16_nodes)
    scales = result.int8_tensor_scales
    splits = [n for n in result.model.graph.node if n.op_type == "Split"]
    assert splits
    for node in splits:
        assert {scales[t] for t in node.output} == {scales[node.input[0]]}, node.name
    onnx.checker.check_model(result.model)


def test_fp16_heads_are_the_head_convs_not_only_their_concatenation(quantized: Any) -> None:
    """A DFL head is its box and class convs concatenated: ``heads="fp16"`` runs both convs in
    FP16 (with the Concat), as YOLOv5's FP16 heads run its head convs."""
    from prep.latency import estimate

    convs = {f"/{b}.{i}/{b}.{i}.2/Conv" for b in ("cv2", "cv3") for i in range(3)}
    graph = quantized.result.model.graph
    producer = {o: n for n in graph.node for o in n.output}
    heads = set(head_nodes([o.name for o in graph.output], producer))
    assert convs < heads
    assert {producer[o.name].op_type for o in graph.output} == {"Concat"}
    r = quantized.result
    precision = {
        heads: {x.name: x.precision for x in estimate(r.model, fp16_nodes=r.fp16_nodes,
                                                      heads=heads).layers}
        for heads in ("int8", "fp16")
    }  # fmt: skip
    assert {precision["fp16"][c] for c in convs} == {"fp16"}
    assert {precision["int8"][c] for c in convs} == {"int8"}


def _steps(got: list[np.ndarray], want: Any, scales: list[float]) -> np.ndarray:
    return np.concatenate(
        [
            (np.abs(a - w[0].detach().numpy()) / np.float32(s)).ravel()
            for a, w, s in zip(got, want, scales, strict=True)
        ]
    )


def test_the_emulated_int8_core_agrees_with_the_fake_quant_model(quantized: Any) -> None:
    """INT8 heads from the emulated DLA core vs the QAT model in torch, in steps of each head's
    scale, on random canvases: close to the fake-quant model's own distance from FP32 (the
    INT8 noise floor), and the heads depend on the image."""
    r = quantized.result
    g = build_int8_graph(r.model, r.int8_tensor_scales, r.fp16_nodes, heads="int8")
    eng = Int8Engine(
        g.to_bytes(), input_scale=g.input_scale, input_shape=g.input_shape, outputs=g.outputs
    )
    scales = [float(s.scale or 0.0) for s in g.outputs]
    fp32 = copy.deepcopy(quantized.model).fuse()
    rng = np.random.default_rng(11)
    runs = []
    for _ in range(2):
        hwc4 = quantize_hwc4(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8), g.input_scale)
        x = torch.from_numpy(dequantize_hwc4(hwc4, g.input_scale, SIZE)).permute(2, 0, 1)[None]
        packed = eng.run(hwc4)
        got = [
            unpack_chw32_int8(p, s.channels, scale)
            for s, p, scale in zip(g.outputs, packed, scales, strict=True)
        ]
        with torch.no_grad():
            fake_out = quantized.qmodel(x)
            fake = _steps(got, fake_out, scales)
            floor = _steps([h[0].numpy() for h in fake_out], fp32(x), scales)
        assert fake.mean() <= 2 * floor.mean() + 0.5, (fake.mean(), floor.mean())
        assert np.mean(fake <= 4) >= 0.95
        runs.append(got)
    moved = _steps(runs[0], [torch.from_numpy(h)[None] for h in runs[1]], scales)
    assert moved.mean() >= 1
    # FP16 heads: the same graph with the heads in FP16
    g16 = build_int8_graph(r.model, r.int8_tensor_scales, r.fp16_nodes, heads="fp16")
    assert [s.dtype for s in g16.outputs] == ["fp16"] * 3
    eng16 = Int8Engine(
        g16.to_bytes(), input_scale=g16.input_scale, input_shape=g16.input_shape,
        outputs=g16.outputs,
    )  # fmt: skip
    packed16 = eng16.run(hwc4)
    heads16 = [unpack_chw16(p, s.channels) for s, p in zip(g16.outputs, packed16, strict=True)]
    assert _steps(heads16, [torch.from_numpy(h)[None] for h in got], scales).mean() <= 1.0


def test_a_qat_checkpoint_round_trips(quantized: Any, tmp_path: Path) -> None:
    """``save_qat`` / ``load_qat`` rebuild the family's quantized model with its shared
    quantizers and ranges: the same outputs."""
    cfg = qat.QATConfig()
    path = tmp_path / "qat.pt"
    qat.set_head_output_quant(quantized.qmodel, cfg.train_head_quant)
    try:
        qat.save_qat(path, quantized.qmodel, cfg, extra={"image_size": SIZE})
        loaded, extra = qat.load_qat(path)
    finally:
        qat.set_head_output_quant(quantized.qmodel, True)
    assert extra == {"image_size": SIZE}
    assert loaded.family == quantized.family
    x = torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    qat.set_head_output_quant(loaded, True)
    with torch.no_grad():
        for a, b in zip(quantized.qmodel(x), loaded(x), strict=True):
            torch.testing.assert_close(b, a)
