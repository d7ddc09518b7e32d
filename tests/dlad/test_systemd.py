"""``Type=notify`` under systemd (dlad/systemd.py): a unix datagram socket stands in for
systemd's ``$NOTIFY_SOCKET`` and records what the daemon tells it, and the shipped unit passes
``systemd-analyze verify``."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.systemd import Notifier
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import CONFIG

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "dlad.service"


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    """systemd's end: a datagram socket bound where ``$NOTIFY_SOCKET`` will point."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(20.0)
    try:
        yield sock
    finally:
        sock.close()


def _messages(sock: socket.socket, until: str) -> list[dict[str, str]]:
    """What arrives, each datagram parsed, up to and including the first with ``until``."""
    out = []
    while True:
        lines = sock.recv(4096).decode().split("\n")
        out.append(dict(line.split("=", 1) for line in lines))
        if until in out[-1]:
            return out


def test_ready_then_the_watchdog_from_the_heartbeat_then_stopping(
    tmp_path: Path, manager: socket.socket
) -> None:
    cfg = tmp_path / "dlad.toml"
    text = CONFIG.format(depth=4, mode="timing", latency=2000.0, faults0="", faults1="",
                         scheduler="")  # fmt: skip
    cfg.write_text(text + "\n[metrics]\nenabled = false\nheartbeat_s = 0.05\n")
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "1000000",
           "WATCHDOG_PID": str(os.getpid())}  # fmt: skip
    notifier = Notifier(env)
    assert notifier.watchdog_s == 1.0
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"], notifier=notifier)
    with serve_in_thread(daemon):
        told = _messages(manager, "READY")
        ready = told[-1]
        assert ready["MAINPID"] == str(os.getpid())
        assert ready["STATUS"].startswith("serving dla0, dla1 on tcp://127.0.0.1:")
        beats = 0
        while beats < 3:  # the heartbeat goes on feeding it while the daemon serves
            beats += "WATCHDOG" in _messages(manager, "WATCHDOG")[-1]
    after = _messages(manager, "STOPPING")  # the drain told systemd before the socket closed
    assert after[-1]["STATUS"].startswith("draining")


def test_without_a_notify_socket_nothing_is_sent_and_a_dead_manager_costs_one_warning(
    tmp_path: Path,
) -> None:
    quiet = Notifier({})
    assert (quiet.enabled, quiet.watchdog_s) == (False, None)
    quiet.ready("serving")  # nothing to send to: no error
    assert (
        Notifier(
            {"NOTIFY_SOCKET": "@abstract", "WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}
        ).watchdog_s
        is None
    )  # another process's watchdog
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        for _ in range(3):
            gone.status("serving")
    assert [e["event"] for e in logs] == ["sd_notify_failed"]


def test_the_abstract_namespace_is_reached_too() -> None:
    name = f"dlad-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5.0)
        Notifier({"NOTIFY_SOCKET": f"@{name}"}).stopping("draining")
        assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_unit_file_verifies(tmp_path: Path) -> None:
    # ExecStart's binary must exist for verify: point it at this venv's dlad
    scripts = sysconfig.get_path("scripts")  # this venv's (not always on PATH)
    found = shutil.which("dlad", path=scripts) or shutil.which("dlad")
    assert found is not None, "the dlad command is installed with the package"
    dlad = Path(found)
    unit = tmp_path / "dlad.service"
    unit.write_text(UNIT.read_text().replace("/opt/dlad/bin/dlad", str(dlad)))
    run = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, check=False)  # fmt: skip
    problems = [line for line in run.stderr.splitlines() if str(unit) in line]
    assert (run.returncode, problems) == (0, []), run.stderr


def test_the_units_paths_are_those_its_install_steps_make() -> None:
    """ExecStart runs the dlad the header's steps install, on the config they write."""
    text = UNIT.read_text()
    venv = re.search(r"sudo python3 -m venv (\S+) && sudo \1/bin/pip install", text)
    written = re.search(r"dlad config --print-default \| sudo tee (\S+)", text)
    assert venv is not None
    assert written is not None
    exec_start = re.search(r"^ExecStart=(\S+) --config (\S+)$", text, re.M)
    assert exec_start is not None
    assert exec_start.group(1) == f"{venv.group(1)}/bin/dlad"
    assert exec_start.group(2) == written.group(1)
    assert f"{venv.group(1)}/bin/dlad config --print-default" in text
