"""DLA output reformat, YOLOv5 decode and NMS against straightforward loop references."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlad.families.yolov5 import ANCHORS, STRIDES, decode, postprocess
from dlad.imaging import post
from dlad.imaging.post import (
    Candidates,
    nms,
    pack_chw16,
    pack_chw32,
    unpack_chw16,
    unpack_chw32_int8,
)
from dlad.imaging.pre import Letterbox, letterbox


def _sig(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


# ----------------------------------------------------------------------------- reformat


@settings(max_examples=40, deadline=None)
@given(
    c=st.integers(1, 70),
    h=st.integers(1, 5),
    w=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_chw16_round_trip_and_byte_layout(c: int, h: int, w: int, seed: int) -> None:
    x = np.random.default_rng(seed).normal(0, 10, (c, h, w)).astype(np.float32)
    packed = pack_chw16(x)
    groups = -(-c // 16)
    assert packed.shape == (groups, h, w, 16)
    assert packed.dtype == np.float16
    flat = np.frombuffer(packed.tobytes(), dtype=np.float16)
    x16 = x.astype(np.float16)
    for ci in range(groups * 16):
        for hi in range(h):
            for wi in range(w):
                off = ((ci // 16) * h * w + hi * w + wi) * 16 + ci % 16
                want = x16[ci, hi, wi] if ci < c else 0.0
                assert flat[off] == want, (ci, hi, wi)
    np.testing.assert_array_equal(unpack_chw16(packed, c), x16.astype(np.float32))


@settings(max_examples=40, deadline=None)
@given(
    c=st.integers(1, 70),
    h=st.integers(1, 5),
    w=st.integers(1, 5),
    scale=st.floats(1e-3, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_chw32_round_trip_and_byte_layout(c: int, h: int, w: int, scale: float, seed: int) -> None:
    x = np.random.default_rng(seed).normal(0, 60 * scale, (c, h, w)).astype(np.float32)
    packed = pack_chw32(x, scale)
    groups = -(-c // 32)
    assert packed.shape == (groups, h, w, 32)
    assert packed.dtype == np.int8
    flat = np.frombuffer(packed.tobytes(), dtype=np.int8)
    for ci in range(groups * 32):
        for hi in range(h):
            for wi in range(w):
                off = ((ci // 32) * h * w + hi * w + wi) * 32 + ci % 32
                if ci >= c:
                    assert flat[off] == 0
                    continue
                q = float(np.float32(x[ci, hi, wi]) / np.float32(scale))
                r = math.copysign(math.floor(abs(q) + 0.5), q)  # ties away from zero
                assert flat[off] == max(-128, min(127, r)), (ci, hi, wi)
    back = unpack_chw32_int8(packed, c, scale)
    assert back.dtype == np.float32
    unsat = np.abs(x) < 127 * scale
    np.testing.assert_allclose(back[unsat], x[unsat], atol=scale * 0.5001)


def test_unpack_rejects_mismatched_buffers() -> None:
    buf = np.zeros((16, 2, 2, 16), np.float16)
    assert unpack_chw16(buf, 255).shape == (255, 2, 2)
    with pytest.raises(ValueError, match="CHW16"):
        unpack_chw16(buf, 257)
    with pytest.raises(ValueError, match="float16"):
        unpack_chw16(buf.astype(np.float32), 255)
    with pytest.raises(ValueError, match="CHW32"):
        unpack_chw32_int8(np.zeros((8, 2, 2, 16), np.int8), 255, 0.1)
    with pytest.raises(ValueError, match="scale"):
        unpack_chw32_int8(np.zeros((8, 2, 2, 32), np.int8), 255, 0.0)


# ----------------------------------------------------------------------------- decode


def _ref_decode(
    heads: list[np.ndarray], anchors: np.ndarray, strides: list[int], thr: float, multi: bool
) -> list[tuple[list[float], float, int]]:
    """Per-cell loop straight from the YOLOv5 formulas, in Python floats."""
    out = []
    na = anchors.shape[1]
    for level, head in enumerate(heads):
        no = head.shape[0] // na
        stride = strides[level]
        for a in range(na):
            aw, ah = float(anchors[level, a, 0]), float(anchors[level, a, 1])
            for iy in range(head.shape[1]):
                for ix in range(head.shape[2]):
                    v = [float(head[a * no + k, iy, ix]) for k in range(no)]
                    cx = (_sig(v[0]) * 2 - 0.5 + ix) * stride
                    cy = (_sig(v[1]) * 2 - 0.5 + iy) * stride
                    bw = (_sig(v[2]) * 2) ** 2 * aw
                    bh = (_sig(v[3]) * 2) ** 2 * ah
                    box = [cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2]
                    obj = _sig(v[4])
                    cls = v[5:]
                    if multi:
                        for k, logit in enumerate(cls):
                            if obj * _sig(logit) > thr:
                                out.append((box, obj * _sig(logit), k))
                    else:
                        best = max(range(len(cls)), key=lambda k: cls[k])  # first max wins
                        if obj * _sig(cls[best]) > thr:
                            out.append((box, obj * _sig(cls[best]), best))
    return out


def _random_heads(
    rng: np.random.Generator, shapes: list[tuple[int, int]], na: int, nc: int
) -> list[np.ndarray]:
    heads = []
    for h, w in shapes:
        head = rng.normal(0, 2, (na, 5 + nc, h, w)).astype(np.float32)
        head[:, 4] += rng.choice([-6.0, 0.0, 3.0], size=(na, h, w)).astype(np.float32)
        heads.append(head.reshape(na * (5 + nc), h, w))
    return heads


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=3),
    nc=st.integers(1, 6),
    thr=st.floats(0.0, 0.95),
    multi=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_matches_per_cell_reference(
    shapes: list[tuple[int, int]], nc: int, thr: float, multi: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    nl = len(shapes)
    anchors = rng.uniform(4, 200, (nl, 3, 2)).astype(np.float32)
    strides = [8 * 2**i for i in range(nl)]
    heads = _random_heads(rng, shapes, 3, nc)
    got = decode(heads, anchors, strides, thr, multi)
    ref = _ref_decode(heads, anchors, strides, thr, multi)

    # float32 vs float64 may disagree on scores within rounding of the threshold: drop those.
    def far(s: float) -> bool:
        return abs(s - thr) > 1e-5

    keep_got = [i for i in range(len(got)) if far(float(got.scores[i]))]
    ref = [r for r in ref if far(r[1])]
    assert len(keep_got) == len(ref)
    if ref:
        np.testing.assert_allclose(got.boxes[keep_got], [r[0] for r in ref], rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(got.scores[keep_got], [r[1] for r in ref], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(got.classes[keep_got], [r[2] for r in ref])
    assert (got.scores > np.float32(thr)).all()
    assert got.boxes.dtype == np.float32
    assert got.scores.dtype == np.float32


def test_decode_hand_computed_cell() -> None:
    nc = 3
    heads = [np.full((3 * (5 + nc), h, h), -20.0, np.float32) for h in (4, 2, 1)]
    # Level 1 (stride 16), anchor 2 (59, 119), cell ix=1, iy=0.
    base = 2 * (5 + nc)
    heads[1][base : base + 4, 0, 1] = 0.0  # S(0) = 0.5 -> offsets 0.5, size factor 1
    heads[1][base + 4, 0, 1] = math.log(0.9 / 0.1)  # objectness 0.9
    heads[1][base + 5 + 2, 0, 1] = math.log(0.8 / 0.2)  # class 2 at 0.8
    c = decode(heads, ANCHORS, STRIDES, 0.25, multi_label=False)
    assert len(c) == 1
    cx, cy = (0.5 + 1) * 16, (0.5 + 0) * 16
    np.testing.assert_allclose(c.boxes[0], [cx - 29.5, cy - 59.5, cx + 29.5, cy + 59.5], rtol=1e-6)
    np.testing.assert_allclose(c.scores, [0.72], rtol=1e-6)
    assert c.classes.tolist() == [2]
    # Multi-label adds nothing here (other classes are at S(-20)); a 0.75 threshold drops it.
    assert len(decode(heads, ANCHORS, STRIDES, 0.25, multi_label=True)) == 1
    assert len(decode(heads, ANCHORS, STRIDES, 0.75, multi_label=False)) == 0


def test_decode_accepts_fp16_and_rejects_bad_heads() -> None:
    rng = np.random.default_rng(3)
    heads = _random_heads(rng, [(4, 4), (2, 2), (1, 1)], 3, 2)
    c32 = decode(heads, ANCHORS, STRIDES, 0.3, False)
    c16 = decode([h.astype(np.float16) for h in heads], ANCHORS, STRIDES, 0.3, False)
    assert abs(len(c16) - len(c32)) <= 2
    bad = [h.copy() for h in heads]
    bad[0][:, 1, 1] = np.nan  # every channel of one cell, three anchors
    bad[1][0, 0, 0] = np.nan  # tx of one box
    nan_free = decode(bad, ANCHORS, STRIDES, 0.0, True)
    assert np.isfinite(nan_free.boxes).all()
    assert np.isfinite(nan_free.scores).all()
    assert len(nan_free) < len(decode(heads, ANCHORS, STRIDES, 0.0, True))
    with pytest.raises(ValueError, match="heads"):
        decode(heads[:2], ANCHORS, STRIDES, 0.3, False)
    with pytest.raises(ValueError, match="same C"):
        decode([heads[0], heads[1][:-3], heads[2]], ANCHORS, STRIDES, 0.3, False)
    with pytest.raises(ValueError, match="not 3"):
        decode([h[:16] for h in heads], ANCHORS, STRIDES, 0.3, False)
    with pytest.raises(ValueError, match="conf_threshold"):
        decode(heads, ANCHORS, STRIDES, 1.0, False)
    with pytest.raises(ValueError, match="anchors"):
        decode(heads, ANCHORS[:, :, :1], STRIDES, 0.3, False)


# ----------------------------------------------------------------------------- NMS


def _iou(a: list[float], b: list[float]) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    area_a = max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1])
    area_b = max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])
    union = area_a + area_b - inter
    return inter / union if union > 0 else 0.0


def _ref_nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    classes: np.ndarray,
    thr: float,
    max_det: int,
    max_candidates: int | None,
) -> list[int]:
    b = boxes.astype(np.float64).tolist()
    s = scores.astype(np.float64).tolist()
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    if max_candidates is not None:
        order = order[:max_candidates]
    keep: list[int] = []
    for i in order:
        if len(keep) == max_det:
            break
        if all(classes[j] != classes[i] or _iou(b[i], b[j]) < thr for j in keep):
            keep.append(i)
    return keep


def _random_boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    xy = rng.uniform(0, 100, (n, 2))
    wh = rng.uniform(0, 40, (n, 2)) * (rng.random((n, 1)) > 0.05)  # a few zero-area boxes
    boxes = np.concatenate([xy, xy + wh], axis=1).astype(np.float32)
    dup = rng.random(n) < 0.15  # exact duplicates: IoU exactly 1
    if n > 1:
        boxes[dup] = boxes[0]
    return boxes


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 80),
    n_classes=st.integers(1, 4),
    thr=st.floats(0.05, 1.0),
    max_det=st.integers(0, 90),
    cap=st.one_of(st.none(), st.integers(0, 90)),
    strategy=st.sampled_from(["pairs", "heap"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_nms_matches_quadratic_reference(
    n: int, n_classes: int, thr: float, max_det: int, cap: int | None, strategy: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    boxes = _random_boxes(rng, n)
    scores = rng.choice(np.linspace(0.1, 0.9, 7), n).astype(np.float32)  # many ties
    classes = rng.integers(0, n_classes, n)
    with _force_strategy(strategy):
        keep = nms(boxes, scores, classes, thr, max_det, max_candidates=cap)
    assert keep.tolist() == _ref_nms(boxes, scores, classes, thr, max_det, cap)
    # Invariants, stated directly.
    assert len(keep) <= max_det
    assert (np.diff(scores[keep]) <= 0).all()
    kb = boxes.astype(np.float64)[keep].tolist()
    for i in range(len(keep)):
        for j in range(i):
            if classes[keep[i]] == classes[keep[j]]:
                assert _iou(kb[i], kb[j]) < thr


@contextlib.contextmanager
def _force_strategy(strategy: str) -> Iterator[None]:
    saved = post._PAIRS_PER_HEAP_STEP
    post._PAIRS_PER_HEAP_STEP = 10**9 if strategy == "pairs" else 0
    try:
        yield
    finally:
        post._PAIRS_PER_HEAP_STEP = saved


def test_nms_long_suppression_chain_falls_back_to_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Boxes 1 px apart: each suppresses only its neighbour (IoU 9/11 >= 0.8 > 8/12), so the
    # outcome alternates and the fixed-point iteration needs one round per box.
    x = np.arange(60, dtype=np.float32)
    boxes = np.stack([x, np.zeros(60), x + 10, np.full(60, 10)], axis=1)
    scores = np.linspace(0.9, 0.3, 60).astype(np.float32)
    classes = np.zeros(60, int)
    want = _ref_nms(boxes, scores, classes, 0.8, 100, None)
    assert want == list(range(0, 60, 2))
    monkeypatch.setattr(post, "_PAIRS_PER_HEAP_STEP", 10**9)
    pair_result = post._greedy_pairs  # spy: the pair strategy must have given up
    calls: list[object] = []

    def spy(*args: Any) -> Any:
        calls.append(out := pair_result(*args))
        return out

    monkeypatch.setattr(post, "_greedy_pairs", spy)
    assert nms(boxes, scores, classes, 0.8, 100).tolist() == want
    assert calls == [None]
    monkeypatch.setattr(post, "_MAX_FIXED_POINT_ROUNDS", 100)
    assert nms(boxes, scores, classes, 0.8, 100).tolist() == want
    assert calls[-1] is not None


@pytest.mark.parametrize("strategy", ["pairs", "heap"])
def test_nms_threshold_is_inclusive_and_class_aware(strategy: str) -> None:
    with _force_strategy(strategy):
        _check_inclusive_and_class_aware()


def _check_inclusive_and_class_aware() -> None:
    boxes = np.array([[0, 0, 2, 1], [1, 0, 3, 1]], np.float32)  # IoU exactly 1/3
    scores = np.array([0.9, 0.8], np.float32)
    same = np.array([0, 0])
    assert nms(boxes, scores, same, 1 / 3, 10).tolist() == [0]
    assert nms(boxes, scores, same, 0.34, 10).tolist() == [0, 1]
    assert nms(boxes, scores, np.array([0, 1]), 1 / 3, 10).tolist() == [0, 1]
    # Identical boxes and scores: the lower index wins; IoU 1 >= 1.0 suppresses.
    twins = np.array([[5, 5, 9, 9]] * 3, np.float32)
    assert nms(twins, np.full(3, 0.5, np.float32), np.zeros(3), 1.0, 10).tolist() == [0]


def test_nms_empty_and_bad_input() -> None:
    empty = nms(np.zeros((0, 4)), np.zeros(0), np.zeros(0, int), 0.5, 10)
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="boxes"):
        nms(np.zeros((3, 5)), np.zeros(3), np.zeros(3), 0.5, 10)
    with pytest.raises(ValueError, match="iou_threshold"):
        nms(np.zeros((3, 4)), np.zeros(3), np.zeros(3), 0.0, 10)
    with pytest.raises(ValueError, match="finite"):
        nms(np.full((1, 4), np.nan), np.zeros(1), np.zeros(1), 0.5, 10)


def test_nms_large_input_matches_reference() -> None:
    rng = np.random.default_rng(11)
    boxes = _random_boxes(rng, 1500)
    scores = rng.random(1500).astype(np.float32)
    classes = rng.integers(0, 5, 1500)
    want = _ref_nms(boxes, scores, classes, 0.45, 300, 1000)
    for strategy in ("pairs", "heap"):
        with _force_strategy(strategy):
            keep = nms(boxes, scores, classes, 0.45, 300, max_candidates=1000)
        assert keep.tolist() == want


# ----------------------------------------------------------------------------- postprocess


def _plant(
    head: np.ndarray, nc: int, a: int, iy: int, ix: int, obj: float, cls: int, p: float
) -> None:
    base = a * (5 + nc)
    head[base : base + 4, iy, ix] = 0.0
    head[base + 4, iy, ix] = math.log(obj / (1 - obj))
    head[base + 5 + cls, iy, ix] = math.log(p / (1 - p))


def test_postprocess_planted_objects() -> None:
    nc = 4
    _, lb = letterbox(np.zeros((200, 256, 3), np.uint8), 128)  # scale 0.5, pad_y 14
    assert (lb.scale, lb.pad_x, lb.pad_y) == (0.5, 0, 14)
    heads = [np.full((3 * (5 + nc), s, s), -12.0, np.float32) for s in (16, 8, 4)]
    _plant(heads[0], nc, 2, 7, 5, 0.95, 2, 0.9)  # (33, 23) anchor at cell (5, 7)
    _plant(heads[0], nc, 2, 7, 6, 0.90, 2, 0.9)  # same class, 8 px right: IoU 25/41
    _plant(heads[0], nc, 1, 8, 5, 0.90, 3, 0.9)  # other class, overlapping: kept
    out = postprocess(heads, ANCHORS, STRIDES, lb, conf_threshold=0.25)
    assert out.shape == (2, 6)
    assert out.dtype == np.float32
    cx, cy = (5 + 0.5) * 8, (7 + 0.5) * 8
    canvas_box = np.array([cx - 16.5, cy - 11.5, cx + 16.5, cy + 11.5])
    want = (canvas_box - [0, 14, 0, 14]) / 0.5
    np.testing.assert_allclose(out[0, :4], want, rtol=1e-5)
    np.testing.assert_allclose(out[:, 4], [0.95 * 0.9, 0.90 * 0.9], rtol=1e-5)
    assert out[:, 5].tolist() == [2.0, 3.0]
    assert len(postprocess(heads, ANCHORS, STRIDES, lb, max_det=1)) == 1
    none = postprocess(heads, ANCHORS, STRIDES, lb, conf_threshold=0.9)
    assert none.shape == (0, 6)


@pytest.mark.parametrize("multi_label", [False, True])
def test_postprocess_is_decode_nms_and_back_projection(multi_label: bool) -> None:
    rng = np.random.default_rng(21)
    heads = _random_heads(rng, [(12, 12), (6, 6), (3, 3)], 3, 5)
    lb = Letterbox(scale=0.25, pad_x=6, pad_y=0, src_w=360, src_h=384, dst_w=96, dst_h=96)
    out = postprocess(
        heads,
        ANCHORS,
        STRIDES,
        lb,
        conf_threshold=0.3,
        iou_threshold=0.5,
        max_det=50,
        multi_label=multi_label,
    )
    c: Candidates = decode(heads, ANCHORS, STRIDES, 0.3, multi_label)
    keep = _ref_nms(c.boxes, c.scores, c.classes, 0.5, 50, None)
    assert 0 < len(out) <= 50
    assert (np.diff(out[:, 4]) <= 0).all()
    np.testing.assert_allclose(out[:, 4], c.scores[keep])
    np.testing.assert_array_equal(out[:, 5], c.classes[keep])
    b = c.boxes[keep].astype(np.float64)
    want = np.stack([(b[:, 0] - 6) * 4, b[:, 1] * 4, (b[:, 2] - 6) * 4, b[:, 3] * 4], axis=1).clip(
        0, [360, 384, 360, 384]
    )
    np.testing.assert_allclose(out[:, :4], want, rtol=1e-5, atol=1e-3)
