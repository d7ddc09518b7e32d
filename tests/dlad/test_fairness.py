"""Clients cannot push each other around: streams scoped per client, per-client caps, fair
shares of full queues, and a rate limit on cheap requests (docs/protocol.md "Clients")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import Status
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import IMAGE, _status, dealer, recv
from tests.dlad.test_metrics import wait_for

SLOW_CORE = """
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
max_in_flight_per_client = {cap}
cheap_requests_per_s = {cheap}
[metrics]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 4
mode = "timing"
latency_us = 1000000.0
task_timeout_ms = 30000.0
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


@contextmanager
def slow_daemon(tmp_path: Path, cap: int = 256, cheap: float = 100000.0) -> Iterator[str]:
    """One core at 1 s a frame: whatever is sent stays queued for the test's length."""
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(SLOW_CORE.format(cap=cap, cheap=cheap))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep:
        yield ep


def _infer(sock: zmq.Socket[bytes], rid: int, stream: str | None = None) -> None:
    sock.send_multipart(protocol.encode(protocol.InferRequest(rid, "demo", IMAGE, stream=stream)))


def _fill_slots(ep: str, sock: zmq.Socket[bytes]) -> None:
    """Two frames on the core's two slots, so that what follows queues."""
    _infer(sock, 900)
    _infer(sock, 901)
    while _status(sock, 902)["devices"][0]["in_flight"] < 2:
        pass


def test_one_clients_stream_never_supersedes_anothers(tmp_path: Path) -> None:
    with slow_daemon(tmp_path) as ep, dealer(ep) as a, dealer(ep) as b:
        _fill_slots(ep, a)
        _infer(a, 1, stream="cam0")
        # a's frame is queued before b's is sent: two connections are read in no set order
        assert _status(a, 2)["queues"]["depth"] == 1
        _infer(b, 1, stream="cam0")  # same name, another client: its own stream
        report = _status(b, 2)
        assert (report["queues"]["depth"], report["queues"]["streams"]) == (2, 2)
        _infer(a, 3, stream="cam0")  # a's own newer frame does supersede a's
        superseded = recv(a)
        assert (superseded.id, superseded.status) == (1, Status.CANCELLED)
        assert _status(b, 4)["queues"]["depth"] == 2  # a's frame 3 and b's frame 1


def test_a_client_over_its_cap_is_refused_at_once(tmp_path: Path) -> None:
    with slow_daemon(tmp_path, cap=3) as ep, dealer(ep) as sock:
        for i in range(5):
            _infer(sock, i)
        refused = [recv(sock) for _ in range(2)]
        assert [r.status for r in refused] == [Status.OVERLOADED] * 2
        assert "3 requests in flight" in refused[0].message
        with dealer(ep) as other:  # another client is not held to the first one's count
            _infer(other, 1)
            assert _status(other, 2)["queues"]["depth"] == 2


def test_full_queues_are_shared_a_greedy_client_gives_way(tmp_path: Path) -> None:
    with slow_daemon(tmp_path) as ep, dealer(ep) as greedy, dealer(ep) as polite:
        _fill_slots(ep, greedy)
        for i in range(4):  # the whole queue
            _infer(greedy, i)
        _infer(greedy, 4)
        first = recv(greedy)  # full: the greedy client holds everything, so it is refused
        assert (first.id, first.status) == (4, Status.OVERLOADED)
        _infer(polite, 1)
        displaced = recv(greedy)
        assert (displaced.id, displaced.status) == (3, Status.OVERLOADED)  # its newest frame
        assert "displaced" in displaced.message
        report = _status(polite, 2)
        assert report["queues"]["depth"] == 4  # the polite frame took the place


def test_cheap_requests_are_rate_limited_per_client(tmp_path: Path) -> None:
    with slow_daemon(tmp_path, cheap=5.0) as ep, dealer(ep) as flood, dealer(ep) as other:
        for i in range(40):  # a burst of 10 is allowed, then 5 a second
            flood.send_multipart(protocol.encode(protocol.StatusRequest(i)))
        statuses = Counter(recv(flood).status for _ in range(40))
        assert statuses[Status.OVERLOADED] >= 25
        assert statuses[Status.OK] >= 10
        assert _status(other, 1)["state"] == "RUNNING"  # another client's bucket is full


