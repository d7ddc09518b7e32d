"""COCO-format detection datasets: loading, a deterministic hold-out split, and a letterboxed
array cache for training and evaluation.

Any COCO-format directory works, so a user with real COCO runs the same commands as one with the
synthetic set from :mod:`prep.data.synth`:

* ``load_coco("data/shapes")`` reads ``data/shapes/annotations.json`` and resolves each image's
  ``file_name`` under ``data/shapes/images/``;
* ``load_coco(("coco/val2017", "coco/annotations/instances_val2017.json"))`` takes an explicit
  ``(images_dir, annotation_file)`` pair, for COCO's own layout.

Validation policy (every failure is a :class:`DatasetError`, a ``ValueError``): a missing or
unreadable file, malformed JSON, a missing or mistyped field, duplicate ids, an annotation that
names an unknown image or category, and a box with a non-finite coordinate or negative size are
errors. A box that sticks out of its image is clipped to it (COCO has such boxes). A box with no
area left after clipping (zero width/height, or wholly outside) is skipped and counted in
:attr:`CocoDataset.skipped_degenerate`, or is an error with ``strict=True``. Crowd annotations
(``iscrowd=1``) are not training targets: they are skipped and counted in
:attr:`CocoDataset.skipped_crowd` (the evaluator reads them from the JSON itself).

Category ids map to contiguous class indices ``0 .. nc-1`` in increasing id order
(:meth:`CocoDataset.category_to_class`, :meth:`CocoDataset.class_to_category`).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image

from dlad.imaging.pre import Letterbox, letterbox

__all__ = [
    "CocoDataset",
    "CocoImage",
    "DatasetError",
    "LetterboxedArrays",
    "load_coco",
    "split",
]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

CACHE_VERSION = 1
"""Version of the ``.npz`` layout written by :meth:`LetterboxedArrays.save`."""


class DatasetError(ValueError):
    """A dataset, annotation file, image or cache is missing or malformed; the message names
    the file and the offending entry."""


@dataclass(frozen=True, eq=False)
class CocoImage:
    """One image and its training targets: ``boxes`` ``[k, 4]`` float32 ``x1, y1, x2, y2`` in
    pixels (clipped to the image, positive area), ``category_ids`` and contiguous ``classes``
    ``[k]`` int64, in annotation-file order, crowd boxes excluded."""

    id: int
    path: Path
    width: int
    height: int
    boxes: F32 = field(repr=False)
    category_ids: I64 = field(repr=False)
    classes: I64 = field(repr=False)


@dataclass(frozen=True, eq=False)
class CocoDataset:
    """A loaded COCO dataset. ``images`` is keyed and ordered by image id; ``categories`` maps
    category id to name, ordered by id (class index order)."""

    ann_file: Path
    images_dir: Path
    images: dict[int, CocoImage]
    categories: dict[int, str]
    skipped_crowd: int = 0
    skipped_degenerate: int = 0
    clipped: int = 0

    @property
    def category_ids(self) -> tuple[int, ...]:
        """Category ids in class-index order."""
        return tuple(self.categories)

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(self.categories.values())

    @property
    def num_classes(self) -> int:
        return len(self.categories)

    def category_to_class(self, category_ids: npt.ArrayLike) -> I64:
        """Contiguous class indices of ``category_ids`` (any shape). Raises DatasetError for an
        id that is not a category of this dataset."""
        ids = np.asarray(category_ids, dtype=np.int64)
        known = np.asarray(self.category_ids, dtype=np.int64)
        idx = np.searchsorted(known, ids)
        ok = (idx < len(known)) & (known[np.minimum(idx, len(known) - 1)] == ids)
        if not ok.all():
            raise DatasetError(f"unknown category id(s) {np.unique(ids[~ok]).tolist()}")
        return idx.astype(np.int64)

    def class_to_category(self, classes: npt.ArrayLike) -> I64:
        """Category ids of contiguous class indices (any shape). Raises DatasetError for an
        index outside ``0 .. num_classes - 1``."""
        cls = np.asarray(classes, dtype=np.int64)
        bad = (cls < 0) | (cls >= self.num_classes)
        if bad.any():
            raise DatasetError(
                f"class index(es) {np.unique(cls[bad]).tolist()} outside 0..{self.num_classes - 1}"
            )
        return np.asarray(self.category_ids, dtype=np.int64)[cls]


# --------------------------------------------------------------------------------- loading


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field(entry: object, key: str, where: str, kind: str) -> Any:
    if not isinstance(entry, dict) or key not in entry:
        raise DatasetError(f"{where}: missing field {key!r}")
    v = entry[key]
    ok = {
        "int": _is_int(v),
        "pos_int": _is_int(v) and v > 0,
        "str": isinstance(v, str),
    }[kind]
    if not ok:
        raise DatasetError(f"{where}: field {key!r} must be {kind}, got {v!r}")
    return v


def _read_json(ann_file: Path) -> dict[str, Any]:
    try:
        text = ann_file.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"annotation file not found: {ann_file}") from None
    except OSError as e:
        raise DatasetError(f"cannot read annotation file {ann_file}: {e}") from e
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{ann_file}: malformed JSON: {e}") from e
    if not isinstance(doc, dict):
        raise DatasetError(f"{ann_file}: top level must be a JSON object")
    for key in ("images", "categories"):
        if not isinstance(doc.get(key), list):
            raise DatasetError(f"{ann_file}: {key!r} must be a list")
    if not isinstance(doc.get("annotations", []), list):
        raise DatasetError(f"{ann_file}: 'annotations' must be a list")
    return doc


def _resolve(source: str | os.PathLike[str] | tuple[Any, Any]) -> tuple[Path, Path]:
    if isinstance(source, tuple):
        if len(source) != 2:
            raise DatasetError(f"expected (images_dir, annotation_file), got {source!r}")
        images_dir, ann_file = Path(source[0]), Path(source[1])
    else:
        root = Path(source)
        if not root.is_dir():
            raise DatasetError(f"dataset directory not found: {root}")
        images_dir, ann_file = root / "images", root / "annotations.json"
    if not images_dir.is_dir():
        raise DatasetError(f"images directory not found: {images_dir}")
    return images_dir, ann_file


def load_coco(
    source: str | os.PathLike[str] | tuple[str | os.PathLike[str], str | os.PathLike[str]],
    *,
    strict: bool = False,
    check_files: bool = True,
) -> CocoDataset:
    """Load a COCO-format dataset: a directory holding ``annotations.json`` and ``images/``, or
    an ``(images_dir, annotation_file)`` pair.

    ``check_files`` checks that every listed image file exists. ``strict`` turns boxes with no
    area after clipping into errors instead of skipping them. Raises DatasetError for anything
    described in the module docstring.
    """
    images_dir, ann_file = _resolve(source)
    doc = _read_json(ann_file)

    categories: dict[int, str] = {}
    for i, c in enumerate(doc["categories"]):
        where = f"{ann_file}: categories[{i}]"
        cid, name = _field(c, "id", where, "int"), _field(c, "name", where, "str")
        if cid in categories:
            raise DatasetError(f"{where}: duplicate category id {cid}")
        categories[cid] = name
    if not categories:
        raise DatasetError(f"{ann_file}: no categories")
    categories = dict(sorted(categories.items()))
    cat_index = {cid: k for k, cid in enumerate(categories)}

    raw_images: dict[int, tuple[Path, int, int]] = {}
    for i, im in enumerate(doc["images"]):
        where = f"{ann_file}: images[{i}]"
        iid = _field(im, "id", where, "int")
        if iid in raw_images:
            raise DatasetError(f"{where}: duplicate image id {iid}")
        path = images_dir / _field(im, "file_name", where, "str")
        w, h = _field(im, "width", where, "pos_int"), _field(im, "height", where, "pos_int")
        raw_images[iid] = (path, w, h)
    if check_files:
        missing = [str(p) for p, _, _ in raw_images.values() if not p.is_file()]
        if missing:
            raise DatasetError(
                f"{ann_file}: {len(missing)} image file(s) missing, e.g. {missing[:3]}"
            )

    targets: dict[int, list[tuple[float, float, float, float, int]]] = {i: [] for i in raw_images}
    crowd = degenerate = clipped = 0
    for i, a in enumerate(doc.get("annotations", [])):
        where = f"{ann_file}: annotations[{i}] (id {a.get('id') if isinstance(a, dict) else '?'})"
        iid, cid = _field(a, "image_id", where, "int"), _field(a, "category_id", where, "int")
        if iid not in raw_images:
            raise DatasetError(f"{where}: image_id {iid} is not in 'images'")
        if cid not in categories:
            raise DatasetError(f"{where}: category_id {cid} is not in 'categories'")
        if a.get("iscrowd", 0) not in (0, 1, False, True):
            raise DatasetError(f"{where}: iscrowd must be 0 or 1, got {a.get('iscrowd')!r}")
        bbox = a.get("bbox")
        if (
            not isinstance(bbox, list)
            or len(bbox) != 4
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in bbox)
            or not all(math.isfinite(v) for v in bbox)
            or bbox[2] < 0
            or bbox[3] < 0
        ):
            raise DatasetError(
                f"{where}: bbox must be 4 finite numbers [x, y, w>=0, h>=0], got {bbox!r}"
            )
        if a.get("iscrowd", 0):
            crowd += 1
            continue
        _, w, h = raw_images[iid]
        x, y, bw, bh = (float(v) for v in bbox)
        x1, y1 = min(max(x, 0.0), w), min(max(y, 0.0), h)
        x2, y2 = min(max(x + bw, 0.0), w), min(max(y + bh, 0.0), h)
        if x2 <= x1 or y2 <= y1:
            if strict:
                raise DatasetError(f"{where}: bbox {bbox} has no area inside the {w}x{h} image")
            degenerate += 1
            continue
        clipped += (x1, y1, x2, y2) != (x, y, x + bw, y + bh)
        targets[iid].append((x1, y1, x2, y2, cid))

    images: dict[int, CocoImage] = {}
    for iid in sorted(raw_images):
        path, w, h = raw_images[iid]
        t = targets[iid]
        boxes = np.array([r[:4] for r in t], dtype=np.float32).reshape(-1, 4)
        cids = np.array([r[4] for r in t], dtype=np.int64)
        classes = np.array([cat_index[c] for c in cids.tolist()], dtype=np.int64)
        images[iid] = CocoImage(iid, path, w, h, boxes, cids, classes)
    return CocoDataset(ann_file, images_dir, images, categories, crowd, degenerate, clipped)


def split(
    dataset: CocoDataset, holdout_fraction: float, seed: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Deterministic ``(train_ids, val_ids)``, each sorted: a seeded permutation of the sorted
    image ids, the first ``round(n * holdout_fraction)`` held out (at least one when the fraction
    is positive, and at least one image left for training). Raises ValueError for a fraction
    outside ``[0, 1)`` or a negative seed."""
    if not 0.0 <= holdout_fraction < 1.0 or seed < 0:
        raise ValueError(
            f"need 0 <= holdout_fraction < 1 and seed >= 0, got {holdout_fraction}, {seed}"
        )
    ids = np.array(sorted(dataset.images), dtype=np.int64)
    n_val = round(len(ids) * holdout_fraction)
    if holdout_fraction > 0 and len(ids) >= 2:
        n_val = min(max(n_val, 1), len(ids) - 1)
    perm = np.random.default_rng(seed).permutation(ids)
    val = tuple(sorted(int(i) for i in perm[:n_val]))
    train = tuple(sorted(int(i) for i in perm[n_val:]))
    return train, val


