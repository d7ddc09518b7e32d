"""Suite-wide settings that need an optional dependency: applied only where it is installed."""

from __future__ import annotations

import importlib.util

import pytest

_HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # torch's tracer warns about the model's own constant shapes during ONNX export; the filter
    # names torch's class, so it exists only where torch does (the daemon's tests run without).
    if _HAS_TORCH:
        for item in items:
            item.add_marker(pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"))