def test_the_daemon_holds_at_most_its_byte_budget_of_frames(tmp_path: Path) -> None:
    budget = 3 * IMAGE.nbytes  # the slow core's two slots and one queued frame
    cfg = tmp_path / "dlad.toml"
    text = SLOW_CORE.format(cap=256, cheap=100000.0)
    side = "max_image_width = 512\nmax_image_height = 512\n"  # the budget holds one largest
    cfg.write_text(text.replace("[metrics]", f"max_buffered_bytes = {budget}\n{side}[metrics]"))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep, dealer(ep) as sock:
        for i in range(5):
            _infer(sock, i)
        refused = [recv(sock) for _ in range(2)]
        assert [(r.id, r.status) for r in refused] == [
            (3, Status.OVERLOADED),
            (4, Status.OVERLOADED),
        ]
        assert "budget" in refused[0].message
        assert daemon.frontend.buffered_bytes == budget


def test_a_connection_that_takes_a_closed_ones_routing_id_inherits_nothing(
    tmp_path: Path,
) -> None:
    """A client as routing id ``cam1`` sends three INFERs and an INFER_BATCH of two to a core
    that takes 1 s a frame and exits; another connects as ``cam1``. Before, the second got the
    first one's replies, with their detections, and could cancel its queued requests by id. Now
    the closed connection's queued images are cancelled when it closes and its replies (the
    batch's, which the control plane sends, too) are dropped, both counted: the newcomer gets
    only the replies to what it sent."""
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(SLOW_CORE.format(cap=256, cheap=100000.0))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep:
        plane = daemon.frontend.plane
        assert plane is not None
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        first = ctx.socket(zmq.DEALER)
        first.setsockopt(zmq.ROUTING_ID, b"cam1")
        first.linger = 0
        first.connect(ep)
        for rid in range(3):  # the core's slots run some, the rest wait in the queue
            first.send_multipart(protocol.encode(protocol.InferRequest(rid, "demo", IMAGE)))
        batch = protocol.InferBatchRequest(
            10, "demo", tuple(protocol.InferRequest(10, "demo", IMAGE) for _ in range(2))
        )
        first.send_multipart(protocol.encode(batch))
        wait_for(lambda: plane.pending == 5)
        first.close(0)
        wait_for(lambda: plane.counters()["cancelled_on_close"] > 0)
        second = ctx.socket(zmq.DEALER)
        second.setsockopt(zmq.ROUTING_ID, b"cam1")
        second.linger = 0
        second.connect(ep)
        try:
            second.send_multipart(protocol.encode(protocol.StatusRequest(99)))
            reply = recv(second)
            assert (type(reply).__name__, reply.id) == ("StatusReply", 99)
            # the running ones end on the core: their replies go nowhere either
            # (three INFERs' and the batch's one)
            wait_for(lambda: plane.counters()["orphaned"] == 4 and plane.pending == 0)
            assert plane.counters()["cancelled_on_close"] == 3  # the queued ones
            second.send_multipart(protocol.encode(protocol.StatusRequest(100)))
            assert recv(second).id == 100  # its own, and nothing of the first one's before it
        finally:
            second.close(0)
            ctx.term()


