"""Synthetic dataset generator: determinism, exact boxes, occlusion rule, COCO output."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prep.data.synth import (
    CLASSES,
    Placement,
    Scene,
    SynthConfig,
    generate_dataset,
    generate_image,
    generate_sample,
)

# A scene with nothing but the objects on a flat background, so the image itself is an oracle.
PLAIN = SynthConfig(
    backgrounds=("flat",),
    textures=("solid",),
    clutter_mean=0.0,
    outline_prob=0.0,
    shadow_prob=0.0,
    shading_prob=0.0,
    lighting=False,
    blur_prob=0.0,
    max_noise_sigma=0.0,
    min_contrast=120.0,
)
SMALL = SynthConfig(min_side=96, max_side=160, min_object_size=6.0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """120 default-config images, drawn by 2 processes."""
    out = tmp_path_factory.mktemp("synth")
    return generate_dataset(out, 120, seed=7, workers=2)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_same_seed_same_bytes_any_workers(tmp_path: Path) -> None:
    a = generate_dataset(tmp_path / "a", 6, seed=3, config=SMALL, workers=2).parent
    b = generate_dataset(tmp_path / "b", 6, seed=3, config=SMALL, workers=1).parent
    c = generate_dataset(tmp_path / "c", 6, seed=4, config=SMALL, workers=1).parent
    fa, fb, fc = _files(a), _files(b), _files(c)
    assert len(fa) == 7  # 6 images + annotations.json
    assert fa == fb
    differing = [k for k in fa if k.startswith("images/") and fa[k] != fc[k]]
    assert len(differing) == 6


def test_image_depends_only_on_seed_and_index() -> None:
    img, ann = generate_image(11, 5, SMALL)
    generate_image(11, 4, SMALL)  # drawing another image first changes nothing
    img2, ann2 = generate_image(11, 5, SMALL)
    assert np.array_equal(img, img2)
    assert ann == ann2
    other, _ = generate_image(11, 6, SMALL)
    assert img.shape != other.shape or not np.array_equal(img, other)


def _check_sample_boxes(seed: int, index: int, cfg: SynthConfig) -> None:
    s = generate_sample(seed, index, cfg)
    h, w, c = s.image.shape
    assert c == 3
    assert s.image.dtype == np.uint8
    assert cfg.min_side <= min(h, w) <= max(h, w) <= cfg.max_side
    kept = [o for o in s.objects if o.kept]
    assert [a.bbox for a in s.annotations] == [o.bbox for o in kept]
    for o in s.objects:
        x, y, bw, bh = o.bbox
        if o.in_image_area == 0:
            assert not o.kept
            continue
        assert x >= 0
        assert y >= 0
        assert x + bw <= w
        assert y + bh <= h
        assert bw >= 1
        assert bh >= 1
        # tight: the box is exactly the extent of the object's in-image mask
        ys, xs = np.nonzero(o.mask)
        left, top = o.mask_origin
        assert (xs.min() + left, ys.min() + top) == (x, y)
        assert (xs.max() + left + 1, ys.max() + top + 1) == (x + bw, y + bh)
        assert o.visible_area <= o.in_image_area <= o.full_area
        expect_kept = (
            o.visible_area >= cfg.min_visible_pixels
            and o.visible_area >= (1 - cfg.max_occlusion) * o.in_image_area
            and o.in_image_area >= cfg.min_in_image * o.full_area
        )
        assert o.kept == expect_kept
    for a in s.annotations:
        assert 1 <= a.category_id <= len(CLASSES)
        assert a.iscrowd == 0
        assert cfg.min_visible_pixels <= a.area <= a.bbox[2] * a.bbox[3]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), index=st.integers(0, 10**6))
def test_boxes_inside_and_tight_default_config(seed: int, index: int) -> None:
    _check_sample_boxes(seed, index, SynthConfig())


def _alpha_boxes(image: np.ndarray, bg: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Edges (x1, y1, x2, y2) of the pixels surely, and of those possibly, at least half covered,
    from the pixels alone: with a flat background and a solid fill, ``pixel = bg + alpha *
    (colour - bg)``, and rounding to uint8 moves a pixel's alpha by at most ``1 / |colour - bg|``
    (so a pixel exactly half covered may read 0.498, and two of them side by side both flip)."""
    diff = image.astype(np.float64) - bg
    mag = np.linalg.norm(diff, axis=2)
    colour_dir = diff[np.unravel_index(np.argmax(mag), mag.shape)]
    alpha = diff @ colour_dir / (colour_dir @ colour_dir)
    eps = 1.0 / float(np.linalg.norm(colour_dir))

    def edges(mask: np.ndarray) -> tuple[int, ...]:
        ys, xs = np.nonzero(mask)
        return int(xs.min()), int(ys.min()), int(xs.max() + 1), int(ys.max() + 1)

    return edges(alpha >= 0.5 + eps), edges(alpha >= 0.5 - eps)


