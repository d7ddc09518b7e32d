"""What the distributions carry: the sdist holds what a build and the docs need, the wheel's
Python part holds the default config and the KServe protocol file, and an installed ``dlad``
finds its default config from any directory."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dlad.cli import main
from dlad.config import DEFAULT_CONFIG, load_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _setup(tmp_path: Path, *command: str) -> None:
    """Run a setup.py command in a copy-free way: the tree's own setup.py, output in tmp."""
    subprocess.run([sys.executable, "setup.py", "-q", *command], cwd=ROOT, check=True,
                   capture_output=True, timeout=240)  # fmt: skip


def test_the_sdist_holds_the_build_and_the_docs(tmp_path: Path) -> None:
    _setup(tmp_path, "sdist", "--dist-dir", str(tmp_path), "--formats", "gztar")
    (sdist,) = tmp_path.glob("dlad-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in [
        "LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in",
        "dlad/native/plane.hpp", "dlad/native/plane.cpp", "dlad/native/frame_rules.hpp",
        "clients/dlad_wire/native/names.hpp", "clients/dlad_wire/native/frames.hpp",
        "dlad/etc/dlad.toml", "etc/dlad.toml", "dlad/kserve/open_inference.proto",
        "deploy/systemd/dlad.service", "deploy/docker/Dockerfile.jetson",
        "examples/detect.py", "docs/protocol.md", "docs/jetson.md",
        "dlad/models/demo/fp16_heads.dla0.emu",
    ]:  # fmt: skip
        assert needed in names, needed
    assert not [n for n in names if n.endswith((".so", ".pyc"))]


def test_the_wheels_python_holds_the_default_config_and_the_proto(tmp_path: Path) -> None:
    _setup(tmp_path, "build_py", "--build-lib", str(tmp_path))
    assert (tmp_path / "dlad/etc/dlad.toml").read_text() == DEFAULT_CONFIG.read_text()
    assert (tmp_path / "dlad/kserve/open_inference.proto").is_file()
    assert (tmp_path / "dlad/models/demo/fp16_heads.dla1.emu").is_file()


def test_the_repositorys_config_is_the_packages() -> None:
    assert (ROOT / "etc/dlad.toml").resolve() == DEFAULT_CONFIG.resolve()


def test_print_default_writes_the_default_config(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:  # fmt: skip
    assert main(["config", "--print-default"]) == 0
    written = tmp_path / "mine.toml"
    written.write_text(capsys.readouterr().out)
    assert written.read_text() == DEFAULT_CONFIG.read_text()
    assert [d.name for d in load_config(written).plan().config.devices] == ["dla0", "dla1", "gpu"]


def test_without_config_dlad_uses_the_default_from_any_directory(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dlad.cli", "status", "--platform"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(proc.stdout)["engines"]) == ["dla0", "dla1", "gpu"]
