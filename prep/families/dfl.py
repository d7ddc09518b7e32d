"""The DFL families' models (YOLOv8, YOLO11, YOLO26) from Ultralytics' own definitions.

The network is ``ultralytics.nn.tasks.DetectionModel`` built from the YAML the installed
``ultralytics`` package ships (``yolo11.yaml`` and its ``n``/``s``/... scales; nothing is
downloaded). :class:`RawHeads` runs its layers as ``DetectionModel`` does and ends each level at
the last convs of ``Detect``'s box and class branches, concatenated (``cv2[i]``, then ``cv3[i]``):
the DFL, ``dist2bbox``, the sigmoids and NMS are the post program's (``dlad.families.yolov8``),
because the DLA cannot run them as Ultralytics writes them (Reshape, Split and Softmax over a
non-channel axis, dynamic TopK). The module tree keeps Ultralytics' names (``model.0.conv``,
``model.23.cv2.0.2``), so its state dict is theirs key for key.

Ultralytics writes a settings file and checks the network when imported: this module points its
configuration at dlad's cache directory and turns both off first (``YOLO_OFFLINE``,
``YOLO_VERBOSE``). Its import also replaces PIL's ``Image.open`` process-wide (with one that tries
to install a HEIF plugin when an image cannot be read); this module puts PIL's own back.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image
from torch import nn


def _quiet_ultralytics() -> None:
    cache = Path(os.environ.get("DLAD_CACHE_DIR", Path.home() / ".cache" / "dlad"))
    os.environ.setdefault("YOLO_CONFIG_DIR", str(cache / "ultralytics"))
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_VERBOSE", "0")


_quiet_ultralytics()
_pil_open = Image.open
from ultralytics.nn.tasks import DetectionModel, yaml_model_load  # noqa: E402  # env first

Image.open = _pil_open  # Ultralytics' patch undone

__all__ = ["DflLoss", "ImportedDetector", "RawHeads", "build_model", "import_checkpoint"]

_DEFINITION = re.compile(r"(yolov8|yolo11|yolo26)([nslmx]?)\.yaml")


class RawHeads(nn.Module):
    """An Ultralytics detector whose ``forward`` returns the raw heads ``[N, 4 * bins + nc, H,
    W]``, one per stride: of its one-to-many branches (``cv2``, ``cv3``), or with ``one2one`` of
    YOLO26's one-to-one branches (``one2one_cv2``, ``one2one_cv3``: the NMS-free head). ``model``
    is the detector's layer list (its own ``model``), so every parameter keeps its Ultralytics
    name."""

    def __init__(self, detector: Any, *, one2one: bool = False) -> None:
        super().__init__()
        if one2one and getattr(detector.model[-1], "one2one_cv2", None) is None:
            raise ValueError("the detector has no one-to-one head")
        self.one2one = one2one
        self.model: nn.Sequential = detector.model
        self.save: list[int] = list(detector.save)
        self.yaml: dict[str, Any] = dict(detector.yaml)
        self.names: dict[int, str] = dict(getattr(detector, "names", {}))
        self.register_buffer("stride", detector.stride.clone().float(), persistent=False)
        self.stride: torch.Tensor
        detect = self.model[-1]
        self.nc, self.bins = int(detect.nc), int(detect.reg_max)
        self.num_classes, self.variant = self.nc, str(self.yaml.get("scale", ""))
        self.family = f"{self.yaml_family()}{'_one2one' if one2one else ''}"
        # Ultralytics' default loss gains (its cfg/default.yaml), read by its loss
        self.args = SimpleNamespace(box=7.5, cls=0.5, dfl=1.5)

    def yaml_family(self) -> str:
        """The family of the definition this model was built from (``yolo11``, ...)."""
        found = _DEFINITION.fullmatch(Path(str(self.yaml.get("yaml_file", ""))).name)
        return found[1] if found else "unknown"

    @property
    def detect(self) -> Any:
        """The ``Detect`` layer (its box and class branches are what the heads end with)."""
        return self.model[-1]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs: list[Any] = []
        y: Any = x
        layers: list[Any] = list(self.model)
        for m in layers[:-1]:
            if m.f != -1:
                y = outputs[m.f] if isinstance(m.f, int) else [
                    y if j == -1 else outputs[j] for j in m.f
                ]  # fmt: skip
            y = m(y)
            outputs.append(y if m.i in self.save else None)
        detect = self.detect
        feats = [y if j == -1 else outputs[j] for j in detect.f]
        box, cls = (
            (detect.one2one_cv2, detect.one2one_cv3) if self.one2one else (detect.cv2, detect.cv3)
        )
        return tuple(torch.cat((box[i](f), cls[i](f)), 1) for i, f in enumerate(feats))

    def head_convs(self) -> list[str]:
        """The convs whose outputs make the heads: per stride, the box branch's last conv, then
        the class branch's (the branches :meth:`forward` runs)."""
        last = len(self.model) - 1
        box, cls = ("one2one_cv2", "one2one_cv3") if self.one2one else ("cv2", "cv3")
        return [
            f"model.{last}.{branch}.{i}.2"
            for i in range(len(self.detect.f))
            for branch in (box, cls)
        ]  # fmt: skip

    def distill_layers(self) -> list[int]:
        """The layers whose outputs QAT's feature distillation matches: every one a later layer
        reads (the backbone stages, the neck and the heads' inputs)."""
        return sorted({*self.save, *self.detect.f} - {len(self.model) - 1})

    def fuse(self) -> RawHeads:
        """Put the model in its deployable form, in place; returns ``self``. The function is
        unchanged (to float rounding); the layers become the DLA's:

        * every BatchNorm folds into its conv (Ultralytics' ``fuse_conv_and_bn``);
        * attention becomes :class:`prep.families.dla_attention.DlaAttention`;
        * C2f / C3k2 split their first conv's output with ``split`` of static sizes (the
          exporter then writes one ``Split``, not shape arithmetic: Ultralytics' own export
          does the same);
        * residual additions (``Bottleneck``, ``PSABlock``, a shortcut ``SPPF``) and the neck's
          concatenations become ``prep.model.Add`` / ``Concat`` modules, so QAT quantizes and
          shares their inputs' scale as it does YOLOv5's.

        The Detect layer's unused branches (the DFL conv; YOLO26's other head) stay, unused,
        so the state dict keeps Ultralytics' keys.
        """
        from ultralytics.nn.modules import C2f, Concat, Conv, DWConv
        from ultralytics.nn.modules.block import SPPF, Bottleneck, PSABlock
        from ultralytics.utils.torch_utils import fuse_conv_and_bn

        from prep import model as yolov5
        from prep.families.dla_attention import dla_legal_inplace

        dla_legal_inplace(self)
        for m in list(self.modules()):
            if isinstance(m, Conv | DWConv) and hasattr(m, "bn"):
                m.conv = fuse_conv_and_bn(m.conv, m.bn)
                delattr(m, "bn")
                m.forward = m.forward_fuse  # type: ignore[method-assign]
                if isinstance(m.act, nn.SiLU):  # Ultralytics shares one: QAT quantizes each
                    m.act = nn.SiLU()
            for name, child in list(m.named_children()):
                if (
                    isinstance(child, nn.Sequential)
                    and len(child) == 2
                    and isinstance(child[0], nn.Conv2d)
                    and isinstance(child[1], nn.BatchNorm2d)
                ):
                    setattr(m, name, fuse_conv_and_bn(child[0], child[1]))
            if isinstance(m, C2f):
                m.forward = m.forward_split  # type: ignore[method-assign]
            residual = {Bottleneck: _bottleneck, PSABlock: _psa_block, SPPF: _sppf}
            if type(m) in residual and getattr(m, "add", False):
                m.addop = yolov5.Add()
                if type(m) is PSABlock:
                    m.addop2 = yolov5.Add()
                m.forward = types.MethodType(residual[type(m)], m)
        for i, layer in enumerate(self.model):
            if isinstance(layer, Concat):
                concat = yolov5.Concat(layer.d)
                concat.f, concat.i = layer.f, layer.i
                self.model[i] = concat
        return self


