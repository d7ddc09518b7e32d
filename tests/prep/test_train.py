from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prep.model import YOLOv5
from prep.train import (
    PAD_VALUE,
    TrainConfig,
    augment,
    collate_targets,
    load_checkpoint,
    save_checkpoint,
    train,
)


def _scene(n: int, size: int, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Grey canvases, each with one white rectangle and its exact label."""
    rng = np.random.default_rng(seed)
    images = np.full((n, size, size, 3), 114, np.uint8)
    labels = []
    for i in range(n):
        w, h = rng.integers(size // 6, size // 2, 2)
        x, y = rng.integers(0, size - w), rng.integers(0, size - h)
        images[i, y : y + h, x : x + w] = 255
        labels.append(
            np.array([[0, (x + w / 2) / size, (y + h / 2) / size, w / size, h / size]], np.float32)
        )
    return images, labels


def test_collate_targets() -> None:
    t = collate_targets([np.zeros((0, 5), np.float32), np.ones((2, 5), np.float32)])
    assert t.shape == (2, 6)
    assert (t[:, 0] == 1).all()
    assert collate_targets([np.zeros((0, 5), np.float32)]).shape == (0, 6)


@pytest.mark.parametrize("seed", range(4))
def test_augment_moves_boxes_with_pixels(seed: int) -> None:
    images, labels = _scene(6, 96, seed)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    t = collate_targets(labels)
    cfg = TrainConfig(color=0.0, scale=0.4, translate=0.2)
    out, new = augment(x, t, cfg, torch.Generator().manual_seed(seed))
    bright = out.mean(1) > (PAD_VALUE + 1) / 2  # the white rectangle after the affine warp
    for b, _c, cx, cy, w, h in new.tolist():
        mask = bright[int(b)]
        ys, xs = torch.nonzero(mask, as_tuple=True)
        # The label box is where the white pixels went (within a pixel of bilinear blur).
        assert abs((xs.min().item() + xs.max().item() + 1) / 2 / 96 - cx) < 1.5 / 96
        assert abs((ys.min().item() + ys.max().item() + 1) / 2 / 96 - cy) < 1.5 / 96
        assert abs((xs.max().item() - xs.min().item() + 1) / 96 - w) < 2.5 / 96
        assert abs((ys.max().item() - ys.min().item() + 1) / 96 - h) < 2.5 / 96
    assert out.min() >= 0
    assert out.max() <= 1


def test_train_rejects_bad_input() -> None:
    model = YOLOv5("n", 1)
    with pytest.raises(ValueError, match="uint8"):
        train(model, np.zeros((2, 64, 64, 3), np.float32), [np.zeros((0, 5))] * 2, TrainConfig())
    with pytest.raises(ValueError, match="multiple of 32"):
        train(model, np.zeros((2, 60, 60, 3), np.uint8), [np.zeros((0, 5))] * 2, TrainConfig())
    with pytest.raises(ValueError, match="label arrays"):
        train(model, np.zeros((2, 64, 64, 3), np.uint8), [np.zeros((0, 5))], TrainConfig())


@pytest.mark.slow
def test_training_learns_and_checkpoints(tmp_path: Path) -> None:
    images, labels = _scene(64, 64, 0)
    torch.manual_seed(0)
    model = YOLOv5("n", 1)
    steps: list[int] = []
    cfg = TrainConfig(epochs=6, batch_size=16, lr=3e-3, device="cpu", scale=0.1, translate=0.05)
    result = train(model, images, labels, cfg, progress=lambda s, total, info: steps.append(s))
    assert steps == list(range(1, 6 * 4 + 1))
    assert result.epochs == 6
    first, last = result.history[0], result.history[-1]
    assert last["box"] < first["box"]  # localisation improves on a trivially learnable task
    save_checkpoint(
        tmp_path / "m.pt", result.model, image_size=64, class_names=["box"], extra={"k": 1}
    )
    ckpt = load_checkpoint(tmp_path / "m.pt")
    assert ckpt.class_names == ["box"]
    assert ckpt.image_size == 64
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        for a, b in zip(result.model(x), ckpt.model(x), strict=True):
            torch.testing.assert_close(a, b)


def test_time_budget_cuts_epochs() -> None:
    images, labels = _scene(32, 64, 1)
    cfg = TrainConfig(epochs=1000, batch_size=2, device="cpu", max_seconds=1.0)
    result = train(YOLOv5("n", 1), images, labels, cfg)
    assert 1 <= result.epochs < 1000
    assert len(result.history) == result.epochs


def test_a_dfl_family_trains_with_its_own_loss_and_checkpoints(tmp_path: Path) -> None:
    """YOLO11 trains with Ultralytics' loss (box, cls, dfl) through the same loop, and its
    checkpoint rebuilds it from the family's definition."""
    from prep.families import prep_family

    images, labels = _scene(64, 64, 2)
    torch.manual_seed(0)
    model = prep_family("yolo11").build("n", 1)
    cfg = TrainConfig(epochs=5, batch_size=16, lr=3e-3, device="cpu", scale=0.1, translate=0.05)
    result = train(model, images, labels, cfg)
    first, last = result.history[0], result.history[-1]
    assert set(first) == {"epoch", "box", "cls", "dfl", "lr"}
    assert last["box"] < first["box"]
    path = tmp_path / "train" / "fp32.pt"
    path.parent.mkdir()
    save_checkpoint(path, result.model, image_size=64, class_names=["box"], extra={})
    ckpt = load_checkpoint(path)
    assert ckpt.family == "yolo11"
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        for a, b in zip(result.model(x), ckpt.model(x), strict=True):
            torch.testing.assert_close(a, b)


def test_checkpoints_of_earlier_runs_still_load(tmp_path: Path) -> None:
    model = YOLOv5("n", 2)
    legacy = {
        "format": "dlad-prep-yolov5/1", "variant": "n", "num_classes": 2,
        "anchors_px": model.anchors_px.tolist(), "image_size": 64, "class_names": ["a", "b"],
        "state_dict": model.state_dict(), "extra": {},
    }  # fmt: skip
    torch.save(legacy, tmp_path / "old.pt")
    ckpt = load_checkpoint(tmp_path / "old.pt")
    assert (ckpt.family, ckpt.class_names) == ("yolov5", ["a", "b"])
