"""The YOLOv5 detection loss, for raw heads ``[N, na*(5+nc), H, W]``.

Target assignment follows YOLOv5: a target is matched to every anchor whose width and height
ratios to it are within ``anchor_t`` (4.0), at its own grid cell and at the two neighbouring cells
nearest its centre (so each target trains up to 3 cells x 3 anchors per level). Box regression
uses CIoU on the decoded boxes, objectness is BCE against the detached IoU of the matched
prediction (so objectness learns localisation quality, which is what mAP rewards), and classes
use BCE (multi-label friendly). Level weights ``(4.0, 1.0, 0.4)`` balance the many P3 cells against
the few P5 cells. Gains are YOLOv5's ``box 0.05, obj 1.0, cls 0.5`` scaled by the number of
classes and the image size as YOLOv5 scales them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LossGains:
    box: float = 0.05
    obj: float = 1.0
    cls: float = 0.5
    anchor_t: float = 4.0


def bbox_ciou(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Complete IoU of paired ``[N, 4]`` boxes in ``cx, cy, w, h``."""
    b1x1, b1x2 = box1[:, 0] - box1[:, 2] / 2, box1[:, 0] + box1[:, 2] / 2
    b1y1, b1y2 = box1[:, 1] - box1[:, 3] / 2, box1[:, 1] + box1[:, 3] / 2
    b2x1, b2x2 = box2[:, 0] - box2[:, 2] / 2, box2[:, 0] + box2[:, 2] / 2
    b2y1, b2y2 = box2[:, 1] - box2[:, 3] / 2, box2[:, 1] + box2[:, 3] / 2
    w1, h1 = box1[:, 2], box1[:, 3] + eps
    w2, h2 = box2[:, 2], box2[:, 3] + eps

    inter = (torch.min(b1x2, b2x2) - torch.max(b1x1, b2x1)).clamp(0) * (
        torch.min(b1y2, b2y2) - torch.max(b1y1, b2y1)
    ).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union

    cw = torch.max(b1x2, b2x2) - torch.min(b1x1, b2x1)
    ch = torch.max(b1y2, b2y2) - torch.min(b1y1, b2y1)
    c2 = cw**2 + ch**2 + eps
    rho2 = (box2[:, 0] - box1[:, 0]) ** 2 + (box2[:, 1] - box1[:, 1]) ** 2
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


