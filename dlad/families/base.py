"""The parts every model family is made of (``dlad.families`` has the registry)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from dlad.imaging.pre import Letterbox
    from dlad.loadable import Loadable

__all__ = ["Family", "Heads", "HeadsModel", "PostProcess", "PostProgram", "UnknownFamilyError"]

Heads = Sequence[npt.NDArray[np.floating]]


class HeadsModel(Protocol):
    """What a decode reads of a model: a :class:`~dlad.loadable.Loadable`, or prep's
    ``ModelInfo`` before the loadable exists."""

    @property
    def num_classes(self) -> int: ...
    @property
    def anchors_px(self) -> tuple[tuple[tuple[float, float], ...], ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...


class PostProcess(Protocol):
    """The numpy decode + NMS of one image's heads (``multi_label``: every class above the
    threshold a candidate, as mAP is measured; the daemon serves the best class a cell)."""

    def __call__(
        self,
        heads: Heads,
        model: HeadsModel,
        letterbox: Letterbox,
        *,
        conf: float,
        iou: float,
        max_det: int,
        multi_label: bool = False,
    ) -> npt.NDArray[np.float32]: ...


class UnknownFamilyError(ValueError):
    """A loadable names a model family this dlad does not have."""


@dataclass(frozen=True, slots=True)
class PostProgram:
    """One model's GPU post-processing: its family's decode kernel and the head parameters it
    reads (``dlad.gpu.prepost.PostParams``); selection, NMS and back-projection follow.

    Attributes:
        kernel: the family's decode kernel (``extern "C"`` in its ``.cu``).
        nc: classes.
        per_cell: decode threads per head cell (anchors per cell; 1 for anchor-free heads).
        anchors: ``(levels, per_cell, 2)`` anchor sizes in input pixels, or None.
        bins: distribution bins per box side (DFL), 0 where the family has none.
        end2end: a one-to-one head (YOLO26's NMS-free one): every class of every cell is a
            candidate and the best ``max_det`` are the detections, without NMS.
    """

    kernel: str
    nc: int
    per_cell: int = 1
    anchors: npt.NDArray[np.float32] | None = None
    bins: int = 0
    end2end: bool = False


@dataclass(frozen=True)
class Family:
    """One model family (``dlad.families``).

    Attributes:
        name: what loadables call it.
        check_heads: raises ValueError unless a loadable's heads are this family's.
        postprocess: the numpy decode + NMS, ``N x 6`` float32 ``x1 y1 x2 y2 score class`` in
            the original image's pixels.
        cuda_program: the model's :class:`PostProgram`, or None where the family has no CUDA
            decode (an executor then post-processes on the CPU even where a GPU is present).
        cuda_source: the ``.cu`` file holding its decode kernels.
        cuda_kernels: their names.
        end2end: its heads are one-to-one (NMS-free): its decode keeps the best ``max_det``
            candidates without NMS.
    """

    name: str
    check_heads: Callable[[Loadable], None]
    postprocess: PostProcess
    cuda_program: Callable[[Loadable], PostProgram] | None = None
    cuda_source: Path | None = None
    cuda_kernels: tuple[str, ...] = ()
    end2end: bool = False

    @property
    def cuda(self) -> bool:
        """Whether the GPU chain can post-process this family."""
        return self.cuda_program is not None
