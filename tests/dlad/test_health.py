"""Engine health: quarantine, failover and probes on a running daemon (docs/daemon.md
"Engine health"). Every test synchronises on replies and STATUS, never on the clock."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import Status
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import IMAGE, _status, dealer, recv

TWO_CORES = """
[daemon]
default_deadline_ms = 20000.0
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[metrics]
enabled = false
[health]
quarantine_after = {after}
retry = {retry}
probe_after_s = 30.0
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = 500.0
task_timeout_ms = {timeout}
[devices.dla0.faults]
error_rate = {error_rate}
hang_rate = {hang_rate}
seed = {seed}
[devices.dla1]
kind = "dla"
core = 1
mode = "timing"
latency_us = 500.0
[models.demo]
devices = ["dla0", "dla1"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
core1 = "bundled:demo/fp16_heads.dla1.emu"
"""


def _seed(rate: float, then_fail: int) -> int:
    """A fault seed whose first draw (the warm-up task) passes and the next ``then_fail`` fail
    (or hang)."""
    for seed in range(100_000):
        rng = random.Random(seed)
        if rng.random() >= rate and all(rng.random() < rate for _ in range(then_fail)):
            return seed
    raise AssertionError("no such seed below 100000")


def _daemon(
    tmp_path: Path, *, after: int = 3, retry: bool = True, error_rate: float = 0.0,
    hang_rate: float = 0.0, timeout: float = 10_000.0, then_fail: int = 1,
) -> Daemon:  # fmt: skip
    cfg = tmp_path / "dlad.toml"
    rate = error_rate + hang_rate
    cfg.write_text(TWO_CORES.format(
        after=after, retry=str(retry).lower(), error_rate=error_rate, hang_rate=hang_rate,
        timeout=timeout, seed=_seed(rate, then_fail),
    ))  # fmt: skip
    return Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])


def _serve(endpoint: str, n: int, window: int = 4) -> list[protocol.InferReply]:
    """Send ``n`` INFERs, ``window`` in flight (within what either core's queue holds, so a
    retry always finds room), and return their replies."""
    replies = []
    with dealer(endpoint) as sock:
        for i in range(n):
            if i >= window:
                replies.append(recv(sock))
            sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", IMAGE)))
        replies += [recv(sock) for _ in range(min(n, window))]
    assert sorted(int(r.id or 0) for r in replies) == list(range(n))  # one reply each
    return replies  # type: ignore[return-value]


def test_failed_jobs_are_retried_once_on_the_other_core(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, after=0, error_rate=0.3)  # no quarantine: retries alone
    with serve_in_thread(daemon) as ep:
        replies = _serve(ep, 60)
    assert Counter(r.status for r in replies) == {Status.OK: 60}
    failed = daemon.executors["dla0"].stats.failed
    assert failed > 0  # dla0 did fail some; each was answered by dla1
    assert sum(r.device == "dla1" for r in replies) >= failed


def test_without_retry_a_failure_is_the_answer(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, after=0, retry=False, error_rate=0.3)
    with serve_in_thread(daemon) as ep:
        replies = _serve(ep, 60)
    failed = daemon.executors["dla0"].stats.failed
    assert Counter(r.status for r in replies)[Status.DEVICE_FAILED] == failed > 0


def test_a_hung_core_is_fenced_off_at_its_first_hang_and_nothing_is_lost(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, hang_rate=0.9, timeout=300.0, then_fail=3)
    with serve_in_thread(daemon) as ep:
        replies = _serve(ep, 40)
        with dealer(ep) as sock:
            report = _status(sock, 99)
        # dla1 serves the model: the daemon stays ready (asked while it runs: once it drains,
        # its next heartbeat makes it not ready, as it should be)
        ready = daemon.metrics.ready()[0]
    assert Counter(r.status for r in replies) == {Status.OK: 40}
    dla0 = next(d for d in report["devices"] if d["name"] == "dla0")
    assert (dla0["state"], dla0["healthy"]) == ("quarantined", False)
    assert "a task hung" in dla0["reason"]
    assert daemon.quarantines("dla0") == 1
    assert ready
    # At most the tasks in flight when the first hang ended ever ran on dla0 (its two slots).
    assert daemon.executors["dla0"].stats.failed <= 2


@pytest.mark.parametrize("after", [1, 3])
def test_a_failing_core_is_quarantined_and_its_queue_moves(tmp_path: Path, after: int) -> None:
    daemon = _daemon(tmp_path, after=after, error_rate=0.9, then_fail=after + 2)
    with serve_in_thread(daemon) as ep:
        replies = _serve(ep, 40)
    assert Counter(r.status for r in replies) == {Status.OK: 40}
    assert daemon.quarantines("dla0") == 1  # and out still: its probe rest is 30 s
    assert daemon.executors["dla0"].stats.failed < after + 2  # then it got no more work