@settings(max_examples=40, deadline=None)
@given(
    cls=st.integers(0, len(CLASSES) - 1),
    size=st.floats(16, 150),  # smaller rings have no fully covered pixel to read colour from
    aspect=st.floats(1 / 1.5, 1.5),
    angle=st.floats(0, 2 * math.pi),
    cx=st.floats(100, 120),
    seed=st.integers(0, 1000),
)
# A crescent whose tip edge falls exactly on a half-pixel: two columns at alpha 0.5 read 0.498.
@example(cls=7, size=105.5, aspect=1.453125, angle=0.0, cx=100.5, seed=1000)
def test_box_matches_pixels_of_a_lone_object(
    cls: int, size: float, aspect: float, angle: float, cx: float, seed: int
) -> None:
    scene = Scene(220, 200, PLAIN, np.random.default_rng(seed))
    scene.add_object(Placement(cls, cx, 100.0, size, aspect, angle))
    s = scene.finish()
    bg = s.image[0, 0].astype(np.float64)
    assert len(s.annotations) == 1
    x, y, w, h = s.annotations[0].bbox
    sure, possible = _alpha_boxes(s.image, bg)
    # Each edge lies between the surely and the possibly covered pixels' edge, give or take the
    # one pixel by which the box's coverage rule and the rendered antialiasing may differ.
    got = (x, y, x + w, y + h)
    low = (possible[0], possible[1], sure[2], sure[3])
    high = (sure[0], sure[1], possible[2], possible[3])
    assert all(lo - 1 <= g <= hi + 1 for g, lo, hi in zip(got, low, high, strict=True)), (
        got,
        sure,
        possible,
    )


@settings(max_examples=30, deadline=None)
@given(
    size=st.floats(8, 180),
    aspect=st.floats(1 / 1.5, 1.5),
    angle=st.floats(0, math.pi),
    seed=st.integers(0, 1000),
)
def test_circle_box_matches_analytic_ellipse(
    size: float, aspect: float, angle: float, seed: int
) -> None:
    scene = Scene(240, 240, PLAIN, np.random.default_rng(seed))
    scene.add_object(Placement(CLASSES.index("circle"), 120.3, 119.6, size, aspect, angle))
    (ann,) = scene.finish().annotations
    a, b = size / 2 * math.sqrt(aspect), size / 2 / math.sqrt(aspect)
    hx = math.hypot(a * math.cos(angle), b * math.sin(angle))
    hy = math.hypot(a * math.sin(angle), b * math.cos(angle))
    expect = (120.3 - hx, 119.6 - hy, 2 * hx, 2 * hy)
    x, y, w, h = ann.bbox
    # pixel quantisation: each edge lands on the pixel grid, within one pixel of the ellipse
    assert abs(x - expect[0]) <= 1
    assert abs(y - expect[1]) <= 1
    assert abs((x + w) - (expect[0] + expect[2])) <= 1
    assert abs((y + h) - (expect[1] + expect[3])) <= 1


def test_occlusion_drops_hidden_objects() -> None:
    cfg = dataclasses.replace(PLAIN, max_occlusion=0.7)
    scene = Scene(400, 300, cfg, np.random.default_rng(0))
    square = CLASSES.index("square")
    scene.add_object(Placement(square, 100, 150, 80))  # 0: fully covered by 1
    scene.add_object(Placement(square, 100, 150, 110))  # 1: on top of 0
    scene.add_object(Placement(square, 300, 150, 80))  # 2: left half covered by 3
    scene.add_object(Placement(square, 260, 150, 80))  # 3
    scene.add_object(Placement(square, 300, 60, 80))  # 4: 80 % covered by 5
    scene.add_object(Placement(square, 300 - 0.2 * 72, 60, 80))  # 5
    s = scene.finish()
    o = s.objects
    for k, hider in ((0, 1), (2, 3), (4, 5)):
        # visible area is exactly the part of the mask not under the later object's mask
        mine = np.zeros((300, 400), bool)
        theirs = np.zeros((300, 400), bool)
        for rec, m in ((o[k], mine), (o[hider], theirs)):
            left, top = rec.mask_origin
            m[top : top + rec.mask.shape[0], left : left + rec.mask.shape[1]] = rec.mask
        assert o[k].visible_area == int((mine & ~theirs).sum())
    assert o[0].visible_area == 0
    assert not o[0].kept
    assert 0.4 < o[2].visible_area / o[2].in_image_area < 0.6
    assert o[2].kept
    assert o[4].visible_area / o[4].in_image_area < 0.3
    assert not o[4].kept
    # the box of a partly hidden object is still its full extent
    assert o[2].bbox[2] > 60
    assert [a.bbox for a in s.annotations] == [o[k].bbox for k in (1, 2, 3, 5)]


