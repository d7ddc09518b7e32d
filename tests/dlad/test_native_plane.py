"""The native data plane (dlad/native/plane.cpp) serves INFERs as the Python frontend does.

A DEALER talks to a ROUTER the plane owns: INFERs are answered OK from its emulated cores with
their timing, refusals carry the Python frontend's statuses and words, every other message
reaches the control plane's PAIR whole and its answer reaches the client, deadlines and
draining answer every accepted request exactly once. Replies are awaited with a poll bound
(a hang guard, not a timing assertion).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dlad import native_plane, protocol
from dlad.devices.dram import SharedDram
from dlad.errors import Status
from dlad.native_plane import CancelResult, Item, NativePlane, PlaneDevice, loaded_libzmq
from dlad.protocol import InferReply, InferRequest
from tests.dlad.test_metrics import wait_for

pytestmark = [
    pytest.mark.timeout(120),
]

WAIT_MS = 20_000  # a hang guard: the replies come in milliseconds
IMAGE = np.zeros((4, 4, 3), np.uint8)


class Rig:
    """A plane on a fresh ROUTER, and a DEALER connected to it."""

    def __init__(self, devices: list[PlaneDevice], **settings: Any) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        models = settings.pop("models", {"demo": [d.name for d in devices]})
        self.plane = NativePlane(self.router, devices=devices, models=models, **settings)
        self.plane.start()
        self.dealers: list[zmq.Socket[bytes]] = []
        self.client = self.dealer(port)
        self.port = port

    def dealer(self, port: int | None = None) -> zmq.Socket[bytes]:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{port or self.port}")
        self.dealers.append(d)
        return d

    def infer(self, rid: int, sock: zmq.Socket[bytes] | None = None, **fields: Any) -> None:
        fields.setdefault("model", "demo")
        request = InferRequest(id=rid, image=IMAGE, **fields)
        (sock or self.client).send_multipart(protocol.encode(request), copy=False)

    def reply(self, sock: zmq.Socket[bytes] | None = None) -> InferReply:
        sock = sock or self.client
        assert sock.poll(WAIT_MS), "no reply"
        reply = protocol.decode_reply(sock.recv_multipart())
        assert isinstance(reply, InferReply)
        return reply

    def close(self) -> None:
        self.plane.close()
        for d in self.dealers:
            d.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig([PlaneDevice("dla0", 500.0, capacity=16), PlaneDevice("dla1", 500.0, capacity=16)])
    yield r
    r.close()


def test_the_libzmq_pyzmq_loaded_is_found() -> None:
    assert "libzmq" in loaded_libzmq()


def test_infers_are_answered_ok_with_their_timing(rig: Rig) -> None:
    for rid in range(20):
        rig.infer(rid, stream=None if rid % 2 else f"cam{rid}")
    replies = [rig.reply() for _ in range(20)]
    assert sorted(r.id for r in replies) == list(range(20))
    for r in replies:
        assert r.status is Status.OK
        assert r.message == ""
        assert r.device in ("dla0", "dla1")
        assert r.count == 0  # pre/post-processing off: no detections
        t = r.timing
        assert t.start_ns is not None
        assert t.end_ns is not None
        assert t.device_us >= 500
        assert t.total_us >= t.device_us
    assert {r.device for r in replies} == {"dla0", "dla1"}  # both cores served
    counters = rig.plane.counters()
    assert counters["by_status"] == {"OK": 20}
    assert counters["received"] == counters["replied"] == 20
    assert rig.plane.pending == 0


def test_refusals_carry_the_frontends_status_and_words(rig: Rig) -> None:
    rig.infer(1, model="other")
    r = rig.reply()
    assert (r.id, r.status, r.message) == (1, Status.NOT_FOUND, "no device serves model 'other'")
    assert r.device is None
    assert r.timing.start_ns is None


def test_a_request_id_in_flight_is_refused_on_its_connection_only() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0)])  # long tasks: the first stays in flight
    try:
        r.infer(7)
        r.infer(7)
        refused = r.reply()
        assert (refused.id, refused.status) == (7, Status.BAD_REQUEST)
        assert refused.message == "request id 7 is already in flight on this connection"
        other = r.dealer()
        r.infer(7, sock=other)  # another connection may use the same id
        assert r.plane.counters()["by_status"] == {"BAD_REQUEST": 1}
    finally:
        r.close()


def test_the_in_flight_cap_and_the_byte_budget() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0, capacity=16)], max_in_flight_per_client=2,
            max_buffered_bytes=3 * IMAGE.nbytes)  # fmt: skip
    try:
        for rid in range(3):
            r.infer(rid)
        capped = r.reply()
        assert (capped.id, capped.status) == (2, Status.OVERLOADED)
        assert capped.message == "this client has 2 requests in flight, the most one may"
        other = r.dealer()
        r.infer(10, sock=other)  # the third frame of the budget
        r.infer(11, sock=other)
        over = r.reply(other)
        assert (over.id, over.status) == (11, Status.OVERLOADED)
        assert over.message == (f"the daemon holds {3 * IMAGE.nbytes} bytes of frames; this one "
                                f"would pass its budget of {3 * IMAGE.nbytes}")  # fmt: skip
    finally:
        r.close()


def test_full_queues_are_refused_with_the_schedulers_words() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0, slots=1, capacity=2)])
    try:
        for rid in range(4):  # one running, two queued, the fourth refused
            r.infer(rid)
        full = r.reply()
        assert (full.id, full.status) == (3, Status.OVERLOADED)
        assert full.message == "all queues for model 'demo' are full (dla0 2/2)"
    finally:
        r.close()


def test_a_newer_frame_of_a_stream_supersedes_the_queued_one() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0, slots=1, capacity=4)])
    try:
        r.infer(1)  # runs
        r.infer(2, stream="cam")  # queued
        r.infer(3, stream="cam")  # replaces it
        old = r.reply()
        assert (old.id, old.status) == (2, Status.CANCELLED)
        assert old.message == "superseded by a newer frame of its stream"
    finally:
        r.close()


def test_other_messages_reach_the_control_plane_whole(rig: Rig) -> None:
    status = protocol.encode(protocol.StatusRequest(5))
    head, payload = protocol.encode(InferRequest(id=6, model="demo", image=IMAGE))
    refused = [msgpack.packb(msgpack.unpackb(head) | {"conf": 2}), payload]  # answered there
    batch = protocol.InferBatchRequest(8, "demo", (InferRequest(id=8, model="demo", image=IMAGE),))
    garbage = [b"\xc1", b"x", b"y", b"z"]
    sent: list[list[Any]] = [status, refused, protocol.encode(batch), garbage]
    for frames in sent:
        rig.client.send_multipart([bytes(f) for f in frames])
    for frames in sent:
        assert rig.plane.forwarded.poll(WAIT_MS)
        client, peer, user, conn, *parts = rig.plane.forwarded.recv_multipart()
        assert peer == b"127.0.0.1"  # the sender's Peer-Address, which the pair does not carry
        assert user == b""  # and its CURVE key: none here
        assert len(conn) == 16  # and its connection: (fd, generation, socket cookie)
        assert parts == [bytes(f) for f in frames]
        rig.plane.send(client, [msgpack.packb({"echo": len(parts)}), b"tail"])
        assert rig.client.poll(WAIT_MS)
        assert rig.client.recv_multipart() == [msgpack.packb({"echo": len(parts)}), b"tail"]
    counters = rig.plane.counters()
    # replied: the plane's own INFER replies (the control plane counts its own)
    assert (counters["forwarded"], counters["replied"], counters["forward_lost"]) == (4, 0, 0)


def test_a_queued_request_past_its_deadline_is_answered_so() -> None:
    r = Rig([PlaneDevice("dla0", 200_000.0, slots=1, capacity=8)])
    try:
        r.infer(1)  # holds the core for 200 ms
        r.infer(2, deadline_ms=1)
        late = r.reply()
        assert (late.id, late.status, late.message) == (
            2, Status.DEADLINE_EXCEEDED, "deadline passed while queued")  # fmt: skip
        assert r.reply().id == 1
    finally:
        r.close()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["demo", "demo", "none"]),
                          st.none() | st.integers(1, 30),
                          st.none() | st.sampled_from(["a", "b"])),
                min_size=1, max_size=40))  # fmt: skip
def test_every_request_gets_exactly_one_reply(
    requests: list[tuple[str, int | None, str | None]],
) -> None:
    r = Rig([PlaneDevice("dla0", 2000.0, slots=1, capacity=3),
             PlaneDevice("dla1", 3000.0, slots=2, capacity=3)])  # fmt: skip
    try:
        for rid, (model, deadline, stream) in enumerate(requests):
            r.infer(rid, model=model, deadline_ms=deadline, stream=stream)
        replies = Counter(r.reply().id for _ in requests)
        assert replies == Counter(range(len(requests)))
        assert not r.client.poll(50)  # and no second one
        assert r.plane.pending == 0
    finally:
        r.close()


def _admitted(r: Rig, n: int) -> None:
    """Wait until the plane holds ``n`` jobs (its state; the test's timeout bounds it)."""
    while r.plane.pending < n:
        threading.Event().wait(0.001)


def test_draining_finishes_what_runs_and_refuses_the_rest() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0, slots=1, capacity=4)])
    try:
        r.infer(1)  # runs
        r.infer(2)  # queued
        _admitted(r, 2)
        drained = threading.Thread(target=r.plane.drain, args=(60.0,))
        drained.start()
        queued = r.reply()  # the daemon's drain: what is queued is answered at once
        assert (queued.id, queued.status) == (2, Status.SHUTTING_DOWN)
        assert queued.message == "the daemon is shutting down"
        assert r.plane.draining
        r.infer(3)
        late = r.reply()
        assert (late.id, late.status) == (3, Status.SHUTTING_DOWN)
        ran = r.reply()
        assert (ran.id, ran.status, ran.device) == (1, Status.OK, "dla0")
        drained.join()
        assert r.plane.pending == 0
    finally:
        r.close()


