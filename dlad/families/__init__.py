"""Model families: what one detector architecture's heads are and how they become detections.

A loadable names its family (``Loadable.family``). The family's module owns everything that
depends on it on the serving side:

- ``check_heads(loadable)``: the head geometry the loadable must have (channels per level, the
  anchors it needs), raised as ValueError when :class:`~dlad.loadable.Loadable` is built;
- ``postprocess(heads, loadable, letterbox, *, conf, iou, max_det)``: decode + NMS in numpy, the
  reference every other path is tested against and the CPU path itself;
- its CUDA decode kernel (a ``.cu`` file beside the module, compiled with ``dlad/gpu/kernels.cu``)
  and ``cuda_program(loadable)``, the :class:`PostProgram` that selects and parameterises it.
  Candidate selection, NMS and back-projection after the decode are the same kernels for every
  family, so the GPU chain (the Python pipelines and the C++ data plane's captured graphs alike)
  runs any family through one program.

Adding a family is one module here (and its ``.cu``), its entry in :data:`FAMILIES`, and prep's
model definition registered under the same name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Final

from dlad.families import yolov5, yolov8
from dlad.families.base import Family, PostProcess, PostProgram, UnknownFamilyError

if TYPE_CHECKING:
    from dlad.loadable import Loadable

__all__ = [
    "FAMILIES", "Family", "PostProcess", "PostProgram", "UnknownFamilyError", "cuda_kernels",
    "cuda_sources", "family_for", "post_program",
]  # fmt: skip

FAMILIES: Final[dict[str, Family]] = {f.name: f for f in (yolov5.FAMILY, *yolov8.FAMILIES)}
"""Every model family this dlad has, by name."""


def family_for(name: str) -> Family:
    """The family called ``name``. Raises UnknownFamilyError naming the ones there are."""
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise UnknownFamilyError(
            f"no model family {name!r} in this dlad (it has: {known})"
        ) from None


def post_program(loadable: Loadable) -> PostProgram:
    """The GPU post program of ``loadable``'s model. Raises UnknownFamilyError, or ValueError
    where its family has no CUDA decode."""
    family = family_for(loadable.family)
    if family.cuda_program is None:
        raise ValueError(f"model family {family.name!r} has no CUDA decode")
    return family.cuda_program(loadable)


def cuda_sources() -> list[Path]:
    """The families' ``.cu`` files, in name order (compiled after ``dlad/gpu/kernels.cu``)."""
    return sorted({f.cuda_source for f in FAMILIES.values() if f.cuda_source is not None})


def cuda_kernels() -> list[str]:
    """The families' decode kernels."""
    return sorted({k for f in FAMILIES.values() for k in f.cuda_kernels})
