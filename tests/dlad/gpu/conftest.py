"""GPU fixtures. Every test here needs a CUDA GPU with cuda-python and NVRTC; on CI (no GPU)
they skip with the probe's reason, and the numpy reference they compare against is tested by
tests/dlad/test_pre.py and test_post.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlad.gpu.driver import GpuContext, probe

PROBE = probe()
needs_gpu = pytest.mark.skipif(
    not PROBE.available, reason=f"needs a CUDA GPU (run on the H200): {PROBE.reason}"
)


@pytest.fixture(scope="session")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuContext]:
    if not PROBE.available:
        pytest.skip(f"needs a CUDA GPU (run on the H200): {PROBE.reason}")
    context = GpuContext(0, cache_dir=tmp_path_factory.mktemp("kernel-cache"))
    yield context
    context.close()


class Device:
    """Device copies of numpy arrays for the tests (synchronous)."""

    def __init__(self, ctx: GpuContext) -> None:
        self.ctx = ctx
        self.buffers: list[object] = []

    def put(self, array: np.ndarray) -> int:
        from cuda.bindings import driver

        buf = self.ctx.alloc(array.nbytes)
        self.buffers.append(buf)
        a = np.ascontiguousarray(array)
        (err,) = driver.cuMemcpyHtoD(buf.ptr, a.ctypes.data, a.nbytes)
        assert int(err) == 0
        return buf.ptr

    def empty(self, nbytes: int) -> int:
        buf = self.ctx.alloc(nbytes)
        self.buffers.append(buf)
        return buf.ptr

    def get(self, ptr: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        from cuda.bindings import driver

        out: np.ndarray = np.empty(shape, dtype)
        (err,) = driver.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes)
        assert int(err) == 0
        return out

    def free(self) -> None:
        for b in self.buffers:
            b.free()  # type: ignore[attr-defined]


@pytest.fixture
def dev(ctx: GpuContext) -> Iterator[Device]:
    d = Device(ctx)
    yield d
    d.free()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
