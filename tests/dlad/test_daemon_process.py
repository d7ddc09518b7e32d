"""The real ``dlad`` process: SIGTERM drains (every accepted request answered, new ones refused),
a second signal forces the exit, and the exit is clean."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import zmq

from dlad import protocol
from dlad.errors import Status

pytestmark = pytest.mark.timeout(90)

CONFIG = """
[daemon]
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


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    endpoint = f"ipc://{tmp_path}/dlad.sock"
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(CONFIG.format(endpoint=endpoint))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlad.cli", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # readiness is announced, not slept on
        if "listening" in line:
            return proc, endpoint
    raise AssertionError(f"dlad exited with {proc.wait()} before listening")


def test_sigterm_drains_then_exits_cleanly(tmp_path: Path) -> None:
    proc, endpoint = _start(tmp_path)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    image = np.zeros((64, 64, 3), np.uint8)
    try:
        for i in range(12):  # 4 on the cores (2 slots each), 8 queued
            sock.send_multipart(
                protocol.encode(protocol.InferRequest(i, "demo", image)), copy=False
            )
        sock.send_multipart(protocol.encode(protocol.StatusRequest(100)))
        assert sock.poll(10_000)
        status = protocol.decode_reply(sock.recv_multipart())
        assert status.id == 100  # all 12 INFERs were read before the signal
        proc.send_signal(signal.SIGTERM)
        replies = []
        for _ in range(12):
            assert sock.poll(20_000)
            replies.append(protocol.decode_reply(sock.recv_multipart()))
        assert proc.wait(30) == 0
    finally:
        sock.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert sorted(int(r.id or 0) for r in replies) == list(range(12))
    counts = Counter(r.status for r in replies)
    assert counts[Status.OK] >= 4  # the ones already on a device finished
    assert set(counts) == {Status.OK, Status.SHUTTING_DOWN}


def test_second_signal_forces_exit(tmp_path: Path) -> None:
    proc, endpoint = _start(tmp_path)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        for i in range(4):  # keep both cores busy for 150 ms x 2 slots
            sock.send_multipart(
                protocol.encode(protocol.InferRequest(i, "demo", np.zeros((8, 8, 3), np.uint8))),
                copy=False,
            )
        sock.send_multipart(protocol.encode(protocol.StatusRequest(100)))
        assert sock.poll(10_000)
        sock.recv_multipart()
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) in (0, 1)
    finally:
        sock.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
