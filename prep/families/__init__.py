"""prep's side of the model families (``dlad.families`` is the serving side): per family, the
PyTorch model whose ``forward`` returns the raw heads the DLA graph ends at, registered under
the name its loadables carry.

========  =====================================================  ================================
family    model definition                                       heads (per stride 8 / 16 / 32)
========  =====================================================  ================================
yolov5    ``prep.model.YOLOv5`` (v7.0 layout, written here)      ``na * (5 + nc)`` logits
yolov8    Ultralytics' ``yolov8.yaml`` (``prep.families.dfl``)   ``4 * 16`` box bins + ``nc``
yolo11    Ultralytics' ``yolo11.yaml``                           ``4 * 16`` box bins + ``nc``
yolo26    Ultralytics' ``yolo26.yaml`` (one-to-many head)        4 distances + ``nc``
yolo26_   the same model, its one-to-one (NMS-free) head         4 distances + ``nc``
one2one
========  =====================================================  ================================
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "PREP_FAMILIES", "Criterion", "Imported", "PrepFamily", "import_checkpoint", "prep_family",
]  # fmt: skip


class Criterion(Protocol):
    """A family's training loss: ``(raw heads, targets [T, 6] (image, class, cx, cy, w, h)
    normalised)`` → the loss summed over the batch and its three parts (detached), named by
    ``part_names``."""

    part_names: tuple[str, str, str]

    def __call__(
        self, heads: Sequence[torch.Tensor], targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class PrepFamily:
    """One model family's PyTorch side.

    Attributes:
        name: the family, as ``dlad.families`` and the loadables name it.
        variants: the sizes it comes in (``n``, ``s``, ...).
        build: ``(variant, num_classes)`` → a new FP32 model (random weights) whose ``forward``
            returns the raw heads, one tensor per stride, and whose ``family`` is ``name``.
        loss: ``(model, image_size)`` → its training :class:`Criterion`.
    """

    name: str
    variants: tuple[str, ...]
    build: Callable[[str, int], nn.Module]
    loss: Callable[[nn.Module, int], Criterion]


def _yolov5(variant: str, num_classes: int) -> nn.Module:
    from prep.model import YOLOv5  # torch is imported on use

    return YOLOv5(variant, num_classes)


def _yolov5_loss(model: nn.Module, image_size: int) -> Criterion:
    from prep.loss import YoloLoss

    yolov5: Any = model
    return YoloLoss(yolov5.detect.anchors, int(yolov5.num_classes), image_size)


def _dfl(name: str) -> Callable[[str, int], nn.Module]:
    def build(variant: str, num_classes: int) -> nn.Module:
        from prep.families.dfl import build_model  # needs ultralytics

        return build_model(name, variant, num_classes)

    return build


def _dfl_loss(model: nn.Module, image_size: int) -> Criterion:
    from prep.families.dfl import DflLoss, RawHeads

    if not isinstance(model, RawHeads):
        raise TypeError(f"a DFL family's loss takes its RawHeads, not a {type(model).__name__}")
    return DflLoss(model)


_SIZES: Final = ("n", "s", "m", "l", "x")
PREP_FAMILIES: Final[dict[str, PrepFamily]] = {
    f.name: f
    for f in (
        PrepFamily("yolov5", _SIZES, _yolov5, _yolov5_loss),
        PrepFamily("yolov8", _SIZES, _dfl("yolov8"), _dfl_loss),
        PrepFamily("yolo11", _SIZES, _dfl("yolo11"), _dfl_loss),
        PrepFamily("yolo26", _SIZES, _dfl("yolo26"), _dfl_loss),
        PrepFamily("yolo26_one2one", _SIZES, _dfl("yolo26_one2one"), _dfl_loss),
    )
}
"""Every family prep builds, by name (the same names as ``dlad.families.FAMILIES``)."""


def prep_family(name: str) -> PrepFamily:
    """The family called ``name``. Raises ValueError naming the ones there are."""
    try:
        return PREP_FAMILIES[name]
    except KeyError:
        known = ", ".join(PREP_FAMILIES)
        raise ValueError(f"prep has no model family {name!r} (it has: {known})") from None


@dataclass(frozen=True)
class Imported:
    """A user's Ultralytics checkpoint as prep's model of its family (FP32, eval mode)."""

    model: nn.Module
    family: str
    variant: str
    class_names: tuple[str, ...]


def import_checkpoint(path: str | os.PathLike[str], *, one2one: bool = False) -> Imported:
    """Import an Ultralytics checkpoint of any family prep has: YOLOv8, YOLO11 and YOLO26 by
    the definition it carries (``prep.families.dfl.import_checkpoint``), YOLOv5 v7.0 (and bare
    YOLOv5 state dicts) by its layers (``prep.ultralytics``). Nothing in the file runs.
    ``one2one``: a YOLO26's NMS-free head. Raises ``prep.ultralytics.CheckpointError`` naming
    what does not fit."""
    from prep.ultralytics import (  # torch is imported on use
        CheckpointError,
        load_into_model,
        load_ultralytics_state_dict,
        read_checkpoint,
    )  # fmt: skip

    _, _, module = read_checkpoint(path)
    cfg = None if module is None else vars(module).get("yaml")
    definition = str(cfg.get("yaml_file", "")) if isinstance(cfg, dict) else ""
    if os.path.basename(definition).startswith(("yolov8", "yolo11", "yolo26")):
        from prep.families import dfl  # needs ultralytics

        d = dfl.import_checkpoint(path, one2one=one2one)
        return Imported(d.model, d.family, d.variant, d.class_names)
    if one2one:
        raise CheckpointError(f"{path}: a YOLOv5 has no one-to-one (NMS-free) head")
    ckpt = load_ultralytics_state_dict(path)
    names = ckpt.names or [str(i) for i in range(ckpt.num_classes)]
    return Imported(load_into_model(ckpt), "yolov5", ckpt.variant, tuple(names))
