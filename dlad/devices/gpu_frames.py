"""What every GPU engine takes: a batch of the DLA's own input frames.

The GPU executor pre-processes a frame once, to the bytes a DLA core reads (``DLA_HWC4`` int8,
``dlad.imaging.pre.quantize_hwc4``), whichever engine then runs it; so the emulated, torch and
TensorRT engines check a batch the same way (:func:`check_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlad.loadable import Loadable

__all__ = [
    "DeviceIoSizes",
    "check_batch",
    "chw16_image_bytes",
    "frame_shape",
]


def frame_shape(loadable: Loadable) -> tuple[int, int, int]:
    """One input frame's ``DLA_HWC4`` shape ``(H, W', C')`` (``W'`` the row pitch in pixels), as
    ``quantize_hwc4`` writes it for ``loadable``'s input."""
    _, h, w, c = loadable.inputs[0].buffer_shape
    return (h, w, c)


def chw16_image_bytes(c: int, h: int, w: int) -> int:
    """Bytes of one image of a ``c x h x w`` head in fp16 ``CHW16`` (``HeadSpec.nbytes``)."""
    return -(-c // 16) * h * w * 16 * 2


class DeviceIoSizes:
    """The sizes of an engine's device-side I/O (``DeviceIoEngine``), from its ``loadable``:
    the torch and TensorRT engines both keep int8 ``DLA_HWC4`` frames and fp16 ``CHW16`` heads
    on the device."""

    loadable: Loadable

    @property
    def frame_bytes(self) -> int:
        """Bytes of one ``DLA_HWC4`` int8 input frame (frame ``b`` at ``input_ptr + b *
        frame_bytes``)."""
        h, w, c = frame_shape(self.loadable)
        return h * w * c

    @property
    def head_image_bytes(self) -> tuple[int, ...]:
        """Bytes of one image of each ``CHW16`` head, in output order (``HeadSpec.nbytes``)."""
        return tuple(chw16_image_bytes(d.c, d.h, d.w) for d in self.loadable.outputs)


def check_batch(frames: Sequence[object], max_batch: int, shape: tuple[int, ...]) -> None:
    """Raise ValueError unless ``frames`` holds 1..``max_batch`` int8 arrays of ``shape``."""
    if not 1 <= len(frames) <= max_batch:
        raise ValueError(f"a batch holds 1..{max_batch} frames, got {len(frames)}")
    for i, f in enumerate(frames):
        if not isinstance(f, np.ndarray) or f.dtype != np.int8 or f.shape != shape:
            raise ValueError(
                f"frame {i} must be an int8 DLA_HWC4 array of shape {shape}, got "
                f"{getattr(f, 'dtype', type(f).__name__)} {getattr(f, 'shape', '')}"
            )
