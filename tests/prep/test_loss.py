from __future__ import annotations

import math

import torch

from prep.loss import YoloLoss, bbox_ciou
from prep.model import YOLOv5


def test_ciou_identity_and_disjoint() -> None:
    b = torch.tensor([[5.0, 5.0, 2.0, 4.0]])
    torch.testing.assert_close(bbox_ciou(b, b), torch.ones(1), atol=1e-5, rtol=0)
    far = torch.tensor([[50.0, 50.0, 2.0, 4.0]])
    assert float(bbox_ciou(b, far)) < 0  # IoU 0 minus a positive distance penalty


def test_ciou_against_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(64, 4, generator=gen) * torch.tensor([10, 10, 4, 4]) + torch.tensor(
        [0, 0, 0.5, 0.5]
    )
    b = torch.rand(64, 4, generator=gen) * torch.tensor([10, 10, 4, 4]) + torch.tensor(
        [0, 0, 0.5, 0.5]
    )
    got = bbox_ciou(a, b, eps=0.0)
    for i in range(64):
        (x1, y1, w1, h1), (x2, y2, w2, h2) = a[i].tolist(), b[i].tolist()
        iw = max(0.0, min(x1 + w1 / 2, x2 + w2 / 2) - max(x1 - w1 / 2, x2 - w2 / 2))
        ih = max(0.0, min(y1 + h1 / 2, y2 + h2 / 2) - max(y1 - h1 / 2, y2 - h2 / 2))
        inter = iw * ih
        iou = inter / (w1 * h1 + w2 * h2 - inter)
        cw = max(x1 + w1 / 2, x2 + w2 / 2) - min(x1 - w1 / 2, x2 - w2 / 2)
        ch = max(y1 + h1 / 2, y2 + h2 / 2) - min(y1 - h1 / 2, y2 - h2 / 2)
        rho2 = (x1 - x2) ** 2 + (y1 - y2) ** 2
        v = 4 / math.pi**2 * (math.atan(w2 / h2) - math.atan(w1 / h1)) ** 2
        alpha = v / (v - iou + 1)
        assert abs(float(got[i]) - (iou - rho2 / (cw**2 + ch**2) - alpha * v)) < 1e-4


def _loss(nc: int = 3, size: int = 64) -> tuple[YoloLoss, YOLOv5]:
    model = YOLOv5("n", nc)
    return YoloLoss(model.detect.anchors, nc, size), model


def test_assignment_centre_and_neighbours() -> None:
    loss, _ = _loss()
    # One 16x16-px target on a 64 px image, centre in the lower-left quarter of cell (2, 2) of
    # the stride-8 grid: it trains its own cell plus the left and upper neighbours.
    t = torch.tensor([[0, 1, (2 + 0.25) / 8, (2 + 0.25) / 8, 16 / 64, 16 / 64]])
    b, a, gj, gi, tbox, cls, anchor = loss._assign(t, level=0, h=8, w=8)
    cells = {(int(j), int(i)) for j, i in zip(gj, gi, strict=True)}
    assert cells == {(2, 2), (2, 1), (1, 2)}
    assert set(cls.tolist()) == {1}
    assert (b == 0).all()
    # The target is 2x2 grid cells; anchors (1.25,1.625),(2,3.75),(4.125,2.875) are all within 4x.
    assert set(a.tolist()) == {0, 1, 2}
    # Box targets are offsets from the assigned cell, within (-0.5, 1.5) as the decode allows.
    assert (tbox[:, :2] > -0.5).all()
    assert (tbox[:, :2] < 1.5).all()
    assert anchor.shape == (len(a), 2)


def test_loss_prefers_the_right_answer() -> None:
    loss, _ = _loss(nc=2, size=64)
    t = torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.3]])
    heads = [torch.zeros(1, 21, 64 // s, 64 // s) - 6.0 for s in (8, 16, 32)]
    base, _ = loss(heads, t)
    # Raise objectness and the right class at every cell: the object term can only help at the
    # assigned cells, the class term must drop.
    good = [h.clone() for h in heads]
    for h in good:
        v = h.view(1, 3, 7, *h.shape[2:])
        v[:, :, 6] = 6.0
    better, parts = loss(good, t)
    assert float(better) < float(base)
    assert torch.isfinite(parts).all()


def test_empty_targets_only_objectness() -> None:
    loss, model = _loss()
    heads = model.eval()(torch.rand(2, 3, 64, 64))
    total, parts = loss(heads, torch.zeros((0, 6)))
    assert float(parts[0]) == 0
    assert float(parts[2]) == 0
    assert float(parts[1]) > 0
    total.backward()
