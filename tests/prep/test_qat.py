from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

from prep import qat
from prep.export import export_onnx, remove_identity_casts
from prep.model import YOLOv5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quantized(warm_model: YOLOv5) -> tuple[Any, list[list[str]]]:
    qmodel, groups = qat.quantize(warm_model, qat.QATConfig())
    gen = torch.Generator().manual_seed(3)
    qat.calibrate(qmodel, [torch.rand(2, 3, 96, 96, generator=gen) for _ in range(2)])
    return qmodel, groups


def test_sharing_groups_follow_the_graph(warm_model: YOLOv5) -> None:
    groups = {tuple(g) for g in qat.scale_groups(copy.deepcopy(warm_model).fuse())}
    # SPPF: the max-pool chain and everything concatenated with it share cv2's input scale.
    assert ("model.9.m", "model.9.concat", "model.9.cv2.conv") in groups
    # Residual add: both addends share the bottleneck's cv1 input scale.
    assert ("model.2.m.0.cv1.conv", "model.2.m.0.addop") in groups
    # Neck concat: backbone P4 (also read by model.7) joins the upsampled branch.
    assert ("model.7.conv", "model.12", "model.13.cv1.conv", "model.13.cv2.conv") in groups
    # No module appears in two groups.
    names = [n for g in groups for n in g]
    assert len(names) == len(set(names))


def test_quantizers_are_shared_and_calibrated(
    quantized: tuple[YOLOv5, list[list[str]]],
) -> None:
    qmodel, groups = quantized
    modules = dict(qmodel.named_modules())
    for group in groups:
        enabled = [n for n in group if not modules[n].input_quantizer._disabled]
        ids = {id(modules[n].input_quantizer) for n in enabled}
        assert len(ids) == 1, group
    summary = qat.quantizer_summary(qmodel)
    assert summary["distinct_activation_quantizers"] < summary["activation_sites"]
    for name, m in qmodel.named_modules():
        if name.endswith("weight_quantizer") and not m._disabled:
            w = modules[name.rsplit(".", 1)[0]].weight
            # per-output-channel max calibration
            torch.testing.assert_close(m.amax.flatten(), w.abs().amax((1, 2, 3)))


def test_fake_quant_close_to_float(
    warm_model: YOLOv5, quantized: tuple[YOLOv5, list[list[str]]], images: torch.Tensor
) -> None:
    qmodel, _ = quantized
    fused = copy.deepcopy(warm_model).fuse()
    with torch.no_grad():
        for f, q in zip(fused(images), qmodel(images), strict=True):
            rel = float((f - q).abs().mean() / f.abs().mean())
            assert 0 < rel < 0.05  # quantization is on, and it is not broken


def _mse_brute(counts: np.ndarray, edges: np.ndarray, start: int) -> float:
    centers = (edges[1:] + edges[:-1]) / 2
    best, err = 0.0, np.inf
    for amax in centers[start:]:
        s = amax / 127
        q = np.clip(np.round(centers / s), -127, 127) * s
        e = float(((q - centers) ** 2 * counts).sum())
        if e < err:
            best, err = float(amax), e
    return best


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["normal", "uniform", "laplace"]))
def test_histogram_mse_amax_matches_brute_force(seed: int, kind: str) -> None:
    rng = np.random.default_rng(seed)
    x = np.abs(
        {"normal": rng.normal, "uniform": rng.uniform, "laplace": rng.laplace}[kind](size=20000)
    )
    counts, edges = np.histogram(x, bins=512, range=(0, float(x.max())))
    got = qat.histogram_mse_amax(counts, edges, start_bin=32)
    want = _mse_brute(counts.astype(np.float64), edges, 32)

    def err(a: float) -> float:
        centers = (edges[1:] + edges[:-1]) / 2
        q = np.clip(np.round(centers / (a / 127)), -127, 127) * (a / 127)
        return float(((q - centers) ** 2 * counts).sum())

    # float32 arithmetic may pick a different bin of (nearly) equal error, never a worse one.
    assert err(got) <= err(want) * (1 + 1e-4) + 1e-12


def test_histogram_mse_amax_empty() -> None:
    with pytest.raises(RuntimeError, match="no data"):
        qat.histogram_mse_amax(np.zeros(16), np.linspace(0, 1, 17))


