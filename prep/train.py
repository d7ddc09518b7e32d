"""FP32 training of a detector of any prep family (``prep.families``) on letterboxed arrays.

The data arrive as one uint8 array ``[N, S, S, 3]`` (RGB, already letterboxed to the training
size by ``prep.data.coco``) plus per-image labels ``[k, 5]`` rows ``(class, cx, cy, w, h)``
normalised to the canvas. Augmentation runs on whole batches in torch (so it is as fast on a GPU
as the model): horizontal flip, a random scale/translate affine with the letterbox's grey (114)
fill, and brightness/contrast/saturation jitter. The loss is the model family's (YOLOv5's own for
``yolov5``, Ultralytics' for the DFL families). The model that comes out is the exponential moving
average of the weights (YOLOv5's ModelEMA), which is what YOLOv5 evaluates and exports.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from prep.families import prep_family
from prep.model import YOLOv5

PAD_VALUE = 114 / 255.0


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one FP32 training run (all recorded in the stage manifest)."""

    epochs: int = 30
    batch_size: int = 32
    optimizer: Literal["sgd", "adamw"] = "adamw"
    lr: float = 2e-3
    final_lr_fraction: float = 0.05
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    ema_decay: float = 0.9999
    flip: bool = True
    scale: float = 0.35
    translate: float = 0.1
    color: float = 0.3
    seed: int = 0
    device: str = "auto"  # "auto": the first CUDA GPU if there is one, else the CPU
    amp: bool = True  # bfloat16 autocast on CUDA (ignored on the CPU)
    max_seconds: float | None = None
    """Wall-clock budget: after 10 timed steps the epoch count is cut to what fits (the
    learning-rate schedule is re-planned over the new length); the result records it."""


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` when a CUDA device is usable, else ``cpu``; other names as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class TrainResult:
    model: nn.Module
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    epochs: int = 0  # epochs actually run (fewer than asked when ``max_seconds`` cut them)


# ------------------------------------------------------------------------------------------ data
def collate_targets(labels: Sequence[np.ndarray]) -> torch.Tensor:
    """Per-image ``[k, 5]`` labels -> one ``[T, 6]`` tensor with the batch index first."""
    rows = [
        np.concatenate([np.full((len(lab), 1), i, np.float32), lab.astype(np.float32)], 1)
        for i, lab in enumerate(labels)
        if len(lab)
    ]
    if not rows:
        return torch.zeros((0, 6))
    return torch.from_numpy(np.concatenate(rows, 0))


def to_tensor(images: np.ndarray, device: str | torch.device) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` RGB -> float ``[N, 3, H, W]`` in [0, 1]."""
    t = torch.from_numpy(np.ascontiguousarray(images)).to(device)
    return t.permute(0, 3, 1, 2).float().div_(255.0)


def augment(
    images: torch.Tensor, targets: torch.Tensor, cfg: TrainConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip, scale/translate and colour-jitter a batch and its targets together."""
    n = images.shape[0]
    device = images.device

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, generator=gen).to(device)

    s = uniform(1 - cfg.scale, 1 + cfg.scale)
    tx = uniform(-cfg.translate, cfg.translate)
    ty = uniform(-cfg.translate, cfg.translate)
    flip = (
        (torch.rand(n, generator=gen) < 0.5).to(device)
        if cfg.flip
        else torch.zeros(n, dtype=torch.bool, device=device)
    )
    sx = torch.where(flip, -s, s)
    # affine_grid maps output coordinates to input ones: X_in = (X_out - 2t) / s.
    theta = torch.zeros(n, 2, 3, device=device)
    theta[:, 0, 0] = 1 / sx
    theta[:, 0, 2] = -2 * tx / sx
    theta[:, 1, 1] = 1 / s
    theta[:, 1, 2] = -2 * ty / s
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    out = F.grid_sample(images - PAD_VALUE, grid, mode="bilinear", align_corners=False) + PAD_VALUE

    if cfg.color > 0:
        c = cfg.color
        gain = uniform(1 - c, 1 + c).view(n, 1, 1, 1)
        contrast = uniform(1 - c, 1 + c).view(n, 1, 1, 1)
        sat = uniform(1 - c, 1 + c).view(n, 1, 1, 1)
        gray = out.mean(1, keepdim=True)
        out = gray + (out - gray) * sat
        mean = out.mean((1, 2, 3), keepdim=True)
        out = ((out - mean) * contrast + mean) * gain
    out = out.clamp_(0, 1)

    if targets.numel() == 0:
        return out, targets
    b = targets[:, 0].long()
    cx, cy, w, h = targets[:, 2], targets[:, 3], targets[:, 4], targets[:, 5]
    cx = torch.where(flip[b], 1 - cx, cx)
    x1 = (cx - w / 2 - 0.5) * s[b] + 0.5 + tx[b]
    x2 = (cx + w / 2 - 0.5) * s[b] + 0.5 + tx[b]
    y1 = (cy - h / 2 - 0.5) * s[b] + 0.5 + ty[b]
    y2 = (cy + h / 2 - 0.5) * s[b] + 0.5 + ty[b]
    area = (x2 - x1) * (y2 - y1)
    x1c, x2c, y1c, y2c = x1.clamp(0, 1), x2.clamp(0, 1), y1.clamp(0, 1), y2.clamp(0, 1)
    wc, hc = x2c - x1c, y2c - y1c
    min_side = 2.0 / images.shape[-1]
    keep = (wc > min_side) & (hc > min_side) & (wc * hc > 0.3 * area)
    new = torch.stack((targets[:, 0], targets[:, 1], (x1c + x2c) / 2, (y1c + y2c) / 2, wc, hc), 1)
    return out, new[keep]


