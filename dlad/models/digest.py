"""A fingerprint of the emulated INT8 core's integers on a model's images (``heads_sha256``)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from dlad.devices.int8_engine import engine_for_loadable
from dlad.devices.int8_layout import OperandsChoice
from dlad.imaging.pre import letterbox, quantize_hwc4
from dlad.loadable import read_loadable

__all__ = ["heads_sha256"]


def heads_sha256(
    loadable_path: Path, images: Iterable[Path], *, operands: OperandsChoice = "auto"
) -> str:
    """SHA-256 of the emulated INT8 core's output buffers (their bytes, in order) for each
    image of ``images`` in turn, letterboxed and quantised as the daemon does: a fingerprint of
    the core's integers, the same on every host (``prep bundle`` records it for the bundled
    images). ``operands`` as ``Int8Engine`` takes it.

    Raises ``LoadableError``/``OSError`` for a bad loadable, ``Int8EngineError`` for an engine
    that cannot be built, PIL's errors for a file that is not an image.
    """
    loadable = read_loadable(loadable_path)
    engine = engine_for_loadable(loadable, operands=operands)
    digest = hashlib.sha256()
    for path in images:
        rgb = np.asarray(Image.open(path).convert("RGB"))
        canvas, _ = letterbox(rgb, loadable.image_size[0])
        for buf in engine.run(quantize_hwc4(canvas, loadable.input_scale)):
            digest.update(buf.tobytes())
    return digest.hexdigest()