def test_a_drain_out_of_time_answers_the_rest_shutting_down() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0, slots=1, capacity=4)])
    try:
        for rid in range(3):
            r.infer(rid)
        _admitted(r, 3)
        r.plane.drain(0.0)
        replies = [r.reply() for _ in range(3)]
        assert {x.status for x in replies} == {Status.SHUTTING_DOWN}
        assert sorted(x.id for x in replies) == [0, 1, 2]
    finally:
        r.close()


def test_a_model_naming_no_device_is_refused_at_construction() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(ValueError, match="no device dla9"):
            NativePlane(router, devices=[PlaneDevice("dla0", 100.0)], models={"m": ["dla9"]})
        with pytest.raises(ValueError, match="must be positive"):
            NativePlane(router, devices=[PlaneDevice("dla0", 0.0)], models={"m": ["dla0"]})
    finally:
        router.close(0)
        ctx.term()


def _outcome(r: Rig) -> tuple[int, int, InferReply]:
    assert r.plane.forwarded.poll(WAIT_MS), "no outcome"
    client, *parts = r.plane.forwarded.recv_multipart()
    assert client == b""  # an outcome, not a client's message
    out = NativePlane.outcome(parts)
    reply = protocol.decode_reply([out.header, b""])
    assert isinstance(reply, InferReply)
    return out.tag, out.index, reply