# ------------------------------------------------------------------------------------------ EMA
class ModelEMA:
    """Exponential moving average of weights with YOLOv5's warm-up ramp of the decay."""

    def __init__(self, model: nn.Module, decay: float, tau: float) -> None:
        self.ema = copy.deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.tau = tau
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau))
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(d).add_(msd[k].detach(), alpha=1 - d)
            else:
                v.copy_(msd[k])


# ------------------------------------------------------------------------------------------ loop
def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "weight" and not isinstance(module, nn.BatchNorm2d):
                decay.append(p)
            else:
                no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


ProgressFn = Callable[[int, int, dict[str, float]], None]


def train(
    model: nn.Module,
    images: np.ndarray,
    labels: Sequence[np.ndarray],
    cfg: TrainConfig,
    progress: ProgressFn | None = None,
) -> TrainResult:
    """Train ``model`` (its ``family`` names its loss) in place; return the EMA model and the
    per-epoch history (the loss's three parts by their names, and the learning rate).

    Raises:
        ValueError: empty data, images that are not square uint8 ``[N, S, S, 3]``, or labels
            that do not match the images.
    """
    if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [N, S, S, 3], got {images.dtype} {images.shape}")
    if images.shape[1] != images.shape[2] or images.shape[1] % 32:
        raise ValueError(
            f"training images must be square with a multiple of 32, got {images.shape}"
        )
    if len(labels) != len(images) or len(images) == 0:
        raise ValueError(f"{len(images)} images but {len(labels)} label arrays")
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    device = resolve_device(cfg.device)
    model.to(device).train()
    use_amp = cfg.amp and device.type == "cuda"
    size = images.shape[1]
    criterion = prep_family(str(model.family)).loss(model, size)
    if isinstance(criterion, nn.Module):
        criterion.to(device)
    names = criterion.part_names

    groups = _param_groups(model, cfg.weight_decay)
    opt: torch.optim.Optimizer
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=0.937, nesterov=True)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.937, 0.999))

    n = len(images)
    steps_per_epoch = max(n // cfg.batch_size, 1)
    epochs = cfg.epochs
    total_steps = steps_per_epoch * epochs
    warmup = max(int(cfg.warmup_epochs * steps_per_epoch), 1)
    ema = ModelEMA(model, cfg.ema_decay, tau=max(min(2000.0, total_steps / 5), 1.0))
    timed_from: float | None = None

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        frac = (step - warmup) / max(total_steps - warmup, 1)
        low = cfg.lr * cfg.final_lr_fraction
        return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * frac))

    history: list[dict[str, float]] = []
    start = time.perf_counter()
    step = 0
    epoch = 0
    while epoch < epochs:
        order = rng.permutation(n)
        sums = torch.zeros(3)
        for i in range(steps_per_epoch):
            idx = np.sort(order[i * cfg.batch_size : (i + 1) * cfg.batch_size])
            x = to_tensor(images[idx], device)
            t = collate_targets([labels[j] for j in idx]).to(device)
            x, t = augment(x, t, cfg, gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                heads = model(x)
            loss, parts = criterion([h.float() for h in heads], t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            ema.update(model)
            sums += parts.cpu()
            step += 1
            if cfg.max_seconds is not None and step in (2, 12):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if step == 2:  # the first steps pay for allocation and autotuning
                    timed_from = time.perf_counter()
                elif timed_from is not None:
                    per_step = (time.perf_counter() - timed_from) / 10
                    fit = int((cfg.max_seconds - (time.perf_counter() - start)) / per_step)
                    fit_epochs = max(1, (fit + step) // steps_per_epoch)
                    if fit_epochs < epochs:
                        epochs = fit_epochs
                        total_steps = steps_per_epoch * epochs
                        ema.tau = max(min(2000.0, total_steps / 5), 1.0)
            if progress is not None:
                means = dict(zip(names, (sums / (i + 1)).tolist(), strict=True))
                progress(step, total_steps, {"epoch": epoch + 1, **means})
        means = dict(zip(names, (sums / steps_per_epoch).tolist(), strict=True))
        history.append({"epoch": epoch + 1, **means, "lr": lr_at(step - 1)})
        epoch += 1
    result_model = ema.ema
    assert isinstance(result_model, type(model))  # deepcopy preserves the class
    return TrainResult(result_model.cpu().eval(), history, time.perf_counter() - start, epochs)


# ------------------------------------------------------------------------------------------ io
CHECKPOINT_FORMAT = "dlad-prep-detector/1"
"""What :func:`save_checkpoint` writes; :func:`load_checkpoint` also reads the YOLOv5-only
``dlad-prep-yolov5/1`` of earlier runs."""


def save_checkpoint(
    path: Path,
    model: nn.Module,
    *,
    image_size: int,
    class_names: Sequence[str],
    extra: dict[str, Any],
) -> None:
    """Save weights and the metadata needed to rebuild the model of any family (its family,
    size, classes, and a YOLOv5's anchors), loadable with ``weights_only``."""
    m: Any = model
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "family": m.family,
            "variant": m.variant,
            "num_classes": m.num_classes,
            "anchors_px": m.anchors_px.tolist() if isinstance(m, YOLOv5) else None,
            "image_size": image_size,
            "class_names": list(class_names),
            "state_dict": model.state_dict(),
            "extra": extra,
        },
        path,
    )


@dataclass(frozen=True)
class Checkpoint:
    model: nn.Module
    image_size: int
    class_names: list[str]
    extra: dict[str, Any]

    @property
    def family(self) -> str:
        return str(getattr(self.model, "family", "yolov5"))


def rebuild_model(data: dict[str, Any]) -> nn.Module:
    """A new model (random weights) of the family, size and classes a checkpoint's ``data``
    records (no ``family``: a YOLOv5, with its anchors)."""
    family = data.get("family", "yolov5")
    if family == "yolov5":
        return YOLOv5(data["variant"], data["num_classes"], anchors=data["anchors_px"])
    return prep_family(family).build(data["variant"], data["num_classes"])


def load_checkpoint(path: Path) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Raises:
        ValueError: the file is not a prep checkpoint.
    """
    data = torch.load(path, map_location="cpu", weights_only=True)
    formats = (CHECKPOINT_FORMAT, "dlad-prep-yolov5/1")
    if not isinstance(data, dict) or data.get("format") not in formats:
        raise ValueError(f"{path} is not a prep checkpoint")
    model = rebuild_model(data)
    model.load_state_dict(data["state_dict"])
    return Checkpoint(
        model.eval(), int(data["image_size"]), list(data["class_names"]), dict(data["extra"])
    )


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    return asdict(cfg)
