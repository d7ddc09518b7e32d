"""Connections that flood the daemon and vanish (docs/reliability.md, "A flood that vanishes"):
libzmq 4.3.5 aborts the process when a peer whose inbound queue is full hangs up and a PING or a
heartbeat then asks that connection's engine to write. The daemon runs in a process of its own
here, so that an abort fails the test instead of ending the suite."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from dlad import protocol
from dlad.errors import Status
from tests.dlad.test_metrics import wait_for
from tests.dlad.zmtp_peer import flood_and_vanish

pytestmark = pytest.mark.timeout(300)

CONFIG = """
[frontend]
endpoints = ["tcp://127.0.0.1:*"]
heartbeat_s = 0.05
[metrics]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_twenty_floods_that_vanish_leave_the_daemon_serving(tmp_path: Path) -> None:
    """Twenty times, four connections send junk with PINGs among it as fast as the daemon
    takes it, never reading, then reset: the daemon lives through each (heartbeats every
    50 ms: the other way to the abort), cuts the floods, grows by little, and then serves."""
    cfg, log = tmp_path / "dlad.toml", tmp_path / "dlad.log"
    cfg.write_text(CONFIG)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dlad.cli", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(lambda: "listening" in log.read_text() or proc.poll() is not None, 60)
        found = re.search(r"tcp://127\.0\.0\.1:(\d+)", log.read_text().split("listening")[1])
        assert found, log.read_text()[-2000:]
        port = int(found.group(1))
        before = rss_mib(proc.pid)
        for _ in range(20):
            floods = [threading.Thread(target=flood_and_vanish, args=("127.0.0.1", port, 0.3))
                      for _ in range(4)]  # fmt: skip
            for t in floods:
                t.start()
            for t in floods:
                t.join()
            assert proc.poll() is None, log.read_text()[-2000:]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(protocol.encode(protocol.StatusRequest(1)))
            assert sock.poll(30_000)
            reply = protocol.decode_reply(sock.recv_multipart())
            assert (reply.id, reply.status) == (1, Status.OK)
        finally:
            sock.close(0)
            ctx.term()
        assert proc.poll() is None
        assert rss_mib(proc.pid) - before < 256  # unbounded, the floods took 300-700 MB
        wait_for(lambda: "connections_cut=" in log.read_text())
        cuts = sum(int(n) for n in re.findall(r"connections_cut=(\d+)", log.read_text()))
        assert cuts >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
