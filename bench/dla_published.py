"""The DLA latency model against NVIDIA's published per-DLA times of six networks.

    .venv/bin/python bench/dla_published.py [--json out.json] [--keep DIR] [--only NAME ...]

NVIDIA's DLA-SW README publishes images/s on **two** DLAs of a Jetson AGX Orin 64GB (JetPack
5.1.1, INT8, dense, ``int8:dla_hwc4`` in, ``int8:chw32`` out, ``--memPoolSize=dlaSRAM:1``;
docs/reference/cudla.md §6.4). The MAXN column is used; one DLA runs half the images, so one
DLA's time for one task of ``batch`` images is ``batch x 2 / (images/s)``: ResNet-50 at batch 2,
2037 img/s -> 2 x 2 / 2037 = 1.964 ms a task. At MAXN the DLA clock is 1.6 GHz (the clock of
the 105 sparse TOPS), so the model runs with ``clock_hz=1.6e9`` here and everything else at its
defaults.

The six networks are written below in torch (BatchNorm folded away, as in DLA-SW's prepared
graphs; random weights: only the structure matters to the model) and exported at the published
shapes, every layer INT8 (heads too). What is assumed where the public sources stop is said at
each builder. The graphs are those DLA-SW's ``scripts/prepare_models`` runs: MLPerf's models
cut before the box decoding, detection heads' box and class convs fused side by side where that
script fuses them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from prep.latency import (
    CALIBRATION_US,
    ORIN_DLA,
    DlaParams,
    LatencyPlan,
    estimate_plan,
    fit_params,
    plan_graph,
)

#: The DLA clock at MAXN on AGX Orin 64GB (JetPack 5.1.1), the power mode of the published column.
MAXN_DLA_HZ = 1.6e9


# --------------------------------------------------------------------------------- building blocks
def conv(
    cin: int, cout: int, k: int, stride: int = 1, pad: int | None = None, *,
    groups: int = 1, act: bool = True,
) -> nn.Module:  # fmt: skip
    """Conv (BatchNorm folded into its weights and bias) and ReLU."""
    layer = nn.Conv2d(cin, cout, k, stride, k // 2 if pad is None else pad, groups=groups)
    return nn.Sequential(layer, nn.ReLU()) if act else layer


class Basic(nn.Module):
    """ResNet-18/34 basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.a = conv(cin, cout, 3, stride)
        self.b = conv(cout, cout, 3, act=False)
        self.down = conv(cin, cout, 1, stride, act=False) if stride != 1 or cin != cout else None
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        short = x if self.down is None else self.down(x)
        return self.relu(self.b(self.a(x)) + short)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck (stride on the 3x3), grouped for ResNeXt."""

    def __init__(self, cin: int, width: int, cout: int, stride: int, groups: int = 1) -> None:
        super().__init__()
        self.a = conv(cin, width, 1)
        self.b = conv(width, width, 3, stride, groups=groups)
        self.c = conv(width, cout, 1, act=False)
        self.down = conv(cin, cout, 1, stride, act=False) if stride != 1 or cin != cout else None
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        short = x if self.down is None else self.down(x)
        return self.relu(self.c(self.b(self.a(x))) + short)


def stem() -> nn.Sequential:
    """7x7/2 conv and 3x3/2 max-pool: the ResNet stem."""
    return nn.Sequential(conv(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))


class Trunk(nn.Module):
    """The stem, then the stages; returns every stage's output."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = stem()
        self.stages = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.stem(x)
        feats = []
        for s in self.stages:
            x = s(x)
            feats.append(x)
        return feats


class ResNet34Trunk(Trunk):
    """ResNet-34 to ``layers`` stages; ``layer3_stride`` 1 is SSD-ResNet-34's modification."""

    def __init__(self, layers: int = 4, layer3_stride: int = 2) -> None:
        super().__init__()
        chans, depths = (64, 128, 256, 512), (3, 4, 6, 3)
        strides = (1, 2, layer3_stride, 2)
        cin = 64
        for c, d, s in list(zip(chans, depths, strides, strict=True))[:layers]:
            blocks = [Basic(cin if i == 0 else c, c, s if i == 0 else 1) for i in range(d)]
            self.stages.append(nn.Sequential(*blocks))
            cin = c