# --------------------------------------------------------------------------------- cache


def _letterbox_one(
    task: tuple[str, int, int, F32, I64, int, int],
) -> tuple[U8, F32, float, int, int]:
    path, width, height, boxes, classes, size, pad_value = task
    try:
        with Image.open(path) as im:
            rgb = np.asarray(im.convert("RGB"))
    except OSError as e:
        raise DatasetError(f"cannot decode image {path}: {e}") from None
    if rgb.shape[:2] != (height, width):
        raise DatasetError(
            f"{path}: decoded size {rgb.shape[1]}x{rgb.shape[0]} differs from the annotation "
            f"file's {width}x{height}"
        )
    canvas, lb = letterbox(rgb, size, pad_value=pad_value)
    on_canvas = np.clip(lb.to_canvas(boxes).astype(np.float64), 0.0, size)
    labels = np.empty((len(boxes), 5), dtype=np.float32)
    labels[:, 0] = classes
    labels[:, 1] = (on_canvas[:, 0] + on_canvas[:, 2]) / (2 * size)
    labels[:, 2] = (on_canvas[:, 1] + on_canvas[:, 3]) / (2 * size)
    labels[:, 3] = (on_canvas[:, 2] - on_canvas[:, 0]) / size
    labels[:, 4] = (on_canvas[:, 3] - on_canvas[:, 1]) / size
    return canvas, labels, lb.scale, lb.pad_x, lb.pad_y