def test_qdq_export_is_symmetric_int8(
    quantized: tuple[YOLOv5, list[list[str]]], images: torch.Tensor, tmp_path: Path
) -> None:
    qmodel, _ = quantized
    proto = export_onnx(qmodel, tmp_path / "qat.onnx", 96)
    assert [o.name for o in proto.graph.output] == ["s8", "s16", "s32"]
    assert not any(n.op_type == "Cast" for n in proto.graph.node)
    consts = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in proto.graph.node
        if n.op_type == "Constant"
    }
    consts |= {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    qnodes = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert qnodes
    for n in qnodes:
        zp = consts[n.input[2]]
        assert zp.dtype == np.int8, n.name
        assert not zp.any(), n.name
    weight_q = [n for n in qnodes if n.input[0].endswith(".weight")]
    assert weight_q
    assert all(consts[n.input[1]].ndim == 1 for n in weight_q)
    sess = ort.InferenceSession(str(tmp_path / "qat.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"images": images[:1].numpy()})
    with torch.no_grad():
        want = qmodel(images[:1])
    for g, w in zip(got, want, strict=True):
        # ORT and torch may round a tie differently: at most about one quantization step apart.
        assert np.abs(g - w.numpy()).mean() < 0.01 * np.abs(w.numpy()).mean() + 1e-3


def test_save_load_round_trip(
    quantized: tuple[YOLOv5, list[list[str]]], images: torch.Tensor, tmp_path: Path
) -> None:
    qmodel, _ = quantized
    qat.save_qat(tmp_path / "q.pt", qmodel, qat.QATConfig(), {"note": 1})
    loaded, extra = qat.load_qat(tmp_path / "q.pt")
    assert extra == {"note": 1}
    # A loaded model has its head-output quantizers off unless train_head_quant (see QATConfig).
    assert qat.set_head_output_quant(qmodel, False) == 3
    try:
        with torch.no_grad():
            for a, b in zip(qmodel(images), loaded(images), strict=True):
                torch.testing.assert_close(a, b)
        assert qat.set_head_output_quant(loaded, True) == 3
        assert qat.set_head_output_quant(qmodel, True) == 3
        with torch.no_grad():
            for a, b in zip(qmodel(images), loaded(images), strict=True):
                torch.testing.assert_close(a, b)
    finally:
        qat.set_head_output_quant(qmodel, True)
    torch.save({"format": "x"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a prep QAT checkpoint"):
        qat.load_qat(tmp_path / "bad.pt")


def test_finetune_runs_and_reduces_distillation_loss(warm_model: YOLOv5) -> None:
    qmodel, _ = qat.quantize(warm_model, qat.QATConfig())
    gen = torch.Generator().manual_seed(4)
    data = [torch.rand(2, 3, 64, 64, generator=gen) for _ in range(2)]
    qat.calibrate(qmodel, data)
    teacher = copy.deepcopy(warm_model).fuse()
    cfg = qat.QATConfig(epochs=2, iters_per_epoch=4, lr=1e-4)
    it = iter(data * 8)
    history = qat.finetune(qmodel, teacher, lambda: next(it), cfg)
    assert len(history) == 2
    assert all(np.isfinite(h["loss"]) for h in history)


def test_remove_identity_casts_keeps_real_casts() -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    z = helper.make_tensor_value_info("z", TensorProto.INT32, [1])
    nodes = [
        helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),  # identity
        helper.make_node("Relu", ["c"], ["y"]),
        helper.make_node("Cast", ["x"], ["z"], to=TensorProto.INT32),  # real, graph output
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y, z]))
    out = remove_identity_casts(model)
    ops = [(n.op_type, list(n.input)) for n in out.graph.node]
    assert ops == [("Relu", ["x"]), ("Cast", ["x"])]
    onnx.checker.check_model(out)


def test_refresh_weight_amax_tracks_trained_weights(warm_model: YOLOv5) -> None:
    qmodel, _ = qat.quantize(warm_model, qat.QATConfig())
    qat.calibrate(qmodel, [torch.rand(1, 3, 64, 64)])
    conv = qmodel.model[0].conv
    with torch.no_grad():
        conv.weight.mul_(1.5)  # as if fine-tuning had grown the weights
    assert not torch.allclose(
        conv.weight_quantizer.amax.flatten(), conv.weight.abs().amax((1, 2, 3))
    )
    assert qat.refresh_weight_amax(qmodel) == 60
    torch.testing.assert_close(
        conv.weight_quantizer.amax.flatten(), conv.weight.abs().amax((1, 2, 3))
    )
