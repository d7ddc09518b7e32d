"""YOLOv8 and YOLO11 (Ultralytics ``Detect``): anchor-free heads with distribution focal loss.

A head is one level of ``[4 * bins + nc, H, W]`` raw values: the box branch's last conv
(``cv2[i]``, ``4 * bins`` channels, side-major: channel ``s * bins + k`` is bin ``k`` of side
``s`` = left, top, right, bottom) then the class branch's (``cv3[i]``, ``nc`` logits), as the DLA
graph ends where Ultralytics' own export would reshape for DFL. What follows the convs in
``Detect`` runs here and in ``yolov8.cu``'s ``post_decode_dfl``: per side, a softmax over the
``bins`` and its expectation (DFL's fixed 1x1 conv over ``0 .. bins-1``; with 1 bin the raw value
is the distance, as YOLO26's heads are), the distances from the cell centre to a box (``dist2bbox``
as ``xywh``, times the stride, then corners), class sigmoids, and NMS.

YOLOv8 and YOLO11 differ in their backbones and in the class branch's depthwise convs; their heads'
outputs are the same, so both are this decode. The loadable carries no anchors (``anchors_px`` is
empty) and ``bins`` follows from the channels: ``(C - nc) / 4``.

``yolo26_one2one`` is YOLO26's NMS-free head (its one-to-one branch, ``one2one_cv2/cv3``): the
boxes are ``dist2bbox`` as corners, every class of every cell is a candidate, and the best
``max_det`` above the confidence threshold are the detections, as Ultralytics'
``Detect.postprocess`` takes its top-k; there is no NMS.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from dlad.families.base import Family, Heads, HeadsModel, PostProgram
from dlad.imaging.post import (
    DEFAULT_MAX_CANDIDATES,
    Candidates,
    check_conf_threshold,
    check_head_arrays,
    class_candidates,
    detections,
    logit_cut,
)  # fmt: skip

if TYPE_CHECKING:
    from dlad.imaging.pre import Letterbox
    from dlad.loadable import Loadable

__all__ = ["BINS", "FAMILIES", "KERNEL", "decode", "distances", "postprocess", "program"]

_F32 = npt.NDArray[np.float32]
_Idx = npt.NDArray[np.intp]

BINS: Final = 16
"""Ultralytics' ``reg_max`` of YOLOv8 and YOLO11 (YOLO26 has 1)."""
KERNEL: Final = "post_decode_dfl"


def bins_of(channels: int, nc: int) -> int:
    """The bins per box side of heads of ``channels`` scoring ``nc`` classes. Raises ValueError
    unless ``channels = 4 * bins + nc`` with ``bins >= 1`` and ``nc >= 1``."""
    if nc < 1 or channels <= nc or (channels - nc) % 4:
        raise ValueError(f"head channels {channels} are not 4 * bins + {nc} classes")
    return (channels - nc) // 4


def distances(box: _F32, bins: int) -> _F32:
    """``[M, 4 * bins]`` box logits → ``[M, 4]`` distances (left, top, right, bottom; grid
    units): per side ``sum_k k * softmax(x)_k``, in float32 with the sums taken in bin order (the
    kernel's order); with 1 bin, the value itself."""
    if bins == 1:
        return box.astype(np.float32, copy=True)
    x = box.astype(np.float32).reshape(-1, 4, bins)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x - x.max(axis=2, keepdims=True))
        total = e[:, :, 0].copy()
        for k in range(1, bins):
            total += e[:, :, k]
        p = e / total[:, :, None]
        d = np.zeros(p.shape[:2], np.float32)
        for k in range(1, bins):
            d += p[:, :, k] * np.float32(k)
    return d


