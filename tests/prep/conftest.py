"""Shared fixtures: small, BN-warmed detectors (random weights) and inputs."""

from __future__ import annotations

import pytest
import torch

from prep.model import YOLOv5
from prep.qat import warm_up_batchnorm


@pytest.fixture(scope="session")
def warm_model() -> YOLOv5:
    """YOLOv5n, 3 classes, random weights with real BatchNorm statistics (eval mode).

    Untrained models need warmed-up BN before fusing, or calibration collapses."""
    torch.manual_seed(0)
    model = YOLOv5("n", 3)
    gen = torch.Generator().manual_seed(1)
    warm_up_batchnorm(model, [torch.rand(4, 3, 96, 96, generator=gen) for _ in range(4)])
    return model.eval()


@pytest.fixture
def images() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return torch.rand(2, 3, 96, 96, generator=gen)
