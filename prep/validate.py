"""Accuracy of a detector (float or fake-quant) on held-out letterboxed images, COCO-style.

Inference returns raw heads; decoding, multi-label candidates and class-aware NMS are the
daemon's own numpy reference (``dlad.imaging.post``), so the numbers measured here are those of
the post-processing dlad serves with. Boxes are mapped back to original image pixels and scored
with faster-coco-eval (``prep.evaluate``) against the dataset's COCO annotations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dlad.families import family_for
from dlad.imaging.post import unpack_head
from dlad.imaging.pre import Letterbox
from dlad.loadable import Loadable
from prep.data.coco import LetterboxedArrays
from prep.evaluate import EvalResult, detections_to_coco, evaluate_detections

if TYPE_CHECKING:
    from prep.emulated_build import ModelInfo

HeadsFn = Callable[[np.ndarray], list[np.ndarray]]
PostFn = Callable[[list[np.ndarray], Letterbox], np.ndarray]
"""One image's heads and letterbox → its ``[N, 6]`` detections in original-image pixels."""


@dataclass(frozen=True)
class EvalSettings:
    """COCO-evaluation thresholds (YOLOv5's ``val.py`` defaults)."""

    conf_threshold: float = 0.001
    iou_threshold: float = 0.65
    max_det: int = 300
    batch_size: int = 16


def torch_heads(model: nn.Module, device: str = "cpu") -> HeadsFn:
    """Wrap a torch detector: uint8 ``[N, S, S, 3]`` RGB -> three float32 ``[N, C, H, W]``."""
    model = model.eval().to(device)

    def run(images: np.ndarray) -> list[np.ndarray]:
        x = torch.from_numpy(np.ascontiguousarray(images)).to(device)
        x = x.permute(0, 3, 1, 2).float().div_(255.0)
        with torch.inference_mode():
            heads = model(x)
        return [h.float().cpu().numpy() for h in heads]

    return run


def iter_heads(
    heads_fn: HeadsFn, arrays: LetterboxedArrays, batch_size: int
) -> Iterator[tuple[int, list[np.ndarray]]]:
    """``(item index, [per-level head [C, H, W]])`` for every image of ``arrays``."""
    for start in range(0, len(arrays), batch_size):
        batch = arrays.images[start : start + batch_size]
        heads = heads_fn(batch)
        for k in range(len(batch)):
            yield start + k, [h[k] for h in heads]


def postprocessor(info: ModelInfo, settings: EvalSettings) -> PostFn:
    """The family's numpy decode + NMS (``dlad.families``: what dlad serves with) with
    ``settings``' thresholds, multi-label as mAP is measured (a one-to-one head: its top
    ``max_det`` scores, no NMS)."""
    post = family_for(info.family).postprocess
    conf, iou, max_det = settings.conf_threshold, settings.iou_threshold, settings.max_det
    return lambda heads, lb: post(
        heads, info, lb, conf=conf, iou=iou, max_det=max_det, multi_label=True
    )


def detect_all(
    heads_fn: HeadsFn, arrays: LetterboxedArrays, post: PostFn, settings: EvalSettings
) -> list[np.ndarray]:
    """Per image, ``[N, 6]`` detections in original-image pixels (multi-label, for mAP)."""
    out: list[np.ndarray] = [np.zeros((0, 6), np.float32)] * len(arrays)
    for i, heads in iter_heads(heads_fn, arrays, settings.batch_size):
        out[i] = post(heads, arrays.geometry(i))
    return out


def evaluate(
    heads_fn: HeadsFn,
    arrays: LetterboxedArrays,
    ground_truth: dict[str, Any],
    class_to_category: Sequence[int],
    post: PostFn,
    *,
    settings: EvalSettings = EvalSettings(),
) -> EvalResult:
    """mAP@[.5:.95] and mAP@.5 of ``heads_fn`` on ``arrays`` against ``ground_truth``.

    Only the images of ``arrays`` are scored (the ground truth is restricted to them).
    """
    detections = detect_all(heads_fn, arrays, post, settings)
    coco: list[dict[str, Any]] = []
    for i, dets in enumerate(detections):
        coco.extend(detections_to_coco(int(arrays.image_ids[i]), dets, class_to_category))
    return evaluate_detections(restrict_ground_truth(ground_truth, arrays.image_ids), coco)


def restrict_ground_truth(
    gt: dict[str, Any], image_ids: Sequence[int] | np.ndarray
) -> dict[str, Any]:
    """The COCO dict limited to ``image_ids`` (so held-out scoring ignores training images)."""
    keep = {int(i) for i in image_ids}
    return {
        **gt,
        "images": [im for im in gt["images"] if int(im["id"]) in keep],
        "annotations": [a for a in gt["annotations"] if int(a["image_id"]) in keep],
    }


def emulated_heads(loadable: Loadable, *, threads: int = 2) -> HeadsFn:
    """The emulated DLA core's path, image by image, as the daemon runs it: quantise the
    letterboxed canvas to ``DLA_HWC4`` int8 with the loadable's input scale, run the INT8 engine,
    unpack the ``CHW32`` int8 / ``CHW16`` fp16 head buffers back to float heads."""
    from dlad.devices.int8_engine import engine_for_loadable
    from dlad.imaging.pre import quantize_hwc4

    engine = engine_for_loadable(loadable, threads=threads)
    specs = engine.outputs

    def run(images: np.ndarray) -> list[np.ndarray]:
        per_level: list[list[np.ndarray]] = [[] for _ in specs]
        for image in images:
            buffers = engine.run(quantize_hwc4(image, loadable.input_scale))
            for level, (spec, buf) in enumerate(zip(specs, buffers, strict=True)):
                head = unpack_head(buf, spec.channels, spec.height, spec.width, spec.scale)
                per_level[level].append(head)
        return [np.stack(level) for level in per_level]

    return run
