"""Shared fixtures: small, BN-warmed detectors (random weights) and inputs.

Without the ``[prep]`` extra (``pip install -e '.[dev]'`` alone: the daemon's and clients'
tests), every module here is reported as skipped, with the packages that are missing and the
command that installs them, instead of failing to import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from prep.extras import install_hint, missing

MISSING = missing()

if MISSING:

    class _ExtraMissing(pytest.Item):
        def runtest(self) -> None:
            pytest.skip(f"needs the [prep] extra ({', '.join(MISSING)} missing): {install_hint()}")

        def reportinfo(self) -> tuple[Path, int, str]:
            return self.path, 0, self.name

    class _SkippedModule(pytest.File):
        def collect(self) -> Any:
            yield _ExtraMissing.from_parent(self, name="[prep extra not installed]")

    def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.File:
        return _SkippedModule.from_parent(parent, path=module_path)  # never imported


if TYPE_CHECKING or not MISSING:
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
