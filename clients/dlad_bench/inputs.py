"""The frames dlad-bench sends: the demo images, generated frames of any size, or a directory.

Every source gives a list of ``H x W x 3`` uint8 RGB arrays, C-contiguous and read-only (the SDK
sends them without copies, so nothing may write into one while a request is in flight); the
runner cycles through them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from dlad.models import DEMO

__all__ = ["IMAGE_SUFFIXES", "directory_frames", "generated_frames", "load_frames"]

Frame = npt.NDArray[np.uint8]
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")
_GENERATED = re.compile(r"(?:random|generated):(\d+)x(\d+)")


def _frozen(image: npt.NDArray[np.uint8]) -> Frame:
    out = np.ascontiguousarray(image, dtype=np.uint8)
    out.flags.writeable = False
    return out


def directory_frames(path: Path) -> list[Frame]:
    """Every image file (by suffix, sorted by name) in ``path``, as RGB.

    Raises FileNotFoundError when ``path`` is not a directory, ValueError when it holds no
    image or a file that does not decode.
    """
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"{path}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    return [_read(file) for file in files]


def _read(file: Path) -> Frame:
    try:
        with Image.open(file) as img:
            return _frozen(np.asarray(img.convert("RGB")))
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{file}: not a readable image ({exc})") from None


def generated_frames(width: int, height: int, count: int = 4, seed: int = 0) -> list[Frame]:
    """``count`` random RGB frames of ``width x height``. Raises ValueError on a size < 1."""
    if width < 1 or height < 1 or count < 1:
        raise ValueError(f"need width, height and count >= 1, got {width}x{height} x {count}")
    rng = np.random.default_rng(seed)
    return [_frozen(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]


def load_frames(spec: str, seed: int = 0) -> list[Frame]:
    """``demo`` (the bundled demo images), ``random:WxH`` (generated frames), or a directory.

    Raises ValueError (or FileNotFoundError) with the reason when ``spec`` names nothing usable.
    """
    if spec == "demo":
        return directory_frames(DEMO / "images")
    match = _GENERATED.fullmatch(spec)
    if match:
        return generated_frames(int(match[1]), int(match[2]), seed=seed)
    if spec.startswith(("random:", "generated:")):
        raise ValueError(f"{spec!r}: generated frames are random:WIDTHxHEIGHT, e.g. random:640x480")
    return directory_frames(Path(spec))
