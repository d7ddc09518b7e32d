"""YOLOv5 (v7.0, P3-P5): anchor-based heads with objectness.

A head is one level of ``[na * (5 + nc), H, W]`` raw logits, channel ``a * (5 + nc) + k`` holding,
for anchor ``a``, ``k = 0..3``: ``tx, ty, tw, th``; ``k = 4``: objectness; ``k >= 5``: class
logits (the cuDLA sample's ``--noanchor`` export: the Detect layer's decode is not in the model).
The loadable carries the anchors (``anchors_px``, pixels, one row of ``na`` per level). The CUDA
decode is ``yolov5.cu``'s ``post_decode_yolov5``.
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
    sigmoid,
)  # fmt: skip

if TYPE_CHECKING:
    from dlad.imaging.pre import Letterbox
    from dlad.loadable import Loadable

__all__ = ["ANCHORS", "FAMILY", "STRIDES", "decode", "postprocess", "program"]

_F32 = npt.NDArray[np.float32]
_Idx = npt.NDArray[np.intp]

ANCHORS: Final[_F32] = np.array(
    [
        [(10, 13), (16, 30), (33, 23)],
        [(30, 61), (62, 45), (59, 119)],
        [(116, 90), (156, 198), (373, 326)],
    ],
    dtype=np.float32,
)
"""YOLOv5 P3/P4/P5 anchors ``(w, h)`` in input pixels, shape ``(3, 3, 2)``."""
ANCHORS.flags.writeable = False

STRIDES: Final[tuple[int, ...]] = (8, 16, 32)
"""Strides of the P3/P4/P5 heads, in input pixels."""

KERNEL: Final = "post_decode_yolov5"


def _geometry(channels: int, anchors: npt.ArrayLike, levels: int) -> tuple[int, int]:
    """``(na, nc)`` of heads of ``channels`` over ``levels`` levels with ``anchors``; raises
    ValueError where they disagree."""
    anc = np.asarray(anchors)
    if anc.ndim != 3 or anc.shape[2] != 2 or anc.shape[1] < 1:
        raise ValueError(f"anchors must be (levels, anchors, 2), got {anc.shape}")
    nl, na = anc.shape[0], anc.shape[1]
    if levels != nl:
        raise ValueError(f"{levels} heads for {nl} anchor levels")
    if channels < na * 6 or channels % na:
        raise ValueError(f"head channels {channels} are not {na} * (5 + nc) with nc >= 1")
    return na, channels // na - 5


def decode(
    heads: Heads,
    anchors: npt.ArrayLike,
    strides: Sequence[int],
    conf_threshold: float,
    multi_label: bool,
) -> Candidates:
    """Decode raw YOLOv5 heads into candidate boxes (canvas pixels).

    For each level, anchor ``a`` with ``(aw, ah) = anchors[level, a]`` (pixels) and cell
    ``(ix, iy)``, with ``S(x) = 1 / (1 + exp(-x))``, in float32::

        cx = (S(tx) * 2 - 0.5 + ix) * stride      cy = (S(ty) * 2 - 0.5 + iy) * stride
        w  = (S(tw) * 2) ** 2 * aw                h  = (S(th) * 2) ** 2 * ah

    Single label: one candidate with the best class (``argmax`` of the class logits, lowest
    index on ties) and ``score = S(obj) * S(max logit)``. Multi-label (for mAP): one candidate
    per class with ``S(obj) * S(cls) > conf_threshold``. Either way a candidate is kept only if
    its score is ``> conf_threshold`` (so NaN scores never pass) and its box is finite; rows
    whose objectness alone cannot pass are skipped first (:func:`~dlad.imaging.post.logit_cut`).

    Candidates come in order level, anchor, row, column, class. Raises ValueError when heads,
    anchors ``(levels, anchors, 2)`` and strides disagree, a head is not ``[na*(5+nc), H, W]``
    with the same ``nc`` everywhere, or ``conf_threshold`` is not in ``[0, 1)``.
    """
    check_conf_threshold(conf_threshold)
    na, nc = _geometry(check_head_arrays(heads, strides), anchors, len(heads))
    anchors32 = np.asarray(anchors, dtype=np.float32)
    obj_cut = logit_cut(conf_threshold)
    thr = np.float32(conf_threshold)
    parts: list[tuple[_F32, _F32, _Idx]] = []
    for level, head in enumerate(heads):
        h, w = head.shape[1], head.shape[2]
        p = head.reshape(na, 5 + nc, h * w)
        a_idx, cell = np.nonzero(p[:, 4, :] > obj_cut)
        if a_idx.size == 0:
            continue
        rows = p[a_idx, :, cell]  # (M, 5 + nc), in anchor, cell order
        s = sigmoid(rows[:, :5].astype(np.float32))
        stride = np.float32(strides[level])
        anc = anchors32[level, a_idx]
        cx = (s[:, 0] * np.float32(2.0) - np.float32(0.5) + (cell % w).astype(np.float32)) * stride
        cy = (s[:, 1] * np.float32(2.0) - np.float32(0.5) + (cell // w).astype(np.float32)) * stride
        bw = np.square(s[:, 2] * np.float32(2.0)) * anc[:, 0]
        bh = np.square(s[:, 3] * np.float32(2.0)) * anc[:, 1]
        half_w, half_h = bw * np.float32(0.5), bh * np.float32(0.5)
        xyxy = np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], axis=1)
        parts.append(class_candidates(xyxy, rows[:, 5:], thr, multi_label, s[:, 4]))
    return Candidates.join(parts)


def postprocess(
    heads: Heads,
    anchors: npt.ArrayLike,
    strides: Sequence[int],
    letterbox: Letterbox,
    *,
    conf_threshold: float = 0.25,
    iou_threshold: float = 0.45,
    max_det: int = 300,
    multi_label: bool = False,
    max_candidates: int | None = DEFAULT_MAX_CANDIDATES,
) -> _F32:
    """Heads → final detections ``[N, 6]`` float32 ``x1, y1, x2, y2, score, class``:
    :func:`decode`, then :func:`~dlad.imaging.post.detections` (NMS, back-projection). Raises
    ValueError as those do."""
    cand = decode(heads, anchors, strides, conf_threshold, multi_label)
    return detections(
        cand, letterbox, iou_threshold=iou_threshold, max_det=max_det, max_candidates=max_candidates
    )


def program(anchors: npt.ArrayLike, channels: int) -> PostProgram:
    """The GPU post program of heads of ``channels`` with ``anchors`` ``(levels, na, 2)``
    (pixels). Raises ValueError where they disagree."""
    anc = np.asarray(anchors, dtype=np.float32)
    na, nc = _geometry(channels, anc, anc.shape[0] if anc.ndim == 3 else -1)
    return PostProgram(KERNEL, nc, per_cell=na, anchors=anc)


def _check_heads(loadable: Loadable) -> None:
    if not loadable.anchors_px:
        raise ValueError("a yolov5 loadable needs anchors_px, one row of anchors per level")
    na = len(loadable.anchors_px[0])
    if len(loadable.anchors_px) != len(loadable.outputs):
        raise ValueError(f"{len(loadable.outputs)} outputs for {len(loadable.anchors_px)} "
                         "anchor levels")  # fmt: skip
    for d in loadable.outputs:
        if d.c != na * (5 + loadable.num_classes):
            raise ValueError(f"output {d.name!r} has {d.c} channels, a yolov5 head of "
                             f"{loadable.num_classes} classes has {na} x (5 + "
                             f"{loadable.num_classes})")  # fmt: skip


def _postprocess(
    heads: Heads, model: HeadsModel, letterbox: Letterbox, *, conf: float, iou: float,
    max_det: int, multi_label: bool = False,
) -> _F32:  # fmt: skip
    return postprocess(
        heads, model.anchors_px, model.strides, letterbox, conf_threshold=conf,
        iou_threshold=iou, max_det=max_det, multi_label=multi_label,
    )  # fmt: skip


def _program(loadable: Loadable) -> PostProgram:
    return program(loadable.anchors_px, loadable.outputs[0].c)


FAMILY: Final = Family(
    "yolov5", _check_heads, _postprocess, _program, Path(__file__).with_suffix(".cu"), (KERNEL,)
)