def test_distractors_drawn_on_top_hide_objects() -> None:
    cfg = dataclasses.replace(PLAIN, min_contrast=0.0)
    scene = Scene(200, 200, cfg, np.random.default_rng(4))
    scene.add_object(Placement(CLASSES.index("square"), 100, 100, 260))  # covers the image
    for _ in range(15):
        scene.add_distractor()
    s = scene.finish()
    (o,) = s.objects
    assert o.in_image_area == 200 * 200
    _, counts = np.unique(s.image.reshape(-1, 3), axis=0, return_counts=True)
    changed = 200 * 200 - counts.max()  # pixels no longer showing the object's own colour
    hidden = o.in_image_area - o.visible_area
    # hidden pixels are those at least half covered; anti-aliased fringes change colour too
    assert 0 < hidden <= changed < 1.2 * hidden


def test_truncated_objects_kept_unless_mostly_outside() -> None:
    scene = Scene(300, 200, PLAIN, np.random.default_rng(1))
    circle = CLASSES.index("circle")
    scene.add_object(Placement(circle, 0.0, 100, 60))  # half outside: kept, box clipped
    scene.add_object(Placement(circle, 299, -20, 60))  # a corner sliver: dropped
    a, b = scene.finish().objects
    assert a.kept
    assert a.bbox[0] == 0
    assert 28 <= a.bbox[2] <= 31
    assert 0.45 < a.in_image_area / a.full_area < 0.55
    assert not b.kept
    assert b.in_image_area < 0.3 * b.full_area


def test_dataset_is_valid_coco(dataset: Path) -> None:
    from faster_coco_eval import COCO

    doc = json.loads(dataset.read_text())
    coco = COCO(str(dataset))
    assert len(coco.getImgIds()) == 120 == len(doc["images"])
    assert len(coco.getAnnIds()) == len(doc["annotations"]) > 120
    assert [a["id"] for a in doc["annotations"]] == list(range(1, len(doc["annotations"]) + 1))
    assert [im["id"] for im in doc["images"]] == list(range(1, 121))
    per_image = Counter(a["image_id"] for a in doc["annotations"])
    assert all(len(coco.getAnnIds(imgIds=[i])) == per_image[i] for i in range(1, 121))
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(CLASSES)
    assert doc["info"]["seed"] == 7
    assert doc["info"]["config"] == json.loads(json.dumps(dataclasses.asdict(SynthConfig())))
    for im in doc["images"]:
        path = dataset.parent / "images" / im["file_name"]
        from PIL import Image

        with Image.open(path) as pil:
            assert pil.size == (im["width"], im["height"])
            assert pil.format == "JPEG"
    sizes = {(im["width"], im["height"]) for im in doc["images"]}
    assert any(w > h for w, h in sizes)
    assert any(w < h for w, h in sizes)
    assert any(w == h for w, h in sizes)
    assert min(min(s) for s in sizes) >= 256
    assert max(max(s) for s in sizes) <= 640


def test_every_class_appears_and_is_balanced(dataset: Path) -> None:
    doc = json.loads(dataset.read_text())
    counts = Counter(a["category_id"] for a in doc["annotations"])
    total = sum(counts.values())
    assert set(counts) == set(range(1, len(CLASSES) + 1))
    assert all(n > 0.06 * total for n in counts.values()), counts
    # scales span small to large objects (COCO's small/medium/large all occur)
    areas = np.array([a["bbox"][2] * a["bbox"][3] for a in doc["annotations"]])
    assert (areas < 32**2).sum() > 0.15 * total
    assert (areas > 96**2).sum() > 0.05 * total


def test_config_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="max_occlusion"):
        SynthConfig(max_occlusion=1.5)
    with pytest.raises(ValueError, match="textures"):
        SynthConfig(textures=("plaid",))
    with pytest.raises(ValueError, match="min_side"):
        SynthConfig(min_side=700)
    with pytest.raises(ValueError, match="num_images >= 0"):
        generate_dataset("/nonexistent-never-created", -1, seed=0)
