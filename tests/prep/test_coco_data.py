"""COCO loading, validation errors, class mapping, split and the letterboxed array cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from dlad.imaging.pre import letterbox
from prep.data.coco import (
    CocoDataset,
    DatasetError,
    LetterboxedArrays,
    load_coco,
    split,
)
from prep.data.synth import CLASSES, SynthConfig, generate_dataset

SMALL = SynthConfig(min_side=96, max_side=200, min_object_size=6.0)


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_dataset(tmp_path_factory.mktemp("coco"), 14, seed=5, config=SMALL).parent


def _write(root: Path, doc: dict[str, Any], sizes: dict[str, tuple[int, int]]) -> Path:
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, (w, h) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            root / "images" / name
        )
    (root / "annotations.json").write_text(json.dumps(doc))
    return root


def _doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "images": [
            {"id": 10, "file_name": "a.png", "width": 64, "height": 48},
            {"id": 3, "file_name": "b.png", "width": 40, "height": 80},
        ],
        "categories": [{"id": 90, "name": "z"}, {"id": 2, "name": "x"}, {"id": 7, "name": "y"}],
        "annotations": [
            {"id": 1, "image_id": 10, "category_id": 7, "bbox": [1, 2, 30, 20], "iscrowd": 0},
            {"id": 2, "image_id": 10, "category_id": 90, "bbox": [50, 40, 30, 30]},  # clipped
            {"id": 3, "image_id": 3, "category_id": 2, "bbox": [0, 0, 5, 5], "iscrowd": 1},
            {"id": 4, "image_id": 3, "category_id": 2, "bbox": [0.5, 1.5, 10.25, 70]},
        ],
    }
    doc.update(changes)
    return doc


SIZES = {"a.png": (64, 48), "b.png": (40, 80)}


def test_load_hand_written_dataset(tmp_path: Path) -> None:
    ds = load_coco(_write(tmp_path, _doc(), SIZES))
    assert list(ds.images) == [3, 10]
    assert ds.category_ids == (2, 7, 90)
    assert ds.class_names == ("x", "y", "z")
    a, b = ds.images[10], ds.images[3]
    assert (a.width, a.height, a.path) == (64, 48, tmp_path / "images" / "a.png")
    np.testing.assert_array_equal(a.boxes, [[1, 2, 31, 22], [50, 40, 64, 48]])
    np.testing.assert_array_equal(a.category_ids, [7, 90])
    np.testing.assert_array_equal(a.classes, [1, 2])
    np.testing.assert_array_equal(b.boxes, np.array([[0.5, 1.5, 10.75, 71.5]], np.float32))
    assert (ds.skipped_crowd, ds.clipped, ds.skipped_degenerate) == (1, 1, 0)


def test_explicit_images_dir_and_annotation_file(tmp_path: Path) -> None:
    root = _write(tmp_path, _doc(), SIZES)
    moved = tmp_path / "elsewhere.json"
    (root / "annotations.json").rename(moved)
    ds = load_coco((root / "images", moved))
    assert ds.ann_file == moved
    assert len(ds.images) == 2


def _bad(**changes: Any) -> dict[str, Any]:
    return _doc(**changes)


def _ann(**fields: Any) -> list[dict[str, Any]]:
    return [{"id": 1, "image_id": 10, "category_id": 7, "bbox": [1, 2, 3, 4]} | fields]


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        (_bad(annotations=_ann(image_id=99)), "image_id 99 is not in 'images'"),
        (_bad(annotations=_ann(category_id=5)), "category_id 5 is not in 'categories'"),
        (_bad(annotations=_ann(bbox=[1, 2, 3])), "bbox must be 4 finite numbers"),
        (_bad(annotations=_ann(bbox=[1, 2, -3, 4])), "bbox must be 4 finite numbers"),
        (_bad(annotations=_ann(bbox=[1, 2, "3", 4])), "bbox must be 4 finite numbers"),
        (_bad(annotations=_ann(iscrowd=2)), "iscrowd"),
        (_bad(annotations=[{"id": 1, "image_id": 10, "bbox": [1, 2, 3, 4]}]), "category_id"),
        (_bad(images=[{"id": 10, "file_name": "a.png", "width": 0, "height": 48}]), "width"),
        (_bad(images=[{"id": "10", "file_name": "a.png", "width": 64, "height": 48}]), "'id'"),
        (
            _bad(
                images=[
                    {"id": 10, "file_name": "a.png", "width": 64, "height": 48},
                    {"id": 10, "file_name": "b.png", "width": 40, "height": 80},
                ]
            ),
            "duplicate image id",
        ),
        (_bad(categories=[{"id": 1, "name": "a"}, {"id": 1, "name": "b"}]), "duplicate category"),
        (_bad(categories=[]), "no categories"),
        (_bad(images={"id": 1}), "'images' must be a list"),
        (_bad(images=[{"id": 10, "file_name": "gone.png", "width": 64, "height": 48}]), "missing"),
    ],
)
def test_bad_annotation_files_raise(tmp_path: Path, doc: dict[str, Any], match: str) -> None:
    root = _write(tmp_path, doc, SIZES)
    with pytest.raises(DatasetError, match=match):
        load_coco(root)


def test_non_finite_box_raises(tmp_path: Path) -> None:
    root = _write(tmp_path, _doc(), SIZES)
    text = json.dumps(_bad(annotations=_ann(bbox=[1, 2, 3, 4])))
    (root / "annotations.json").write_text(text.replace("[1, 2, 3, 4]", "[1, NaN, 3, 4]"))
    with pytest.raises(DatasetError, match="finite"):
        load_coco(root)


def test_missing_and_malformed_files_raise(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="dataset directory not found"):
        load_coco(tmp_path / "nope")
    (tmp_path / "images").mkdir()
    with pytest.raises(DatasetError, match="annotation file not found"):
        load_coco(tmp_path)
    with pytest.raises(DatasetError, match="images directory not found"):
        load_coco((tmp_path / "imgs", tmp_path / "annotations.json"))
    (tmp_path / "annotations.json").write_text('{"images": [')
    with pytest.raises(DatasetError, match="malformed JSON"):
        load_coco(tmp_path)
    (tmp_path / "annotations.json").write_text("[]")
    with pytest.raises(DatasetError, match="top level"):
        load_coco(tmp_path)
    assert issubclass(DatasetError, ValueError)


def test_degenerate_boxes_skipped_or_strict(tmp_path: Path) -> None:
    anns = [
        {"id": 1, "image_id": 10, "category_id": 7, "bbox": [70, 10, 5, 5]},  # wholly outside
        {"id": 2, "image_id": 10, "category_id": 7, "bbox": [10, 10, 0, 5]},  # zero width
        {"id": 3, "image_id": 10, "category_id": 7, "bbox": [10, 10, 5, 5]},
    ]
    root = _write(tmp_path, _doc(annotations=anns), SIZES)
    ds = load_coco(root)
    assert ds.skipped_degenerate == 2
    assert len(ds.images[10].boxes) == 1
    with pytest.raises(DatasetError, match="no area inside the 64x48 image"):
        load_coco(root, strict=True)


@settings(max_examples=60, deadline=None)
@given(ids=st.sets(st.integers(1, 10**6), min_size=1, max_size=30), data=st.data())
def test_class_mapping_round_trip(ids: set[int], data: st.DataObject) -> None:
    cats = {i: f"c{i}" for i in sorted(ids)}
    ds = CocoDataset(Path("a.json"), Path("images"), {}, cats)
    sample = data.draw(st.lists(st.sampled_from(sorted(ids)), max_size=20))
    classes = ds.category_to_class(sample)
    assert classes.tolist() == [sorted(ids).index(i) for i in sample]
    assert ds.class_to_category(classes).tolist() == sample
    assert ds.class_to_category(np.arange(len(ids))).tolist() == sorted(ids)
    unknown = data.draw(st.integers(0, 2 * 10**6).filter(lambda i: i not in ids))
    with pytest.raises(DatasetError, match="unknown category"):
        ds.category_to_class([*sample, unknown])
    with pytest.raises(DatasetError, match="outside"):
        ds.class_to_category([len(ids)])


def test_split_is_deterministic_disjoint_and_complete(synth_dir: Path) -> None:
    ds = load_coco(synth_dir)
    train, val = split(ds, 0.25, seed=3)
    assert (train, val) == split(ds, 0.25, seed=3)
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(ds.images)
    assert len(val) == round(14 * 0.25)
    assert list(val) == sorted(val)
    assert {split(ds, 0.25, seed=s)[1] for s in range(6)} != {val}
    assert len(split(ds, 0.01, seed=0)[1]) == 1  # a positive fraction holds out at least one
    assert split(ds, 0.0, seed=0) == (tuple(sorted(ds.images)), ())
    with pytest.raises(ValueError, match="holdout_fraction"):
        split(ds, 1.0, seed=0)


def test_synthetic_dataset_loads_with_matching_boxes(synth_dir: Path) -> None:
    ds = load_coco(synth_dir, strict=True)
    doc = json.loads((synth_dir / "annotations.json").read_text())
    assert ds.class_names == CLASSES
    assert ds.category_ids == tuple(range(1, 9))
    assert sum(len(im.boxes) for im in ds.images.values()) == len(doc["annotations"])
    assert ds.clipped == 0
    for a in doc["annotations"]:
        im = ds.images[a["image_id"]]
        x, y, w, h = a["bbox"]
        assert [x, y, x + w, y + h] in im.boxes.tolist()


def test_letterboxed_labels_map_back_and_cache_round_trips(synth_dir: Path, tmp_path: Path) -> None:
    ds = load_coco(synth_dir)
    ids = [13, 2, 7, 1, 14]
    arrays = LetterboxedArrays.build(ds, ids, 128, workers=2)
    assert arrays.images.shape == (5, 128, 128, 3)
    assert arrays.images.dtype == np.uint8
    assert arrays.image_ids.tolist() == ids
    for k, iid in enumerate(ids):
        im = ds.images[iid]
        with Image.open(im.path) as pil:
            canvas, lb = letterbox(np.asarray(pil.convert("RGB")), 128)
        np.testing.assert_array_equal(arrays.images[k], canvas)
        assert arrays.geometry(k) == lb
        lab = arrays.labels[k]
        assert lab.dtype == np.float32
        assert lab.shape == (len(im.boxes), 5)
        np.testing.assert_array_equal(lab[:, 0], im.classes)
        assert ((lab[:, 1:] >= 0) & (lab[:, 1:] <= 1)).all()
        # back in original pixels: the brief asks for 1 px; only float32 rounding is lost
        np.testing.assert_allclose(arrays.boxes_original(k), im.boxes, atol=1e-3)

    serial = LetterboxedArrays.build(ds, ids, 128, workers=1)
    np.testing.assert_array_equal(serial.images, arrays.images)

    path = arrays.save(tmp_path / "cache.npz")
    back = LetterboxedArrays.load(path)
    assert back.size == 128
    assert len(back) == 5
    for name in ("images", "image_ids", "scale", "pad", "src_size"):
        got, want = getattr(back, name), getattr(arrays, name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert len(back.labels) == 5
    for got, want in zip(back.labels, arrays.labels, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


def test_cache_handles_images_without_labels(tmp_path: Path) -> None:
    root = _write(tmp_path / "d", _doc(annotations=[]), SIZES)
    arrays = LetterboxedArrays.build(load_coco(root), [3, 10], 32, workers=1)
    assert [len(lab) for lab in arrays.labels] == [0, 0]
    back = LetterboxedArrays.load(arrays.save(tmp_path / "c.npz"))
    assert [lab.shape for lab in back.labels] == [(0, 5), (0, 5)]


def test_cache_errors(tmp_path: Path) -> None:
    root = _write(tmp_path / "d", _doc(), SIZES)
    ds = load_coco(root)
    with pytest.raises(DatasetError, match="not in the dataset"):
        LetterboxedArrays.build(ds, [10, 11], 32, workers=1)
    Image.new("RGB", (10, 10)).save(root / "images" / "a.png")  # size disagrees with the JSON
    with pytest.raises(DatasetError, match="differs from the annotation"):
        LetterboxedArrays.build(ds, [10], 32, workers=1)
    (root / "images" / "a.png").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match="cannot decode"):
        LetterboxedArrays.build(ds, [10], 32, workers=1)

    with pytest.raises(DatasetError, match="cache not found"):
        LetterboxedArrays.load(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(DatasetError, match="cannot read cache"):
        LetterboxedArrays.load(tmp_path / "junk.npz")
    good = LetterboxedArrays.build(ds, [3], 32, workers=1).save(tmp_path / "good.npz")
    with np.load(good) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(tmp_path / "nolabels.npz", **{k: v for k, v in arrays.items() if k != "labels"})
    with pytest.raises(DatasetError, match="lacks array 'labels'"):
        LetterboxedArrays.load(tmp_path / "nolabels.npz")
    np.savez(tmp_path / "badoff.npz", **(arrays | {"label_offsets": np.array([0, 5])}))
    with pytest.raises(DatasetError, match="inconsistent"):
        LetterboxedArrays.load(tmp_path / "badoff.npz")
    np.savez(tmp_path / "obj.npz", **(arrays | {"pad": np.array([None, 1], dtype=object)}))
    with pytest.raises(DatasetError, match="cannot read cache"):
        LetterboxedArrays.load(tmp_path / "obj.npz")
