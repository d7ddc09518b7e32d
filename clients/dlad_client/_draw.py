"""Detections drawn on an image (:meth:`dlad_client.Result.draw`), with Pillow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw, ImageFont

__all__ = ["draw_detections"]

# One colour a class, cycling (RGB): distinct hues that read on light and dark scenes.
PALETTE: Final = (
    (255, 56, 56), (255, 157, 151), (255, 112, 31), (255, 178, 29), (207, 210, 49),
    (72, 249, 10), (146, 204, 23), (61, 219, 134), (26, 147, 52), (0, 212, 187),
    (44, 153, 168), (0, 194, 255), (52, 69, 147), (100, 115, 255), (0, 24, 236),
    (132, 56, 255), (82, 0, 133), (203, 56, 255), (255, 149, 200), (255, 55, 199),
)  # fmt: skip


def draw_detections(
    image: npt.NDArray[np.uint8],
    detections: npt.NDArray[np.float32],
    labels: Sequence[str],
    *,
    bgr: bool = False,
    line_width: int | None = None,
) -> npt.NDArray[np.uint8]:
    """A copy of ``image`` (``H x W x 3`` RGB, or BGR with ``bgr``; ``H x W`` or ``H x W x 1``
    gray, drawn on as RGB) with each detection's box and ``label score`` in its class's
    colour. Raises ValueError for another shape or dtype."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:  # type: ignore[redundant-expr]
        raise ValueError(f"image must be a uint8 numpy array, got {getattr(image, 'dtype', image)}")
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    if image.ndim == 2:
        rgb = np.repeat(image[:, :, None], 3, axis=2)
    elif image.ndim == 3 and image.shape[2] == 3:
        rgb = image[:, :, ::-1] if bgr else image
    else:
        raise ValueError(f"image must be H x W x 3 or gray (H x W), got shape {image.shape}")
    canvas = Image.fromarray(np.ascontiguousarray(rgb))
    pen = ImageDraw.Draw(canvas)
    width = line_width or max(1, round(0.002 * (canvas.width + canvas.height)))
    font = ImageFont.load_default()
    for (x1, y1, x2, y2, score, cls), label in zip(detections.tolist(), labels, strict=True):
        colour = PALETTE[int(cls) % len(PALETTE)]
        pen.rectangle((x1, y1, x2, y2), outline=colour, width=width)
        text = f"{label} {score:.2f}"
        left, top, right, bottom = pen.textbbox((x1, y1), text, font=font)
        lift = bottom - top + 2
        y = y1 - lift if y1 - lift >= 0 else y1  # above the box, else inside its top
        pen.rectangle((x1, y, x1 + right - left + 4, y + lift), fill=colour)
        pen.text((x1 + 2, y + 1), text, fill=(255, 255, 255), font=font)
    out = np.asarray(canvas)
    return np.ascontiguousarray(out[:, :, ::-1]) if bgr and image.ndim == 3 else out
