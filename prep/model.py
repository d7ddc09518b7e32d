"""The YOLOv5 family (v7.0 layout), written here, with raw head outputs.

The module tree mirrors Ultralytics YOLOv5 v7.0 exactly (``model.0.conv``, ``model.2.m.0.cv1``,
``model.24.m.1`` ...), so

- an Ultralytics checkpoint's state dict loads by name (``prep.ultralytics``), and
- the ONNX exporter names nodes and tensors as it does for an Ultralytics model
  (``/model.0/conv/Conv_output_0``, ``/model.0/act/Mul_output_0``), which is what the Q/DQ
  translator's scales and TensorRT's calibration cache are keyed by.

``forward`` returns the three raw head tensors ``[N, 3*(5+nc), H/s, W/s]`` for strides 8/16/32,
as the cuDLA sample's ``--noanchor`` export does: decoding (sigmoid, grid, anchors) is
post-processing (``dlad.imaging.post``), because the DLA cannot run it.

Residual additions and concatenations are modules (:class:`Add`, :class:`Concat`) rather than
inline operators so that QAT can attach quantizers to their inputs and share them (see
``prep.qat``); in float mode they are exactly ``a + b`` and ``torch.cat``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

#: Standard YOLOv5 anchors (w, h) in input pixels, one row per level (strides 8, 16, 32).
ANCHORS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((10, 13), (16, 30), (33, 23)),
    ((30, 61), (62, 45), (59, 119)),
    ((116, 90), (156, 198), (373, 326)),
)
STRIDES: tuple[int, int, int] = (8, 16, 32)


@dataclass(frozen=True)
class Variant:
    """Depth and width multiples of one YOLOv5 size."""

    name: str
    depth: float
    width: float


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("n", 0.33, 0.25),
        Variant("s", 0.33, 0.50),
        Variant("m", 0.67, 0.75),
        Variant("l", 1.00, 1.00),
        Variant("x", 1.33, 1.25),
    )
}


def _channels(c: int, width: float) -> int:
    """Channels after the width multiple, rounded up to a multiple of 8 (as YOLOv5 does)."""
    return math.ceil(c * width / 8) * 8


def _repeats(n: int, depth: float) -> int:
    return max(round(n * depth), 1) if n > 1 else n


class Conv(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU; after :meth:`fuse` the BN is folded into conv."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, p: int | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2 if p is None else p, bias=False)
        self.bn: nn.Module = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))

    @torch.no_grad()
    def fuse(self) -> None:
        """Fold the BatchNorm into the convolution (exact in eval mode); idempotent."""
        bn = self.bn
        if not isinstance(bn, nn.BatchNorm2d):
            return
        conv = self.conv
        # BatchNorm2d with track_running_stats (the default used here) always has both.
        assert bn.running_var is not None
        assert bn.running_mean is not None
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight / std
        fused = nn.Conv2d(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,  # type: ignore[arg-type]
            conv.stride,  # type: ignore[arg-type]
            conv.padding,  # type: ignore[arg-type]
            bias=True,
        ).to(conv.weight.device)
        fused.weight.copy_(conv.weight * gamma.reshape(-1, 1, 1, 1))
        prior_bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        assert fused.bias is not None  # built with bias=True
        fused.bias.copy_(bn.bias + (prior_bias - bn.running_mean) * gamma)
        self.conv = fused
        self.bn = nn.Identity()


class Add(nn.Module):
    """Residual addition as a module, so QAT can quantize (and share) its inputs' scale."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Concat(nn.Module):
    """Channel concatenation as a module, so QAT can quantize its inputs."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.d = dim

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs, self.d)


class Bottleneck(nn.Module):
    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_, c2, 3, 1)
        self.add = shortcut and c1 == c2
        # A module (so QAT can quantize it) named ``addop`` because Ultralytics' boolean
        # attribute is ``add``; only present where the shortcut exists.
        self.addop: Add | None = Add() if self.add else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return self.addop(x, y) if self.addop is not None else y


class C3(nn.Module):
    """CSP bottleneck with three convolutions."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True) -> None:
        super().__init__()
        c_ = c2 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, e=1.0) for _ in range(n)))
        self.concat = Concat(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(self.concat([self.m(self.cv1(x)), self.cv2(x)]))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained 5x5 max-pools."""

    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)
        self.concat = Concat(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(self.concat([x, y1, y2, self.m(y2)]))


class Detect(nn.Module):
    """The three 1x1 head convolutions. ``anchors`` is stored in grid units, as Ultralytics does."""

    anchors: torch.Tensor

    def __init__(self, nc: int, ch: Sequence[int], anchors: Sequence[Sequence[Sequence[float]]]):
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0])
        strides = torch.tensor(STRIDES[: self.nl], dtype=torch.float32)
        grid_anchors = torch.tensor(anchors, dtype=torch.float32) / strides.view(-1, 1, 1)
        self.register_buffer("anchors", grid_anchors)
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [conv(x) for conv, x in zip(self.m, xs, strict=True)]

    @torch.no_grad()
    def initialize_biases(self, image_size: int = 640) -> None:
        """YOLOv5's prior: ~8 objects per 640 image, ~0.6 of them split over the classes."""
        for conv, stride in zip(self.m, STRIDES, strict=False):
            assert isinstance(conv, nn.Conv2d)
            assert conv.bias is not None  # the head convs are built with a bias
            b = conv.bias.view(self.na, -1)
            b[:, 4] += math.log(8 / (image_size / stride) ** 2)
            b[:, 5:] += math.log(0.6 / (self.nc - 0.99)) if self.nc > 1 else 0.0


class YOLOv5(nn.Module):
    """A YOLOv5 v7.0 detector (P3-P5, anchor-based) returning raw heads.

    Args:
        variant: one of ``n s m l x``.
        num_classes: number of object classes.
        anchors: anchor (w, h) pairs in pixels per level; the YOLOv5 defaults if omitted.

    Raises:
        ValueError: unknown variant or a non-positive class count.
    """

    family = "yolov5"  # its model family (prep.families, dlad.families)

    def __init__(
        self,
        variant: str = "n",
        num_classes: int = 80,
        anchors: Sequence[Sequence[Sequence[float]]] = ANCHORS,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(
                f"unknown YOLOv5 variant {variant!r}; expected one of {list(VARIANTS)}"
            )
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        v = VARIANTS[variant]
        self.variant = variant
        self.num_classes = num_classes

        def ch(c: int) -> int:
            return _channels(c, v.width)

        def rep(n: int) -> int:
            return _repeats(n, v.depth)

        layers: list[nn.Module] = [
            Conv(3, ch(64), 6, 2, 2),  # 0  P1/2
            Conv(ch(64), ch(128), 3, 2),  # 1  P2/4
            C3(ch(128), ch(128), rep(3)),  # 2
            Conv(ch(128), ch(256), 3, 2),  # 3  P3/8
            C3(ch(256), ch(256), rep(6)),  # 4
            Conv(ch(256), ch(512), 3, 2),  # 5  P4/16
            C3(ch(512), ch(512), rep(9)),  # 6
            Conv(ch(512), ch(1024), 3, 2),  # 7  P5/32
            C3(ch(1024), ch(1024), rep(3)),  # 8
            SPPF(ch(1024), ch(1024), 5),  # 9
            Conv(ch(1024), ch(512), 1, 1),  # 10
            nn.Upsample(scale_factor=2.0, mode="nearest"),  # 11
            Concat(1),  # 12  cat backbone P4
            C3(ch(512) * 2, ch(512), rep(3), shortcut=False),  # 13
            Conv(ch(512), ch(256), 1, 1),  # 14
            nn.Upsample(scale_factor=2.0, mode="nearest"),  # 15
            Concat(1),  # 16  cat backbone P3
            C3(ch(256) * 2, ch(256), rep(3), shortcut=False),  # 17  P3/8 out
            Conv(ch(256), ch(256), 3, 2),  # 18
            Concat(1),  # 19  cat head P4
            C3(ch(256) * 2, ch(512), rep(3), shortcut=False),  # 20  P4/16 out
            Conv(ch(512), ch(512), 3, 2),  # 21
            Concat(1),  # 22  cat head P5
            C3(ch(512) * 2, ch(1024), rep(3), shortcut=False),  # 23  P5/32 out
            Detect(num_classes, (ch(256), ch(512), ch(1024)), anchors),  # 24
        ]
        self.model = nn.Sequential(*layers)
        self._initialize_weights()

    @property
    def detect(self) -> Detect:
        head = self.model[24]
        assert isinstance(head, Detect)  # structural invariant of __init__
        return head

    @property
    def anchors_px(self) -> torch.Tensor:
        """Anchors ``[nl, na, 2]`` in input pixels."""
        strides = torch.tensor(STRIDES, dtype=torch.float32, device=self.detect.anchors.device)
        return self.detect.anchors * strides.view(-1, 1, 1)

    def _initialize_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eps = 1e-3
                m.momentum = 0.03
        self.detect.initialize_biases()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        m = self.model
        x0 = m[0](x)
        x2 = m[2](m[1](x0))
        p3 = m[4](m[3](x2))
        p4 = m[6](m[5](p3))
        x9 = m[9](m[8](m[7](p4)))
        h10 = m[10](x9)
        h13 = m[13](m[12]([m[11](h10), p4]))
        h14 = m[14](h13)
        out3 = m[17](m[16]([m[15](h14), p3]))
        out4 = m[20](m[19]([m[18](out3), h14]))
        out5 = m[23](m[22]([m[21](out4), h10]))
        heads: list[torch.Tensor] = m[24]([out3, out4, out5])
        return heads

    def head_convs(self) -> list[str]:
        """The convs whose outputs are the heads (one per stride)."""
        return [f"model.24.m.{i}" for i in range(len(STRIDES))]

    def distill_layers(self) -> list[int]:
        """The layers whose outputs QAT's feature distillation matches: the backbone stages'
        and the three neck C3 blocks' feeding the heads."""
        return [2, 4, 6, 8, 9, 13, 17, 20, 23]

    def fuse(self) -> YOLOv5:
        """Fold every BatchNorm into its convolution (for QAT and export); returns ``self``."""
        for module in self.modules():
            if isinstance(module, Conv):
                module.fuse()
        return self


def build_model(variant: str, num_classes: int) -> YOLOv5:
    """A fresh, randomly initialised detector (see :class:`YOLOv5`)."""
    return YOLOv5(variant, num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
