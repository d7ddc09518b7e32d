"""``dlad status --watch``: the live table is drawn from STATUS (with ``load``) of a real daemon,
and an unreachable daemon is a clear error with exit status 1."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from dlad import protocol
from dlad.cli import main
from dlad.errors import Status
from dlad.status_view import render, watch
from tests.dlad.test_metrics import dealer, recv, serving, wait_for

pytestmark = pytest.mark.timeout(60)


def _text(view: object) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(view)
    out = console.file
    assert isinstance(out, io.StringIO)
    return out.getvalue()


def test_render_shows_each_device_and_the_load() -> None:
    report: protocol.DaemonStatus = {
        "name": "orin1", "state": "RUNNING", "live": True, "ready": True, "version": "0.1.0",
        "protocol": 1, "models": [], "queues": {"depth": 3, "capacity": 8, "streams": 1},
        "devices": [
            {"name": "dla0", "kind": "dla", "core": 0, "healthy": True, "busy": True,
             "state": "serving", "reason": "",
             "in_flight": 2, "queue_depth": 3, "completed": 10, "failed": 0,
             "service_time_us": 3820.0, "host_us": 0.0, "max_batch": 1, "batches": [10]},
            {"name": "dla1", "kind": "dla", "core": 1, "healthy": False, "busy": False,
             "state": "quarantined", "reason": "3 tasks failed in a row", "in_flight": 0,
             "queue_depth": 0, "completed": 5, "failed": 4,
             "service_time_us": 3820.0, "host_us": 0.0, "max_batch": 1, "batches": [5]},
            {"name": "gpu", "kind": "gpu", "core": None, "healthy": True, "busy": True,
             "state": "serving", "reason": "",
             "in_flight": 8, "queue_depth": 4, "completed": 40, "failed": 0,
             "service_time_us": 1820.0,
             "host_us": 0.0, "max_batch": 8, "batches": [0, 2, 0, 1, 0, 0, 0, 4]},
        ],
        "load": {"window_s": 10.0, "rate_hz": 130.0, "ok_rate_hz": 125.0, "p50_us": 8000.0,
                 "p99_us": 21500.0, "devices": [
                     {"name": "dla0", "busy_ratio": 0.873, "rate_hz": 125.0, "p99_us": 21500.0},
                     {"name": "dla1", "busy_ratio": 0.0, "rate_hz": 0.0, "p99_us": 0.0}]},
    }  # fmt: skip
    text = _text(render(report, "tcp://x:1"))
    assert "orin1" in text
    assert "queue 3/8" in text
    assert "p99 21.5 ms" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("dla")}
    assert rows["dla0"][:8] == ["dla0", "dla0", "ok", "87", "2", "3", "125.0", "21.5"]
    assert rows["dla1"][2:4] == ["QUARANTINED", "0"]
    gpu = next(line.split() for line in text.splitlines() if line.startswith("gpu"))
    assert gpu[-1] == "5.7/8"  # 40 frames in 7 batches
    assert rows["dla0"][-1] == "1.0/1"


def test_watch_draws_a_running_daemon(tmp_path: Path) -> None:
    image = np.zeros((32, 32, 3), np.uint8)
    with serving(tmp_path, latency=1000.0) as daemon, dealer(daemon.bound[0]) as sock:
        wait_for(daemon.ready.is_set)
        for i in range(6):
            sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", image)))
        assert {recv(sock).status for _ in range(6)} == {Status.OK}
        out = io.StringIO()
        console = Console(file=out, width=160, color_system=None, force_terminal=False)
        assert watch(daemon.bound[0], 0.05, 5.0, count=3, console=console) == 0
    text = out.getvalue()
    assert "RUNNING" in text
    dla_rows = [line.split() for line in text.splitlines() if line.startswith(("dla0", "dla1"))]
    assert {row[0] for row in dla_rows} == {"dla0", "dla1"}
    assert sum(int(row[8]) for row in dla_rows[-2:]) == 6  # completed, from the last draw


def test_watch_without_a_daemon_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    assert main(["status", "--endpoint", endpoint, "--watch", "0.1", "--timeout", "0.2"]) == 1
    assert "no reply within 0.2 s" in capsys.readouterr().err