# Ultralytics' forwards of its blocks with a residual addition (``add`` set), the addition an
# ``Add`` module (``addop``, then ``addop2``).
def _bottleneck(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.addop(x, self.cv2(self.cv1(x)))


def _psa_block(self: Any, x: torch.Tensor) -> torch.Tensor:
    x = self.addop(x, self.attn(x))
    return self.addop2(x, self.ffn(x))


def _sppf(self: Any, x: torch.Tensor) -> torch.Tensor:
    y = [self.cv1(x)]
    y.extend(self.m(y[-1]) for _ in range(getattr(self, "n", 3)))
    return self.addop(self.cv2(torch.cat(y, 1)), x)


def build_model(family: str, variant: str, num_classes: int) -> RawHeads:
    """A new ``family`` detector of size ``variant`` (random weights, FP32) with raw heads
    (``yolo26_one2one``: YOLO26's, of its one-to-one head). Raises ValueError for a size the
    family's YAML does not have."""
    family, one2one = family.removesuffix("_one2one"), family.endswith("_one2one")
    sizes = yaml_model_load(f"{family}.yaml").get("scales", {})
    if variant not in sizes:
        raise ValueError(f"{family} has no size {variant!r} (it has: {', '.join(sizes)})")
    detector: Any = DetectionModel(f"{family}{variant}.yaml", nc=num_classes, verbose=False)
    return RawHeads(detector.float(), one2one=one2one)


@dataclass(frozen=True)
class ImportedDetector:
    """A user's Ultralytics checkpoint as prep's model: ``model`` (FP32, eval mode, raw heads),
    its ``family`` and size ``variant``, its ``class_names`` (the checkpoint's, else the class
    indices as text) and which entry it came from (``source``: ``ema`` or ``model``)."""

    model: RawHeads
    family: str
    variant: str
    class_names: tuple[str, ...]
    source: str


def import_checkpoint(path: str | os.PathLike[str], *, one2one: bool = False) -> ImportedDetector:
    """Import an Ultralytics YOLOv8 / YOLO11 / YOLO26 detector checkpoint exactly: the weights
    load, key for key and shape for shape, into the model of the package's own definition, and
    nothing in the file runs (``prep.ultralytics.read_checkpoint``). ``one2one``: a YOLO26's
    NMS-free head (family ``yolo26_one2one``) instead of its one-to-many head.

    Raises CheckpointError: unreadable; a bare state dict (it does not say which model it is);
    not a P3-P5 detector of these families; ``one2one`` for a model without that head; an
    architecture other than the package's YAML; keys or shapes that differ (listed)."""
    from prep.ultralytics import CheckpointError, checkpoint_names, conform_state, read_checkpoint

    raw, source, module = read_checkpoint(path)
    cfg = None if module is None else vars(module).get("yaml")
    if not isinstance(cfg, dict):
        raise CheckpointError(
            f"{path}: no model definition in the checkpoint (a bare state dict does not say "
            "which model it is): give the .pt Ultralytics writes (training, or YOLO(...).save())"
        )
    found = _DEFINITION.fullmatch(Path(str(cfg.get("yaml_file", ""))).name)
    if found is None:
        raise CheckpointError(
            f"{path}: a model of {cfg.get('yaml_file')!r}, not a YOLOv8, YOLO11 or YOLO26 "
            "detector (P3-P5)"
        )
    family, variant = found[1], str(cfg.get("scale") or found[2])
    nc = cfg.get("nc")
    if not isinstance(nc, int) or isinstance(nc, bool) or nc < 1:
        raise CheckpointError(f"{path}: the definition's class count is {nc!r}")
    package = yaml_model_load(f"{family}.yaml")
    if cfg.get("backbone") != package["backbone"] or cfg.get("head") != package["head"]:
        raise CheckpointError(
            f"{path}: its layers differ from ultralytics' {family}.yaml (a modified "
            "architecture is not imported)"
        )
    if one2one and family != "yolo26":
        raise CheckpointError(f"{path}: a {family} has no one-to-one (NMS-free) head")
    family = f"{family}_one2one" if one2one else family
    model = build_model(family, variant, nc)
    reference = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    model.load_state_dict(conform_state(raw, reference, f"{family}{variant}"), strict=True)
    names = checkpoint_names(module, nc) or [str(i) for i in range(nc)]
    return ImportedDetector(model.eval(), family, variant, tuple(names), source)


class DflLoss:
    """Ultralytics' own detection loss (``v8DetectionLoss``: task-aligned assignment, CIoU and
    DFL box loss, BCE classes, its default gains) on the raw heads of a :class:`RawHeads`, with
    prep's targets ``[T, 6]`` (image, class, cx, cy, w, h normalised). A YOLO26 model trains
    the head it serves: the one-to-many head with the top 10 anchors of a target, the one-to-one
    head (``yolo26_one2one``) with one anchor a target (the top 7, then 1: ``E2ELoss``'s
    assignment for it), which is what makes its detections NMS-free."""

    def __init__(self, model: RawHeads) -> None:
        from ultralytics.utils.loss import v8DetectionLoss

        self.bins, self.nc = model.bins, model.nc
        # box (CIoU), classes (BCE), then DFL, or L1 on the distances without bins (YOLO26)
        self.part_names = ("box", "cls", "dfl" if model.bins > 1 else "l1")
        topk = {"tal_topk": 7, "tal_topk2": 1} if model.one2one else {"tal_topk": 10}
        self._loss: Any = v8DetectionLoss(model, **topk)

    def __call__(
        self, heads: Sequence[torch.Tensor], targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, split = heads[0].shape[0], 4 * self.bins
        preds: dict[str, Any] = {
            "boxes": torch.cat([h[:, :split].reshape(n, split, -1) for h in heads], 2),
            "scores": torch.cat([h[:, split:].reshape(n, self.nc, -1) for h in heads], 2),
            "feats": list(heads),
        }
        batch = {"batch_idx": targets[:, 0], "cls": targets[:, 1:2], "bboxes": targets[:, 2:6]}
        loss, parts = self._loss(preds, batch)  # parts: {name: value}, in box, cls, dfl order
        return loss.sum(), torch.stack([torch.as_tensor(v).detach() for v in parts.values()])