def _client_id(r: Rig) -> bytes:
    """The ROUTER's routing id of the rig's client (read off a forwarded STATUS)."""
    r.client.send_multipart(protocol.encode(protocol.StatusRequest(99)))
    assert r.plane.forwarded.poll(WAIT_MS)
    client, *_ = r.plane.forwarded.recv_multipart()
    return client


def test_submitted_images_are_answered_to_the_client_or_as_outcomes(rig: Rig) -> None:
    client = _client_id(rig)
    item = Item("demo", None, 0, None, 48)
    assert rig.plane.submit(client, client.hex(), 7, [item]) is None
    direct = rig.reply()
    assert (direct.id, direct.status) == (7, Status.OK)
    images = [item, Item("nope", None, 0, None, 48), Item("demo", "s", 1, 5000, 48)]
    assert rig.plane.submit(client, client.hex(), 8, images, tag=42) is None
    outcomes = sorted((_outcome(rig) for _ in images), key=lambda o: o[1])
    assert [(t, i) for t, i, _ in outcomes] == [(42, 0), (42, 1), (42, 2)]
    assert [o.status for _, _, o in outcomes] == [Status.OK, Status.NOT_FOUND, Status.OK]
    assert outcomes[1][2].message == "no device serves model 'nope'"
    assert all(o.id == 8 for _, _, o in outcomes)
    assert not rig.client.poll(50)  # a tagged image is never answered to the client
    observed = rig.plane.observations()
    assert sorted(o[2] for o in observed) == [0, 0, 0, int(Status.NOT_FOUND)]
    assert ("nope", "", int(Status.NOT_FOUND)) in {o[:3] for o in observed}
    assert rig.plane.observations() == []  # handed over once


