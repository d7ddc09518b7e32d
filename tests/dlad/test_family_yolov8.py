"""The DFL families (YOLOv8, YOLO11, YOLO26): the numpy decode against Ultralytics' ``Detect``
decode written out in torch (its DFL module, anchor points, ``dist2bbox`` and ``xywh2xyxy``),
and the loadable rules the family owns."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dlad.families import family_for, post_program, yolov8
from dlad.imaging.post import nms
from dlad.imaging.pre import letterbox
from dlad.loadable import Loadable, chw_vectorized, hwc4_input

STRIDES = (8, 16, 32)


def _heads(seed: int, canvas: int, nc: int, bins: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for s in STRIDES:
        g = canvas // s
        raw = rng.normal(0.0, 2.0, size=(4 * bins + nc, g, g)).astype(np.float32)
        if bins == 1:
            raw[:4] = rng.uniform(0.0, 6.0, size=(4, g, g))
        out.append(raw)
    return out


def _ultralytics_decode(heads: list[np.ndarray], nc: int, bins: int) -> tuple[Any, Any]:
    """Boxes ``[A, 4]`` xyxy (canvas pixels) and class probabilities ``[A, nc]``, as
    ``Detect._inference`` and ``non_max_suppression``'s ``xywh2xyxy`` compute them."""
    x = [torch.from_numpy(h)[None] for h in heads]
    box = torch.cat([xi[:, : 4 * bins].reshape(1, 4 * bins, -1) for xi in x], dim=2)
    cls = torch.cat([xi[:, 4 * bins :].reshape(1, nc, -1) for xi in x], dim=2)
    if bins > 1:  # ultralytics.nn.modules.block.DFL
        conv = nn.Conv2d(bins, 1, 1, bias=False).requires_grad_(False)
        conv.weight.data[:] = torch.arange(bins, dtype=torch.float32).view(1, bins, 1, 1)
        a = box.shape[2]
        dist = conv(box.view(1, 4, bins, a).transpose(2, 1).softmax(1)).view(1, 4, a)
    else:
        dist = box
    points, strides = [], []
    for xi, s in zip(x, STRIDES, strict=True):  # ultralytics.utils.tal.make_anchors, offset 0.5
        h, w = xi.shape[2:]
        sy, sx = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
        points.append(torch.stack((sx, sy), -1).view(-1, 2).float())
        strides.append(torch.full((h * w, 1), float(s)))
    anchors = torch.cat(points).transpose(0, 1)[None]
    stride = torch.cat(strides).transpose(0, 1)[None]
    lt, rb = dist.chunk(2, 1)  # dist2bbox(xywh=True)
    x1y1, x2y2 = anchors - lt, anchors + rb
    xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * stride
    xy, wh = xywh[0, :2].T, xywh[0, 2:].T / 2  # xywh2xyxy
    return torch.cat((xy - wh, xy + wh), 1).numpy(), cls[0].sigmoid().T.numpy()


