"""prep's model families: the raw heads of the Ultralytics families (YOLOv8, YOLO11, YOLO26)
are what Ultralytics' own ``DetectionModel`` computes before its decode, bit for bit in FP32, and
dlad's decode of them is Ultralytics' decoded output."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from dlad.families import FAMILIES, yolov8
from prep.families import PREP_FAMILIES, prep_family

pytestmark = pytest.mark.timeout(120)


def test_every_prep_family_is_a_dlad_family() -> None:
    assert set(PREP_FAMILIES) <= set(FAMILIES)
    with pytest.raises(ValueError, match="no model family 'yolov9'"):
        prep_family("yolov9")


@pytest.mark.parametrize("family", ["yolov8", "yolo11", "yolo26"])
def test_raw_heads_are_ultralytics_own_before_its_decode(family: str) -> None:
    from prep.families.dfl import RawHeads, build_model

    torch.manual_seed(0)
    model = build_model(family, "n", 3).eval()
    assert isinstance(model, RawHeads)
    x = torch.rand(2, 3, 128, 128)
    with torch.no_grad():
        heads = model(x)
        # the same modules run by Ultralytics' own forward: decoded output and raw branches
        from ultralytics.nn.tasks import DetectionModel

        detector = DetectionModel(f"{family}n.yaml", nc=3, verbose=False).eval()
        detector.load_state_dict(model.state_dict(), strict=False)
        decoded, raw = detector(x)
    raw = raw.get("one2many", raw)
    bins = model.bins
    assert bins == (1 if family == "yolo26" else 16)
    assert [tuple(h.shape) for h in heads] == [(2, 4 * bins + 3, 128 // s, 128 // s)
                                               for s in (8, 16, 32)]  # fmt: skip
    flat = torch.cat([h.flatten(2) for h in heads], 2)
    assert torch.equal(flat[:, : 4 * bins], raw["boxes"])
    assert torch.equal(flat[:, 4 * bins :], raw["scores"])
    for b in range(2):
        cand = yolov8.decode([h[b].numpy() for h in heads], (8, 16, 32), 3, 0.0, False)
        xywh = decoded[b, :4].T.numpy()
        xyxy = np.concatenate([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], 1)
        np.testing.assert_allclose(cand.boxes, xyxy, rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(cand.scores, decoded[b, 4:].max(0).values.numpy(), rtol=1e-6)


def test_a_size_the_family_lacks_is_refused() -> None:
    from prep.families.dfl import build_model

    with pytest.raises(ValueError, match="no size 'q'"):
        build_model("yolo11", "q", 3)


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_the_dla_attention_is_ultralytics_attention(family: str) -> None:
    """The rewrite computes the same heads to float rounding (its sums run in another order),
    and leaves the model it was given as it was."""
    from prep.families.dfl import build_model
    from prep.families.dla_attention import DlaAttention, dla_legal

    torch.manual_seed(1)
    model = build_model(family, "n", 5).eval()
    for m in model.modules():  # BN statistics away from the identity, so every part counts
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    legal = dla_legal(model).eval()
    assert any(isinstance(m, DlaAttention) for m in legal.modules())
    assert not any(isinstance(m, DlaAttention) for m in model.modules())
    x = torch.rand(1, 3, 320, 320)
    with torch.no_grad():
        for want, got in zip(model(x), legal(x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_resizes_are_chained_in_dla_sized_factors() -> None:
    from prep.families.dla_attention import factors

    assert factors(400) == [25, 16]
    assert factors(1600) == [32, 25, 2]
    assert factors(1) == []
    with pytest.raises(ValueError, match="prime factor above 32"):
        factors(37 * 2)


def _ultralytics_checkpoint(path: Any, family: str, nc: int, seed: int) -> Any:
    """A checkpoint as Ultralytics writes one (``model``: the pickled ``DetectionModel`` in
    half precision, ``ema`` None), with random weights and BN statistics; the model returned
    is Ultralytics' own, in FP32, as its loader gives it back."""
    import copy

    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(seed)
    detector = DetectionModel(f"{family}n.yaml", nc=nc, verbose=False).eval()
    for m in detector.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    detector.names = {i: f"thing-{i}" for i in range(nc)}
    torch.save({"model": copy.deepcopy(detector).half(), "ema": None, "date": "2026-12-07"}, path)
    return torch.load(path, weights_only=False)["model"].float().eval()  # the test's own file


