from __future__ import annotations

import copy

import pytest
import torch

from prep.model import ANCHORS, STRIDES, YOLOv5, count_parameters


@pytest.mark.parametrize(
    ("variant", "params"),
    # Ultralytics YOLOv5 v7.0 model summaries (80 classes, before fusing).
    [("n", 1_872_157), ("s", 7_235_389)],
)
def test_parameter_counts_match_ultralytics(variant: str, params: int) -> None:
    assert count_parameters(YOLOv5(variant, 80)) == params


@pytest.mark.parametrize("size", [64, 160, 320])
def test_raw_heads_shapes(size: int) -> None:
    model = YOLOv5("n", 5).eval()
    with torch.no_grad():
        heads = model(torch.rand(2, 3, size, size))
    assert [tuple(h.shape) for h in heads] == [(2, 3 * 10, size // s, size // s) for s in STRIDES]


def test_fuse_is_exact_in_eval(warm_model: YOLOv5, images: torch.Tensor) -> None:
    fused = copy.deepcopy(warm_model).fuse()
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())
    with torch.no_grad():
        a, b = warm_model(images), fused(images)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    fused.fuse()  # idempotent
    with torch.no_grad():
        torch.testing.assert_close(fused(images)[0], b[0])


def test_ultralytics_names_and_anchor_units() -> None:
    model = YOLOv5("s", 80)
    keys = set(model.state_dict())
    for key in (
        "model.0.conv.weight",
        "model.0.bn.running_var",
        "model.2.m.0.cv1.conv.weight",
        "model.9.cv2.bn.bias",
        "model.24.m.2.weight",
        "model.24.anchors",
    ):
        assert key in keys
    # Ultralytics keeps anchors in grid units (pixels / stride).
    grid = model.detect.anchors
    torch.testing.assert_close(model.anchors_px, torch.tensor(ANCHORS, dtype=torch.float32))
    torch.testing.assert_close(grid[2, 0], torch.tensor([116 / 32, 90 / 32]))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown YOLOv5 variant"):
        YOLOv5("q", 3)
    with pytest.raises(ValueError, match="num_classes"):
        YOLOv5("n", 0)
