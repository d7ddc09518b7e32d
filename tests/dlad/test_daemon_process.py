"""The real ``dlad`` process: SIGTERM drains (every accepted request answered, new ones refused),
a second signal forces the exit, and the exit is clean."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq

from dlad import protocol
from dlad.errors import Status

pytestmark = pytest.mark.timeout(90)

CONFIG = """
[daemon]
event_loop = "{loop}"
drain_timeout_s = 20.0
default_deadline_ms = 30000.0
[frontend]
endpoints = ["{endpoint}"]
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 8
mode = "timing"
latency_us = 150000.0
[devices.dla1]
kind = "dla"
core = 1
queue_depth = 8
mode = "timing"
latency_us = 150000.0
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


@contextmanager
def _daemon(
    tmp_path: Path, loop: str = "uvloop"
) -> Iterator[tuple[subprocess.Popen[str], zmq.Socket]]:
    """A ``dlad`` process on an ipc endpoint and a DEALER connected to it; both cleaned up.
    ``loop``: its ``[daemon] event_loop``, which its readiness line must name."""
    endpoint = f"ipc://{tmp_path}/dlad.sock"
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(CONFIG.format(endpoint=endpoint, loop=loop))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlad.cli", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        for line in proc.stdout:  # readiness is announced, not slept on
            if "listening" in line:
                assert f"event_loop={loop}" in line, line
                break
        else:
            raise AssertionError(f"dlad exited with {proc.wait()} before listening")
        sock.connect(endpoint)
        yield proc, sock
    finally:
        sock.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def _infer_then_status(sock: zmq.Socket, n: int, image: np.ndarray) -> None:
    """Send ``n`` INFERs, then a STATUS whose reply proves the daemon has read all of them."""
    for i in range(n):
        sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", image)), copy=False)
    sock.send_multipart(protocol.encode(protocol.StatusRequest(100)))
    assert sock.poll(10_000)
    assert protocol.decode_reply(sock.recv_multipart()).id == 100


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigterm_drains_then_exits_cleanly(tmp_path: Path, loop: str) -> None:
    with _daemon(tmp_path, loop) as (proc, sock):
        _infer_then_status(sock, 12, np.zeros((64, 64, 3), np.uint8))  # 4 run, 8 queue
        proc.send_signal(signal.SIGTERM)
        replies = []
        for _ in range(12):
            assert sock.poll(20_000)
            replies.append(protocol.decode_reply(sock.recv_multipart()))
        assert proc.wait(30) == 0
    assert sorted(int(r.id or 0) for r in replies) == list(range(12))
    counts = Counter(r.status for r in replies)
    assert counts[Status.OK] >= 4  # the ones already on a device finished
    assert set(counts) == {Status.OK, Status.SHUTTING_DOWN}


def test_second_signal_forces_exit(tmp_path: Path) -> None:
    with _daemon(tmp_path) as (proc, sock):
        _infer_then_status(sock, 4, np.zeros((8, 8, 3), np.uint8))  # both cores busy
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) in (0, 1)