@pytest.mark.parametrize("family", ["yolo11", "yolo26"])
def test_a_users_checkpoint_imports_exactly(tmp_path: Any, family: str) -> None:
    from prep.families import import_checkpoint

    path = tmp_path / f"{family}.pt"
    theirs = _ultralytics_checkpoint(path, family, 4, seed=3)
    imported = import_checkpoint(path)
    assert (imported.family, imported.variant) == (family, "n")
    assert imported.class_names == ("thing-0", "thing-1", "thing-2", "thing-3")
    x = torch.rand(1, 3, 128, 128)
    with torch.no_grad():
        heads = imported.model(x)
        raw = theirs(x)[1]
    raw = raw.get("one2many", raw)
    flat = torch.cat([h.flatten(2) for h in heads], 2)
    bins = 1 if family == "yolo26" else 16
    assert torch.equal(flat[:, : 4 * bins], raw["boxes"])
    assert torch.equal(flat[:, 4 * bins :], raw["scores"])


def test_what_cannot_be_imported_says_why(tmp_path: Any) -> None:
    from prep.families.dfl import import_checkpoint
    from prep.ultralytics import CheckpointError

    path = tmp_path / "y.pt"
    _ultralytics_checkpoint(path, "yolo11", 2, seed=4)
    data = torch.load(path, weights_only=False)
    data["model"].yaml["head"][-1] = [[16, 19, 22], 1, "Detect", ["nc"], "changed"]
    torch.save(data, tmp_path / "changed.pt")
    with pytest.raises(CheckpointError, match=r"differ from ultralytics' yolo11\.yaml"):
        import_checkpoint(tmp_path / "changed.pt")
    torch.save(data["model"].state_dict(), tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="bare state dict"):
        import_checkpoint(tmp_path / "bare.pt")
    data["model"].yaml["yaml_file"] = "yolov9c.yaml"
    torch.save(data, tmp_path / "v9.pt")
    with pytest.raises(CheckpointError, match="not a YOLOv8, YOLO11 or YOLO26"):
        import_checkpoint(tmp_path / "v9.pt")


def test_prep_import_writes_the_dla_graph_and_the_model_card(tmp_path: Any, capsys: Any) -> None:
    import json

    from prep.cli import main

    path = tmp_path / "y.pt"
    _ultralytics_checkpoint(path, "yolo26", 3, seed=5)
    out = tmp_path / "imported"
    assert (
        main(["import", "--checkpoint", str(path), "--out", str(out), "--image-size", "128"]) == 0
    )
    card = json.loads((out / "model.json").read_text())
    assert card["family"] == "yolo26"
    assert card["class_names"] == ["thing-0", "thing-1", "thing-2"]
    assert "every layer runs on the DLA" in capsys.readouterr().out
    assert main(["import", "--checkpoint", str(tmp_path / "none.pt"), "--out", str(out)]) == 2


