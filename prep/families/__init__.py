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
========  =====================================================  ================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PREP_FAMILIES", "PrepFamily", "prep_family"]


@dataclass(frozen=True)
class PrepFamily:
    """One model family's PyTorch side.

    Attributes:
        name: the family, as ``dlad.families`` and the loadables name it.
        variants: the sizes it comes in (``n``, ``s``, ...).
        build: ``(variant, num_classes)`` → a new FP32 model (random weights) whose ``forward``
            returns the raw heads, one tensor per stride.
    """

    name: str
    variants: tuple[str, ...]
    build: Callable[[str, int], nn.Module]


def _yolov5(variant: str, num_classes: int) -> nn.Module:
    from prep.model import YOLOv5  # torch is imported on use

    return YOLOv5(variant, num_classes)


def _dfl(name: str) -> Callable[[str, int], nn.Module]:
    def build(variant: str, num_classes: int) -> nn.Module:
        from prep.families.dfl import build_model  # needs ultralytics

        return build_model(name, variant, num_classes)

    return build


_SIZES: Final = ("n", "s", "m", "l", "x")
PREP_FAMILIES: Final[dict[str, PrepFamily]] = {
    f.name: f
    for f in (
        PrepFamily("yolov5", _SIZES, _yolov5),
        PrepFamily("yolov8", _SIZES, _dfl("yolov8")),
        PrepFamily("yolo11", _SIZES, _dfl("yolo11")),
        PrepFamily("yolo26", _SIZES, _dfl("yolo26")),
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