def test_a_late_close_of_a_reused_fd_takes_nothing_from_the_connection_now_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket's monitor can tell of a connection's close after a new connection has taken
    its file descriptor and sent work: the close then came while the newcomer's frames were
    queued and running. Before, it cancelled the newcomer's queued frames and dropped the
    replies of its running ones; now the newcomer's work is told apart by its socket (SO_COOKIE)
    and kept. Here the monitor's calls are held back (as a busy event loop holds them) while
    the kernel gives the closed connection's fd to the next one; the newcomer's own close
    afterwards still cancels what it left queued."""
    cfg = tmp_path / "dlad.toml"
    deadline = "[daemon]\ndefault_deadline_ms = 30000.0\n"  # the queued ones wait 1 s a frame
    cfg.write_text(deadline + SLOW_CORE.format(cap=256, cheap=100000.0))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep:
        plane = daemon.frontend.plane
        assert plane is not None
        held: list[tuple[str, int]] = []

        def hold_open(f: int) -> None:
            held.append(("opened", f))

        def hold_close(f: int) -> int:
            held.append(("closed", f))
            return 0

        with dealer(ep) as first:
            assert _status(first, 1)["queues"]["depth"] == 0
            wait_for(lambda: len(daemon.frontend._accepted) == 1)
            (fd,) = daemon.frontend._accepted
            monkeypatch.setattr(plane, "connection_opened", hold_open)
            monkeypatch.setattr(plane, "connection_closed", hold_close)
        wait_for(lambda: ("closed", fd) in held)
        with dealer(ep) as second:
            for rid in range(4):  # two run on the core's slots, two wait in its queue
                _infer(second, rid)
            wait_for(lambda: plane.pending == 4 and len(held) == 2)
            assert held == [("closed", fd), ("opened", fd)]  # the kernel's lowest free fd
            monkeypatch.undo()
            assert plane.connection_closed(fd) == 0  # the first one's close, heard late
            plane.connection_opened(fd)
            replies = [recv(second) for _ in range(4)]
            assert sorted((r.id, r.status) for r in replies) == [(i, Status.OK) for i in range(4)]
            counters = plane.counters()
            assert (counters["cancelled_on_close"], counters["orphaned"]) == (0, 0)
            for rid in range(10, 14):
                _infer(second, rid)
            while _status(second, 20)["devices"][0]["in_flight"] < 2:  # two run, two wait
                pass
        # the newcomer's own close: its two queued frames are cancelled, and every reply it
        # would have had (the two cancellations, the two running frames') is dropped
        wait_for(lambda: plane.pending == 0)
        counters = plane.counters()
        assert (counters["cancelled_on_close"], counters["orphaned"]) == (2, 4)


def test_connections_that_never_speak_take_no_clients_place(tmp_path: Path) -> None:
    """Raw TCP connections that never send a byte were counted toward the cap before any
    handshake: 80 of them, re-opened as they were cut, locked every client out. The cap now
    counts connections that have spoken (or outlived the handshake deadline): ten silent ones
    beside two clients, and the clients are served; a third client is still refused."""
    import socket

    cfg = tmp_path / "dlad.toml"
    text = SLOW_CORE.format(cap=256, cheap=100000.0)
    cfg.write_text(text.replace(  # the silent ones stay for the test's length
        "[metrics]", "max_connections = 2\nhandshake_timeout_s = 600.0\n[metrics]"))  # fmt: skip
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep:
        host, port = ep.removeprefix("tcp://").rsplit(":", 1)
        silent = [socket.create_connection((host, int(port))) for _ in range(10)]
        try:
            wait_for(lambda: daemon.frontend.connections == 10)  # accepted, never speaking
            with dealer(ep) as a, dealer(ep) as b:
                for sock in (a, b):
                    assert _status(sock, 1)["state"] == "RUNNING"
                with dealer(ep) as c:  # the cap holds for clients that speak
                    c.send_multipart(protocol.encode(protocol.StatusRequest(3)))
                    refused = daemon.metrics.registry.get_sample_value
                    wait_for(lambda: bool(refused("dlad_connections_refused_total")))
                    assert c.poll(0) == 0
        finally:
            for s in silent:
                s.close()


def test_connections_past_the_cap_are_refused_at_the_handshake(tmp_path: Path) -> None:
    cfg = tmp_path / "dlad.toml"
    text = SLOW_CORE.format(cap=256, cheap=100000.0)
    cfg.write_text(text.replace("[metrics]", "max_connections = 2\n[metrics]"))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as ep, dealer(ep) as a, dealer(ep) as b:
        for sock in (a, b):
            assert _status(sock, 1)["state"] == "RUNNING"  # the first two are served
        with dealer(ep) as c:
            c.send_multipart(protocol.encode(protocol.StatusRequest(3)))
            refused = daemon.metrics.registry.get_sample_value
            wait_for(lambda: bool(refused("dlad_connections_refused_total")))  # handshake failed,
            # so nothing it sent was read:
            assert daemon.counters.received == 2
            assert c.poll(0) == 0
        wait_for(lambda: daemon.frontend.connections == 2)  # the refused one left no count
        assert _status(a, 4)["state"] == "RUNNING"