def decode(
    heads: Heads,
    strides: Sequence[int],
    nc: int,
    conf_threshold: float,
    multi_label: bool,
    *,
    end2end: bool = False,
) -> Candidates:
    """Decode raw heads of ``nc`` classes into candidate boxes (canvas pixels).

    For each level and cell ``(ix, iy)``, with distances ``l, t, r, b`` (:func:`distances`) and
    ``S(x) = 1 / (1 + exp(-x))``, in float32 as Ultralytics computes them::

        x1' = ix + 0.5 - l    y1' = iy + 0.5 - t    x2' = ix + 0.5 + r    y2' = iy + 0.5 + b
        cx = (x1' + x2') / 2 * stride    w = (x2' - x1') * stride    (cy, h likewise)
        x1 = cx - w / 2    x2 = cx + w / 2    (y1, y2 likewise)

    With ``end2end`` (a one-to-one head) the box is the corners times the stride, ``x1 =
    (ix + 0.5 - l) * stride`` ..., and every class is a candidate (as multi-label).

    Single label: one candidate with the best class (``argmax`` of the logits, lowest index on
    ties), ``score = S(max logit)``; multi-label (for mAP): one per class with ``S(logit) >
    conf_threshold``. A candidate is kept only if its score is ``> conf_threshold`` and its box
    is finite; cells whose best logit cannot pass are skipped first. Candidates come in order
    level, row, column, class. Raises ValueError when heads and strides disagree, a head is not
    ``[4 * bins + nc, H, W]`` with the same channels everywhere, or ``conf_threshold`` is not in
    ``[0, 1)``.
    """
    check_conf_threshold(conf_threshold)
    bins = bins_of(check_head_arrays(heads, strides), nc)
    cut = logit_cut(conf_threshold)
    thr = np.float32(conf_threshold)
    half = np.float32(0.5)
    parts: list[tuple[_F32, _F32, _Idx]] = []
    for level, head in enumerate(heads):
        h, w = head.shape[1], head.shape[2]
        p = head.reshape(4 * bins + nc, h * w)
        logits = p[4 * bins :]
        (cell,) = np.nonzero(logits.max(axis=0) > cut)
        if cell.size == 0:
            continue
        rows = p[:, cell].T.astype(np.float32)  # (M, 4 * bins + nc), in cell order
        d = distances(rows[:, : 4 * bins], bins)
        stride = np.float32(strides[level])
        ax = (cell % w).astype(np.float32) + half
        ay = (cell // w).astype(np.float32) + half
        x1, y1 = ax - d[:, 0], ay - d[:, 1]
        x2, y2 = ax + d[:, 2], ay + d[:, 3]
        if end2end:
            xyxy = np.stack([x1 * stride, y1 * stride, x2 * stride, y2 * stride], axis=1)
        else:
            cx, cy = (x1 + x2) / np.float32(2) * stride, (y1 + y2) / np.float32(2) * stride
            bw, bh = (x2 - x1) * stride, (y2 - y1) * stride
            half_w, half_h = bw / np.float32(2), bh / np.float32(2)
            xyxy = np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], axis=1)
        parts.append(class_candidates(xyxy, rows[:, 4 * bins :], thr, multi_label or end2end))
    return Candidates.join(parts)


def postprocess(
    heads: Heads,
    strides: Sequence[int],
    nc: int,
    letterbox: Letterbox,
    *,
    conf_threshold: float = 0.25,
    iou_threshold: float = 0.45,
    max_det: int = 300,
    multi_label: bool = False,
    max_candidates: int | None = DEFAULT_MAX_CANDIDATES,
    end2end: bool = False,
) -> _F32:
    """Heads → final detections ``[N, 6]`` float32 ``x1, y1, x2, y2, score, class``:
    :func:`decode`, then :func:`~dlad.imaging.post.detections` (NMS, back-projection); with
    ``end2end``, the ``max_det`` best candidates by score (ties: decode order) without NMS."""
    cand = decode(heads, strides, nc, conf_threshold, multi_label, end2end=end2end)
    return detections(
        cand, letterbox, iou_threshold=iou_threshold, max_det=max_det,
        max_candidates=max_candidates, suppress=not end2end,
    )  # fmt: skip


def program(channels: int, nc: int, *, end2end: bool = False) -> PostProgram:
    """The GPU post program of heads of ``channels`` scoring ``nc`` classes (``end2end``: a
    one-to-one head). Raises ValueError where the channels are not ``4 * bins + nc``."""
    return PostProgram(KERNEL, nc, bins=bins_of(channels, nc), end2end=end2end)


def _check_heads(loadable: Loadable) -> None:
    if loadable.anchors_px:
        raise ValueError(f"a {loadable.family} loadable has no anchors (anchors_px must be empty)")
    for d in loadable.outputs:
        bins_of(d.c, loadable.num_classes)


def _family(name: str, *, end2end: bool = False) -> Family:
    def post(
        heads: Heads, model: HeadsModel, letterbox: Letterbox, *, conf: float, iou: float,
        max_det: int, multi_label: bool = False,
    ) -> _F32:  # fmt: skip
        return postprocess(
            heads, model.strides, model.num_classes, letterbox, conf_threshold=conf,
            iou_threshold=iou, max_det=max_det, multi_label=multi_label, end2end=end2end,
        )  # fmt: skip

    def post_program(loadable: Loadable) -> PostProgram:
        return program(loadable.outputs[0].c, loadable.num_classes, end2end=end2end)

    source = Path(__file__).with_suffix(".cu")
    return Family(name, _check_heads, post, post_program, source, (KERNEL,), end2end)


FAMILIES: Final = (
    _family("yolov8"), _family("yolo11"), _family("yolo26"),
    _family("yolo26_one2one", end2end=True),
)  # fmt: skip
"""The DFL families: YOLOv8, YOLO11 (16 bins), YOLO26's one-to-many heads (1 bin, NMS) and its
one-to-one heads (1 bin, top-k without NMS)."""