def test_yolo26s_nms_free_head_is_ultralytics_end_to_end_output() -> None:
    """Raw one-to-one heads decoded as ``yolo26_one2one`` (corners, every class, the 300 best,
    no NMS) are what Ultralytics' end-to-end ``Detect`` makes of them; and the family's model
    ends at that head's convs."""
    from ultralytics.nn.tasks import DetectionModel

    from dlad.imaging.pre import letterbox
    from prep.families.dfl import build_model

    model = build_model("yolo26_one2one", "n", 7)
    assert model.one2one
    detect = DetectionModel("yolo26n.yaml", nc=7, verbose=False).eval().model[-1]
    detect.end2end = True
    rng = np.random.default_rng(6)
    heads = []
    for s in (8, 16, 32):
        h = rng.normal(0.0, 2.0, size=(11, 160 // s, 160 // s)).astype(np.float32)
        h[:4] = rng.uniform(0.0, 4.0, size=(4, 160 // s, 160 // s))
        heads.append(h)
    flat = torch.cat([torch.from_numpy(h).flatten(1) for h in heads], 1)[None]
    feats = [torch.zeros(1, 1, 160 // s, 160 // s) for s in (8, 16, 32)]
    with torch.no_grad():
        decoded = detect._inference({"boxes": flat[:, :4], "scores": flat[:, 4:], "feats": feats})
        theirs = detect.postprocess(decoded.permute(0, 2, 1))[0].numpy()  # [300, 6]
    _, identity = letterbox(np.zeros((160, 160, 3), np.uint8), 160)
    ours = yolov8.postprocess(heads, (8, 16, 32), 7, identity, conf_threshold=0.0, max_det=300,
                              end2end=True)  # fmt: skip
    assert ours.shape == theirs.shape == (300, 6)
    assert len(np.unique(theirs[:, 4])) == 300  # no ties: the order is the scores' alone
    np.testing.assert_array_equal(ours[:, 5], theirs[:, 5])
    np.testing.assert_allclose(ours[:, 4], theirs[:, 4], rtol=1e-6)
    unclipped = (theirs[:, :4] >= 0).all(1) & (theirs[:, :4] <= 160).all(1)
    np.testing.assert_allclose(ours[unclipped, :4], theirs[unclipped, :4], rtol=1e-5, atol=1e-3)


def test_importing_ultralytics_leaves_pil_as_it_was() -> None:
    """Ultralytics replaces ``PIL.Image.open`` when imported (with one that tries to install a
    HEIF plugin for an unreadable image); prep's import of it puts PIL's own back."""
    from PIL import Image

    import prep.families.dfl  # noqa: F401

    assert Image.open.__module__ == "PIL.Image"


def test_the_settings_take_every_family_prep_has_and_no_other() -> None:
    from prep.pipeline import ConfigError, load_config

    for name in PREP_FAMILIES:
        assert load_config(None, {"model.family": name}).model.family == name
    with pytest.raises(ConfigError, match=r"model\.family 'yolov9' is not one of"):
        load_config(None, {"model.family": "yolov9"})


def test_a_yolo11_loadable_is_built_and_served_by_the_emulated_dla(tmp_path: Any) -> None:
    """The seam end to end: a YOLO11 graph (attention in DLA layers, every layer FP16) built
    into an emulated loadable of the family, served by the daemon's emulated core, post-processed
    as the family does; STATUS names its family and classes."""
    import warnings

    import onnx
    import zmq

    from dlad import protocol
    from dlad.config import load_config
    from dlad.daemon import Daemon
    from dlad.devices.int8_engine import engine_for_loadable
    from dlad.imaging.post import unpack_head
    from dlad.imaging.pre import letterbox, quantize_hwc4
    from dlad.loadable import write_loadable
    from prep.emulated_build import ModelInfo, Variant, build_loadable
    from prep.export import export_onnx
    from prep.families.dla_attention import dla_legal
    from prep.onnx_static import static_model
    from tests.dlad.serving import serve_in_thread

    torch.manual_seed(4)
    raw = prep_family("yolo11").build("n", 2)
    with torch.no_grad():  # scores that pass (an untrained head scores nothing above 0.01)
        for branch in raw.detect.cv3:
            branch[-1].weight.normal_(0.0, 0.05)
            branch[-1].bias.fill_(-0.5)
    model = dla_legal(raw).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(model, tmp_path / "y11.onnx", 64)
    ptq = static_model(onnx.load(str(tmp_path / "y11.onnx")))
    info = ModelInfo(2, ("cat", "dog"), (), (8, 16, 32), 64, family="yolo11")
    every = [n.name for n in ptq.graph.node]
    loadable, _ = build_loadable(ptq, {"images": 1 / 127}, every, info, core=0,
                                 variant=Variant("fp16", "fp16"))  # fmt: skip
    assert (loadable.family, loadable.anchors_px, loadable.latency_us > 0) == ("yolo11", (), True)
    path = write_loadable(tmp_path / "y11.dla0.emu", loadable)
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(
        '[frontend]\nendpoints = ["tcp://127.0.0.1:5555"]\n'
        '[devices.dla0]\nkind = "dla"\ncore = 0\nmode = "numeric"\n'
        f'[models.y11]\ndevices = ["dla0"]\n[models.y11.loadables]\ncore0 = "{path}"\n'
    )
    rgb = np.random.default_rng(0).integers(0, 256, (48, 80, 3), np.uint8)
    canvas, geometry = letterbox(rgb, 64)
    engine = engine_for_loadable(loadable)
    buffers = engine.run(quantize_hwc4(canvas, loadable.input_scale))
    heads = [unpack_head(b, s.channels, s.height, s.width, None)
             for s, b in zip(engine.outputs, buffers, strict=True)]  # fmt: skip
    expected = yolov8.postprocess(heads, (8, 16, 32), 2, geometry, conf_threshold=0.2,
                                  iou_threshold=0.5, max_det=20)  # fmt: skip
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    ctx = zmq.Context()
    with serve_in_thread(daemon) as endpoint, ctx.socket(zmq.DEALER) as sock:
        sock.linger = 0
        sock.connect(endpoint)
        request = protocol.InferRequest(1, "y11", rgb, conf=0.2, iou=0.5, max_det=20)
        sock.send_multipart(protocol.encode(request))
        assert sock.poll(60_000)
        reply = protocol.decode_reply(sock.recv_multipart())
        sock.send_multipart(protocol.encode(protocol.StatusRequest(2)))
        assert sock.poll(60_000)
        status = protocol.decode_reply(sock.recv_multipart())
    ctx.term()
    assert isinstance(reply, protocol.InferReply)
    assert len(expected) > 0
    np.testing.assert_array_equal(reply.detections, expected)
    assert isinstance(status, protocol.StatusReply)
    assert status.report is not None
    (m,) = status.report["models"]
    assert (m["family"], m["class_names"]) == ("yolo11", ["cat", "dog"])


def test_the_one_to_one_head_trains_with_one_anchor_a_target() -> None:
    from prep.families.dfl import DflLoss, build_model

    many = DflLoss(build_model("yolo26", "n", 2))
    one = DflLoss(build_model("yolo26_one2one", "n", 2))
    assert (many._loss.assigner.topk, one._loss.assigner.topk) == (10, 7)
    assert one._loss.assigner.topk2 == 1


def test_a_yolo26_checkpoint_imports_with_its_nms_free_head(tmp_path: Any) -> None:
    from prep.families import import_checkpoint
    from prep.ultralytics import CheckpointError

    path = tmp_path / "y26.pt"
    theirs = _ultralytics_checkpoint(path, "yolo26", 3, seed=8)
    imported = import_checkpoint(path, one2one=True)
    assert imported.family == "yolo26_one2one"
    x = torch.rand(1, 3, 96, 96)
    with torch.no_grad():
        heads = imported.model(x)
        raw = theirs(x)[1]["one2one"]
    flat = torch.cat([h.flatten(2) for h in heads], 2)
    assert torch.equal(flat[:, :4], raw["boxes"])
    assert torch.equal(flat[:, 4:], raw["scores"])
    _ultralytics_checkpoint(tmp_path / "y11.pt", "yolo11", 3, seed=9)
    with pytest.raises(CheckpointError, match="a yolo11 has no one-to-one"):
        import_checkpoint(tmp_path / "y11.pt", one2one=True)