class ResNet50Trunk(Trunk):
    """ResNet-50 v1.5, or ResNeXt-50 32x4d with ``groups=32`` (widths x2, grouped 3x3s)."""

    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        cin = 64
        for i, (planes, depth) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            width = planes * 2 if groups > 1 else planes  # 32 groups x 4 channels at stage 1
            blocks = [
                Bottleneck(cin if j == 0 else planes * 4, width, planes * 4,
                           2 if (j == 0 and i > 0) else 1, groups)
                for j in range(depth)
            ]  # fmt: skip
            self.stages.append(nn.Sequential(*blocks))
            cin = planes * 4


# ----------------------------------------------------------------------------------- the networks
class ResNet50(nn.Module):
    """MLPerf's ResNet-50 v1.5 as DLA-SW prepares it: ReduceMean -> 7x7 AveragePool, the dense
    layer -> a 1x1 conv of 1001 outputs (the TF model's classes); no softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = ResNet50Trunk()
        self.pool = nn.AvgPool2d(7)
        self.fc = nn.Conv2d(2048, 1001, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.trunk(x)[-1]))


class SsdMobileNetV1(nn.Module):
    """MLPerf's ssd_mobilenet_v1_coco (TF object detection API) to the box predictors: MobileNetV1
    (depth multiplier 1, ReLU6), features at Conv2d_11 (19x19x512) and Conv2d_13 (10x10x1024),
    four extra 1x1 + 3x3/2 pairs (512, 256, 256, 128 channels), and per level one 1x1 predictor
    (the config's kernel_size 1) of A x (4 + 91) outputs: DLA-SW fuses the box and class convs
    side by side; A = 3 on the first level, 6 on the others. TF's SAME padding gives the same
    sizes as padding 1 here (300 -> 150 -> ... -> 1)."""

    def __init__(self) -> None:
        super().__init__()

        def cbr(cin: int, cout: int, k: int, s: int = 1, g: int = 1) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, groups=g), nn.ReLU6())

        layers: list[nn.Module] = [cbr(3, 32, 3, 2)]
        cin = 32
        plan = [(1, 64), (2, 128), (1, 128), (2, 256), (1, 256), (2, 512), *[(1, 512)] * 5,
                (2, 1024), (1, 1024)]  # fmt: skip
        for s, cout in plan:
            layers += [cbr(cin, cin, 3, s, cin), cbr(cin, cout, 1)]  # depthwise, pointwise
            cin = cout
        self.to11 = nn.Sequential(*layers[: 1 + 2 * 11])
        self.to13 = nn.Sequential(*layers[1 + 2 * 11 :])
        extras = [(1024, 256, 512), (512, 128, 256), (256, 128, 256), (256, 64, 128)]
        self.extras = nn.ModuleList(
            nn.Sequential(cbr(a, b, 1), cbr(b, c, 3, 2)) for a, b, c in extras
        )
        chans = (512, 1024, 512, 256, 256, 128)
        anchors = (3, 6, 6, 6, 6, 6)
        self.heads = nn.ModuleList(
            nn.Conv2d(c, a * (4 + 91), 1) for c, a in zip(chans, anchors, strict=True)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        f11 = self.to11(x)
        f = self.to13(f11)
        feats = [f11, f]
        for e in self.extras:
            f = e(f)
            feats.append(f)
        return tuple(h(t) for h, t in zip(self.heads, feats, strict=True))


class SsdResNet34(nn.Module):
    """MLPerf's SSD-ResNet-34 1200x1200 (``ssd_r34.py``, strides [3, 3, 2, 2, 2, 2]): ResNet-34 to
    layer3 with layer3's stride 1 (150x150x256), five extra blocks, and per level one 3x3
    stride-3 predictor of A x (4 + 81) outputs (DLA-SW fuses the loc and conf convs side by side),
    A = 4, 6, 6, 6, 4, 4; levels 50, 25, 13, 7, 3, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = ResNet34Trunk(layers=3, layer3_stride=1)
        spec = [(256, 256, 512, 2, 1), (512, 256, 512, 2, 1), (512, 128, 256, 2, 1),
                (256, 128, 256, 2, 0), (256, 128, 256, 1, 0)]  # fmt: skip
        self.extras = nn.ModuleList(
            nn.Sequential(conv(a, b, 1), conv(b, c, 3, s, p)) for a, b, c, s, p in spec
        )
        chans = (256, 512, 512, 256, 256, 256)
        anchors = (4, 6, 6, 6, 4, 4)
        self.heads = nn.ModuleList(
            nn.Conv2d(c, a * (4 + 81), 3, 3, 1) for c, a in zip(chans, anchors, strict=True)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        f = self.trunk(x)[-1]
        feats = [f]
        for e in self.extras:
            f = e(f)
            feats.append(f)
        return tuple(h(t) for h, t in zip(self.heads, feats, strict=True))


class ResNet34Backbone(nn.Module):
    """DLA-SW's ``backbone_rn34_1280x768``: assumed to be the ResNet-34 trunk alone (stem and four
    stages, C5 = 24x40x512), the RetinaNet below without its FPN and heads."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = ResNet34Trunk()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)[-1]


class RetinaNet(nn.Module):
    """RetinaNet (Lin et al.; torchvision's layout): FPN on C3-C5 (1x1 laterals, nearest 2x
    top-down sums, 3x3 outputs), P6 = 3x3/2 on P5, P7 = 3x3/2 on ReLU(P6), and on each of the
    five levels a class subnet and a box subnet of four 3x3 256-channel convs with ReLU and a
    3x3 predictor (A x K and A x 4, A = 9), weights shared across levels as separate layers."""

    def __init__(self, trunk: nn.Module, c3_c5: Sequence[int], classes: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.lateral = nn.ModuleList(nn.Conv2d(c, 256, 1) for c in c3_c5)
        self.output = nn.ModuleList(nn.Conv2d(256, 256, 3, 1, 1) for _ in c3_c5)
        self.p6 = nn.Conv2d(256, 256, 3, 2, 1)
        self.p7 = nn.Sequential(nn.ReLU(), nn.Conv2d(256, 256, 3, 2, 1))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")

        def subnet(out: int) -> nn.Sequential:
            return nn.Sequential(
                *(conv(256, 256, 3) for _ in range(4)), nn.Conv2d(256, out, 3, 1, 1)
            )

        self.cls = subnet(9 * classes)
        self.box = subnet(9 * 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c3, c4, c5 = self.trunk(x)[-3:]
        lat5 = self.lateral[2](c5)
        # The upsampled term first: the sum then fuses into the lateral conv as its residual.
        lat4 = self.up(lat5) + self.lateral[1](c4)
        lat3 = self.up(lat4) + self.lateral[0](c3)
        p3, p4, p5 = (o(t) for o, t in zip(self.output, (lat3, lat4, lat5), strict=True))
        p6 = self.p6(p5)
        p7 = self.p7(p6)
        return tuple(head(p) for p in (p3, p4, p5, p6, p7) for head in (self.cls, self.box))


def retinanet_r34() -> nn.Module:
    """DLA-SW's RetinaNet ResNet-34 1280x768 (trained on the Waymo Open Dataset): K = 3 classes
    (vehicle, pedestrian, cyclist) is assumed; P3-P7 at 96x160 ... 6x10."""
    return RetinaNet(ResNet34Trunk(), (128, 256, 512), classes=3)


def retinanet_rx50() -> nn.Module:
    """MLPerf's RetinaNet ResNeXt-50 32x4d 800x800 (OpenImages MLPerf subset, K = 264 classes)."""
    return RetinaNet(ResNet50Trunk(groups=32), (512, 1024, 2048), classes=264)


@dataclass(frozen=True)
class Network:
    """One published row: how to build it, its input (N, 3, H, W) and its images/s on 2 DLAs."""

    name: str
    build: Callable[[], nn.Module]
    shape: tuple[int, int, int, int]
    images_per_s: float

    @property
    def published_ms(self) -> float:
        """One DLA's time for one task of the graph's batch: half the images go to each DLA."""
        return self.shape[0] * 2 / self.images_per_s * 1e3


NETWORKS: tuple[Network, ...] = (
    Network("ResNet-50 224 bs2", ResNet50, (2, 3, 224, 224), 2037),
    Network("SSD-MobileNetV1 300 bs2", SsdMobileNetV1, (2, 3, 300, 300), 2664),
    Network("ResNet-34 backbone 1280x768", ResNet34Backbone, (1, 3, 768, 1280), 285),
    Network("RetinaNet ResNet-34 1280x768", retinanet_r34, (1, 3, 768, 1280), 108),
    Network("RetinaNet ResNeXt-50 800", retinanet_rx50, (1, 3, 800, 800), 78),
    Network("SSD-ResNet-34 1200", SsdResNet34, (1, 3, 1200, 1200), 83),
)


def export(net: Network, path: Path) -> Path:
    """Export ``net`` at its published shape (legacy exporter, as prep.export does)."""
    torch.manual_seed(0)
    model = net.build().eval()
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (torch.zeros(net.shape),), str(path), opset_version=13, dynamo=False,
            input_names=["input"], do_constant_folding=True,
        )  # fmt: skip
    return path


def maxn_params(base: DlaParams = ORIN_DLA) -> DlaParams:
    """The model's constants at the published column's clock."""
    return replace(base, clock_hz=MAXN_DLA_HZ)


# ------------------------------------------------------------------------------------ the fit
#: Networks the joint fit uses; the rest of NETWORKS are checks only.
FIT_NETWORKS = ("ResNet-50 224 bs2", "SSD-MobileNetV1 300 bs2", "ResNet-34 backbone 1280x768")
#: The constants fitted jointly (YOLOv5s-672 INT8 heads is the fourth point).
JOINT_FIELDS = (
    "int8_conv_efficiency", "conv_reduction_knee", "lut_elems_per_cycle", "layer_overhead_us",
)  # fmt: skip
_BOUNDS = {"int8_conv_efficiency": (0.05, 1.0), "conv_reduction_knee": (0.0, 50.0),
           "lut_elems_per_cycle": (1.0, 128.0), "layer_overhead_us": (0.1, 50.0)}  # fmt: skip


def joint_fit(cases: Sequence[tuple[LatencyPlan, float, float]], base: DlaParams) -> DlaParams:
    """Least squares on log(modelled / published) over ``cases`` (plan, published us, clock Hz)
    in :data:`JOINT_FIELDS`: Levenberg-Marquardt with forward differences, within bounds."""

    def residuals(x: np.ndarray) -> np.ndarray:
        p = replace(base, **dict(zip(JOINT_FIELDS, map(float, x), strict=True)))
        return np.array([
            math.log(estimate_plan(plan, params=replace(p, clock_hz=hz)).total_us / us)
            for plan, us, hz in cases
        ])  # fmt: skip

    lo = np.array([_BOUNDS[f][0] for f in JOINT_FIELDS])
    hi = np.array([_BOUNDS[f][1] for f in JOINT_FIELDS])
    x = np.array([float(getattr(base, f)) for f in JOINT_FIELDS])
    r, damping = residuals(x), 1e-2
    for _ in range(60):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            step = 1e-4 * max(abs(x[j]), 1e-2)
            probe = x.copy()
            probe[j] += step
            jac[:, j] = (residuals(probe) - r) / step
        a = jac.T @ jac
        g = jac.T @ r
        trial = np.clip(x - np.linalg.solve(a + damping * np.diag(np.diag(a) + 1e-12), g), lo, hi)
        r_trial = residuals(trial)
        if r_trial @ r_trial < r @ r:
            x, r, damping = trial, r_trial, damping / 3
            if np.max(np.abs(g)) < 1e-9:
                break
        else:
            damping *= 4
    rounded = {"int8_conv_efficiency": 3, "conv_reduction_knee": 2,
               "lut_elems_per_cycle": 1, "layer_overhead_us": 2}  # fmt: skip
    return replace(
        base, **{f: round(float(v), rounded[f]) for f, v in zip(JOINT_FIELDS, x, strict=True)}
    )


def yolov5s_plans(folder: Path) -> tuple[LatencyPlan, LatencyPlan]:
    """YOLOv5s 672x672 (80 classes) with INT8 and with FP16 heads, exported once into ``folder``."""
    from prep.export import export_onnx
    from prep.model import YOLOv5

    path = folder / "yolov5s_672.onnx"
    if not path.exists():
        torch.manual_seed(0)
        export_onnx(YOLOv5("s", 80).eval().fuse(), path, 672)
    return plan_graph(path, heads="int8"), plan_graph(path, heads="fp16")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--keep", type=Path, help="write the ONNX graphs here (default: a temp dir)")
    ap.add_argument("--only", action="append", default=[], help="networks whose name starts so")
    ap.add_argument("--fit", action="store_true", help="refit the fitted constants, then compare")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        plans: dict[str, LatencyPlan] = {}
        for net in NETWORKS:
            if args.only and not any(net.name.startswith(o) for o in args.only):
                continue
            path = folder / (net.name.replace(" ", "_").lower() + ".onnx")
            if not path.exists():
                t0 = time.perf_counter()
                export(net, path)
                print(
                    f"(exported {path.name} in {time.perf_counter() - t0:.0f} s)", file=sys.stderr
                )
            plans[net.name] = plan_graph(path, heads="int8")
        base = ORIN_DLA
        if args.fit:
            y8, y16 = yolov5s_plans(folder)
            cases = [(plans[n.name], n.published_ms * 1e3, MAXN_DLA_HZ)
                     for n in NETWORKS if n.name in FIT_NETWORKS]  # fmt: skip
            cases.append((y8, CALIBRATION_US["int8_heads"], ORIN_DLA.clock_hz))
            base = joint_fit(cases, ORIN_DLA)
            yolo = [(y8, CALIBRATION_US["int8_heads"]), (y16, CALIBRATION_US["fp16_heads"])]
            base = fit_params(yolo, base, ("lut_elems_per_cycle", "fp16_conv_efficiency"))
            fitted = {f: getattr(base, f) for f in (*JOINT_FIELDS, "fp16_conv_efficiency")}
            print("fitted:", ", ".join(f"{k}={v}" for k, v in fitted.items()))
            print(f"fit on YOLOv5s-672 and {', '.join(FIT_NETWORKS)}; the rest are checks")
        params = maxn_params(base)
        rows = []
        print(f"{'network':<30}{'modelled ms':>12}{'published ms':>14}{'ratio':>8}  role")
        for net in NETWORKS:
            if net.name not in plans:
                continue
            est = estimate_plan(plans[net.name], params=params)
            ratio = est.total_ms / net.published_ms
            role = "fit" if net.name in FIT_NETWORKS else "check"
            rows.append({
                "network": net.name, "batch": est.batch, "modelled_ms": est.total_ms,
                "published_ms": net.published_ms, "ratio": ratio, "role": role,
                "by_op_us": {k: v["time_us"] for k, v in est.by_op().items()},
            })  # fmt: skip
            print(
                f"{net.name:<30}{est.total_ms:>12.3f}{net.published_ms:>14.3f}{ratio:>8.3f}  {role}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"params": asdict(params), "rows": rows}, indent=2) + "\n")
    worst = max((abs(r["ratio"] - 1) for r in rows), default=0.0)
    print(f"largest error: {worst:.1%} (|modelled / published - 1|)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