class YoloLoss(nn.Module):
    """Loss for :class:`prep.model.YOLOv5` raw heads.

    Args:
        anchors_grid: ``[nl, na, 2]`` anchors in grid units of each level.
        num_classes: number of classes.
        image_size: training image size (scales the objectness gain as YOLOv5 does).
    """

    part_names = ("box", "obj", "cls")

    balance = (4.0, 1.0, 0.4)

    def __init__(
        self,
        anchors_grid: torch.Tensor,
        num_classes: int,
        image_size: int,
        gains: LossGains = LossGains(),
    ) -> None:
        super().__init__()
        self.register_buffer("anchors", anchors_grid.clone().float())
        self.anchors: torch.Tensor
        self.nc = num_classes
        self.nl, self.na = anchors_grid.shape[:2]
        self.no = num_classes + 5
        scale = 3 / self.nl
        self.box_gain = gains.box * scale
        self.cls_gain = gains.cls * num_classes / 80 * scale
        self.obj_gain = gains.obj * (image_size / 640) ** 2 * scale
        self.anchor_t = gains.anchor_t

    def forward(
        self, heads: list[torch.Tensor], targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss of one batch.

        Args:
            heads: raw head outputs, one per level.
            targets: ``[T, 6]`` rows ``(image index, class, cx, cy, w, h)``, coordinates
                normalised to the image.

        Returns:
            ``(loss, parts)``: the scalar loss (summed over the batch, as YOLOv5 reports it) and
            the detached ``(box, obj, cls)`` parts.
        """
        device = heads[0].device
        lbox = torch.zeros((), device=device)
        lobj = torch.zeros((), device=device)
        lcls = torch.zeros((), device=device)
        batch = heads[0].shape[0]

        for level, head in enumerate(heads):
            n, _, h, w = head.shape
            p = head.view(n, self.na, self.no, h, w).permute(0, 1, 3, 4, 2)
            tobj = torch.zeros(p.shape[:4], device=device, dtype=p.dtype)
            b, a, gj, gi, tbox, tcls, anchor = self._assign(targets, level, h, w)
            if b.numel():
                ps = p[b, a, gj, gi]
                pxy = ps[:, :2].sigmoid() * 2 - 0.5
                pwh = (ps[:, 2:4].sigmoid() * 2) ** 2 * anchor
                ciou = bbox_ciou(torch.cat((pxy, pwh), 1), tbox)
                lbox = lbox + (1.0 - ciou).mean()
                tobj[b, a, gj, gi] = ciou.detach().clamp(0).to(tobj.dtype)
                if self.nc > 1:
                    t = torch.zeros_like(ps[:, 5:])
                    t[torch.arange(len(tcls), device=device), tcls] = 1.0
                    lcls = lcls + F.binary_cross_entropy_with_logits(ps[:, 5:], t)
            lobj = lobj + F.binary_cross_entropy_with_logits(p[..., 4], tobj) * self.balance[level]

        lbox = lbox * self.box_gain
        lobj = lobj * self.obj_gain
        lcls = lcls * self.cls_gain
        total = (lbox + lobj + lcls) * batch
        return total, torch.stack((lbox, lobj, lcls)).detach()

    def _assign(
        self, targets: torch.Tensor, level: int, h: int, w: int
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ]:
        device = targets.device
        anchors = self.anchors[level]  # [na, 2] grid units
        nt = targets.shape[0]
        empty = torch.zeros(0, dtype=torch.long, device=device)
        if nt == 0:
            z = torch.zeros((0, 4), device=device)
            return empty, empty, empty, empty, z, empty, torch.zeros((0, 2), device=device)

        gain = torch.tensor([1, 1, w, h, w, h], device=device, dtype=targets.dtype)
        t = targets * gain  # to grid units
        # Pair every target with every anchor: [na, nt, 7] (..., anchor index).
        ai = torch.arange(self.na, device=device, dtype=t.dtype).view(-1, 1).repeat(1, nt)
        t = torch.cat((t.unsqueeze(0).repeat(self.na, 1, 1), ai.unsqueeze(2)), 2)
        ratio = t[..., 4:6] / anchors[:, None]
        keep = torch.max(ratio, 1 / ratio).max(2).values < self.anchor_t
        t = t[keep]
        if t.shape[0] == 0:
            z = torch.zeros((0, 4), device=device)
            return empty, empty, empty, empty, z, empty, torch.zeros((0, 2), device=device)

        # Neighbour cells: the two (of four) adjacent cells nearest the centre.
        g = 0.5
        gxy = t[:, 2:4]
        gxi = torch.tensor([w, h], device=device, dtype=t.dtype) - gxy
        j, k = ((gxy % 1 < g) & (gxy > 1)).T
        lft, m = ((gxi % 1 < g) & (gxi > 1)).T
        masks = torch.stack((torch.ones_like(j), j, k, lft, m))
        offsets = (
            torch.tensor([[0, 0], [1, 0], [0, 1], [-1, 0], [0, -1]], device=device, dtype=t.dtype)
            * g
        )
        t = t.repeat((5, 1, 1))[masks]
        off = (torch.zeros_like(gxy)[None] + offsets[:, None])[masks]

        b = t[:, 0].long()
        c = t[:, 1].long()
        gxy = t[:, 2:4]
        gwh = t[:, 4:6]
        gij = (gxy - off).long()
        gi = gij[:, 0].clamp_(0, w - 1)
        gj = gij[:, 1].clamp_(0, h - 1)
        a = t[:, 6].long()
        tbox = torch.cat((gxy - torch.stack((gi, gj), 1), gwh), 1)
        return b, a, gj, gi, tbox, c, anchors[a]
