"""The platform probe, the self-test, ``dlad status --platform`` and the backend factory, on the
fake library (pointed at by DLAD_CUDLA_LIB / DLAD_NVSCIBUF_LIB / DLAD_NVSCISYNC_LIB)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlad.cli import main as dlad_main
from dlad.devices.base import DlaError
from dlad.devices.cudla.backend import CudlaDlaCore
from dlad.devices.cudla.probe import format_version, probe
from dlad.devices.cudla.selftest import main as selftest_main
from dlad.devices.cudla.selftest import run_selftest
from dlad.devices.emulated import EmulatedDlaCore
from dlad.devices.factory import open_core, resolve_backend
from dlad.loadable import read_loadable
from dlad.models import DEMO
from tests.dlad.cudla.fakelib import FakeLib, fake_loadable

pytestmark = pytest.mark.timeout(60)
ENV = ("DLAD_CUDLA_LIB", "DLAD_NVSCIBUF_LIB", "DLAD_NVSCISYNC_LIB")


@pytest.fixture
def on_fake(fake: FakeLib, monkeypatch: pytest.MonkeyPatch) -> FakeLib:
    for name in ENV:
        monkeypatch.setenv(name, str(fake.path))
    return fake


@pytest.fixture
def loadables(tmp_path: Path) -> dict[int, str]:
    out = {}
    for core in (0, 1):
        lo = read_loadable(DEMO / f"fp16_heads.dla{core}.emu")
        path = tmp_path / f"model.dla{core}.loadable"
        path.write_bytes(fake_loadable(lo.inputs, lo.outputs, core))
        out[core] = str(path)
    return out


def test_probe(on_fake: FakeLib) -> None:
    on_fake.option("version", 1_004_002)
    on_fake.option("dla_version", 0x20001)
    found = probe()
    assert found.available
    assert (found.cudla_version, found.device_count) == ("1.4.2", 2)
    assert found.dla_versions == {0: 0x20001, 1: 0x20001}
    assert "2 DLA cores" in found.summary()
    on_fake.fail_next("cudlaCreateDevice", 8)
    broken = probe()
    assert not broken.available
    assert "cudlaCreateDevice" in (broken.reason or "")
    assert format_version(1_002_001) == "1.2.1"


def test_probe_without_libraries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DLAD_CUDLA_LIB", str(tmp_path / "missing.so"))
    found = probe()
    assert not found.available
    assert "not available" in found.summary()
    assert "DLAD_CUDLA_LIB" in (found.reason or "")


def test_status_platform(on_fake: FakeLib, capsys: pytest.CaptureFixture[str]) -> None:
    assert dlad_main(["status", "--platform"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["available"] is True
    assert report["device_count"] == 2
    int8 = report["emulated_int8"]  # the emulated core's kernel path, named for people
    assert int8["exact"] is True
    assert int8["operands"] in ("u8s8", "u8u8")
    assert int8["operands"] in int8["summary"]


def test_selftest_exercises_every_call(on_fake: FakeLib, loadables: dict[int, str]) -> None:
    report = run_selftest(loadables)
    assert report.passed, report.text()
    assert report.uncalled == []  # every declared cuDLA / NvSci function ran at least once
    assert report.calls["cudlaSubmitTask"] == 2


def test_selftest_reports_a_failure(
    on_fake: FakeLib, loadables: dict[int, str], capsys: pytest.CaptureFixture[str]
) -> None:
    on_fake.task_fault(0, 1, 0x40000007, 1_000)  # DLA0's tasks fail
    argv = ["selftest", "--loadable", f"0={loadables[0]}", "--json"]
    on_fake.fail_next("cudlaImportExternalMemory", 4)
    assert dlad_main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    failed = [name for name, outcome, _ in report["steps"] if outcome == "failed"]
    assert failed == ["dla0: input buffers"]
    assert selftest_main(["--loadable", "7=x"]) == 2


def test_factory_backends(on_fake: FakeLib, loadables: dict[int, str]) -> None:
    lo = read_loadable(DEMO / "fp16_heads.dla0.emu")
    emu_path = str(DEMO / "fp16_heads.dla0.emu")
    assert resolve_backend("auto", None) == "emulated"  # no TensorRT loadable configured
    assert resolve_backend("auto", loadables[0]) == "cudla"  # the libraries load
    core, module = open_core("auto", 0, emu_path, lo, cudla_loadable=loadables[0],
                             cudla_options={"wait_grace_ms": 500})  # fmt: skip
    try:
        assert isinstance(core, CudlaDlaCore)
        assert module.inputs == lo.inputs  # scales from the .emu
        assert module.outputs == lo.outputs
    finally:
        core.close()
    emu, _ = open_core("emulated", 0, emu_path, lo, mode="timing")
    assert isinstance(emu, EmulatedDlaCore)
    emu.close()
    other = read_loadable(DEMO / "fp16_heads.dla1.emu")
    path = Path(loadables[0]).with_name("wrong.loadable")  # a different network
    path.write_bytes(fake_loadable(other.inputs, other.outputs[:1], 0))
    with pytest.raises(DlaError, match=r"differ from the \.emu"):
        open_core("cudla", 0, emu_path, lo, cudla_loadable=str(path))
    with pytest.raises(ValueError, match="TensorRT loadable"):
        open_core("cudla", 0, emu_path, lo)
    with pytest.raises(ValueError, match="auto, emulated or cudla"):
        resolve_backend("gpu", None)


def test_auto_without_libraries_is_emulated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DLAD_CUDLA_LIB", str(tmp_path / "missing.so"))
    assert resolve_backend("auto", str(tmp_path / "model.dla0.loadable")) == "emulated"
