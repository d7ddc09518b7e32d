"""The GPU probe and the pre/post backend choice on machines without a GPU (CI): every way of
"no GPU" is an answer with a reason, never a crash."""

from __future__ import annotations

import sys
import types

import pytest

from dlad.gpu import driver
from dlad.gpu.service import select_backend


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, runtime: object, drv: object) -> None:
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime  # type: ignore[attr-defined]
    bindings.driver = drv  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)


class _Err(int):
    @property
    def name(self) -> str:
        return {35: "cudaErrorInsufficientDriver"}.get(int(self), "cudaSuccess")


def _no_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.bindings.runtime"):
        monkeypatch.setitem(sys.modules, name, None)


def test_probe_here_answers_without_raising() -> None:
    found = driver.probe()
    if found.available:
        pytest.skip("this machine has a GPU")
    assert found.reason
    assert "no GPU" in found.describe()


def test_missing_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_cuda_python(monkeypatch)
    found = driver.probe()
    assert not found.available
    assert "cuda-python is not installed" in found.reason


def test_no_driver_runtime_error_35(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = types.SimpleNamespace(cudaGetDeviceCount=lambda: (_Err(35), 0))
    _fake_cuda(monkeypatch, runtime, types.SimpleNamespace())
    found = driver.probe()
    assert not found.available
    assert "cudaErrorInsufficientDriver" in found.reason


def test_driver_library_missing_raises_inside_cuinit(monkeypatch: pytest.MonkeyPatch) -> None:
    class DynamicLibNotFoundError(RuntimeError):
        pass

    def cu_init(_flags: int) -> None:
        raise DynamicLibNotFoundError('"cuda" is an NVIDIA driver library')

    runtime = types.SimpleNamespace(cudaGetDeviceCount=lambda: (_Err(0), 1))
    _fake_cuda(monkeypatch, runtime, types.SimpleNamespace(cuInit=cu_init))
    found = driver.probe()
    assert not found.available
    assert "DynamicLibNotFoundError" in found.reason


def test_zero_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = types.SimpleNamespace(cudaGetDeviceCount=lambda: (_Err(0), 0))
    _fake_cuda(monkeypatch, runtime, types.SimpleNamespace())
    found = driver.probe()
    assert not found.available
    assert "0 CUDA devices" in found.reason


def test_backend_choice_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_cuda_python(monkeypatch)
    assert select_backend("cpu", True) == ("cpu", None)
    assert select_backend("auto", False) == ("cpu", None)
    backend, found = select_backend("auto", True)
    assert backend == "cpu"
    assert found is not None
    assert not found.available
    with pytest.raises(RuntimeError, match=r"pre_post\.backend = 'cuda'"):
        select_backend("cuda", True)