_CACHE_KEYS = {
    "version": np.int64,
    "size": np.int64,
    "images": np.uint8,
    "labels": np.float32,
    "label_offsets": np.int64,
    "image_ids": np.int64,
    "scale": np.float64,
    "pad": np.int64,
    "src_size": np.int64,
}


@dataclass(frozen=True, eq=False)
class LetterboxedArrays:
    """Images of one subset letterboxed to ``size x size`` and their targets, in memory.

    ``images`` ``[N, S, S, 3]`` uint8 RGB; ``labels[i]`` ``[k, 5]`` float32 rows
    ``class, cx, cy, w, h`` normalised by ``S`` (canvas coordinates); ``image_ids`` ``[N]``;
    ``scale`` ``[N]`` float64, ``pad`` ``[N, 2]`` (x, y) and ``src_size`` ``[N, 2]`` (w, h) are
    each image's letterbox geometry (see :meth:`geometry`).
    """

    size: int
    images: U8 = field(repr=False)
    labels: list[F32] = field(repr=False)
    image_ids: I64 = field(repr=False)
    scale: npt.NDArray[np.float64] = field(repr=False)
    pad: I64 = field(repr=False)
    src_size: I64 = field(repr=False)

    def __len__(self) -> int:
        return len(self.image_ids)

    def geometry(self, i: int) -> Letterbox:
        """The :class:`~dlad.imaging.pre.Letterbox` of item ``i`` (maps boxes back and forth)."""
        return Letterbox(
            scale=float(self.scale[i]),
            pad_x=int(self.pad[i, 0]),
            pad_y=int(self.pad[i, 1]),
            src_w=int(self.src_size[i, 0]),
            src_h=int(self.src_size[i, 1]),
            dst_w=self.size,
            dst_h=self.size,
        )

    def boxes_original(self, i: int) -> F32:
        """Item ``i``'s label boxes as ``x1, y1, x2, y2`` pixels of the original image."""
        lab = self.labels[i].astype(np.float64)
        xyxy = np.concatenate([lab[:, 1:3] - lab[:, 3:5] / 2, lab[:, 1:3] + lab[:, 3:5] / 2], 1)
        return self.geometry(i).to_original(xyxy * self.size)

    @classmethod
    def build(
        cls,
        dataset: CocoDataset,
        image_ids: Sequence[int],
        size: int,
        *,
        workers: int = 2,
        pad_value: int = 114,
    ) -> LetterboxedArrays:
        """Decode (Pillow), letterbox (:func:`dlad.imaging.pre.letterbox`) and label the given
        images, in the given order, with ``workers`` spawned processes (1 = in this process).
        Raises DatasetError for an unknown image id, an undecodable image or one whose size
        differs from the annotation file; ValueError for ``size < 1`` or ``workers < 1``."""
        if size < 1 or workers < 1:
            raise ValueError(f"need size >= 1 and workers >= 1, got {size}, {workers}")
        unknown = [i for i in image_ids if i not in dataset.images]
        if unknown:
            raise DatasetError(f"image id(s) not in the dataset: {unknown[:5]}")
        tasks = [
            (str(im.path), im.width, im.height, im.boxes, im.classes, size, pad_value)
            for im in (dataset.images[i] for i in image_ids)
        ]
        n = len(tasks)
        images = np.empty((n, size, size, 3), dtype=np.uint8)
        labels: list[F32] = []
        scale = np.empty(n, dtype=np.float64)
        pad = np.empty((n, 2), dtype=np.int64)
        if workers == 1 or n < 2:
            results = map(_letterbox_one, tasks)
            for k, (canvas, lab, s, px, py) in enumerate(results):
                images[k], scale[k], pad[k] = canvas, s, (px, py)
                labels.append(lab)
        else:
            # spawn, not fork: the caller may already run torch's threads
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(min(workers, n)) as pool:
                chunk = max(1, min(32, n // (4 * workers)))
                for k, (canvas, lab, s, px, py) in enumerate(
                    pool.imap(_letterbox_one, tasks, chunksize=chunk)
                ):
                    images[k], scale[k], pad[k] = canvas, s, (px, py)
                    labels.append(lab)
        src = np.array([(t[1], t[2]) for t in tasks], dtype=np.int64).reshape(n, 2)
        ids = np.asarray(list(image_ids), dtype=np.int64)
        return cls(size, images, labels, ids, scale, pad, src)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write one uncompressed ``.npz`` (no pickled objects; ragged labels stored as one
        ``[M, 5]`` array plus ``[N + 1]`` offsets), atomically. Returns the path written."""
        out = Path(path)
        offsets = np.zeros(len(self.labels) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(lab) for lab in self.labels])
        flat = (
            np.concatenate(self.labels).astype(np.float32)
            if self.labels
            else np.zeros((0, 5), np.float32)
        )
        tmp = out.with_name(out.name + ".tmp")
        with tmp.open("wb") as f:
            np.savez(
                f,
                version=np.int64(CACHE_VERSION),
                size=np.int64(self.size),
                images=self.images,
                labels=flat.reshape(-1, 5),
                label_offsets=offsets,
                image_ids=self.image_ids.astype(np.int64),
                scale=self.scale.astype(np.float64),
                pad=self.pad.astype(np.int64),
                src_size=self.src_size.astype(np.int64),
            )
        tmp.replace(out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LetterboxedArrays:
        """Read a cache written by :meth:`save`. Raises DatasetError for a missing or unreadable
        file, a different cache version, or missing/mistyped/inconsistent arrays."""
        p = Path(path)
        try:
            with np.load(p, allow_pickle=False) as z:
                arrays = {k: z[k] for k in _CACHE_KEYS if k in z.files}
        except FileNotFoundError:
            raise DatasetError(f"cache not found: {p}") from None
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise DatasetError(f"cannot read cache {p}: {e}") from e
        for key, dtype in _CACHE_KEYS.items():
            if key not in arrays:
                raise DatasetError(f"{p}: cache lacks array {key!r}")
            if arrays[key].dtype != dtype:
                raise DatasetError(f"{p}: {key!r} has dtype {arrays[key].dtype}, expected {dtype}")
        if int(arrays["version"]) != CACHE_VERSION:
            raise DatasetError(f"{p}: cache version {int(arrays['version'])} != {CACHE_VERSION}")
        size, images, offsets = int(arrays["size"]), arrays["images"], arrays["label_offsets"]
        n = len(arrays["image_ids"])
        flat = arrays["labels"]
        consistent = (
            images.shape == (n, size, size, 3)
            and flat.ndim == 2
            and flat.shape[1] == 5
            and offsets.shape == (n + 1,)
            and offsets[0] == 0
            and offsets[-1] == len(flat)
            and bool(np.all(np.diff(offsets) >= 0))
            and arrays["scale"].shape == (n,)
            and arrays["pad"].shape == (n, 2)
            and arrays["src_size"].shape == (n, 2)
        )
        if not consistent:
            raise DatasetError(f"{p}: cache arrays have inconsistent shapes")
        labels = [flat[offsets[k] : offsets[k + 1]] for k in range(n)]
        return cls(
            size,
            images,
            labels,
            arrays["image_ids"],
            arrays["scale"],
            arrays["pad"],
            arrays["src_size"],
        )
