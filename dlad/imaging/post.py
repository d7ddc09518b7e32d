"""Post-processing reference, the parts every model family shares: DLA output reformat,
class-aware NMS and back-projection.

A *head* is one detection level as the model emits it (the family's decode is not inside the
model): a ``[C, H, W]`` array of raw values, whose channels the family defines
(``dlad.families``). The DLA writes heads as ``CHW16`` fp16 or ``CHW32`` int8
(``docs/reference/cudla.md`` §3.3); :func:`unpack_chw16` / :func:`unpack_chw32_int8` turn those
into heads. A family decodes them into :class:`Candidates`; :func:`detections` runs NMS →
back-projection.

Unlike NVIDIA's sample (docs/reference/cudla.md §5.3), NMS is always applied, results are capped
at ``max_det``, and candidate order, tie-breaking and thresholds (``>`` for confidence, ``>=``
for IoU) are specified. Malformed input raises :class:`ValueError`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dlad import _native
from dlad.imaging.pre import Letterbox, round_half_away_from_zero

__all__ = [
    "DEFAULT_MAX_CANDIDATES",
    "Candidates",
    "check_conf_threshold",
    "check_head_arrays",
    "class_candidates",
    "detections",
    "logit_cut",
    "nms",
    "pack_chw16",
    "pack_chw32",
    "sigmoid",
    "unpack_chw16",
    "unpack_chw32_int8",
    "unpack_head",
]

_F32 = npt.NDArray[np.float32]
_Idx = npt.NDArray[np.intp]

DEFAULT_MAX_CANDIDATES = 30000
"""Boxes entering NMS at most (YOLOv5's ``max_nms``); the lowest-scoring are dropped first."""


# ------------------------------------------------------------------------------- reformat


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _unpack(buffer: object, channels: int, vec: int, dtype: type[np.generic]) -> _F32:
    if not (isinstance(buffer, np.ndarray) and buffer.dtype == dtype and buffer.ndim == 4):
        raise ValueError(f"buffer must be a 4-D {np.dtype(dtype)} array [C/{vec}][H][W][{vec}]")
    groups, h, w, v = buffer.shape
    if v != vec or channels < 1 or groups != -(-channels // vec):
        raise ValueError(f"buffer {buffer.shape} does not hold {channels} channels as CHW{vec}")
    # [G][H][W][V] -> [G][V][H][W] -> [G*V][H][W]; channel g*V + v is the v-th lane of group g.
    planar = buffer.transpose(0, 3, 1, 2).reshape(groups * vec, h, w)
    return planar[:channels].astype(np.float32)


def unpack_chw16(buffer: npt.NDArray[np.float16], channels: int) -> _F32:
    """``CHW16`` fp16 ``[ceil(C/16)][H][W][16]`` → ``[C, H, W]`` float32 (padding lanes dropped).

    Raises ValueError if the buffer is not 4-D float16 with 16 lanes and ``ceil(channels/16)``
    groups.
    """
    return _unpack(buffer, channels, 16, np.float16)


def unpack_chw32_int8(buffer: npt.NDArray[np.int8], channels: int, scale: float) -> _F32:
    """``CHW32`` int8 ``[ceil(C/32)][H][W][32]`` → ``[C, H, W]`` float32 ``q * scale``.

    Raises ValueError for a malformed buffer (as :func:`unpack_chw16`) or a non-positive scale.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    out = _unpack(buffer, channels, 32, np.int8)
    out *= np.float32(scale)
    return out


def unpack_head(
    buffer: npt.NDArray[Any], channels: int, height: int, width: int, int8_scale: float | None
) -> _F32:
    """One DLA output buffer (any shape over the right bytes) → ``[C, H, W]`` float32: ``CHW32``
    int8 dequantised with ``int8_scale`` when it is given, else ``CHW16`` fp16.

    Raises ValueError for a buffer of the wrong size or dtype, or a non-positive scale.
    """
    if int8_scale is not None:
        return unpack_chw32_int8(buffer.reshape(-1, height, width, 32), channels, int8_scale)
    return unpack_chw16(buffer.reshape(-1, height, width, 16), channels)


def _pack(x: npt.ArrayLike, vec: int) -> npt.NDArray[np.generic]:
    a = np.asarray(x)
    if a.ndim != 3 or a.shape[0] < 1:
        raise ValueError(f"expected a [C, H, W] array, got shape {a.shape}")
    c, h, w = a.shape
    groups = -(-c // vec)
    padded = np.zeros((groups * vec, h, w), dtype=a.dtype)
    padded[:c] = a
    return np.ascontiguousarray(padded.reshape(groups, vec, h, w).transpose(0, 2, 3, 1))


def pack_chw16(x: npt.ArrayLike) -> npt.NDArray[np.float16]:
    """``[C, H, W]`` → ``CHW16`` fp16 ``[ceil(C/16)][H][W][16]``, padding channels zero.

    Raises ValueError if ``x`` is not 3-D.
    """
    return _pack(np.asarray(x, dtype=np.float16), 16).astype(np.float16)


def pack_chw32(x: npt.ArrayLike, scale: float) -> npt.NDArray[np.int8]:
    """``[C, H, W]`` float → ``CHW32`` int8 ``[ceil(C/32)][H][W][32]``, padding channels zero.

    Quantises as the DLA does: ``clamp(round_half_away_from_zero(x / scale), -128, 127)``.
    Raises ValueError if ``x`` is not 3-D or ``scale`` is not finite and positive.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    q = round_half_away_from_zero(np.asarray(x, dtype=np.float32) / np.float32(scale))
    return _pack(np.clip(q, -128, 127).astype(np.int8), 32).astype(np.int8)


# ------------------------------------------------------------------------------- decode


@dataclass(frozen=True, slots=True)
class Candidates:
    """Decoded boxes before NMS: ``boxes`` ``[N, 4]`` float32 ``x1, y1, x2, y2`` in canvas
    pixels, ``scores`` ``[N]`` float32, ``classes`` ``[N]`` intp."""

    boxes: _F32
    scores: _F32
    classes: _Idx

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @classmethod
    def join(cls, parts: Sequence[tuple[_F32, _F32, _Idx]]) -> Candidates:
        """One set of the parts' candidates (boxes, scores, classes each), in order (none: an
        empty set)."""
        if not parts:
            return cls(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.intp))
        boxes, scores, classes = zip(*parts, strict=True)
        return cls(
            np.concatenate(boxes).astype(np.float32, copy=False),
            np.concatenate(scores).astype(np.float32, copy=False),
            np.concatenate(classes).astype(np.intp, copy=False),
        )


def sigmoid(x: _F32) -> _F32:
    """``1 / (1 + exp(-x))`` in float32 (the kernels' ``sigmoidf``)."""
    # exp overflows to inf for very negative logits; 1/(1+inf) = 0 is the right answer.
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def class_candidates(
    xyxy: _F32,
    cls_logits: npt.NDArray[np.floating],
    threshold: np.float32,
    all_classes: bool,
    obj: _F32 | None = None,
) -> tuple[_F32, _F32, _Idx]:
    """The candidates of boxes ``xyxy`` ``[M, 4]`` with class logits ``[M, nc]``, scored
    ``obj * S(logit)`` (``S(logit)`` without ``obj``): every class scoring above ``threshold``
    (``all_classes``), or the best class alone (``argmax``, lowest index on ties). A box that is
    not finite gives none (a NaN logit upstream costs one box, not the frame). Returns boxes,
    scores and classes, in box order then class order (the kernels' ``emit_classes``)."""
    finite = np.isfinite(xyxy).all(axis=1).reshape(-1)
    if all_classes:
        conf = sigmoid(cls_logits.astype(np.float32))
        if obj is not None:
            conf = obj[:, None] * conf
        r, k = np.nonzero((conf > threshold) & finite[:, None])
        return xyxy[r], conf[r, k], k.astype(np.intp)
    best = np.argmax(cls_logits, axis=1)
    conf = sigmoid(np.take_along_axis(cls_logits, best[:, None], axis=1)[:, 0].astype(np.float32))
    if obj is not None:
        conf = obj * conf
    ok = (conf > threshold) & finite
    return xyxy[ok], conf[ok], best[ok].astype(np.intp)


def check_conf_threshold(conf_threshold: object) -> None:
    """Raises ValueError unless ``conf_threshold`` is a number in ``[0, 1)``."""
    if not (isinstance(conf_threshold, (int, float, np.floating)) and 0 <= conf_threshold < 1):
        raise ValueError(f"conf_threshold must be in [0, 1), got {conf_threshold!r}")


def check_head_arrays(heads: Sequence[npt.NDArray[np.floating]], strides: Sequence[int]) -> int:
    """The channels of ``heads``, one per stride. Raises ValueError unless every head is a 3-D
    ``[C, H, W]`` array with the same ``C`` and every stride a positive int."""
    if len(heads) != len(strides) or not heads:
        raise ValueError(f"{len(heads)} heads for {len(strides)} strides")
    channels = {h.shape[0] if getattr(h, "ndim", 0) == 3 else -1 for h in heads}
    if len(channels) != 1 or -1 in channels:
        raise ValueError("every head must be a 3-D [C, H, W] array with the same C")
    if any(not _is_int(s) or s < 1 for s in strides):
        raise ValueError(f"strides must be positive ints, got {list(strides)}")
    return channels.pop()


def logit_cut(conf_threshold: float) -> float:
    """The logit below which no sigmoid passes ``conf_threshold``, less a margin, as a float32
    value: ``S(x) > thr`` ⇔ ``x > logit(thr)``, and the margin keeps float rounding near the
    boundary from dropping a row the exact score test would keep (that test is authoritative).
    A decode skips the rows whose gating logit is not above it; the GPU kernels take it as
    ``FrameParams.obj_cut``. One rule for every path: ``dlad/native/frame_rules.hpp``."""
    return _native.logit_cut(conf_threshold)


# ------------------------------------------------------------------------------- NMS


def nms(
    boxes: npt.ArrayLike,
    scores: npt.ArrayLike,
    classes: npt.ArrayLike,
    iou_threshold: float,
    max_det: int,
    *,
    max_candidates: int | None = DEFAULT_MAX_CANDIDATES,
) -> _Idx:
    """Greedy class-aware non-maximum suppression; returns kept indices, best score first.

    Boxes are visited by descending score (ties: lower index first). A box is kept unless a
    kept box **of the same class** overlaps it with ``IoU >= iou_threshold``. IoU is computed in
    float64 on edge coordinates: ``area = max(0, x2-x1) * max(0, y2-y1)``, ``IoU = inter /
    (area_a + area_b - inter)``, 0 when the union is 0. Only the ``max_candidates`` best boxes are
    considered (``None``: all) and at most ``max_det`` are returned.

    Cost: boxes are only ever compared with boxes of their own class. When the same-class
    pairs are few (the usual case), their IoUs are computed in one vectorised pass and the
    greedy outcome is resolved by fixed-point iteration (Cluster-NMS, which converges to exactly
    the greedy result); otherwise per-class greedy runs are merged by score with a heap and
    stopped at ``max_det`` kept boxes. Both give the same answer.

    Raises ValueError for mismatched lengths, boxes not ``[N, 4]``, non-finite values,
    non-integer classes, ``iou_threshold`` outside ``(0, 1]`` or negative
    ``max_det``/``max_candidates``.
    """
    b = np.asarray(boxes, dtype=np.float64)
    sc = np.asarray(scores)
    cl = np.asarray(classes)
    if b.ndim != 2 or b.shape[1] != 4 or sc.shape != (b.shape[0],) or cl.shape != sc.shape:
        raise ValueError(
            f"need boxes [N, 4], scores [N], classes [N], got {b.shape}, {sc.shape}, {cl.shape}"
        )
    if not (0.0 < iou_threshold <= 1.0):
        raise ValueError(f"iou_threshold must be in (0, 1], got {iou_threshold!r}")
    if max_det < 0 or (max_candidates is not None and max_candidates < 0):
        raise ValueError("max_det and max_candidates must be >= 0")
    if not (np.isfinite(b).all() and np.isfinite(sc).all()):
        raise ValueError("boxes and scores must be finite")
    if cl.dtype.kind not in "iu":
        if cl.size and not (np.isfinite(cl).all() and (cl == np.round(cl)).all()):
            raise ValueError("classes must be integers")
        cl = cl.astype(np.int64)
    if b.shape[0] == 0 or max_det == 0:
        return np.zeros(0, dtype=np.intp)
    order = _score_order(sc.astype(np.float64), max_candidates)
    n = order.size
    if n == 0:
        return order
    # Group by class keeping score order inside each group (int16 keys take numpy's radix sort).
    cls_ord = cl[order]
    small = cls_ord.min() >= -(2**15) and cls_ord.max() < 2**15
    by_class = order[np.argsort(cls_ord.astype(np.int16) if small else cls_ord, kind="stable")]
    rank = np.empty(b.shape[0], dtype=np.float64)
    rank[order] = np.arange(n, dtype=np.float64)
    # One (6, n) table, rows x1, y1, x2, y2, area, global rank (exact in float64); each class
    # is a contiguous column slice of it, in rank order.
    table = np.empty((6, n), dtype=np.float64)
    table[:4] = b[by_class].T
    table[4] = np.maximum(table[2] - table[0], 0.0) * np.maximum(table[3] - table[1], 0.0)
    table[5] = rank[by_class]
    cls_sorted = cl[by_class]
    starts = np.flatnonzero(np.r_[True, cls_sorted[1:] != cls_sorted[:-1]])
    ends = np.r_[starts[1:], n]
    sizes = ends - starts
    pairs = int((sizes * (sizes - 1) // 2).sum())
    kept_ranks: _Idx | None = None
    # Rough costs on one core: ~15 ns per pair vs ~20 us of numpy overhead per heap step.
    if pairs <= _PAIRS_PER_HEAP_STEP * min(n, max_det):
        kept_ranks = _greedy_pairs(table, np.repeat(ends, sizes), pairs, iou_threshold)
    if kept_ranks is None:
        kept_ranks = _greedy_heap(table, starts, ends, iou_threshold, max_det)
    return order[kept_ranks[:max_det]]


_PAIRS_PER_HEAP_STEP = 1000
"""Pair-IoU work worth one heap step; tests set it to 0 or a huge value to force a strategy."""

_MAX_FIXED_POINT_ROUNDS = 24
"""Cluster-NMS rounds before giving up on the pair strategy (long suppression chains)."""


def _greedy_pairs(
    table: npt.NDArray[np.float64], group_end: _Idx, pairs: int, iou_threshold: float
) -> _Idx | None:
    """Kept global ranks, ascending; None if the fixed point is not reached quickly."""
    n = table.shape[1]
    later = group_end - np.arange(n) - 1  # same-class boxes ranked after each box
    i = np.repeat(np.arange(n), later)
    j = i + 1 + (np.arange(pairs) - np.repeat(np.cumsum(later) - later, later))
    ti, tj = table[:, i], table[:, j]
    iw = np.maximum(np.minimum(ti[2], tj[2]) - np.maximum(ti[0], tj[0]), 0.0)
    ih = np.maximum(np.minimum(ti[3], tj[3]) - np.maximum(ti[1], tj[1]), 0.0)
    inter = iw * ih
    union = ti[4] + tj[4] - inter
    iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    hit = iou >= iou_threshold
    src, dst = i[hit], j[hit]
    # keep[j] = no kept earlier box suppresses j. Iterating from "all kept" fixes one more rank
    # per round at least, and usually converges in a handful of rounds.
    keep = np.ones(n, dtype=bool)
    for _ in range(_MAX_FIXED_POINT_ROUNDS):
        new = np.ones(n, dtype=bool)
        new[dst[keep[src]]] = False
        if np.array_equal(new, keep):
            return np.sort(table[5, keep].astype(np.intp))
        keep = new
    return None


def _greedy_heap(
    table: npt.NDArray[np.float64],
    starts: _Idx,
    ends: _Idx,
    iou_threshold: float,
    max_det: int,
) -> _Idx:
    """Kept global ranks, ascending, at most ``max_det``: per-class greedy merged by rank."""
    groups = [table[:, s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    heap = [(int(g[5, 0]), gi) for gi, g in enumerate(groups)]
    heapq.heapify(heap)
    keep: list[int] = []
    while heap and len(keep) < max_det:
        rank_i, gi = heapq.heappop(heap)
        g = groups[gi]
        keep.append(rank_i)
        top = g[:, :1]
        rest = g[:, 1:]
        if top[4, 0] > 0 and rest.shape[1]:
            # A zero-area kept box has zero intersection with everything (IoU 0), and with
            # a positive top area the union is > 0, so the division below is always defined.
            wh = np.minimum(rest[2:4], top[2:4])
            wh -= np.maximum(rest[0:2], top[0:2])
            np.maximum(wh, 0.0, out=wh)
            inter = wh[0] * wh[1]
            union = rest[4] + top[4]
            union -= inter
            inter /= union
            rest = rest[:, inter < iou_threshold]
        groups[gi] = rest
        if rest.shape[1]:
            heapq.heappush(heap, (int(rest[5, 0]), gi))
    return np.asarray(keep, dtype=np.intp)


def _score_order(scores: npt.NDArray[np.float64], limit: int | None) -> _Idx:
    """Indices of the ``limit`` best scores, descending, ties by lower index (all if None)."""
    neg = -scores
    if limit is None or limit >= neg.size:
        return np.argsort(neg, kind="stable")
    if limit == 0:
        return np.zeros(0, dtype=np.intp)
    # O(N) selection before the sort: the COCO-eval setting yields millions of candidates.
    kth = np.partition(neg, limit - 1)[limit - 1]
    better = np.flatnonzero(neg < kth)
    tied = np.flatnonzero(neg == kth)[: limit - better.size]
    chosen = np.sort(np.concatenate([better, tied]))
    return chosen[np.argsort(neg[chosen], kind="stable")]


# ------------------------------------------------------------------------------- pipeline


def detections(
    cand: Candidates,
    letterbox: Letterbox,
    *,
    iou_threshold: float = 0.45,
    max_det: int = 300,
    max_candidates: int | None = DEFAULT_MAX_CANDIDATES,
    suppress: bool = True,
) -> _F32:
    """Decoded candidates → final detections ``[N, 6]`` float32 ``x1, y1, x2, y2, score, class``:
    :func:`nms` in canvas coordinates (as YOLOv5 and Ultralytics do; without ``suppress``, the
    ``max_det`` best by score, ties in candidate order, for an NMS-free head), then
    :meth:`Letterbox.to_original` (undo letterbox, clip to the source image). Rows are sorted by
    score, descending; ``N <= max_det``. Raises ValueError as :func:`nms` does."""
    if suppress:
        keep = nms(
            cand.boxes, cand.scores, cand.classes, iou_threshold, max_det,
            max_candidates=max_candidates,
        )  # fmt: skip
    else:
        keep = np.argsort(-cand.scores, kind="stable")[:max_det]
    out = np.empty((keep.size, 6), dtype=np.float32)
    out[:, :4] = letterbox.to_original(cand.boxes[keep])
    out[:, 4] = cand.scores[keep]
    out[:, 5] = cand.classes[keep]
    return out
