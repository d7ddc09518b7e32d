"""``prep build --target dla --core N``: the TensorRT DLA build path reached from the command
line, against the recording TensorRT stand-in (tests/prep/fake_tensorrt.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from prep import build_trt
from prep.cli import main
from tests.prep.fake_tensorrt import FakeTensorRT
from tests.prep.test_build_trt import INTERNAL, make_onnx, write_cache


@pytest.fixture
def fake_trt(monkeypatch: pytest.MonkeyPatch) -> FakeTensorRT:
    fake = FakeTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(build_trt, "_cuda_device_count", lambda: 1)
    return fake


@pytest.mark.parametrize("core", [0, 1])
def test_build_onnx_for_a_dla_core(tmp_path: Path, fake_trt: FakeTensorRT, core: int) -> None:
    onnx_path = make_onnx(tmp_path / "toy_noqdq.onnx")
    cache = write_cache(tmp_path / "toy.cache", {"images": 0.01, **dict.fromkeys(INTERNAL, 0.05)})
    out = tmp_path / f"toy.dla{core}.loadable"
    argv = ["build", "--target", "dla", "--core", str(core), "--onnx", str(onnx_path),
            "--calib", str(cache), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert out.read_bytes() == f"FAKE-LOADABLE core={core}".encode()
    assert fake_trt.calls_to("config", "DLA_core=") == [(core,)]


def test_chain_build_takes_target_and_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    class RecordingChain:
        def __init__(self, workdir: Path, cfg: Any, **kwargs: Any) -> None:
            seen.append(cfg)

        def run(self, stage: str) -> None:
            seen.append(stage)

    monkeypatch.setattr("prep.pipeline.Chain", RecordingChain)
    assert main(["build", "--target", "dla", "--core", "1", "--workdir", str(tmp_path)]) == 0
    cfg, stage = seen
    assert stage == "build"
    assert cfg.build.targets == ("dla",)
    assert cfg.build.cores == (1,)
    seen.clear()
    assert main(["build", "--workdir", str(tmp_path)]) == 0  # the preset's defaults
    assert seen[0].build.targets == ("emulated", "dla")
    assert seen[0].build.cores == (0, 1)
