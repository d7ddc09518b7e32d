"""Seeded synthetic detection dataset: shapes on cluttered, badly lit backgrounds.

There is no COCO on the project's machines and nothing may be downloaded, so prep trains and
validates on images drawn here. The task is built to be learnable quickly yet not saturated:

* eight classes that differ only by **shape** (:data:`CLASSES`); colour, texture, outline,
  rotation and aspect are drawn independently of the class;
* scales from ~8 px to 60 % of the shorter side (log-uniform), 1-12 objects per image, objects
  overlapping earlier ones, truncation at the border;
* unlabelled clutter (lines, text-like scribbles, irregular blobs, arcs, sectors, random
  polygons), some of it drawn over the objects;
* varied backgrounds, directional shading, colour cast, contrast/gamma, blur and sensor noise;
* varied image sizes and aspect ratios (256-640 px sides), so letterboxing is exercised.

Boxes are exact: each object is rasterised into its own anti-aliased mask (2x or 4x
supersampled), the mask (alpha >= 0.5) gives the box, clipped to the image, in continuous
pixel-edge coordinates (a box ``[x, y, w, h]`` covers pixels ``x .. x + w - 1``). A box is the
object's full in-image extent even where later objects hide part of it; the label is dropped
when more than ``max_occlusion`` of its in-image pixels are hidden, or when less than
``min_in_image`` of it lies inside the image. ``area`` is the visible pixel count (COCO's
segment area).

Determinism: image ``i`` depends only on ``(seed, i, config)`` through
``np.random.default_rng([seed, i])``, so images can be generated in any order, by any number
of processes, and one image can be regenerated alone; the same arguments give byte-identical
files.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw, ImageFilter

__all__ = [
    "BACKGROUNDS",
    "CLASSES",
    "GENERATOR_VERSION",
    "TEXTURES",
    "Annotation",
    "ObjectRecord",
    "Placement",
    "Scene",
    "SynthConfig",
    "SynthSample",
    "generate_dataset",
    "generate_image",
    "generate_sample",
]

GENERATOR_VERSION = "1"
"""Bumped whenever the same (seed, index, config) would draw a different image."""

CLASSES: tuple[str, ...] = (
    "circle", "square", "triangle", "star", "ring", "cross", "hexagon", "crescent",
)  # fmt: skip
"""Class names; COCO category id = class index + 1."""

BACKGROUNDS: tuple[str, ...] = ("flat", "gradient", "noise", "stripes", "checker", "blobs")
TEXTURES: tuple[str, ...] = ("solid", "stripes", "gradient", "noise", "checker")

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
Rng = np.random.Generator


@dataclass(frozen=True)
class SynthConfig:
    """Difficulty knobs. The defaults are the project's benchmark task; every field is checked
    in ``__post_init__`` (ValueError names the field)."""

    min_side: int = 256
    """Smallest image width/height, pixels."""
    max_side: int = 640
    """Largest image width/height, pixels."""
    aspect_ratios: tuple[float, ...] = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3)
    """Width/height ratios, drawn uniformly."""
    min_objects: int = 1
    max_objects: int = 12
    """Objects per image, uniform in [min_objects, max_objects] (before occlusion drops)."""
    min_object_size: float = 8.0
    """Smallest nominal object extent, pixels (log-uniform up to ``max_object_frac``)."""
    max_object_frac: float = 0.6
    """Largest nominal extent as a fraction of the image's shorter side."""
    max_aspect: float = 1.5
    """Objects are stretched by a factor in [1/max_aspect, max_aspect] (log-uniform)."""
    max_occlusion: float = 0.7
    """Drop a label when more than this fraction of its in-image pixels is hidden."""
    min_in_image: float = 0.3
    """Drop a label when less than this fraction of the object lies inside the image."""
    min_visible_pixels: int = 12
    """Drop a label with fewer visible pixels than this."""
    clutter_mean: float = 6.0
    """Mean (Poisson) number of unlabelled distractors per image."""
    foreground_clutter: float = 0.35
    """Fraction of distractors drawn among/over the objects (they occlude) rather than under."""
    backgrounds: tuple[str, ...] = BACKGROUNDS
    textures: tuple[str, ...] = TEXTURES
    outline_prob: float = 0.35
    shadow_prob: float = 0.25
    shading_prob: float = 0.5
    """Probability of a soft light-to-dark gradient across an object (a 3-D look)."""
    min_contrast: float = 50.0
    """Minimum RGB distance between an object's colour and the mean background under it (a few
    redraws are tried; after that the last draw is kept, so some objects stay low-contrast)."""
    lighting: bool = True
    """Directional shading, colour cast, brightness/contrast/gamma."""
    blur_prob: float = 0.3
    max_blur_radius: float = 1.2
    max_noise_sigma: float = 8.0
    """Sensor noise standard deviation is uniform in [0, max_noise_sigma] (uint8 units)."""
    image_format: Literal["jpg", "png"] = "jpg"
    """How :func:`generate_dataset` writes images. JPEG is ~8x smaller and faster to decode; its
    artefacts move no edge by more than a pixel, and boxes come from the masks anyway."""
    jpeg_quality: int = 90

    def __post_init__(self) -> None:
        checks = {
            "min_side": 16 <= self.min_side <= self.max_side,
            "aspect_ratios": len(self.aspect_ratios) > 0
            and all(0.1 <= r <= 10 for r in self.aspect_ratios),
            "min_objects": 0 <= self.min_objects <= self.max_objects,
            "min_object_size": self.min_object_size >= 2.0,
            "max_object_frac": 0.0 < self.max_object_frac <= 1.0
            and self.min_object_size <= self.max_object_frac * self.min_side,
            "max_aspect": self.max_aspect >= 1.0,
            "max_occlusion": 0.0 <= self.max_occlusion <= 1.0,
            "min_in_image": 0.0 <= self.min_in_image <= 1.0,
            "min_visible_pixels": self.min_visible_pixels >= 1,
            "clutter_mean": self.clutter_mean >= 0.0,
            "foreground_clutter": 0.0 <= self.foreground_clutter <= 1.0,
            "backgrounds": len(self.backgrounds) > 0 and set(self.backgrounds) <= set(BACKGROUNDS),
            "textures": len(self.textures) > 0 and set(self.textures) <= set(TEXTURES),
            "outline_prob": 0.0 <= self.outline_prob <= 1.0,
            "shadow_prob": 0.0 <= self.shadow_prob <= 1.0,
            "shading_prob": 0.0 <= self.shading_prob <= 1.0,
            "min_contrast": self.min_contrast >= 0.0,
            "blur_prob": 0.0 <= self.blur_prob <= 1.0,
            "max_blur_radius": self.max_blur_radius >= 0.0,
            "max_noise_sigma": self.max_noise_sigma >= 0.0,
            "image_format": self.image_format in ("jpg", "png"),
            "jpeg_quality": 1 <= self.jpeg_quality <= 100,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid SynthConfig field(s): {', '.join(bad)} ({self!r})")


@dataclass(frozen=True)
class Annotation:
    """One labelled object: COCO ``bbox`` ``(x, y, w, h)`` in pixel-edge coordinates,
    ``category_id`` = class index + 1, ``area`` = visible pixels."""

    bbox: tuple[float, float, float, float]
    category_id: int
    area: float
    iscrowd: int = 0


@dataclass(frozen=True)
class Placement:
    """Geometry of one object: class, centre (pixels), nominal extent ``size`` (pixels, before
    the ``aspect`` stretch of width over height) and rotation ``angle`` (radians)."""

    class_index: int
    cx: float
    cy: float
    size: float
    aspect: float = 1.0
    angle: float = 0.0


@dataclass(frozen=True)
class ObjectRecord:
    """Everything known about one drawn object, kept or not. ``mask`` is its in-image mask
    (alpha >= 0.5, before later objects covered it) whose top-left pixel is ``mask_origin``."""

    class_index: int
    bbox: tuple[float, float, float, float]
    full_area: int
    in_image_area: int
    visible_area: int
    kept: bool
    mask_origin: tuple[int, int]
    mask: npt.NDArray[np.bool_] = field(repr=False)


@dataclass(frozen=True)
class SynthSample:
    """A rendered image (H x W x 3 uint8 RGB), its kept annotations in drawing order, and a
    record of every object drawn."""

    image: U8
    annotations: list[Annotation]
    objects: list[ObjectRecord]


class _Op(NamedTuple):
    kind: Literal["poly", "line"]
    pts: npt.NDArray[np.float64]  # [n, 2] image coordinates, pixel-edge convention
    value: int  # 255 paints, 0 erases (holes)
    width: float = 0.0  # line width, pixels


# --------------------------------------------------------------------------------- geometry


def _ngon(n: int, radius: float = 1.0, phase: float = -math.pi / 2) -> npt.NDArray[np.float64]:
    t = phase + np.arange(n) * (2 * math.pi / n)
    return np.stack([np.cos(t), np.sin(t)], axis=1) * radius


_CIRCLE = _ngon(48)


def _shape(class_index: int, rng: Rng) -> list[tuple[npt.NDArray[np.float64], int]]:
    """Polygons (unit scale, roughly [-1, 1]^2) of one instance; per-instance proportions vary
    so no class is a single template."""
    name = CLASSES[class_index]
    jitter = rng.normal(0.0, 0.025, size=(12, 2))  # corner wobble for the straight-edged ones
    if name == "circle":
        return [(_CIRCLE, 255)]
    if name == "square":
        sq = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=np.float64)
        return [(sq * 0.9 + jitter[:4], 255)]
    if name == "triangle":
        tri = _ngon(3) + np.array([0.0, 0.25])
        return [(tri * 1.1 + jitter[:3], 255)]
    if name == "star":
        r = np.tile([1.0, rng.uniform(0.38, 0.55)], 5)[:, None]
        return [(_ngon(10) * r, 255)]
    if name == "ring":
        return [(_CIRCLE, 255), (_CIRCLE * rng.uniform(0.45, 0.72), 0)]
    if name == "cross":
        a = rng.uniform(0.2, 0.36)
        arm = [(-a, -1), (a, -1), (a, -a), (1, -a), (1, a), (a, a)]
        arm += [(a, 1), (-a, 1), (-a, a), (-1, a), (-1, -a), (-a, -a)]
        return [(np.array(arm) + jitter, 255)]
    if name == "hexagon":
        return [(_ngon(6, phase=0.0) + jitter[:6], 255)]
    # crescent: a disc minus an offset disc that pokes out of it, so the horns stay open
    r2 = rng.uniform(0.7, 0.9)
    d = rng.uniform(max(0.35, 1.12 - r2), 0.65)
    return [(_CIRCLE, 255), (_CIRCLE * r2 + [d, 0.0], 0)]


