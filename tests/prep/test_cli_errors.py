"""``prep``'s expected failures are one line on stderr and an exit status: a package of the
``[prep]`` extra that is not installed (named, with the command that installs it), and a file
given to ``prep translate`` that is not ONNX."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prep.cli import main
from prep.extras import PREP_PACKAGES, missing_extra_message


@pytest.mark.parametrize("command", [["all"], ["train"], ["translate", "--onnx", "x.onnx"]])
def test_a_missing_extra_package_names_the_extra(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # As if torch were not installed: `import torch` raises ModuleNotFoundError('torch'), and
    # prep's modules that import it are imported afresh.
    monkeypatch.setitem(sys.modules, "torch", None)
    keep = {"prep.cli", "prep.extras", "prep.profile_cmd"}
    for name in [m for m in sys.modules if m.startswith("prep.") and m not in keep]:
        monkeypatch.delitem(sys.modules, name)
    assert main([*command, "--workdir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prep: prep {command[0]} needs torch, which comes with the [prep] extra")
    assert "pip install" in err
    assert "'.[prep]'" in err
    assert len(err.strip().splitlines()) == 1


def test_only_the_extras_packages_are_reported_as_the_extra() -> None:
    assert set(PREP_PACKAGES) >= {"torch", "modelopt", "onnx_graphsurgeon"}
    assert missing_extra_message("modelopt.torch.quantization") is not None
    assert missing_extra_message("numpy") is None  # another problem: not disguised as this one
    assert missing_extra_message(None) is None


@pytest.mark.parametrize("content", [b"", b"not an onnx model\n", bytes(range(256)) * 4])
def test_translate_of_a_file_that_is_not_onnx(
    content: bytes,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(content)
    assert main(["translate", "--onnx", str(bad), "--out", str(tmp_path / "out")]) == 1
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]  # prep's log line
    assert f"{bad} is not an ONNX model" in record.getMessage()
    assert record.exc_info is None  # no traceback
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
