"""COCO-style box mAP: a thin, quiet wrapper over faster-coco-eval (or pycocotools).

``faster_coco_eval`` exposes the pycocotools API (``COCO``, ``COCOeval_faster``) and produces the
same numbers much faster; pycocotools is the fallback when it is not importable, and can be
forced with ``backend="pycocotools"`` (the tests cross-check the two). Both follow the COCO
protocol: IoU thresholds 0.50:0.05:0.95, 101 recall points, at most 100 detections per image
(the highest-scoring), area range "all".

The evaluators' console chatter is captured and re-emitted on this module's logger at DEBUG
level. Malformed input raises :class:`EvaluationError` (a ValueError).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = ["EvalResult", "EvaluationError", "detections_to_coco", "evaluate_detections"]

log = logging.getLogger(__name__)

Backend = Literal["auto", "faster_coco_eval", "pycocotools"]


class EvaluationError(ValueError):
    """Ground truth or detections that cannot be evaluated (shape, ids, values)."""


@dataclass(frozen=True, slots=True)
class EvalResult:
    """COCO box metrics.

    ``map50_95`` and ``map50`` are in ``[0, 1]``. ``per_class`` maps each category id that has
    at least one ground-truth box to its AP@[.50:.95], or is None when not requested.
    """

    map50_95: float
    map50: float
    per_class: dict[int, float] | None
    num_images: int
    num_detections: int


def detections_to_coco(
    image_id: int, dets_n6: npt.ArrayLike, class_to_category: Sequence[int]
) -> list[dict[str, Any]]:
    """Turn ``[N, 6]`` ``x1, y1, x2, y2, score, class`` rows into COCO result dicts.

    Each dict has ``image_id``, ``category_id = class_to_category[class]``, ``bbox = [x, y, w, h]``
    and ``score``, all plain Python numbers. Raises EvaluationError if ``dets_n6`` is not
    ``[N, 6]`` with finite values or a class index is not an integer in range.
    """
    d = np.asarray(dets_n6, dtype=np.float64)
    if d.size == 0:
        return []
    if d.ndim != 2 or d.shape[1] != 6 or not np.isfinite(d).all():
        raise EvaluationError(f"detections must be a finite [N, 6] array, got shape {d.shape}")
    cls = d[:, 5]
    if (cls != np.round(cls)).any() or cls.min() < 0 or cls.max() >= len(class_to_category):
        raise EvaluationError(
            f"class indices must be integers in [0, {len(class_to_category)}), got {np.unique(cls)}"
        )
    return [
        {
            "image_id": int(image_id),
            "category_id": int(class_to_category[int(c)]),
            "bbox": [x1, y1, x2 - x1, y2 - y1],
            "score": s,
        }
        for x1, y1, x2, y2, s, c in d.tolist()
    ]


def _load_ground_truth(ground_truth: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(ground_truth, (str, os.PathLike)):
        with open(ground_truth, encoding="utf-8") as f:
            gt = json.load(f)
    else:
        gt = copy.deepcopy(dict(ground_truth))
    if not isinstance(gt, dict) or not all(
        isinstance(gt.get(k), list) for k in ("images", "annotations", "categories")
    ):
        raise EvaluationError("ground truth must be COCO json with images/annotations/categories")
    # COCOeval reads 'iscrowd', 'area' and 'id' unconditionally; generated ground truth may
    # leave them out, and their COCO defaults are unambiguous.
    for i, ann in enumerate(gt["annotations"], start=1):
        bbox = ann.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4):
            raise EvaluationError(f"annotation {ann.get('id', i)} has no [x, y, w, h] bbox")
        ann.setdefault("iscrowd", 0)
        ann.setdefault("area", float(bbox[2]) * float(bbox[3]))
        ann.setdefault("id", i)
    return gt


def _clean_detections(
    detections: Sequence[Mapping[str, Any]], image_ids: set[int]
) -> list[dict[str, Any]]:
    """Validated copies (the evaluators add keys to the dicts they are given)."""
    out: list[dict[str, Any]] = []
    for i, det in enumerate(detections):
        try:
            image_id = int(det["image_id"])
            category_id = int(det["category_id"])
            bbox = [float(v) for v in det["bbox"]]
            score = float(det["score"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EvaluationError(f"detection {i} is malformed: {exc!r}") from None
        if len(bbox) != 4 or not all(math.isfinite(v) for v in [*bbox, score]):
            raise EvaluationError(f"detection {i} needs a finite [x, y, w, h] bbox and score")
        if bbox[2] < 0 or bbox[3] < 0:
            raise EvaluationError(f"detection {i} has a negative width or height: {bbox}")
        if image_id not in image_ids:
            raise EvaluationError(f"detection {i} refers to unknown image_id {image_id}")
        out.append({"image_id": image_id, "category_id": category_id, "bbox": bbox, "score": score})
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Capture what the evaluator prints; hand it to the debug log instead."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        text = buf.getvalue().strip()
        if text:
            log.debug("coco evaluator output:\n%s", text)


def _run_cocoeval(
    gt: dict[str, Any], dets: list[dict[str, Any]], backend: Backend
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], list[int]]:
    """Returns (stats, precision[T, R, K, A, M], category ids along K)."""
    coco_cls: Any = None
    eval_cls: Any = None
    use_faster = backend in ("auto", "faster_coco_eval")
    if use_faster:
        try:
            import faster_coco_eval

            coco_cls, eval_cls = faster_coco_eval.COCO, faster_coco_eval.COCOeval_faster
        except ImportError:
            if backend == "faster_coco_eval":
                raise
            use_faster = False
    if not use_faster:
        from pycocotools import coco, cocoeval

        coco_cls, eval_cls = coco.COCO, cocoeval.COCOeval

    with _quiet():
        if use_faster:
            coco_gt = coco_cls(gt)
            coco_dt = coco_gt.loadRes(dets)
            evaluator = eval_cls(coco_gt, coco_dt, "bbox", print_function=log.debug)
        else:
            coco_gt = coco_cls()
            coco_gt.dataset = gt
            coco_gt.createIndex()
            coco_dt = coco_gt.loadRes(dets)
            evaluator = eval_cls(coco_gt, coco_dt, "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = np.asarray(evaluator.stats, dtype=np.float64)
    precision = np.asarray(evaluator.eval["precision"], dtype=np.float64)
    return stats, precision, [int(c) for c in evaluator.params.catIds]


def evaluate_detections(
    ground_truth: Mapping[str, Any] | str | os.PathLike[str],
    detections: Sequence[Mapping[str, Any]],
    *,
    per_class: bool = False,
    backend: Backend = "auto",
) -> EvalResult:
    """COCO box mAP of ``detections`` against ``ground_truth`` over all ground-truth images.

    ``ground_truth`` is a COCO json dict or a path to one (never modified; missing ``iscrowd``,
    ``area`` and annotation ``id`` get their COCO defaults). ``detections`` are dicts with
    ``image_id``, ``category_id``, ``bbox = [x, y, w, h]`` (pixels) and ``score``, e.g. from
    :func:`detections_to_coco`. No detections gives mAP 0. ``per_class=True`` also reports
    AP@[.50:.95] per category that has ground truth.

    Raises EvaluationError for malformed ground truth or detections, detections on images that
    are not in the ground truth, or ground truth without a single annotation (mAP undefined).
    OSError / json.JSONDecodeError if a path cannot be read; ImportError if ``backend`` names an
    evaluator that is not installed.
    """
    gt = _load_ground_truth(ground_truth)
    image_ids = {int(img["id"]) for img in gt["images"]}
    dets = _clean_detections(detections, image_ids)
    gt_cats = sorted({int(a["category_id"]) for a in gt["annotations"] if not a["iscrowd"]})
    if not gt_cats:
        raise EvaluationError("ground truth has no (non-crowd) annotations: mAP is undefined")
    if not dets:
        # pycocotools cannot load an empty result list; with no detections every AP is 0.
        return EvalResult(
            0.0, 0.0, dict.fromkeys(gt_cats, 0.0) if per_class else None, len(image_ids), 0
        )
    stats, precision, cat_ids = _run_cocoeval(gt, dets, backend)
    classes: dict[int, float] | None = None
    if per_class:
        classes = {}
        for k, cat in enumerate(cat_ids):
            p = precision[:, :, k, 0, -1]  # all IoUs and recalls, area "all", maxDets 100
            valid = p[p > -1]
            if valid.size:
                classes[cat] = float(valid.mean())
    # A -1 stat means "no ground truth"; excluded above, so clamp only guards float noise.
    return EvalResult(
        map50_95=max(float(stats[0]), 0.0),
        map50=max(float(stats[1]), 0.0),
        per_class=classes,
        num_images=len(image_ids),
        num_detections=len(dets),
    )
