"""``prep build --target dla --core N`` and ``prep build --target gpu``: the TensorRT DLA and
GPU build paths reached from the command line and the build stage, against the recording
TensorRT stand-in (tests/prep/fake_tensorrt.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from prep import build_trt
from prep.cli import main
from prep.pipeline import BuildConfig, ConfigError
from tests.prep.fake_tensorrt import FakeTensorRT
from tests.prep.test_build_trt import (
    HEADS,
    INTERNAL,
    make_onnx,
    run_build_stage,
    translated_toy,
    write_cache,
)


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


# --------------------------------------------------------------------------- the GPU engine
def test_build_onnx_for_the_gpu(tmp_path: Path, fake_trt: FakeTensorRT) -> None:
    tdir = translated_toy(tmp_path)
    out = tmp_path / "toy.gpu.engine"
    argv = ["build", "--target", "gpu", "--onnx", str(tdir / "model_noqdq.onnx"),
            "--calib", str(tdir / "model_precision_config_calib.cache"),
            "--precision-config", str(tdir / "model_precision_config.json"),
            "--max-batch", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert out.read_bytes() == b"FAKE-ENGINE gpu"
    assert fake_trt.config is not None
    assert fake_trt.config.profiles[0].shapes["images"] == (
        (1, 3, 32, 32), (4, 3, 32, 32), (4, 3, 32, 32),
    )  # fmt: skip
    assert not fake_trt.calls_to("config", "DLA_core=")
    assert fake_trt.network is not None
    assert sorted(x.name for x in fake_trt.network.layers if x.output_types) == sorted(HEADS)
    meta = json.loads((tmp_path / "toy.gpu.engine.json").read_text())
    assert (meta["max_batch"], meta["engine"]) == (4, "toy.gpu.engine")


@pytest.mark.parametrize("targets", [["emulated"], ["dla", "gpu"]])
def test_build_onnx_takes_one_tensorrt_target(
    tmp_path: Path, fake_trt: FakeTensorRT, capsys: pytest.CaptureFixture[str], targets: list[str]
) -> None:
    onnx_path = make_onnx(tmp_path / "toy.onnx")
    argv = ["build", "--onnx", str(onnx_path)]
    for target in targets:
        argv += ["--target", target]
    assert main(argv) == 2
    assert "builds one TensorRT target, dla or gpu" in capsys.readouterr().err
    assert fake_trt.calls == []


@pytest.mark.parametrize(
    "argv",
    [
        ["build", "--target", "gpu", "--max-batch", "0"],
        ["build", "--target", "gpu", "--max-batch", "65"],
        ["build", "--target", "gpu", "--set", "build.max_batch=100"],
        ["build", "--target", "gpu", "--onnx", "toy.onnx", "--max-batch", "0"],
    ],
)
def test_a_bad_max_batch_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main([*argv, "--workdir", str(tmp_path)]) == 2
    assert "build.max_batch" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()


def test_chain_build_takes_the_gpu_target_and_max_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    class RecordingChain:
        def __init__(self, workdir: Path, cfg: Any, **kwargs: Any) -> None:
            seen.append(cfg)

        def run(self, stage: str) -> None:
            seen.append(stage)

    monkeypatch.setattr("prep.pipeline.Chain", RecordingChain)
    assert main(["build", "--target", "gpu", "--max-batch", "16", "--workdir", str(tmp_path)]) == 0
    cfg, stage = seen
    assert (stage, cfg.build.targets, cfg.build.max_batch) == ("build", ("gpu",), 16)
    seen.clear()
    assert main(["build", "--workdir", str(tmp_path)]) == 0
    assert (seen[0].build.targets, seen[0].build.max_batch) == (("emulated", "dla"), 8)


@pytest.mark.parametrize("target", ["dla", "gpu"])
def test_build_onnx_without_tensorrt_fails_with_the_reason(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    target: str,
) -> None:
    # The precedent of the DLA target, which the GPU target follows: a build error, exit 1.
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    tdir = translated_toy(tmp_path)
    argv = ["build", "--target", target, "--onnx", str(tdir / "model_noqdq.onnx"),
            "--calib", str(tdir / "model_precision_config_calib.cache")]  # fmt: skip
    assert main(argv) == 1
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "TensorRT is not importable here" in record.getMessage()
    assert sorted(p.name for p in tdir.iterdir()) == [
        "model_noqdq.onnx", "model_precision_config.json", "model_precision_config_calib.cache",
    ]  # fmt: skip


def test_the_build_stage_builds_the_gpu_engine(tmp_path: Path, fake_trt: FakeTensorRT) -> None:
    translated_toy(tmp_path)
    outputs, metrics = run_build_stage(tmp_path, targets=("gpu",), max_batch=3)
    build = tmp_path / "build"
    assert outputs == {
        "gpu_onnx": build / "model_gpu.onnx",
        "trtexec_commands": build / "trtexec_commands.json",
        "gpu": build / "model.gpu.engine",
        "gpu_metadata": build / "model.gpu.engine.json",
    }
    assert (build / "model.gpu.engine").read_bytes() == b"FAKE-ENGINE gpu"
    (report,) = metrics["built"]
    assert (report["device"], report["max_batch"]) == ("gpu", 3)
    (command,) = json.loads((build / "trtexec_commands.json").read_text()).values()
    assert f"--onnx={build / 'model_gpu.onnx'}" in command
    assert "--maxShapes=images:3x3x32x32" in command
    assert fake_trt.network is not None
    assert fake_trt.network.inputs[0].shape == (-1, 3, 32, 32)  # read from model_gpu.onnx


def test_without_tensorrt_the_build_stage_skips_the_gpu_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    translated_toy(tmp_path)
    outputs, metrics = run_build_stage(tmp_path, targets=("gpu",))
    assert metrics == {"tensorrt": None, "built": [], "skipped": "TensorRT not installed"}
    assert set(outputs) == {"gpu_onnx", "trtexec_commands"}
    assert not (tmp_path / "build" / "model.gpu.engine").exists()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "not built: gpu" in warning
    assert "built on the device that runs it" in warning


@pytest.mark.parametrize(("asked", "keys"), [
    ("auto", {"dla0", "dla0_explicit"}), ("implicit", {"dla0"}), ("explicit", {"dla0_explicit"}),
])  # fmt: skip
def test_without_tensorrt_the_build_stage_writes_the_asked_paths_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str, keys: set[str]
) -> None:
    """``build.quantization`` picks the trtexec commands written where TensorRT is absent:
    both paths' for ``auto`` (the JetPack that runs them decides), else the asked one's."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    translated_toy(tmp_path)
    run_build_stage(tmp_path, targets=("dla",), cores=(0,), quantization=asked)
    commands = json.loads((tmp_path / "build" / "trtexec_commands.json").read_text())
    assert set(commands) == keys


def test_a_build_path_that_does_not_exist_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"build\.quantization: 'strong' is not auto"):
        BuildConfig(quantization="strong")