def _transform(pts: npt.NDArray[np.float64], p: Placement) -> npt.NDArray[np.float64]:
    half = p.size / 2.0
    sx, sy = half * math.sqrt(p.aspect), half / math.sqrt(p.aspect)
    c, s = math.cos(p.angle), math.sin(p.angle)
    x, y = pts[:, 0] * sx, pts[:, 1] * sy
    return np.stack([x * c - y * s + p.cx, x * s + y * c + p.cy], axis=1)


def _fill_polygon(pts: npt.NDArray[np.float64], h: int, w: int) -> npt.NDArray[np.bool_]:
    """Pixels of an ``h x w`` grid whose centres lie inside the polygon (even-odd rule).

    Exact centre sampling (a scanline crossing count), unlike ImageDraw.polygon, which floors
    vertices and fills its outline too, so its shapes grow by up to a pixel.
    """
    x0, y0 = pts[:, 0], pts[:, 1]
    x1, y1 = np.roll(x0, -1), np.roll(y0, -1)
    yc = np.arange(h, dtype=np.float64)[:, None] + 0.5
    # half-open in y, so a vertex shared by two edges is crossed once
    active = (yc >= np.minimum(y0, y1)) & (yc < np.maximum(y0, y1))
    rows, edges = np.nonzero(active)
    y0e, y1e, x0e = y0[edges], y1[edges], x0[edges]
    xi = x0e + (yc[rows, 0] - y0e) / (y1e - y0e) * (x1[edges] - x0e)
    # a crossing at xi toggles every pixel whose centre j + 0.5 lies right of it
    first = np.clip(np.ceil(xi - 0.5), 0, w).astype(np.intp)
    toggles = np.bincount(rows * (w + 1) + first, minlength=h * (w + 1)).astype(np.uint8)
    return (np.cumsum(toggles.reshape(h, w + 1), axis=1, dtype=np.uint8)[:, :w] & 1).astype(bool)