def test_a_submission_is_refused_whole_when_it_has_no_room() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0, slots=1, capacity=8)], max_in_flight_per_client=3)
    try:
        client = _client_id(r)
        r.infer(1)
        _admitted(r, 1)
        items = [Item("demo", None, 0, None, 48)] * 3
        assert r.plane.submit(client, client.hex(), 1, items[:1]) == (
            int(Status.BAD_REQUEST),
            "request id 1 is already in flight on this connection",
        )
        assert r.plane.submit(client, client.hex(), 2, items, tag=1) == (
            int(Status.OVERLOADED),
            "a client may have 3 requests in flight; these 3 images would pass it (1 held)",
        )
        assert r.plane.pending == 1  # none of them admitted
    finally:
        r.close()


def test_cancel_answers_a_queued_request_and_names_what_it_found() -> None:
    r = Rig([PlaneDevice("dla0", 300_000.0, slots=1, capacity=8)])
    try:
        client = _client_id(r)
        r.infer(1)  # runs
        r.infer(2)  # queued
        _admitted(r, 2)
        assert r.plane.cancel(client, 2) is CancelResult.CANCELLED
        cancelled = r.reply()
        assert (cancelled.id, cancelled.status, cancelled.message) == (
            2, Status.CANCELLED, "cancelled by the client")  # fmt: skip
        assert r.plane.cancel(client, 1) is CancelResult.RUNNING
        assert r.plane.cancel(client, 3) is CancelResult.NOT_QUEUED
        assert r.plane.cancel(b"someone else", 1) is CancelResult.NOT_QUEUED
        devices, queued, streams = r.plane.state()
        assert (queued, streams) == (0, 0)
        assert [(d.name, d.in_flight, d.queue_depth, d.capacity) for d in devices] == [
            ("dla0", 1, 0, 8)]  # fmt: skip
    finally:
        r.close()


def test_calls_and_sends_after_the_thread_has_ended_run_on_the_callers() -> None:
    r = Rig([PlaneDevice("dla0", 500.0)])
    try:
        client = _client_id(r)
        r.plane.drain(0.0)
        r.plane.send(client, [b"late", b"reply"])  # the socket is the caller's now
        assert r.client.poll(WAIT_MS)
        assert r.client.recv_multipart() == [b"late", b"reply"]
        item = Item("demo", None, 0, None, 48)
        assert r.plane.submit(client, client.hex(), 5, [item]) == (
            int(Status.SHUTTING_DOWN),
            "the daemon is shutting down",
        )
        assert r.plane.cancel(client, 5) is CancelResult.NOT_QUEUED
        assert r.plane.state()[1:] == (0, 0)
    finally:
        r.close()


