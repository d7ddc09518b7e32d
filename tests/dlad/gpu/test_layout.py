"""The layout kernels (``dlad/gpu/layout.py``) against their numpy specification, bit for bit:
int8 ``DLA_HWC4`` frames -> a TensorRT engine's linear NCHW input, and its linear heads ->
fp16 ``CHW16``, in fp16 and fp32, for shapes that cut a row's warp and a channel group."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlad.gpu.driver import GpuContext, _driver
from dlad.gpu.layout import GpuLayouts, hwc4_to_nchw
from dlad.imaging.post import pack_chw16
from tests.dlad.gpu.conftest import Device

pytestmark = pytest.mark.timeout(300)
SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _sync(ctx: GpuContext) -> None:
    ctx.make_current()
    assert int(_driver().cuCtxSynchronize()[0]) == 0


@given(
    n=st.integers(1, 3), c=st.integers(1, 4), h=st.integers(1, 9), w=st.integers(1, 70),
    pad=st.integers(0, 5), half=st.booleans(), scale=st.floats(1e-4, 1.0), seed=st.integers(0, 99),
)  # fmt: skip
@SETTINGS
def test_hwc4_to_nchw_is_its_specification(
    ctx: GpuContext, dev: Device, n: int, c: int, h: int, w: int, pad: int, half: bool,
    scale: float, seed: int,
) -> None:  # fmt: skip
    frames = np.random.default_rng(seed).integers(-128, 128, (n, h, w + pad, 4), dtype=np.int8)
    dtype = np.float16 if half else np.float32
    want = hwc4_to_nchw(frames, c, w, scale, dtype)
    dst = dev.empty(want.nbytes)
    GpuLayouts(ctx).to_nchw(
        0, dev.put(frames), dst, n=n, c=c, h=h, w=w, pitch_px=w + pad,
        scale=float(np.float32(scale)), half=half,
    )  # fmt: skip
    _sync(ctx)
    np.testing.assert_array_equal(dev.get(dst, want.shape, dtype).view(np.uint8),
                                  want.view(np.uint8))  # fmt: skip


@given(
    n=st.integers(1, 3), c=st.integers(1, 40), h=st.integers(1, 9), w=st.integers(1, 70),
    half=st.booleans(), seed=st.integers(0, 99),
)  # fmt: skip
@SETTINGS
def test_nchw_to_chw16_is_its_specification(
    ctx: GpuContext, dev: Device, n: int, c: int, h: int, w: int, half: bool, seed: int
) -> None:
    dtype = np.float16 if half else np.float32
    heads = (np.random.default_rng(seed).standard_normal((n, c, h, w)) * 40).astype(dtype)
    want = np.stack([pack_chw16(x) for x in heads])  # fp32 -> fp16 rounds to nearest even
    dst = dev.put(np.full(want.shape, np.float16(7.0)))  # padding lanes must be written as zero
    GpuLayouts(ctx).to_chw16(0, dev.put(heads), dst, n=n, c=c, h=h, w=w, half=half)
    _sync(ctx)
    np.testing.assert_array_equal(dev.get(dst, want.shape, np.float16).view(np.uint16),
                                  want.view(np.uint16))  # fmt: skip