def _rasterize(ops: list[_Op], ss: int) -> tuple[int, int, Image.Image]:
    """Draw ``ops`` supersampled ``ss`` times and box-filter down: an ``L`` alpha image whose
    top-left pixel is ``(x0, y0)`` in image coordinates; alpha >= 128 exactly when at least
    half of a pixel's ``ss * ss`` samples are covered."""
    pts = np.concatenate([op.pts for op in ops])
    margin = max(op.width for op in ops) / 2 + 1.0
    x0, y0 = math.floor(pts[:, 0].min() - margin), math.floor(pts[:, 1].min() - margin)
    x1, y1 = math.ceil(pts[:, 0].max() + margin), math.ceil(pts[:, 1].max() + margin)
    h, w = (y1 - y0) * ss, (x1 - x0) * ss
    cover = np.zeros((h, w), dtype=bool)
    strokes: Image.Image | None = None
    for op in ops:
        q = (op.pts - (x0, y0)) * ss
        if op.kind == "poly":
            inside = _fill_polygon(q, h, w)
            cover = cover | inside if op.value else cover & ~inside
        else:  # unlabelled strokes: ImageDraw's geometry is good enough for them
            strokes = strokes or Image.new("L", (w, h), 0)
            flat = [(float(a) - 0.5, float(b) - 0.5) for a, b in q.tolist()]
            width = max(1, round(op.width * ss))
            ImageDraw.Draw(strokes).line(flat, fill=255, width=width, joint="curve")
    if strokes is not None:
        cover |= np.asarray(strokes) > 0
    cover8 = cover.view(np.uint8)
    counts = np.zeros((h // ss, w // ss), dtype=np.int32)
    for i in range(ss):  # strided adds beat a reshape-sum over two axes by ~5x
        for j in range(ss):
            counts += cover8[i::ss, j::ss]
    alpha = (counts * 255 + (ss * ss) // 2) // (ss * ss)
    return x0, y0, Image.fromarray(alpha.astype(np.uint8))


# --------------------------------------------------------------------------------- appearance


def _grid(h: int, w: int, ox: float, oy: float) -> tuple[F32, F32]:
    ys = np.arange(h, dtype=np.float32)[:, None] + np.float32(0.5 - oy)
    xs = np.arange(w, dtype=np.float32)[None, :] + np.float32(0.5 - ox)
    return xs, ys


def _smooth_noise(rng: Rng, h: int, w: int, cells: int) -> F32:
    """RGB value noise in [-1, 1]: a random grid of ``cells`` along the longer side, upsampled."""
    gh, gw = max(2, round(cells * h / max(h, w))), max(2, round(cells * w / max(h, w)))
    small = Image.fromarray(rng.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8))
    arr = np.asarray(small.resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    return arr * np.float32(1 / 127.5) - np.float32(1.0)


def _pattern(rng: Rng, kind: str, xs: F32, ys: F32, period: float) -> F32:
    """A 0..1 field of ``kind`` (stripes, checker or gradient) over the grid."""
    a = rng.uniform(0, math.pi)
    c, s = np.float32(math.cos(a)), np.float32(math.sin(a))
    u = xs * c + ys * s
    if kind == "gradient":
        return np.clip(u / np.float32(period) + np.float32(0.5), 0, 1)
    if kind == "stripes":
        t = u * np.float32(1 / period)
        if rng.random() < 0.5:  # soft (sinusoidal) or hard stripes
            return np.float32(0.5) + np.float32(0.5) * np.sin(t * np.float32(2 * math.pi))
        return ((t - np.floor(t)) < np.float32(rng.uniform(0.3, 0.7))).astype(np.float32)
    v = ys * c - xs * s
    return ((np.floor(u / np.float32(period)) + np.floor(v / np.float32(period))) % 2).astype(
        np.float32
    )


def _mix(c1: F32, c2: F32, t: F32) -> F32:
    return c1 + (c2 - c1) * t[..., None]


def _texture(rng: Rng, kind: str, base: F32, *, size: float, xs: F32, ys: F32) -> F32:
    """Object/distractor fill over the grid: broadcastable to ``[h, w, 3]`` float32 RGB."""
    c2 = rng.uniform(0, 255, 3).astype(np.float32)
    if kind == "solid":
        return base[None, None, :]
    if kind == "noise":
        h, w = ys.shape[0], xs.shape[1]
        n = _smooth_noise(rng, h, w, cells=int(rng.integers(2, 8)))
        return base + n * np.float32(rng.uniform(20, 70))
    period = size if kind == "gradient" else rng.uniform(2.5, max(3.0, size / 3))
    return _mix(base, c2, _pattern(rng, kind, xs, ys, period))


def _background(rng: Rng, cfg: SynthConfig, h: int, w: int) -> F32:
    img = _background_kind(rng, cfg.backgrounds[rng.integers(len(cfg.backgrounds))], h, w)
    if len(cfg.backgrounds) > 1 and rng.random() < 0.3:
        other = _background_kind(rng, cfg.backgrounds[rng.integers(len(cfg.backgrounds))], h, w)
        t = np.float32(rng.uniform(0.25, 0.6))
        img = img * (np.float32(1.0) - t) + other * t
    return img


def _background_kind(rng: Rng, kind: str, h: int, w: int) -> F32:
    c1 = rng.uniform(0, 255, 3).astype(np.float32)
    if kind == "flat":
        return np.broadcast_to(c1, (h, w, 3)).copy()
    if kind == "noise":
        n = _smooth_noise(rng, h, w, int(rng.integers(3, 10))) * np.float32(rng.uniform(30, 90))
        if rng.random() < 0.5:  # a finer octave on top
            n += _smooth_noise(rng, h, w, int(rng.integers(20, 60))) * np.float32(25)
        return c1 + n
    if kind == "blobs":
        small = Image.new("RGB", (max(8, w // 4), max(8, h // 4)), tuple(int(v) for v in c1))
        draw = ImageDraw.Draw(small)
        for _ in range(int(rng.integers(4, 16))):
            cx, cy = rng.uniform(0, small.width), rng.uniform(0, small.height)
            rx, ry = rng.uniform(2, small.width / 3), rng.uniform(2, small.height / 3)
            col = tuple(int(v) for v in rng.integers(0, 256, 3))
            draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=col)
        small = small.filter(ImageFilter.GaussianBlur(rng.uniform(1.0, 4.0)))
        return np.asarray(small.resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)
    # stripes, checker and gradient in a second colour; patterns stay in a muted range so the
    # background's own squares and bars do not outshine the objects
    spread = 255.0 if kind == "gradient" else rng.uniform(20, 90)
    c2 = np.clip(c1 + rng.uniform(-spread, spread, 3), 0, 255).astype(np.float32)
    xs, ys = _grid(h, w, w / 2, h / 2)
    period = max(h, w) if kind == "gradient" else rng.uniform(6, 64)
    return _mix(c1, c2, _pattern(rng, kind, xs, ys, period))


def _finish(rng: Rng, cfg: SynthConfig, canvas: F32) -> U8:
    """Camera model: directional shading, blur, colour cast and tone curve, sensor noise."""
    h, w, _ = canvas.shape
    if cfg.lighting:
        xs, ys = _grid(h, w, w / 2, h / 2)
        strength = np.float32(rng.uniform(-0.5, 0.5))
        ramp = np.float32(1.0) + _pattern(rng, "gradient", xs, ys, max(h, w)) * strength
        canvas *= ramp[..., None]
    pil = Image.fromarray(np.clip(canvas, 0, 255, out=canvas).astype(np.uint8))
    if rng.random() < cfg.blur_prob and cfg.max_blur_radius > 0:
        pil = pil.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, max(0.3, cfg.max_blur_radius))))
    if cfg.lighting:
        # colour cast, contrast, brightness and gamma folded into one per-channel lookup table
        gains = rng.uniform(0.85, 1.15, 3)
        contrast, bright = rng.uniform(0.7, 1.25), rng.uniform(-30, 30)
        gamma = math.exp(rng.uniform(math.log(0.7), math.log(1.45)))
        v = np.arange(256)[None, :] * gains[:, None]
        v = np.clip((v - 128.0) * contrast + 128.0 + bright, 0, 255) / 255.0
        lut = np.clip(np.round(255.0 * v**gamma), 0, 255).astype(np.uint8)
        pil = pil.point(lut.ravel().tolist())
    img = np.asarray(pil)
    sigma = rng.uniform(0.0, cfg.max_noise_sigma)
    if sigma >= 0.5:
        # Difference of two uniform bytes: triangular, std 104.5, close enough to Gaussian
        # sensor noise and ~5x cheaper to draw. Colour noise or luminance-only noise.
        shape = (2, h, w, 3) if rng.random() < 0.5 else (2, h, w, 1)
        u = rng.integers(0, 256, size=shape, dtype=np.uint8)
        noise = u[0].astype(np.float32)
        noise -= u[1]
        noise *= np.float32(sigma / 104.5)
        noise = noise + img
        img = np.clip(noise, 0, 255, out=noise).astype(np.uint8)
    return np.ascontiguousarray(img)


def _distractor(rng: Rng, w: int, h: int) -> tuple[list[_Op], float]:
    """Ops for one unlabelled distractor and its nominal size. None of them is one of the
    classes: open strokes, scribbles, irregular blobs, arcs, sectors, random polygons."""
    kind = rng.integers(6)
    cx, cy = rng.uniform(0, w), rng.uniform(0, h)
    centre = np.array([cx, cy])
    size = math.exp(rng.uniform(math.log(8), math.log(0.5 * min(w, h))))
    if kind == 0:  # long strokes
        n = int(rng.integers(2, 5))
        pts = np.cumsum(rng.normal(0, size, (n, 2)), axis=0) + centre
        return [_Op("line", pts, 255, rng.uniform(1, 5))], size
    if kind == 1:  # text-like scribbles: rows of small glyphs
        gh = rng.uniform(6, 20)
        ops = []
        for row in range(int(rng.integers(1, 4))):
            for col in range(int(rng.integers(3, 12))):
                ox, oy = cx + col * gh * 0.75, cy + row * gh * 1.4
                pts = rng.uniform((0, 0), (gh * 0.6, gh), (int(rng.integers(2, 5)), 2))
                ops.append(_Op("line", pts + np.array([ox, oy]), 255, rng.uniform(1, 2.2)))
        return ops, gh
    if kind == 2:  # irregular blob: a circle with low-frequency radial wobble
        t = np.linspace(0, 2 * math.pi, 40, endpoint=False)
        r = np.ones_like(t)
        for k in (2, 3, 5):
            r += rng.uniform(0.1, 0.3) * np.sin(k * t + rng.uniform(0, 2 * math.pi))
        pts = np.stack([np.cos(t), np.sin(t)], 1) * (r[:, None] * size / 2) + centre
        return [_Op("poly", pts, 255)], size
    if kind == 3:  # open arc
        a0, span = rng.uniform(0, 2 * math.pi), rng.uniform(1.0, 4.5)
        t = np.linspace(a0, a0 + span, 24)
        pts = np.stack([np.cos(t), np.sin(t)], 1) * (size / 2) + centre
        return [_Op("line", pts, 255, rng.uniform(1.5, max(2.0, size / 8)))], size
    if kind == 4:  # sector ("pie slice" / half disc)
        a0, span = rng.uniform(0, 2 * math.pi), rng.uniform(1.2, 3.5)
        t = np.linspace(a0, a0 + span, 24)
        pts = np.vstack([[0.0, 0.0], np.stack([np.cos(t), np.sin(t)], 1)]) * (size / 2)
        return [_Op("poly", pts + centre, 255)], size
    # random polygon: 4-7 points sorted by angle (irregular, usually concave)
    n = int(rng.integers(4, 8))
    ang = np.sort(rng.uniform(0, 2 * math.pi, n))
    rad = rng.uniform(0.3, 1.0, n) * size / 2
    pts = np.stack([np.cos(ang) * rad, np.sin(ang) * rad], 1) + centre
    return [_Op("poly", pts, 255)], size


# --------------------------------------------------------------------------------- scene


class Scene:
    """One image being drawn: background, then objects and distractors in call order (later ones
    cover earlier ones), then :meth:`finish`. All randomness comes from ``rng``."""

    def __init__(self, width: int, height: int, config: SynthConfig, rng: Rng) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        self.width, self.height, self.config, self.rng = width, height, config, rng
        self.canvas = _background(rng, config, height, width)
        # owner[y, x] = 1 + index of the object that is on top there; 0 = background/clutter
        self.owner = np.zeros((height, width), dtype=np.int16)
        # per object: class, top, left, full mask area, in-image mask
        self._pending: list[tuple[int, int, int, int, npt.NDArray[np.bool_]]] = []

    def _clip(self, x0: int, y0: int, img: Image.Image) -> tuple[slice, slice, slice, slice]:
        cx0, cy0 = max(x0, 0), max(y0, 0)
        cx1, cy1 = min(x0 + img.width, self.width), min(y0 + img.height, self.height)
        cx1, cy1 = max(cx1, cx0), max(cy1, cy0)
        return (
            slice(cy0, cy1),
            slice(cx0, cx1),
            slice(cy0 - y0, cy1 - y0),
            slice(cx0 - x0, cx1 - x0),
        )

    def _paint(self, x0: int, y0: int, alpha: Image.Image, size: float, bg_mean: F32) -> None:
        """Composite a random colour/texture (and maybe an outline) through ``alpha``."""
        rng, cfg = self.rng, self.config
        ry, rx, ay, ax = self._clip(x0, y0, alpha)
        a = np.asarray(alpha, dtype=np.float32)[ay, ax] * np.float32(1 / 255)
        region = self.canvas[ry, rx]
        if a.size == 0:
            return
        for _ in range(4):  # keep most objects distinguishable from what lies under them
            base = rng.uniform(0, 255, 3).astype(np.float32)
            if float(np.linalg.norm(base - bg_mean)) >= cfg.min_contrast:
                break
        kind = cfg.textures[rng.integers(len(cfg.textures))]
        # texture coordinates are relative to the object's centre
        xs, ys = _grid(
            a.shape[0],
            a.shape[1],
            x0 + alpha.width / 2 - rx.start,
            y0 + alpha.height / 2 - ry.start,
        )
        tex = _texture(rng, kind, base, size=size, xs=xs, ys=ys)
        if rng.random() < cfg.shading_prob:
            shade = _pattern(rng, "gradient", xs, ys, size) - np.float32(0.5)
            tex = tex * (np.float32(1.0) + shade * np.float32(rng.uniform(-0.6, 0.6)))[..., None]
        inner = a
        if rng.random() < cfg.outline_prob:
            width = int(rng.integers(1, max(2, min(5, round(size / 10))) + 1))
            eroded = alpha.filter(ImageFilter.MinFilter(2 * width + 1))
            inner = np.asarray(eroded, dtype=np.float32)[ay, ax] * np.float32(1 / 255)
            outline = rng.uniform(0, 255, 3).astype(np.float32)
            region += (outline - region) * a[..., None]
        region += (tex - region) * inner[..., None]

    def _shadow(self, x0: int, y0: int, alpha: Image.Image, size: float) -> None:
        rng = self.rng
        blur = max(1.0, size * rng.uniform(0.02, 0.08))
        pad = math.ceil(2 * blur)
        padded = Image.new("L", (alpha.width + 2 * pad, alpha.height + 2 * pad), 0)
        padded.paste(alpha, (pad, pad))
        soft = padded.filter(ImageFilter.GaussianBlur(blur))
        dx, dy = (round(v) for v in rng.normal(0, 0.06 * size + 1, 2))
        ry, rx, ay, ax = self._clip(x0 - pad + dx, y0 - pad + dy, soft)
        a = np.asarray(soft, dtype=np.float32)[ay, ax] * np.float32(rng.uniform(0.25, 0.55) / 255)
        self.canvas[ry, rx] *= (np.float32(1.0) - a)[..., None]

    def add_object(self, placement: Placement) -> None:
        """Draw one labelled object on top of everything drawn so far."""
        if not 0 <= placement.class_index < len(CLASSES):
            raise ValueError(f"class_index must be in [0, {len(CLASSES)}), got {placement}")
        if placement.size <= 0 or placement.aspect <= 0:
            raise ValueError(f"size and aspect must be positive, got {placement}")
        ops = [
            _Op("poly", _transform(pts, placement), value)
            for pts, value in _shape(placement.class_index, self.rng)
        ]
        x0, y0, alpha = _rasterize(ops, 4 if placement.size < 24 else 2)
        full = np.asarray(alpha) >= 128
        ry, rx, ay, ax = self._clip(x0, y0, alpha)
        mask = full[ay, ax]
        bg = self.canvas[ry, rx][mask]
        bg_mean = bg.mean(axis=0) if len(bg) else np.full(3, 128, np.float32)
        if self.rng.random() < self.config.shadow_prob:
            self._shadow(x0, y0, alpha, placement.size)
        self._paint(x0, y0, alpha, placement.size, bg_mean)
        self.owner[ry, rx][mask] = len(self._pending) + 1
        self._pending.append((placement.class_index, ry.start, rx.start, int(full.sum()), mask))

    def add_distractor(self) -> None:
        """Draw one unlabelled distractor on top; it hides the objects under it."""
        ops, size = _distractor(self.rng, self.width, self.height)
        x0, y0, alpha = _rasterize(ops, 2)
        ry, rx, ay, ax = self._clip(x0, y0, alpha)
        mask = np.asarray(alpha)[ay, ax] >= 128
        bg = self.canvas[ry, rx][mask]
        bg_mean = bg.mean(axis=0) if len(bg) else np.full(3, 128, np.float32)
        self._paint(x0, y0, alpha, size, bg_mean)
        self.owner[ry, rx][mask] = 0

    def finish(self) -> SynthSample:
        """Apply the camera model, decide which labels survive occlusion, return the sample."""
        cfg = self.config
        image = _finish(self.rng, cfg, self.canvas)
        visible = np.bincount(self.owner.ravel(), minlength=len(self._pending) + 1)
        objects: list[ObjectRecord] = []
        annotations: list[Annotation] = []
        for k, (class_index, top, left, full_area, mask) in enumerate(self._pending):
            rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
            in_image, vis = int(mask.sum()), int(visible[k + 1])
            bbox = (0.0, 0.0, 0.0, 0.0)
            if in_image:  # pixel-edge box: first covered pixel to one past the last
                x, y, x2, y2 = (
                    cols[0] + left,
                    rows[0] + top,
                    cols[-1] + left + 1,
                    rows[-1] + top + 1,
                )
                bbox = (float(x), float(y), float(x2 - x), float(y2 - y))
            kept = (
                in_image > 0
                and vis >= cfg.min_visible_pixels
                and vis >= (1.0 - cfg.max_occlusion) * in_image
                and in_image >= cfg.min_in_image * full_area
            )
            objects.append(
                ObjectRecord(class_index, bbox, full_area, in_image, vis, kept, (left, top), mask)
            )
            if kept:
                annotations.append(Annotation(bbox, class_index + 1, float(vis)))
        return SynthSample(image, annotations, objects)


# --------------------------------------------------------------------------------- sampling


def _image_size(rng: Rng, cfg: SynthConfig) -> tuple[int, int]:
    ratio = float(cfg.aspect_ratios[rng.integers(len(cfg.aspect_ratios))])
    stretch = max(ratio, 1 / ratio)
    lo = min(cfg.max_side, cfg.min_side * stretch)
    long_side = rng.uniform(lo, cfg.max_side)
    short_side = max(cfg.min_side, round(long_side / stretch))
    long_px = round(long_side)
    return (long_px, short_side) if ratio >= 1 else (short_side, long_px)


def generate_sample(seed: int, index: int, config: SynthConfig | None = None) -> SynthSample:
    """Draw image ``index`` of the dataset with ``seed``; depends only on its arguments."""
    cfg = config or SynthConfig()
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be non-negative, got {seed}, {index}")
    rng = np.random.default_rng([seed, index])
    w, h = _image_size(rng, cfg)
    scene = Scene(w, h, cfg, rng)
    n_obj = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
    n_clutter = int(rng.poisson(cfg.clutter_mean))
    n_front = int(rng.binomial(n_clutter, cfg.foreground_clutter))
    for _ in range(n_clutter - n_front):
        scene.add_distractor()
    # foreground distractors are interleaved with the objects at random positions
    slots = np.sort(rng.integers(0, n_obj + 1, n_front))
    hi = math.log(max(cfg.min_object_size, cfg.max_object_frac * min(w, h)))
    lo, max_aspect = math.log(cfg.min_object_size), math.log(cfg.max_aspect)
    nxt = 0
    for i in range(n_obj + 1):
        while nxt < len(slots) and slots[nxt] == i:
            scene.add_distractor()
            nxt += 1
        if i == n_obj:
            break
        placement = Placement(
            class_index=int(rng.integers(len(CLASSES))),
            cx=rng.uniform(0, w),
            cy=rng.uniform(0, h),
            size=math.exp(rng.uniform(lo, hi)),
            aspect=math.exp(rng.uniform(-max_aspect, max_aspect)),
            angle=rng.uniform(0, 2 * math.pi),
        )
        scene.add_object(placement)
    return scene.finish()


def generate_image(
    seed: int, index: int, config: SynthConfig | None = None
) -> tuple[U8, list[Annotation]]:
    """Image ``index`` (H x W x 3 uint8 RGB) and its kept annotations.

    See :func:`generate_sample`; raises ValueError like it.
    """
    sample = generate_sample(seed, index, config)
    return sample.image, sample.annotations


def _write_one(task: tuple[int, int, SynthConfig, str]) -> tuple[int, int, str, list[Annotation]]:
    seed, index, cfg, images_dir = task
    image, annotations = generate_image(seed, index, cfg)
    name = f"{index:06d}.{cfg.image_format}"
    pil = Image.fromarray(image)
    if cfg.image_format == "jpg":
        pil.save(Path(images_dir) / name, quality=cfg.jpeg_quality)
    else:
        pil.save(Path(images_dir) / name, compress_level=1)
    return image.shape[1], image.shape[0], name, annotations


def generate_dataset(
    out_dir: str | os.PathLike[str],
    num_images: int,
    seed: int,
    config: SynthConfig | None = None,
    workers: int = 2,
) -> Path:
    """Write ``out_dir/images/NNNNNN.{jpg,png}`` and ``out_dir/annotations.json`` (COCO format,
    ``info`` holds the generator version, seed and config) and return the JSON's path.

    Images are drawn by ``workers`` spawned processes (1 = in this process); the output is
    byte-identical for any ``workers``. Existing files of the same names are overwritten, others
    are left alone. Raises ValueError for a negative ``num_images``/``seed`` or ``workers < 1``,
    OSError if the directory cannot be written.
    """
    cfg = config or SynthConfig()
    if num_images < 0 or seed < 0 or workers < 1:
        raise ValueError(
            f"need num_images >= 0, seed >= 0, workers >= 1; got {num_images}, {seed}, {workers}"
        )
    out = Path(out_dir)
    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    tasks = [(seed, i, cfg, str(images_dir)) for i in range(num_images)]
    results: Iterable[tuple[int, int, str, list[Annotation]]]
    if workers == 1 or num_images < 2:
        results = [_write_one(t) for t in tasks]
    else:
        # spawn, not fork: callers (training) may already run torch's threads
        ctx = multiprocessing.get_context("spawn")
        chunk = max(1, min(16, num_images // (4 * workers)))
        with ctx.Pool(min(workers, num_images)) as pool:
            results = pool.map(_write_one, tasks, chunksize=chunk)
    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []
    for image_id, (w, h, name, kept) in enumerate(results, start=1):
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for a in kept:
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": a.category_id,
                         "bbox": list(a.bbox), "area": a.area, "iscrowd": a.iscrowd})  # fmt: skip
    doc = {
        "info": {
            "description": "dlad synthetic shapes detection dataset (prep.data.synth)",
            "version": GENERATOR_VERSION,
            "seed": seed,
            "config": asdict(cfg),
        },
        "images": images,
        "annotations": anns,
        "categories": [
            {"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CLASSES)
        ],
    }
    path = out / "annotations.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    tmp.replace(path)
    return path
