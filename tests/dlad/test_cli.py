from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dlad.cli import main


def test_version_and_help_import_nothing_heavy() -> None:
    code = (
        "import sys, dlad.cli\n"
        "try:\n    dlad.cli.main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = {'torch', 'onnx', 'onnxruntime', 'zmq', 'anyio'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_config_errors_exit_2_naming_key_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[devices.dla0]\nkind = 'dla'\ncore = 2\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err
    assert "core" in err
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_status_of_an_absent_daemon_is_a_clear_failure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--endpoint", "tcp://127.0.0.1:9", "--timeout", "0.2"]) == 1
    assert "no reply" in capsys.readouterr().err
