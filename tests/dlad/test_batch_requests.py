"""INFER_BATCH on a live daemon (docs/protocol.md "INFER_BATCH"): each image is an INFER of its
own, the one reply holds a result per image in order, and what refuses one image does not cost
the others; what refuses the batch as a whole refuses it before any image is queued."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest
import zmq

from dlad import protocol
from dlad.errors import DladError, NotFound, Overloaded, Status
from dlad_client import AsyncClient, Client, Result
from tests.dlad.test_daemon import IMAGE, _status, dealer, recv, running
from tests.dlad.test_fairness import slow_daemon

pytestmark = pytest.mark.timeout(60)

SMALL = np.ascontiguousarray(IMAGE[:240, :320])


def _batch(rid: int, images: list[np.ndarray], **fields: object) -> protocol.InferBatchRequest:
    streams = fields.pop("streams", [None] * len(images))
    items = tuple(
        protocol.InferRequest(rid, str(fields.get("model", "demo")), image, stream=stream,
                              **{k: v for k, v in fields.items() if k != "model"})  # type: ignore[arg-type]
        for image, stream in zip(images, streams, strict=True)  # type: ignore[call-overload]
    )  # fmt: skip
    return protocol.InferBatchRequest(rid, str(fields.get("model", "demo")), items)


def _reply(sock: zmq.Socket[bytes]) -> protocol.InferBatchReply:
    reply = recv(sock)
    assert isinstance(reply, protocol.InferBatchReply), reply
    return reply


def test_a_batch_gets_the_detections_its_images_get_one_by_one(tmp_path: Path) -> None:
    images = [IMAGE, SMALL, np.ascontiguousarray(IMAGE[::-1])]
    with running(tmp_path, mode="numeric", latency=500.0) as (_, ep), dealer(ep) as sock:
        singles = []
        for i, image in enumerate(images):
            sock.send_multipart(protocol.encode(protocol.InferRequest(i, "demo", image)))
            singles.append(recv(sock))
        sock.send_multipart(protocol.encode(_batch(10, images, conf=0.25)))
        batch = _reply(sock)
        assert (batch.id, batch.status, len(batch.results)) == (10, Status.OK, 3)
        for single, result in zip(singles, batch.results, strict=True):
            assert isinstance(single, protocol.InferReply)
            assert (result.id, result.status, result.message) == (10, Status.OK, "")
            assert result.device in ("dla0", "dla1")
            np.testing.assert_array_equal(result.detections, single.detections)
            assert result.timing.total_us >= result.timing.device_us > 0
        assert len(batch.results[0].detections) > 0
        assert _status(sock, 11)["queues"]["depth"] == 0  # nothing left behind


def test_an_image_refused_or_superseded_costs_only_itself(tmp_path: Path) -> None:
    with slow_daemon(tmp_path) as ep, dealer(ep) as sock:
        sock.send_multipart(protocol.encode(_batch(1, [SMALL] * 4, streams=["a", "b", "c", "d"])))
        while _status(sock, 2)["devices"][0]["in_flight"] < 2:  # "a" and "b" run, 1 s each
            pass
        # a newer frame of stream "c" supersedes the batch's queued one, not its others
        newer = protocol.InferRequest(3, "demo", SMALL, stream="c", deadline_ms=30_000)
        sock.send_multipart(protocol.encode(newer))
        sock.send_multipart(protocol.encode(protocol.CancelRequest(1)))  # the rest queued: "d"
        cancel = recv(sock)
        assert (type(cancel), cancel.id, cancel.status) == (protocol.CancelReply, 1, Status.OK)
        batch = _reply(sock)  # once "a" and "b" are done
        statuses = [r.status for r in batch.results]
        assert statuses == [Status.OK, Status.OK, Status.CANCELLED, Status.CANCELLED]
        assert "superseded" in batch.results[2].message
        assert "cancelled by the client" in batch.results[3].message
        assert (batch.results[3].device, batch.results[3].count) == (None, 0)


def test_images_of_an_unknown_model_each_say_so(tmp_path: Path) -> None:
    with slow_daemon(tmp_path) as ep, dealer(ep) as sock:
        sock.send_multipart(protocol.encode(_batch(5, [SMALL, SMALL], model="nope")))
        batch = _reply(sock)
        assert batch.status == Status.OK
        assert [r.status for r in batch.results] == [Status.NOT_FOUND] * 2
        assert all("nope" in r.message for r in batch.results)


def test_a_batch_past_the_clients_cap_is_refused_whole(tmp_path: Path) -> None:
    with slow_daemon(tmp_path, cap=3) as ep, dealer(ep) as sock:
        sock.send_multipart(protocol.encode(_batch(7, [SMALL] * 4)))
        refused = _reply(sock)
        assert (refused.id, refused.status, refused.results) == (7, Status.OVERLOADED, ())
        assert "a client may have 3 requests in flight" in refused.message
        assert _status(sock, 8)["queues"]["depth"] == 0  # not one image was queued
        sock.send_multipart(protocol.encode(_batch(9, [SMALL] * 3)))  # at the cap: taken
        while _status(sock, 10)["devices"][0]["in_flight"] < 2:
            pass
        sock.send_multipart(protocol.encode(protocol.InferRequest(9, "demo", SMALL)))
        dup = recv(sock)
        assert (dup.id, dup.status) == (9, Status.BAD_REQUEST)  # the batch holds id 9
        assert "already in flight" in dup.message


def test_a_malformed_batch_is_a_bad_request_with_its_id(tmp_path: Path) -> None:
    image = {"height": 2, "width": 2, "format": "RGB", "dtype": "uint8"}
    header = {"v": 1, "kind": int(protocol.Kind.INFER_BATCH), "id": 12, "model": "demo",
              "images": [image] * 2}  # fmt: skip
    bad_stream = header | {"images": [image | {"stream": 5}]}
    cases = [
        ([msgpack.packb(header), bytes(12)], "INFER_BATCH has 3 frame(s)"),
        ([msgpack.packb(header | {"images": []}), bytes(12)], "images: must be an array"),
        ([msgpack.packb(header), bytes(12), bytes(11)], "frames[2]: image payload is 11 bytes"),
        ([msgpack.packb(bad_stream), bytes(12)], "images[0].stream"),
    ]
    with running(tmp_path) as (_, ep), dealer(ep) as sock:
        for frames, why in cases:
            sock.send_multipart(frames)
            reply = recv(sock)
            assert isinstance(reply, protocol.InferBatchReply), reply
            assert (reply.id, reply.status) == (12, Status.BAD_REQUEST)
            assert why in reply.message, reply.message
        assert _status(sock, 13)["state"] == "RUNNING"


# ------------------------------------------------------------------------------ the SDK

SLOT = 4 << 20  # fits the 640 x 480 x 3 demo image


def test_the_sdk_sends_batches_inline_and_in_shared_memory(tmp_path: Path) -> None:
    frames = [IMAGE, SMALL, IMAGE]
    with running(tmp_path, mode="numeric", latency=500.0) as (daemon, ep):
        with Client(ep) as plain:
            singles = [plain.detect(f).detections for f in frames]
            inline = plain.detect_batch(frames)
        # two slots for three images: the third goes in the message, beside the other two
        with Client(ep, shm_slot_bytes=SLOT, shm_slots=2, max_in_flight=6) as client:
            handles = [client.submit_batch(frames, streams=["l", "m", None]) for _ in range(2)]
            assert client.in_flight == 2
            pipelined = [h.result() for h in handles]
            assert client.shm is not None
            assert client.shm.free == 2  # both slots back with the batch's one reply
            assert client.shm.inline == 4  # the first batch's third, the second's three
        assert daemon.frontend.shm is not None
        assert daemon.frontend.shm.stats.frames == 2
    for results in (inline, *pipelined):
        assert len(results) == 3
        for got, want in zip(results, singles, strict=True):
            assert isinstance(got, Result)
            np.testing.assert_array_equal(got.detections, want)


def test_the_async_sdk_sends_batches_and_counts_their_images_in_flight(tmp_path: Path) -> None:
    async def main(ep: str) -> list[list[Result | DladError]]:
        async with AsyncClient(ep, shm_slot_bytes=SLOT, max_in_flight=5) as client:
            out: list[list[Result | DladError]] = []

            async def rig() -> None:  # three batches of three: at most one holds slots at once
                out.append(await client.detect_batch([SMALL] * 3, deadline_ms=5000))

            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(rig)
            assert client.shm is not None
            assert (client.shm.inline, client.shm.free) == (0, 5)
            return out

    with running(tmp_path, mode="numeric", latency=500.0) as (_, ep):
        with Client(ep) as plain:
            want = plain.detect(SMALL).detections
        batches = anyio.run(main, ep)
    assert len(batches) == 3
    for results in batches:
        for got in results:
            assert isinstance(got, Result)
            np.testing.assert_array_equal(got.detections, want)


def test_a_refused_image_is_its_error_and_a_refused_batch_raises(tmp_path: Path) -> None:
    with slow_daemon(tmp_path, cap=3) as ep, Client(ep, timeout_s=30.0) as client:
        results = client.detect_batch([SMALL, SMALL], model="nope")
        assert [type(r) for r in results] == [NotFound, NotFound]
        with pytest.raises(Overloaded, match="a client may have 3 requests in flight"):
            client.detect_batch([SMALL] * 4)


def test_bad_batches_raise_before_anything_is_sent(tmp_path: Path) -> None:
    with running(tmp_path) as (daemon, ep), Client(ep, max_in_flight=4) as client:
        for images, error, why in [
            ([], ValueError, "1 to 4 images"),
            ([SMALL] * 5, ValueError, "1 to 4 images"),  # more than max_in_flight
            (SMALL, TypeError, "sequence of numpy arrays"),
            ([SMALL, np.zeros((2, 2), np.float32)], ValueError, "uint8"),
        ]:
            with pytest.raises(error, match=why):
                client.detect_batch(images)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="streams has 1 names for 2 images"):
            client.detect_batch([SMALL, SMALL], streams=["a"])
        assert daemon.counters.received == 0