def test_a_control_plane_that_falls_behind_is_spared_and_the_socket_still_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the forwarding pair full, the plane keeps reading the socket (a connection whose
    messages queue unread in libzmq can abort it): what the pair cannot take is answered
    OVERLOADED by the plane, each in its own reply; what it took arrives in order; an INFER
    behind them all is served."""
    monkeypatch.setattr(native_plane, "_FORWARD_HWM", 2)
    r = Rig([PlaneDevice("dla0", 500.0)], cheap_requests_per_s=1e6)  # every STATUS forwarded
    try:
        n = 300
        for rid in range(n):
            r.client.send_multipart(protocol.encode(protocol.StatusRequest(rid)))
        r.infer(1000)
        refused, infer = [], None
        while infer is None:
            assert r.client.poll(WAIT_MS)
            reply = protocol.decode_reply(r.client.recv_multipart())
            if isinstance(reply, protocol.InferReply):
                infer = reply
            else:
                assert (type(reply).__name__, reply.status) == ("StatusReply", Status.OVERLOADED)
                assert reply.message == "the daemon's control plane is behind; try again"
                refused.append(reply.id)
        assert (infer.id, infer.status) == (1000, Status.OK)
        taken = []
        while r.plane.forwarded.poll(200):
            *_, header = r.plane.forwarded.recv_multipart()
            taken.append(msgpack.unpackb(header)["id"])
        assert len(taken) >= 2
        assert taken == list(range(len(taken)))
        assert refused == list(range(len(taken), n))
        counters = r.plane.counters()
        assert (counters["refused_busy"], counters["forward_lost"]) == (len(refused), 0)
    finally:
        r.close()


def test_cores_that_share_the_dram_stretch_each_others_tasks() -> None:
    """With ``dram_contention``, a task that runs while the other core runs takes longer than
    its service time (the DRAM model, dlad/native/dram.hpp); one alone never takes less."""
    latency_us = 20_000.0
    r = Rig(
        [
            PlaneDevice("dla0", latency_us, capacity=16),
            PlaneDevice("dla1", latency_us, capacity=16),
        ],
        dram=SharedDram(1.0),
    )
    try:
        for rid in range(20):  # ten on each core: they run side by side
            r.infer(rid)
        replies = [r.reply() for _ in range(20)]
        assert {x.status for x in replies} == {Status.OK}
        spans = [x.timing.device_us for x in replies]
        assert min(spans) >= latency_us
        # K[dla, dla] = 0.043 at contention 1: a task beside the other core's is 4.3% longer
        assert max(spans) >= latency_us * 1.02
    finally:
        r.close()


def test_the_plane_and_the_python_engines_share_one_dram() -> None:
    """The daemon's one DRAM model: a GPU batch running on the Python side (a transfer begun
    there) stretches the plane's DLA tasks by K[dla, gpu], and the plane's tasks stretch the
    batch by K[gpu, dla] while they run."""
    latency_us = 20_000.0
    dram = SharedDram(1.0)
    gpu = dram.begin("gpu", 3600e9)  # an hour: it runs beside every DLA task below
    alone_end = dram.end_ns(gpu)
    r = Rig([PlaneDevice("dla0", latency_us, slots=1, capacity=16)], dram=dram)
    try:
        for rid in range(5):
            r.infer(rid)
        replies = [r.reply() for _ in range(5)]
        assert {x.status for x in replies} == {Status.OK}
        # apart, the tasks would take 20 ms each and the batch's end would not move; shared,
        # a task beside the batch takes up to 1 + K[dla, gpu] = 1.131x (less where the core's
        # thread woke late: that part of its work counts as done alone), and the batch loses
        # 1 - 1 / (1 + K[gpu, dla]) = 28 % of its progress while a task runs (some 30 ms here)
        assert max(x.timing.device_us for x in replies) >= latency_us * 1.05
        assert dram.end_ns(gpu) - alone_end >= 1_000_000
    finally:
        r.close()
        dram.finish(gpu)


def test_malformed_messages_past_a_clients_rate_are_answered_by_the_plane() -> None:
    """A flood of junk cannot stall other clients: a message the decoder refuses costs its
    client a token of the same bucket as STATUS and CANCEL, and past it the plane answers it
    OVERLOADED itself, in the reply the refusal can address (the kind's own where the header
    yielded an id and a known kind, else ERROR_REPLY), without the control plane."""
    r = Rig([PlaneDevice("dla0", 500.0)], cheap_requests_per_s=0.5)
    try:
        image = {"height": 2, "width": 2, "format": "RGB", "dtype": "uint8"}
        bad_infer = msgpack.packb({"v": 1, "kind": 1, "id": 8, "model": "demo", "image": image,
                                   "max_det": -1})  # fmt: skip
        bad_batch = msgpack.packb({"v": 1, "kind": 4, "id": 9, "model": "demo", "images": []})
        r.client.send_multipart([b"\xc1"])  # the one token: forwarded, the control plane's
        for frames in ([b"\xc1"], [bad_infer, bytes(12)], [bad_batch], [b""]):
            r.client.send_multipart(frames)
        r.client.send_multipart(protocol.encode(protocol.StatusRequest(10)))  # the same bucket
        got = []
        for _ in range(5):
            assert r.client.poll(WAIT_MS)
            frames = r.client.recv_multipart()
            reply = protocol.decode_reply(frames)
            got.append((type(reply).__name__, reply.id, reply.status, len(frames)))
            assert reply.message.startswith("more than 0.5 "), reply.message
        assert got == [
            ("ErrorReply", None, Status.OVERLOADED, 1),
            ("InferReply", 8, Status.OVERLOADED, 2),
            ("InferBatchReply", 9, Status.OVERLOADED, 1),
            ("ErrorReply", None, Status.OVERLOADED, 1),
            ("StatusReply", 10, Status.OVERLOADED, 1),
        ]
        assert r.plane.forwarded.poll(WAIT_MS)
        assert r.plane.forwarded.recv_multipart()[-1] == b"\xc1"
        assert not r.plane.forwarded.poll(100)  # nothing else reached the control plane
        assert r.plane.counters()["refused_over_rate"] == 4
    finally:
        r.close()


@pytest.mark.parametrize("flood", ["junk", "infers over the cap"])
def test_a_connection_flooding_past_its_refusals_is_dropped_then_cut(flood: str) -> None:
    """Past a client's cheap-message rate its junk (or its INFERs refused over its cap) is
    answered OVERLOADED 64 times, then dropped unanswered; 64 drops later its connection is shut
    down, so that a flood costs the plane a lookup a message and cannot queue unread in libzmq
    (docs/reliability.md, "A flood that vanishes"). Another client is served throughout."""
    # a token in 1000 s: 64 refusals (the least there are), then 64 drops, then the cut
    r = Rig([PlaneDevice("dla0", 300_000.0)], cheap_requests_per_s=0.001,
            max_in_flight_per_client=1)  # fmt: skip
    try:
        flooder = r.dealer()
        closed = flooder.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        r.dealers.append(closed)  # closed with the rig's sockets

        def send(count: int, first: int) -> None:
            for rid in range(first, first + count):
                if flood == "junk":
                    flooder.send(b"\xc1")
                else:
                    r.infer(rid, flooder)

        if flood != "junk":
            r.infer(0, flooder)  # admitted: the core takes 300 s
        send(64, 1)
        replies = []  # read before the cut, which loses what the connection has not sent yet
        for _ in range(64):
            assert flooder.poll(WAIT_MS)
            replies.append(protocol.decode_reply(flooder.recv_multipart()))
        assert {x.status for x in replies} == {Status.OVERLOADED}
        send(64 + 40, 65)
        assert closed.poll(WAIT_MS)  # the plane cut it
        wait_for(lambda: r.plane.counters()["cut"] == 1)  # counted just after the cut
        counters = r.plane.counters()
        assert (counters["refused_over_rate" if flood == "junk" else "replied"], counters["cut"]) \
            == (64, 1)  # fmt: skip
        assert counters["dropped_over_rate"] >= 64
        assert not r.plane.forwarded.poll(0)  # none of it reached the control plane
        r.client.send_multipart(protocol.encode(protocol.StatusRequest(8)))  # its own bucket
        assert r.client.poll(WAIT_MS)
        reply = protocol.decode_reply(r.client.recv_multipart())
        assert (reply.id, reply.status) == (8, Status.OVERLOADED)
    finally:
        r.close()


def test_a_client_past_its_status_rate_is_answered_by_the_plane() -> None:
    """STATUS and CANCEL past a client's rate (bursts of twice it) are answered OVERLOADED by
    the plane itself, in their own reply kinds, and never reach the control plane: a flood of
    them cannot fill its queue. Another client keeps its own rate."""
    # 0.5 a second, bursts of 1: the first STATUS takes the one token, the next would need 2 s
    r = Rig([PlaneDevice("dla0", 500.0)], cheap_requests_per_s=0.5)
    try:
        for rid in range(3):
            r.client.send_multipart(protocol.encode(protocol.StatusRequest(rid)))
        r.client.send_multipart(protocol.encode(protocol.CancelRequest(99)))
        refused = []
        for _ in range(3):
            assert r.client.poll(WAIT_MS)
            refused.append(protocol.decode_reply(r.client.recv_multipart()))
        assert [(type(x).__name__, x.id, x.status) for x in refused] == [
            ("StatusReply", 1, Status.OVERLOADED),
            ("StatusReply", 2, Status.OVERLOADED),
            ("CancelReply", 99, Status.OVERLOADED),
        ]
        assert refused[0].message == "more than 0.5 STATUS and CANCEL requests a second"
        assert r.plane.forwarded.poll(WAIT_MS)
        assert msgpack.unpackb(r.plane.forwarded.recv_multipart()[-1])["id"] == 0
        assert not r.plane.forwarded.poll(100)  # nothing else reached the control plane
        other = r.dealer()
        other.send_multipart(protocol.encode(protocol.StatusRequest(7)))
        assert r.plane.forwarded.poll(WAIT_MS)  # its own bucket: forwarded
        assert r.plane.counters()["by_status"] == {"OVERLOADED": 3}
    finally:
        r.close()
