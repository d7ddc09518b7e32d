"""COCO mAP wrapper: known values, empty input, and agreement with pycocotools itself."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prep.evaluate import EvaluationError, detections_to_coco, evaluate_detections


def _gt(boxes_per_image: list[list[tuple[int, list[float]]]]) -> dict[str, Any]:
    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    for img_id, boxes in enumerate(boxes_per_image, start=1):
        images.append({"id": img_id, "width": 640, "height": 480, "file_name": f"{img_id}.jpg"})
        for cat, bbox in boxes:
            anns.append({"id": len(anns) + 1, "image_id": img_id, "category_id": cat, "bbox": bbox})
    cats = [{"id": c, "name": f"c{c}"} for c in (1, 2, 5)]
    return {"images": images, "annotations": anns, "categories": cats}


def _perfect(gt: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "image_id": a["image_id"],
            "category_id": a["category_id"],
            "bbox": a["bbox"],
            "score": 0.9,
        }
        for a in gt["annotations"]
    ]


GT = _gt(
    [
        [(1, [10, 20, 100, 100]), (2, [200, 200, 50, 80])],
        [(5, [300, 100, 120, 60])],
        [(1, [0, 0, 100, 100]), (1, [400, 300, 100, 100])],
    ]
)


def test_perfect_detections_score_one() -> None:
    before = copy.deepcopy(GT)
    r = evaluate_detections(GT, _perfect(GT), per_class=True)
    assert r.map50_95 == pytest.approx(1.0)
    assert r.map50 == pytest.approx(1.0)
    assert r.per_class == pytest.approx({1: 1.0, 2: 1.0, 5: 1.0})
    assert (r.num_images, r.num_detections) == (3, 5)
    assert before == GT  # ground truth is never modified


def test_shifted_boxes_give_known_values() -> None:
    # Shift every box right by 23% of its width: IoU = 77/123 = 0.626, which passes the
    # thresholds 0.50, 0.55, 0.60 and fails the other seven.
    dets = _perfect(GT)
    for d in dets:
        x, y, w, h = d["bbox"]
        d["bbox"] = [x + 0.23 * w, y, w, h]
    r = evaluate_detections(GT, dets)
    assert r.map50 == pytest.approx(1.0)
    assert r.map50_95 == pytest.approx(0.3)


def test_missed_object_halves_recall() -> None:
    # Category 1 has three boxes; find one. Recall tops at 1/3: 34 of 101 recall points.
    dets = [d for d in _perfect(GT) if d["category_id"] != 1 or d["image_id"] == 1]
    r = evaluate_detections(GT, dets, per_class=True)
    assert r.per_class is not None
    assert r.per_class[1] == pytest.approx(34 / 101)
    assert r.per_class[2] == pytest.approx(1.0)
    assert r.map50_95 == pytest.approx((34 / 101 + 2) / 3)


def test_false_positive_ranked_first_lowers_precision() -> None:
    gt = _gt([[(2, [0, 0, 50, 50])]])
    dets = [
        {"image_id": 1, "category_id": 2, "bbox": [300, 300, 50, 50], "score": 0.9},
        {"image_id": 1, "category_id": 2, "bbox": [0, 0, 50, 50], "score": 0.5},
    ]
    # Precision is 1/2 at recall 1, interpolated back to every recall point.
    assert evaluate_detections(gt, dets).map50_95 == pytest.approx(0.5)


def test_empty_detections_score_zero() -> None:
    r = evaluate_detections(GT, [], per_class=True)
    assert (r.map50_95, r.map50, r.num_detections) == (0.0, 0.0, 0)
    assert r.per_class == {1: 0.0, 2: 0.0, 5: 0.0}
    for backend in ("faster_coco_eval", "pycocotools"):
        assert evaluate_detections(GT, [], backend=backend).map50 == 0.0


def _random_case(seed: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    per_image = []
    for _ in range(8):
        boxes = []
        for _ in range(rng.integers(1, 7)):
            xy, wh = rng.uniform(0, 500, 2), rng.uniform(5, 150, 2)
            boxes.append((int(rng.choice([1, 2, 5])), [*xy.tolist(), *wh.tolist()]))
        per_image.append(boxes)
    gt = _gt(per_image)
    gt["annotations"][3]["iscrowd"] = 1
    gt["annotations"][3]["area"] = 1234.0
    dets = []
    for a in gt["annotations"]:
        for _ in range(rng.integers(0, 3)):
            x, y, w, h = a["bbox"]
            jitter = rng.normal(0, 0.15, 4) * [w, h, w, h]
            cat = a["category_id"] if rng.random() < 0.85 else int(rng.choice([1, 2, 5]))
            dets.append(
                {
                    "image_id": a["image_id"],
                    "category_id": cat,
                    "bbox": [x + jitter[0], y + jitter[1], abs(w + jitter[2]), abs(h + jitter[3])],
                    "score": float(rng.random()),
                }
            )
    for _ in range(15):
        xy, wh = rng.uniform(0, 500, 2), rng.uniform(5, 150, 2)
        dets.append(
            {
                "image_id": int(rng.integers(1, 9)),
                "category_id": int(rng.choice([1, 2, 5])),
                "bbox": [*xy.tolist(), *wh.tolist()],
                "score": float(rng.random()),
            }
        )
    return gt, dets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agrees_with_pycocotools(seed: int) -> None:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt, dets = _random_case(seed)
    ours = evaluate_detections(gt, dets, per_class=True)
    fallback = evaluate_detections(gt, dets, per_class=True, backend="pycocotools")

    coco_gt = COCO()
    coco_gt.dataset = copy.deepcopy(gt)
    for a in coco_gt.dataset["annotations"]:
        a.setdefault("iscrowd", 0)
        a.setdefault("area", a["bbox"][2] * a["bbox"][3])
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(copy.deepcopy(dets))
        ev = COCOeval(coco_gt, coco_dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    assert 0.05 < ev.stats[0] < 0.95  # a non-degenerate case
    for r in (ours, fallback):
        assert r.map50_95 == pytest.approx(ev.stats[0], abs=1e-6)
        assert r.map50 == pytest.approx(ev.stats[1], abs=1e-6)
    assert ours.per_class is not None
    assert fallback.per_class is not None
    for cat, ap in ours.per_class.items():
        assert ap == pytest.approx(fallback.per_class[cat], abs=1e-6)
    assert np.mean(list(ours.per_class.values())) == pytest.approx(ev.stats[0], abs=1e-6)


def test_evaluator_output_is_quiet_but_logged(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="prep.evaluate"):
        evaluate_detections(GT, _perfect(GT), backend="pycocotools")
        evaluate_detections(GT, _perfect(GT), backend="faster_coco_eval")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""
    assert "Average Precision" in caplog.text


def test_ground_truth_from_path(tmp_path: Path) -> None:
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(GT))
    assert evaluate_detections(path, _perfect(GT)).map50 == pytest.approx(1.0)
    assert evaluate_detections(str(path), _perfect(GT)).map50 == pytest.approx(1.0)


def test_detections_to_coco() -> None:
    dets = np.array([[10, 20, 110, 70, 0.8, 1], [0, 0, 5, 5, 0.1, 0]], np.float32)
    out = detections_to_coco(7, dets, [3, 9])
    assert out[0] == {
        "image_id": 7,
        "category_id": 9,
        "bbox": [10.0, 20.0, 100.0, 50.0],
        "score": pytest.approx(0.8),
    }
    assert out[1]["category_id"] == 3
    assert all(type(v) is float for v in out[0]["bbox"])
    assert detections_to_coco(1, np.zeros((0, 6)), [1]) == []
    with pytest.raises(EvaluationError, match="class indices"):
        detections_to_coco(1, dets, [3])
    with pytest.raises(EvaluationError, match=r"\[N, 6\]"):
        detections_to_coco(1, np.zeros((2, 5)), [1])
    # Round trip through the evaluator: a perfect detection from N x 6 rows.
    gt = _gt([[(2, [10, 20, 100, 50])]])
    assert evaluate_detections(gt, detections_to_coco(1, dets[:1], [0, 2])).map50 == 1.0


@pytest.mark.parametrize(
    ("gt", "dets", "match"),
    [
        (GT, [{"image_id": 99, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 1}], "unknown"),
        (GT, [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 1], "score": 1}], "bbox"),
        (GT, [{"image_id": 1, "category_id": 1, "bbox": [0, 0, -1, 1], "score": 1}], "negative"),
        (GT, [{"image_id": 1, "bbox": [0, 0, 1, 1], "score": 1}], "malformed"),
        (GT, [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 1, 1], "score": "nan"}], "finite"),
        ({**GT, "annotations": []}, [], "no \\(non-crowd\\) annotations"),
        ({"images": []}, [], "COCO json"),
    ],
)
def test_rejects_bad_input(gt: dict[str, Any], dets: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(EvaluationError, match=match):
        evaluate_detections(gt, dets)


def test_falls_back_to_pycocotools_when_faster_coco_eval_is_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "faster_coco_eval", None)  # makes the import fail
    with caplog.at_level(logging.DEBUG, logger="prep.evaluate"):
        assert evaluate_detections(GT, _perfect(GT)).map50 == pytest.approx(1.0)
    assert "index created" in caplog.text  # pycocotools' own chatter, so it really ran
    with pytest.raises(ImportError):
        evaluate_detections(GT, _perfect(GT), backend="faster_coco_eval")
