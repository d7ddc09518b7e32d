"""Decoders: a model family's post-processing, chosen by the name its loadable carries.

A loadable names its decoder (``Loadable.decoder``; ``yolov5`` for every model so far, and for
loadables of format version 1, which did not name one). An executor takes the decoder its
loadable names: the numpy reference here, and the CUDA kernels of ``dlad/gpu`` where the decoder
says it has them. So a new model family touches prep (the model and its export), a decoder, and
nothing in the scheduler, the frontend or the executors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from dlad.imaging.post import postprocess
from dlad.imaging.pre import Letterbox
from dlad.loadable import Loadable

__all__ = ["DECODERS", "Decoder", "UnknownDecoderError", "decoder_for"]

Heads = Sequence[npt.NDArray[np.floating]]


class PostProcess(Protocol):
    def __call__(
        self,
        heads: Heads,
        loadable: Loadable,
        letterbox: Letterbox,
        *,
        conf: float,
        iou: float,
        max_det: int,
    ) -> npt.NDArray[np.float32]: ...


class UnknownDecoderError(ValueError):
    """A loadable names a decoder this dlad does not have."""


@dataclass(frozen=True)
class Decoder:
    """One model family's post-processing.

    Attributes:
        name: what loadables call it.
        postprocess: ``(heads, loadable, letterbox, *, conf, iou, max_det)`` → ``N x 6`` float32
            ``x1 y1 x2 y2 score class`` in the original image's pixels (numpy).
        cuda: whether ``dlad/gpu``'s post-processing kernels implement it (else an executor
            post-processes on the CPU even where a GPU is present).
    """

    name: str
    postprocess: PostProcess
    cuda: bool


def _yolov5(
    heads: Heads,
    loadable: Loadable,
    letterbox: Letterbox,
    *,
    conf: float,
    iou: float,
    max_det: int,
) -> npt.NDArray[np.float32]:
    return postprocess(
        heads,
        np.asarray(loadable.anchors_px, np.float32),
        loadable.strides,
        letterbox,
        conf_threshold=conf,
        iou_threshold=iou,
        max_det=max_det,
    )


DECODERS: Final[dict[str, Decoder]] = {"yolov5": Decoder("yolov5", _yolov5, cuda=True)}
"""Every decoder this dlad has, by name."""


def decoder_for(name: str) -> Decoder:
    """The decoder called ``name``. Raises UnknownDecoderError naming the ones there are."""
    try:
        return DECODERS[name]
    except KeyError:
        known = ", ".join(sorted(DECODERS))
        raise UnknownDecoderError(f"no decoder {name!r} in this dlad (it has: {known})") from None
