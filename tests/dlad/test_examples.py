"""``examples/detect.py`` end to end: the bundled image's detections equal the recorded ones, for
the demo and, through the shipped ``etc/families.toml``, for a bundled model of each family side
by side; every way it can go wrong is one line on stderr with its exit status, never a
traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlad.config import load_config
from dlad.daemon import Daemon
from tests.dlad.serving import NUMERIC_DEMO, serve_config, serve_in_thread

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DETECT = ROOT / "examples" / "detect.py"


def detect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DETECT), *args], capture_output=True, text=True, timeout=100,
        check=False, cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A numeric-mode daemon (the real INT8 core) serving the bundled model."""
    with serve_config(NUMERIC_DEMO, tmp_path_factory.mktemp("detect")) as ep:
        yield ep


def test_the_bundled_image_gives_the_recorded_detections(endpoint: str) -> None:
    proc = detect("--endpoint", endpoint)
    assert proc.returncode == 0, proc.stderr
    assert "the two lists are the same" in proc.stdout
    assert proc.stderr == ""


@pytest.fixture(scope="module")
def families_endpoint() -> Iterator[str]:
    """The shipped etc/families.toml: the demo, YOLO11n and YOLO26n, one engine each."""
    plan = load_config(ROOT / "etc" / "families.toml").plan()
    daemon = Daemon(plan, endpoints=["tcp://127.0.0.1:0"], metrics_port=0)
    with serve_in_thread(daemon) as ep:
        yield ep


@pytest.mark.parametrize(("model", "device"), [("demo", "dla0"), ("yolo11n", "dla1"),
                                               ("yolo26n", "gpu")])  # fmt: skip
def test_each_family_is_served_beside_the_demo(
    families_endpoint: str, model: str, device: str
) -> None:
    proc = detect("--endpoint", families_endpoint, "--model", model)
    assert proc.returncode == 0, proc.stderr
    assert f"on {device} " in proc.stdout
    assert "the two lists are the same" in proc.stdout
    assert proc.stderr == ""


def test_an_unknown_model_is_the_daemons_not_found(endpoint: str) -> None:
    proc = detect("--endpoint", endpoint, "--model", "nope")
    assert proc.returncode == 1
    assert "NOT_FOUND" in proc.stderr
    assert "'nope'" in proc.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["/nonexistent/cat.jpg"], 2, "no such file"),
        ([str(ROOT / "README.md")], 2, "not an image"),
        (["--endpoint", "localhost:5555"], 2, "did you mean 'tcp://localhost:5555'"),
        (["--endpoint", "ipc:///nonexistent/dlad.sock", "--timeout", "0.3"], 1, "no dlad answered"),
    ],
)
def test_errors_are_one_line_and_an_exit_status(args: list[str], code: int, message: str) -> None:
    proc = detect(*args)
    assert proc.returncode == code
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