@pytest.mark.parametrize(("bins", "nc"), [(16, 80), (16, 3), (1, 80), (4, 1)])
def test_the_decode_is_ultralytics_detect(bins: int, nc: int) -> None:
    heads = _heads(bins * 100 + nc, 320, nc, bins)
    boxes, probs = _ultralytics_decode(heads, nc, bins)
    cand = yolov8.decode(heads, STRIDES, nc, 0.0, multi_label=False)  # every cell, in order
    assert len(cand) == boxes.shape[0] == sum((320 // s) ** 2 for s in STRIDES)
    np.testing.assert_allclose(cand.boxes, boxes, rtol=1e-5, atol=2e-4)
    np.testing.assert_array_equal(cand.classes, probs.argmax(1))
    np.testing.assert_allclose(cand.scores, probs.max(1), rtol=1e-6)
    multi = yolov8.decode(heads, STRIDES, nc, 0.3, multi_label=True)
    rows, cols = np.nonzero(probs > 0.3)
    np.testing.assert_array_equal(multi.classes, cols)
    np.testing.assert_allclose(multi.boxes, boxes[rows], rtol=1e-5, atol=2e-4)


def test_postprocess_is_decode_nms_and_back_projection() -> None:
    heads = _heads(7, 256, 3, 16)
    _, geometry = letterbox(np.zeros((480, 640, 3), np.uint8), 256)
    cand = yolov8.decode(heads, STRIDES, 3, 0.25, multi_label=False)
    keep = nms(cand.boxes, cand.scores, cand.classes, 0.45, 300)
    out = yolov8.postprocess(heads, STRIDES, 3, geometry, conf_threshold=0.25)
    assert 0 < len(out) == len(keep)
    np.testing.assert_array_equal(out[:, :4], geometry.to_original(cand.boxes[keep]))
    np.testing.assert_array_equal(out[:, 4], cand.scores[keep])


def test_a_cell_whose_best_class_cannot_pass_is_skipped_and_nan_costs_one_box() -> None:
    heads = _heads(9, 128, 2, 16)
    for h in heads:
        h[64:] = -20.0
    heads[0][64, 3, 5] = 4.0  # one cell of class 0 passes
    cand = yolov8.decode(heads, STRIDES, 2, 0.25, multi_label=False)
    assert len(cand) == 1
    assert cand.classes.tolist() == [0]
    heads[0][0, 3, 5] = np.nan  # its left side's first bin
    assert len(yolov8.decode(heads, STRIDES, 2, 0.25, multi_label=False)) == 0
    with pytest.raises(ValueError, match="not 4 \\* bins \\+ 3 classes"):
        yolov8.decode(heads, STRIDES, 3, 0.25, multi_label=False)


def _loadable(**changes: Any) -> Loadable:
    nc, bins = 2, 16
    kw: dict[str, Any] = {
        "name": "tiny-yolo11", "dla_core": 0,
        "inputs": (hwc4_input("images", 3, 64, 64, scale=0.0078),),
        "outputs": tuple(chw_vectorized(f"s{s}", 4 * bins + nc, 64 // s, 64 // s, vec=16)
                         for s in STRIDES),
        "input_scale": 0.0078, "output_scales": {}, "heads": "fp16", "num_classes": nc,
        "class_names": ("cat", "dog"), "anchors_px": (), "strides": STRIDES,
        "image_size": (64, 64), "latency_us": 100.0, "sections": {"graph": b"x"},
        "family": "yolo11",
    }  # fmt: skip
    kw.update(changes)
    return Loadable(**kw)


def test_the_family_owns_its_loadables_rules_and_post_program() -> None:
    loadable = _loadable()
    program = post_program(loadable)
    fields = (program.kernel, program.nc, program.bins, program.per_cell)
    assert fields == ("post_decode_dfl", 2, 16, 1)
    assert program.anchors is None
    assert post_program(dataclasses.replace(loadable, family="yolov8")) == program
    assert family_for("yolo26").cuda
    with pytest.raises(ValueError, match="has no anchors"):
        _loadable(anchors_px=(((1.0, 2.0),),) * 3)
    with pytest.raises(ValueError, match="not 4 \\* bins \\+ 3 classes"):
        _loadable(num_classes=3, class_names=("a", "b", "c"))


def test_the_one_to_one_head_keeps_the_best_without_nms() -> None:
    """``yolo26_one2one``: corners times the stride, every class a candidate, the best
    ``max_det`` kept even where they overlap (the head was trained not to duplicate)."""
    heads = [np.full((4 + 2, 128 // s, 128 // s), -20.0, np.float32) for s in STRIDES]
    for h in heads:
        h[:4] = 1.0  # a 2 x 2-cell box around every cell centre
    heads[0][4:, 3, 5] = [2.0, 1.0]  # both classes of one cell
    heads[0][4, 3, 6] = 1.5  # the next cell: the same class, the box overlapping
    _, identity = letterbox(np.zeros((128, 128, 3), np.uint8), 128)
    out = yolov8.postprocess(heads, STRIDES, 2, identity, conf_threshold=0.25, end2end=True)
    np.testing.assert_array_equal(out[:, 5], [0, 0, 1])
    np.testing.assert_array_equal(
        out[:, :4], [[36, 20, 52, 36], [44, 20, 60, 36], [36, 20, 52, 36]]
    )
    assert len(yolov8.postprocess(heads, STRIDES, 2, identity, conf_threshold=0.25, end2end=True,
                                  max_det=2)) == 2  # fmt: skip
    with_nms = yolov8.postprocess(heads, STRIDES, 2, identity, conf_threshold=0.25)
    assert len(with_nms) == 2  # the one-to-many decode: the best class of each cell
    program = post_program(_loadable(family="yolo26_one2one", outputs=tuple(
        chw_vectorized(f"s{s}", 6, 64 // s, 64 // s, vec=16) for s in STRIDES)))  # fmt: skip
    assert (program.bins, program.end2end) == (1, True)


def test_the_candidate_store_is_sized_for_a_one_to_one_head() -> None:
    """The daemon serves a model on the plane only where no frame can overflow the GPU's
    candidate store: a one-to-one head makes a candidate of every class of every cell."""
    from dlad.gpu.prepost import HeadSpec, most_candidates

    heads = [HeadSpec(84, 640 // s, 640 // s, s) for s in STRIDES]
    cells = sum((640 // s) ** 2 for s in STRIDES)
    assert most_candidates(yolov8.program(84, 80), heads) == cells
    assert most_candidates(yolov8.program(84, 80, end2end=True), heads) == cells * 80
