"""Wire protocol v1: round trips, zero-copy payloads, and refusal of every malformed message."""

from __future__ import annotations

import contextlib
import math
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dlad import protocol
from dlad.errors import BadRequest, NotFound, Overloaded, ProtocolError, Status
from dlad.protocol import (
    MAX_DEADLINE_MS,
    MAX_DET,
    MAX_MESSAGE_CHARS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    PROTOCOL_VERSION,
    CancelReply,
    CancelRequest,
    DaemonStatus,
    ErrorReply,
    InferReply,
    InferRequest,
    Kind,
    Limits,
    StatusReply,
    StatusRequest,
    Timing,
    decode_reply,
    decode_request,
    encode,
    encode_error_reply,
)
from dlad_wire import protocol as wire

pytestmark = pytest.mark.timeout(60)

U64 = 2**64 - 1
DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

# ------------------------------------------------------------------------------ strategies

names = st.text(
    st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")),
    min_size=1,
    max_size=24,
)
ids = st.integers(0, U64)
formats = st.sampled_from(protocol.PIXEL_FORMATS)


@st.composite
def infer_requests(draw: st.DrawFn) -> InferRequest:
    fmt: Any = draw(formats)
    yuv = fmt in ("NV12", "YUYV")
    height, width = (draw(st.integers(1, 6)) * (2 if yuv else 1) for _ in range(2))
    return InferRequest(
        id=draw(ids),
        model=draw(names),
        image=draw(hnp.arrays(np.uint8, protocol.frame_shape(fmt, height, width))),
        format=fmt,
        colorspace=draw(st.none() | st.sampled_from(protocol.COLORSPACES)) if yuv else None,
        color_range=draw(st.none() | st.sampled_from(protocol.COLOR_RANGES)) if yuv else None,
        stream=draw(st.none() | names),
        priority=draw(st.integers(PRIORITY_MIN, PRIORITY_MAX)),
        deadline_ms=draw(st.none() | st.integers(1, MAX_DEADLINE_MS)),
        conf=draw(st.none() | st.floats(0.0, 1.0, exclude_max=True)),
        iou=draw(st.none() | st.floats(0.0, 1.0, exclude_min=True)),
        max_det=draw(st.none() | st.integers(1, MAX_DET)),
    )


counts = st.integers(0, 2**63 - 1)


@st.composite
def timings(draw: st.DrawFn) -> Timing:
    us = {name: draw(counts) for name in ("queue_us", "pre_us", "device_us", "post_us", "total_us")}
    if draw(st.booleans()):
        return Timing(**us)
    start = draw(st.integers(0, U64))
    return Timing(**us, start_ns=start, end_ns=draw(st.integers(start, U64)))


@st.composite
def infer_replies(draw: st.DrawFn) -> InferReply:
    status = draw(st.sampled_from(Status))
    n = draw(st.integers(0, 20)) if status is Status.OK else 0
    det = draw(hnp.arrays(np.float32, (n, 6)))  # any float32, NaN included: the wire is bytes
    message = "" if status is Status.OK else draw(st.text(max_size=MAX_MESSAGE_CHARS))
    device = draw(st.none() | st.sampled_from(["dla0", "dla1", "gpu"]))
    return InferReply(draw(ids), status, message, device, draw(timings()), det)


def _device(name: str, kind: str, core: int | None) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "name": st.just(name), "kind": st.just(kind), "core": st.just(core),
        "healthy": st.booleans(), "busy": st.booleans(), "in_flight": counts,
        "state": st.sampled_from(["warming", "serving", "quarantined", "failed"]),
        "reason": st.text(max_size=20),
        "queue_depth": counts, "completed": counts, "failed": counts,
        "service_time_us": st.floats(0.0, 1e9),
        "host_us": st.floats(0.0, 1e9), "max_batch": st.just(4),
        "batches": st.lists(counts, min_size=4, max_size=4),
    })  # fmt: skip


reports = st.fixed_dictionaries({
    "name": names,
    "state": st.sampled_from(["RUNNING", "DRAINING", "STOPPED"]),
    "live": st.booleans(),
    "ready": st.booleans(),
    "version": st.just("0.1.0"),
    "protocol": st.just(PROTOCOL_VERSION),
    "devices": st.tuples(_device("dla0", "dla", 0), _device("dla1", "dla", 1),
                         _device("gpu", "gpu", None)).map(list),
    "models": st.lists(st.fixed_dictionaries({
        "name": names, "devices": st.lists(st.sampled_from(["dla0", "dla1", "gpu"]), max_size=3),
        "input_height": st.integers(1, 4096), "input_width": st.integers(1, 4096),
        "classes": st.integers(1, 1000)}, optional={"family": names,
        "class_names": st.lists(names, max_size=5)}), max_size=3),
    "queues": st.fixed_dictionaries({"depth": counts, "capacity": counts, "streams": counts}),
})  # fmt: skip


def other_messages() -> st.SearchStrategy[Any]:
    statuses = st.sampled_from(Status)
    not_ok = st.sampled_from([s for s in Status if s is not Status.OK])
    return st.one_of(
        st.builds(CancelRequest, ids),
        st.builds(StatusRequest, ids),
        st.builds(CancelReply, ids, st.just(Status.OK)),
        st.builds(CancelReply, ids, statuses.filter(lambda s: s is not Status.OK), names),
        st.builds(StatusReply, ids, st.just(Status.OK), st.just(""), reports),
        st.builds(StatusReply, ids, not_ok, names),
        st.builds(ErrorReply, st.none() | ids, not_ok, st.text(max_size=50)),
    )


# ------------------------------------------------------------------------------ helpers


def _frames_as(kind: str, frames: list[Any]) -> list[Any]:
    """The same frames as bytes, as zmq.Frame objects, or as they came from encode()."""
    if kind == "bytes":
        return [bytes(f) for f in frames]
    if kind == "zmq":
        return [zmq.Frame(f) for f in frames]
    return frames


def _assert_same_request(a: InferRequest, b: InferRequest) -> None:
    for name in ("id", "model", "format", "stream", "priority", "deadline_ms", "iou", "max_det"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.conf == b.conf
    assert a.colour == b.colour  # a YUV frame's default colour is sent as absent
    assert (a.height, a.width) == (b.height, b.width)
    assert a.image.shape == b.image.shape
    np.testing.assert_array_equal(a.image, b.image)


def _assert_same_reply(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert (a.id, a.status, a.message, a.kind) == (b.id, b.status, b.message, b.kind)
    if isinstance(a, InferReply):
        assert (a.device, a.timing, a.count) == (b.device, b.timing, b.count)
        assert a.detections.tobytes() == b.detections.tobytes()  # bit-exact, NaN included
    if isinstance(a, StatusReply):
        assert a.report == b.report


def _header(frames: list[Any]) -> dict[str, Any]:
    header: dict[str, Any] = msgpack.unpackb(bytes(frames[0]))
    return header


def _pack(header: object) -> bytes:
    return bytes(msgpack.packb(header, use_bin_type=True))


def _valid_infer() -> tuple[dict[str, Any], bytes]:
    rng = np.random.default_rng(7)
    image = rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)
    frames = encode(InferRequest(9, "demo", image, stream="cam0", deadline_ms=50, conf=0.3))
    return _header(frames), bytes(frames[1])


def _refuse(frames: list[Any], field: str, limits: Limits | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(frames, limits or Limits())
    assert info.value.field == field, info.value.message
    assert info.value.message.startswith(field + ":")
    assert info.value.status is Status.BAD_REQUEST
    return info.value


# ------------------------------------------------------------------------------ round trips


@settings(max_examples=80, deadline=None)
@given(req=infer_requests(), as_=st.sampled_from(["encoded", "bytes", "zmq"]))
def test_infer_request_round_trip(req: InferRequest, as_: str) -> None:
    frames = encode(req)
    assert len(frames) == 2
    assert isinstance(frames[1], memoryview)
    assert frames[1].nbytes == req.image.nbytes
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), req.image)  # not a copy
    got = decode_request(_frames_as(as_, frames))
    assert isinstance(got, InferRequest)
    _assert_same_request(req, got)
    assert not got.image.flags.writeable


@settings(max_examples=80, deadline=None)
@given(reply=infer_replies(), as_=st.sampled_from(["encoded", "bytes", "zmq"]))
def test_infer_reply_round_trip(reply: InferReply, as_: str) -> None:
    frames = encode(reply)
    assert len(frames) == 2
    assert len(bytes(frames[1])) == 24 * reply.count
    got = decode_reply(_frames_as(as_, frames))
    _assert_same_reply(reply, got)


@settings(max_examples=80, deadline=None)
@given(msg=other_messages())
def test_other_messages_round_trip(msg: Any) -> None:
    frames = encode(msg)
    assert len(frames) == 1
    decode = decode_reply if msg.kind.is_reply else decode_request
    got = decode(_frames_as("bytes", frames))
    if msg.kind.is_reply:
        _assert_same_reply(msg, got)
    else:
        assert (type(got), got.id) == (type(msg), msg.id)


def test_kinds_pair_requests_with_replies() -> None:
    requests = [k for k in Kind if not k.is_reply]
    assert requests == [Kind.INFER, Kind.CANCEL, Kind.STATUS, Kind.INFER_BATCH]
    for k in requests:
        assert Kind(k | 0x80).is_reply
    assert int(Kind.ERROR_REPLY) == 0x80


def test_defaults_are_omitted_and_nil_means_default() -> None:
    img = np.zeros((2, 2, 1), np.uint8)
    header = _header(encode(InferRequest(1, "m", img, format="GRAY")))
    assert set(header) == {"v", "kind", "id", "model", "image"}
    assert header["image"] == {"height": 2, "width": 2, "format": "GRAY", "dtype": "uint8"}
    header |= dict.fromkeys(("stream", "priority", "deadline_ms", "conf", "iou", "max_det"))
    got = decode_request([_pack(header), bytes(4)])
    assert isinstance(got, InferRequest)
    assert (got.stream, got.priority, got.deadline_ms, got.conf, got.iou, got.max_det) == (
        None, 0, None, None, None, None)  # fmt: skip


def test_detections_payload_is_little_endian_rows() -> None:
    rng = np.random.default_rng(1)
    det = rng.normal(100, 50, (5, 6)).astype(">f4")  # big-endian input is converted
    frames = encode(InferReply(3, Status.OK, detections=det))
    assert bytes(frames[1]) == det.astype("<f4").tobytes(order="C")
    assert _header(frames)["count"] == 5
    got = decode_reply(frames)
    assert isinstance(got, InferReply)
    np.testing.assert_array_equal(got.detections, det)
    empty = encode(InferReply(4, Status.OVERLOADED, "queue full"))
    assert bytes(empty[1]) == b""
    assert _header(empty)["count"] == 0


# ------------------------------------------------------------------------------ zero copy


@pytest.fixture
def dealer_router() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield dealer, router
    dealer.close()
    router.close()
    term = threading.Thread(target=ctx.term, daemon=True)
    term.start()
    term.join(timeout=5)
    assert not term.is_alive(), "context did not terminate: sockets left open"


def test_zero_copy_over_dealer_router(
    dealer_router: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    dealer, router = dealer_router
    rng = np.random.default_rng(11)
    image = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)  # above pyzmq's copy threshold
    frames = encode(InferRequest(42, "demo", image, stream="cam1", priority=2))
    # the encoder's payload is the caller's array itself, not a copy
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), image)
    dealer.send_multipart(frames, copy=False)

    assert router.poll(5000), "request not received"
    identity, *request_frames = router.recv_multipart(copy=False)
    req = decode_request(request_frames)
    assert isinstance(req, InferRequest)
    assert np.shares_memory(req.image, np.frombuffer(request_frames[1].buffer, np.uint8))
    np.testing.assert_array_equal(req.image, image)

    det = rng.uniform(0, 320, (300, 6)).astype(np.float32)
    reply = InferReply(req.id, Status.OK, device="dla1", timing=Timing(1, 2, 3, 4, 10, 5, 9),
                       detections=det)  # fmt: skip
    router.send_multipart([identity, *encode(reply)], copy=False)
    assert dealer.poll(5000), "reply not received"
    reply_frames = dealer.recv_multipart(copy=False)
    got = decode_reply(reply_frames)
    assert isinstance(got, InferReply)
    assert np.shares_memory(got.detections, np.frombuffer(reply_frames[1].buffer, np.uint8))
    np.testing.assert_array_equal(got.detections, det)
    assert (got.id, got.device, got.timing.end_ns) == (42, "dla1", 9)


# ------------------------------------------------------------------------------ refusals


def test_truncated_headers_are_refused_at_every_length() -> None:
    header, payload = _valid_infer()
    packed = _pack(header)
    for n in range(len(packed)):
        _refuse([packed[:n], payload], "header")


@pytest.mark.parametrize(
    ("frames", "field"),
    [
        ([], "frames"),
        (b"\x80", "frames"),
        ("text", "frames"),
        ([b"\x80"] + [b""] * 17, "frames"),  # past the most a message has (a full batch)
        ([object()], "frames[0]"),
        ([np.zeros((4, 4), np.uint8)[:, ::2]], "frames[0]"),
        ([b"\xc1"], "header"),
        ([b"\x81\xa1v\x01\x00"], "header"),  # trailing bytes
        ([b"\x91" * 5000], "header"),  # nesting deeper than msgpack's stack
        ([_pack({"v": 1, "kind": 2, "id": msgpack.ExtType(1, b"x")})], "id"),
        ([_pack({"v": 1, "kind": 2, "id": msgpack.Timestamp(1)})], "id"),
        ([_pack([1, "kind", 1])], "header"),
        ([_pack(7)], "header"),
        ([_pack({1: 1})], "header"),
        ([b"\x82\xa1v\x01\xa1v\x01"], "header"),  # duplicate key
        ([b"\x81\xa2\xff\xfe\x01"], "header"),  # invalid UTF-8
        ([_pack({b"v": 1})], "header"),  # bin key
        ([_pack({"kind": 2, "id": 1})], "v"),
        ([_pack({"v": 2, "kind": 2, "id": 1})], "v"),
        ([_pack({"v": True, "kind": 2, "id": 1})], "v"),
        ([_pack({"v": 1.0, "kind": 2, "id": 1})], "v"),
        ([_pack({"v": "1", "kind": 2, "id": 1})], "v"),
        ([_pack({"v": 1, "id": 1})], "kind"),
        ([_pack({"v": 1, "kind": 99, "id": 1})], "kind"),
        ([_pack({"v": 1, "kind": 0x82, "id": 1})], "kind"),
        ([_pack({"v": 1, "kind": "CANCEL", "id": 1})], "kind"),
        ([_pack({"v": 1, "kind": 2})], "id"),
        ([_pack({"v": 1, "kind": 2, "id": -1})], "id"),
        ([_pack({"v": 1, "kind": 2, "id": "7"})], "id"),
        ([_pack({"v": 1, "kind": 2, "id": True})], "id"),
        ([_pack({"v": 1, "kind": 3, "id": 1.5})], "id"),
        ([_pack({"v": 1, "kind": 3, "id": 1, "extra": 0})], "extra"),
        ([_pack({"v": 1, "kind": 3, "id": 1}), b""], "frames"),
    ],
)
def test_malformed_envelopes_are_refused(frames: Any, field: str) -> None:
    _refuse(frames, field)


def _mutate(header: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = {**header, "image": dict(header["image"])}
    target, key = (out["image"], path[6:]) if path.startswith("image.") else (out, path)
    if value is _DELETE:
        target.pop(key, None)
    else:
        target[key] = value
    return out


_DELETE = object()
BAD_INFER_FIELDS = [
    ("model", _DELETE), ("model", ""), ("model", "x" * 129), ("model", "a\nb"), ("model", 5),
    ("image", _DELETE), ("image", [2, 2]), ("stream", ""), ("stream", 3), ("stream", b"cam"),
    ("priority", -1), ("priority", PRIORITY_MAX + 1), ("priority", 1.0), ("priority", True),
    ("deadline_ms", 0), ("deadline_ms", -5), ("deadline_ms", MAX_DEADLINE_MS + 1),
    ("deadline_ms", 10.0), ("conf", math.nan), ("conf", math.inf), ("conf", 1.0), ("conf", -0.1),
    ("conf", "0.5"), ("iou", 0.0), ("iou", math.nan), ("iou", 1.5), ("iou", False),
    ("max_det", 0), ("max_det", MAX_DET + 1), ("max_det", 2.5),
    ("image.height", _DELETE), ("image.height", 0), ("image.height", -3), ("image.height", 3.0),
    ("image.width", 2**40), ("image.width", None), ("image.format", "RGBA"), ("image.format", 3),
    ("image.dtype", "float32"), ("image.dtype", "uint16"), ("image.dtype", _DELETE),
    ("image.stride", 12), ("sessionid", "x"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value"), BAD_INFER_FIELDS)
def test_bad_infer_fields_are_refused_by_name(path: str, value: Any) -> None:
    header, payload = _valid_infer()
    exc = _refuse([_pack(_mutate(header, path, value)), payload], path)
    # the id and kind survive, so the daemon can address its BAD_REQUEST reply
    assert (exc.request_id, exc.request_kind) == (9, Kind.INFER)
    reply = decode_reply(encode_error_reply(exc))
    assert isinstance(reply, InferReply)
    assert (reply.id, reply.status, reply.message) == (9, Status.BAD_REQUEST, exc.message)


@pytest.mark.parametrize("delta", [-1, 1, -36])
def test_payload_size_must_match_the_header(delta: int) -> None:
    header, payload = _valid_infer()
    bad = payload[:delta] if delta < 0 else payload + bytes(delta)
    _refuse([_pack(header), bad], "frames[1]")
    _refuse([_pack(header)], "frames")


def test_size_limits() -> None:
    header, payload = _valid_infer()  # 3 x 4 RGB
    frames = [_pack(header), payload]
    total = len(frames[0]) + len(payload)
    assert isinstance(
        decode_request(frames, Limits(max_message_bytes=total, max_header_bytes=len(frames[0]))),
        InferRequest,
    )
    _refuse(frames, "frames", Limits(max_message_bytes=total - 1, max_header_bytes=len(frames[0])))
    _refuse(frames, "header", Limits(max_header_bytes=len(frames[0]) - 1))
    _refuse(frames, "image.height", Limits(max_height=2))
    _refuse(frames, "image.width", Limits(max_width=3))
    _refuse(frames, "image", Limits(max_image_pixels=11))
    # sizes are checked before parsing: garbage over the limit is refused for its size
    _refuse([b"\xc1" * 200], "frames", Limits(max_message_bytes=199, max_header_bytes=199))
    # limits come before the payload is touched: an absurd header with no payload is refused
    huge = _mutate(header, "image.height", 60_000)
    _refuse([_pack(huge), b""], "image.height")


def test_decode_reply_refuses_requests_and_vice_versa() -> None:
    with pytest.raises(ProtocolError, match=r"^kind: 2 is not a reply kind"):
        decode_reply(encode(CancelRequest(1)))
    with pytest.raises(ProtocolError, match=r"^kind: 130 is not a request kind"):
        decode_request(encode(CancelReply(1, Status.OK)))


@pytest.mark.parametrize(
    ("header", "payload", "field"),
    [
        ({"count": 2}, bytes(24), "frames[1]"),
        ({"count": MAX_DET + 1}, bytes(24 * (MAX_DET + 1)), "count"),
        ({"status": 1}, bytes(24), "count"),  # detections only on OK
        ({"status": 42}, bytes(24), "status"),
        ({"message": "oops"}, bytes(24), "message"),  # empty on OK
        ({"device": ""}, bytes(24), "device"),
        ({"timing": {"queue_us": -1}}, bytes(24), "timing.queue_us"),
        ({"timing": {"start_ns": None}}, bytes(24), "timing.end_ns"),
        ({"timing": {"end_ns": 0}}, bytes(24), "timing.end_ns"),
        ({"timing": {"extra_us": 0}}, bytes(24), "timing.extra_us"),
    ],
)
def test_bad_infer_replies_are_refused(header: dict[str, Any], payload: bytes, field: str) -> None:
    good = _header(encode(InferReply(5, Status.OK, detections=np.ones((1, 6), np.float32),
                                     timing=Timing(1, 1, 1, 1, 4, 10, 20))))  # fmt: skip
    good["timing"] |= header.pop("timing", {})
    with pytest.raises(ProtocolError) as info:
        decode_reply([_pack(good | header), payload])
    assert info.value.field == field


def test_status_report_is_strict() -> None:
    report: Any = {
        "name": "orin-7", "state": "DRAINING", "live": True, "ready": False, "version": "0.1.0",
        "protocol": 1,
        "devices": [{"name": "dla0", "kind": "dla", "core": 0, "healthy": True, "busy": True,
                     "state": "serving", "reason": "",
                     "in_flight": 2, "queue_depth": 3, "completed": 10, "failed": 0,
                     "service_time_us": 1900.5, "host_us": 0.0, "max_batch": 1, "batches": [10]},
                    {"name": "gpu", "kind": "gpu", "core": None,
                     "healthy": True, "busy": False, "in_flight": 0, "queue_depth": 0,
                     "state": "serving", "reason": "",
                     "completed": 4, "failed": 1, "service_time_us": 800.0,
                     "host_us": 0.0, "max_batch": 2,
                     "batches": [2, 1]}],
        "models": [{"name": "demo", "devices": ["dla0", "gpu"], "input_height": 256,
                    "input_width": 256, "classes": 8}],
        "queues": {"depth": 3, "capacity": 64, "streams": 2},
    }  # fmt: skip
    frames = encode(StatusReply(8, Status.OK, report=report))
    header = _header(frames)
    header["report"]["devices"][1]["busy"] = 1
    with pytest.raises(ProtocolError, match=r"^report\.devices\[1\]\.busy: expected `bool`"):
        decode_reply([_pack(header)])
    header["report"]["devices"][1]["busy"] = False
    # A newer daemon's fields are left out, not refused (docs/protocol.md §10) ...
    header["report"]["devices"][0]["temperature_c"] = 61.5
    header["report"]["power_w"] = 30
    del header["report"]["devices"][1]["state"], header["report"]["devices"][1]["reason"]
    decoded = decode_reply([_pack(header)])
    assert isinstance(decoded, StatusReply)
    assert decoded.report is not None
    assert "power_w" not in decoded.report
    assert "temperature_c" not in decoded.report["devices"][0]
    assert "state" not in decoded.report["devices"][1]  # ... and an older one's absence taken
    header["report"]["devices"][0]["name"] = "dla\x00"  # a name is printable
    with pytest.raises(ProtocolError, match=r"^report\.devices\[0\]\.name: expected `str`"):
        decode_reply([_pack(header)])
    header["report"]["devices"][0]["name"] = "dla0"
    header["report"]["devices"][0]["batches"] = [1] * (protocol.MAX_BATCH + 1)
    with pytest.raises(ProtocolError, match=r"^report\.devices\[0\]\.batches: expected `array`"):
        decode_reply([_pack(header)])
    header["report"]["devices"][0]["batches"] = [10]
    del header["report"]["queues"]
    with pytest.raises(ProtocolError, match=r"^report\.queues: missing"):
        decode_reply([_pack(header)])
    with pytest.raises(ProtocolError, match=r"^report: must be a msgpack map"):
        StatusReply(8, Status.OK)
    with pytest.raises(ProtocolError, match=r"^report: must be nil"):
        StatusReply(8, Status.INTERNAL, "x", report=report)


# ------------------------------------------------------------------------------ fuzzing

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), U64) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


def _only_bad_request(decode: Callable[..., Any], frames: list[Any]) -> None:
    with contextlib.suppress(BadRequest):  # the only exception a decoder may raise
        decode(frames)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=3))
def test_random_bytes_only_ever_raise_bad_request(frames: list[bytes]) -> None:
    _only_bad_request(decode_request, frames)
    _only_bad_request(decode_reply, frames)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    path=st.sampled_from([
        "v", "kind", "id", "model", "stream", "priority", "deadline_ms", "conf", "iou", "max_det",
        "image", "image.height", "image.width", "image.format", "image.dtype", "zzz", "image.zzz",
    ]),
    payload_delta=st.sampled_from([0, 0, 0, -1, 1]),
)  # fmt: skip
def test_mutated_infer_headers_only_ever_raise_bad_request(
    data: st.DataObject, path: str, payload_delta: int
) -> None:
    header, payload = _valid_infer()
    value = data.draw(msgpack_values | st.just(_DELETE))
    mutated = _mutate(header, path, value)
    payload = payload[:payload_delta] if payload_delta < 0 else payload + bytes(payload_delta)
    got: Any
    try:
        got = decode_request([_pack(mutated), payload])
    except ProtocolError as exc:
        got = exc
    if isinstance(got, ProtocolError):
        valid_id = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64
        assert got.request_id == (9 if path != "id" else value if valid_id else None)
        return
    # accepted: then it is a valid request that survives its own round trip
    assert isinstance(got, InferRequest)
    again = decode_request(encode(got))
    assert isinstance(again, InferRequest)
    _assert_same_request(got, again)


@settings(max_examples=100, deadline=None)
@given(header=msgpack_values, second=st.none() | st.binary(max_size=32))
def test_arbitrary_msgpack_headers_only_ever_raise_bad_request(
    header: Any, second: bytes | None
) -> None:
    frames = [_pack(header)] + ([] if second is None else [second])
    _only_bad_request(decode_request, frames)
    _only_bad_request(decode_reply, frames)


# ------------------------------------------------------------------------------ constructors


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"image": np.zeros((2, 2, 3), np.float32)}, "image.dtype"),
        ({"image": [[[0, 0, 0]]]}, "image.dtype"),
        ({"image": np.zeros((2, 2), np.uint8)}, "image"),
        ({"image": np.zeros((2, 2, 1), np.uint8)}, "image"),  # RGB needs 3 channels
        ({"image": np.zeros((2, 4, 3), np.uint8)[:, ::2]}, "image"),  # not contiguous
        ({"image": np.zeros((0, 2, 3), np.uint8)}, "image.height"),
        ({"format": "YUV"}, "image.format"),
        ({"id": -1}, "id"),
        ({"conf": float("nan")}, "conf"),
    ],
)
def test_invalid_messages_cannot_be_built(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"id": 1, "model": "demo", "image": np.zeros((2, 2, 3), np.uint8)}
    args |= kwargs
    with pytest.raises(ProtocolError) as info:
        InferRequest(**args)
    assert info.value.field == field


def test_reply_construction_rules() -> None:
    with pytest.raises(ProtocolError, match=r"^count"):
        InferReply(1, Status.INTERNAL, "x", detections=np.zeros((1, 6), np.float32))
    with pytest.raises(ProtocolError, match=r"^detections"):
        InferReply(1, Status.OK, detections=np.zeros((1, 5), np.float32))
    with pytest.raises(ProtocolError, match=r"^detections"):
        InferReply(1, Status.OK, detections=np.zeros((1, 6), np.float64))
    with pytest.raises(ProtocolError, match=r"^status"):
        ErrorReply(None, Status.OK)
    with pytest.raises(ProtocolError, match=r"^status"):
        CancelReply(1, 9)  # type: ignore[arg-type]
    assert CancelReply(1, 2).status is Status.NOT_FOUND  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_width"):
        Limits(max_width=0)
    with pytest.raises(ValueError, match="max_header_bytes"):
        Limits(max_message_bytes=10, max_header_bytes=11)


def _error_reply(error: Any, **address: Any) -> Any:
    """What the daemon's one error writer sends for ``error``, as the SDK reads it."""
    return decode_reply(encode_error_reply(error, **address))


def test_error_reply_addresses_what_it_can() -> None:
    infer = _error_reply(NotFound("no model", request_id=3), request_kind=1)
    assert (type(infer), infer.id, infer.status) == (InferReply, 3, Status.NOT_FOUND)
    cancel = _error_reply(NotFound("not queued"), request_id=4, request_kind=Kind.CANCEL)
    assert (type(cancel), cancel.id, cancel.status) == (CancelReply, 4, Status.NOT_FOUND)
    status = _error_reply(Overloaded("x"), request_id=5, request_kind=Kind.STATUS)
    assert isinstance(status, StatusReply)
    assert status.report is None
    unknown = _error_reply(ProtocolError("kind: 99", request_id=6, request_kind=99))
    assert (type(unknown), unknown.id) == (ErrorReply, 6)
    anonymous = _error_reply(ProtocolError("header: garbage " + "x" * 5000))
    assert (type(anonymous), anonymous.id, anonymous.status) == (ErrorReply, None,
                                                                Status.BAD_REQUEST)  # fmt: skip
    assert anonymous.message == ("header: garbage " + "x" * 5000)[:MAX_MESSAGE_CHARS]
    named = _error_reply(NotFound("no model 'caméra'", request_id=7, request_kind=1))
    assert named.message == "no model 'caméra'"  # the words as they are, not only ASCII


# ------------------------------------------------------------------------------ docs


def _doc_example(name: str) -> bytes:
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(rf"<!-- example:{name} -->\s*```text\n(.*?)```", text, re.DOTALL)
    assert match, f"docs/protocol.md has no example:{name}"
    hex_digits = re.sub(r"#.*", "", match.group(1))  # drop the annotations
    return bytes.fromhex("".join(hex_digits.split()))


def test_documented_byte_example_is_what_the_encoder_writes() -> None:
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    request = encode(InferRequest(1, "demo", image, stream="cam0", deadline_ms=200))
    assert _doc_example("infer-request") == bytes(request[0])
    assert _doc_example("infer-payload") == bytes(request[1])
    det = np.array([[0.5, 0.25, 1.5, 1.75, 0.875, 3.0]], dtype=np.float32)
    timing = Timing(120, 40, 900, 60, 1150, 5_000_000_000, 5_000_900_000)
    reply = encode(InferReply(1, Status.OK, device="dla0", timing=timing, detections=det))
    assert _doc_example("infer-reply") == bytes(reply[0])
    assert _doc_example("infer-detections") == bytes(reply[1])
    # and the documented bytes decode to the documented message
    got = decode_request([_doc_example("infer-request"), _doc_example("infer-payload")])
    assert isinstance(got, InferRequest)
    assert (got.id, got.model, got.stream, got.deadline_ms, got.image.shape) == (
        1, "demo", "cam0", 200, (2, 2, 3))  # fmt: skip


def test_report_type_is_the_documented_schema() -> None:
    doc = DOCS.read_text(encoding="utf-8")
    for key in DaemonStatus.__annotations__:
        assert f"`{key}`" in doc, key


@pytest.mark.parametrize("depth", [5, 100, 1000])
def test_a_header_nested_past_its_limit_is_refused_with_its_id(depth: int) -> None:
    nested: object = 1
    for _ in range(depth - 1):  # the header itself is the first level
        nested = [nested]
    header = msgpack.packb({"v": 1, "kind": int(protocol.Kind.STATUS), "id": 4, "x": nested})
    with pytest.raises(ProtocolError, match="nests deeper than the 4 levels") as info:
        protocol.decode_request([header])
    assert info.value.request_id == 4
    # A reply may nest deeper (a STATUS report), but not without bound.
    reply = msgpack.packb({"v": 1, "kind": int(protocol.Kind.STATUS_REPLY), "id": 4, "x": nested})
    if depth > protocol.MAX_REPLY_DEPTH:
        with pytest.raises(ProtocolError, match="nests deeper than the 8 levels"):
            protocol.decode_reply([reply])


# ------------------------------------------------------------------------------ INFER_BATCH


def _items(rid: int, n: int, **fields: Any) -> tuple[InferRequest, ...]:
    return tuple(
        InferRequest(rid, "demo", np.full((2, 3, 3), i, np.uint8), stream=f"cam{i}", **fields)
        for i in range(n)
    )


def test_a_batch_round_trips_with_each_images_stream_and_shared_memory_slot() -> None:
    ref = protocol.ShmRef("seg", 64, 4096, bytes(16))
    first, second, third = _items(9, 3, deadline_ms=50, conf=0.5)
    second = InferRequest(9, "demo", second.image, stream="cam1", deadline_ms=50, conf=0.5,
                          shm=ref)  # fmt: skip
    items = (first, second, third)
    frames = encode(protocol.InferBatchRequest(9, "demo", items))
    assert len(frames) == 3  # the header and the two images not in shared memory
    header = msgpack.unpackb(frames[0])
    assert header["images"][1]["shm"] == {
        "name": "seg",
        "offset": 64,
        "size": 4096,
        "token": bytes(16),
    }
    assert (header["deadline_ms"], header["conf"]) == (50, 0.5)
    seen = []

    def resolve(r: protocol.ShmRef, nbytes: int) -> memoryview:
        seen.append((r, nbytes))
        return memoryview(bytes(nbytes))

    got = decode_request(frames, shm=resolve)
    assert isinstance(got, protocol.InferBatchRequest)
    assert seen == [(ref, 18)]
    assert [i.stream for i in got.images] == ["cam0", "cam1", "cam2"]
    assert [i.shm for i in got.images] == [None, ref, None]
    np.testing.assert_array_equal(got.images[2].image, items[2].image)
    assert (got.id, got.model, got.images[0].deadline_ms, got.images[2].conf) == (
        9,
        "demo",
        50,
        0.5,
    )


def test_a_batch_must_hold_one_to_sixteen_images_that_agree() -> None:
    with pytest.raises(ProtocolError, match="images: must be 1 to 16"):
        protocol.InferBatchRequest(1, "demo", ())
    with pytest.raises(ProtocolError, match="images: must be 1 to 16"):
        protocol.InferBatchRequest(1, "demo", _items(1, 17))
    with pytest.raises(ProtocolError, match=r"images\[1\]: must have the batch's id"):
        protocol.InferBatchRequest(1, "demo", (*_items(1, 1), *_items(2, 1)))
    mixed = (*_items(1, 1, priority=3), *_items(1, 1))
    with pytest.raises(ProtocolError, match=r"images\[1\].priority: must be the same"):
        protocol.InferBatchRequest(1, "demo", mixed)


def test_a_batch_reply_round_trips_and_only_ok_carries_results() -> None:
    ok = InferReply(4, Status.OK, device="dla1", timing=Timing(1, 2, 3, 4, 10, 5, 9),
                    detections=np.arange(12, dtype=np.float32).reshape(2, 6))  # fmt: skip
    gone = InferReply(4, Status.CANCELLED, "superseded by a newer frame of its stream")
    frames = encode(protocol.InferBatchReply(4, Status.OK, results=(ok, gone)))
    assert len(frames) == 3
    got = decode_reply(frames)
    assert isinstance(got, protocol.InferBatchReply)
    _assert_same_reply(ok, got.results[0])
    _assert_same_reply(gone, got.results[1])
    batch_kind = int(Kind.INFER_BATCH)
    refused = decode_reply(
        protocol.encode_error_reply(Overloaded("full"), request_id=4, request_kind=batch_kind)
    )
    assert isinstance(refused, protocol.InferBatchReply)
    assert (refused.status, refused.results) == (Status.OVERLOADED, ())
    with pytest.raises(ProtocolError, match="results: must be empty when status is not OK"):
        protocol.InferBatchReply(4, Status.OVERLOADED, "full", (gone,))
    with pytest.raises(ProtocolError, match="results: must hold 1 to 16"):
        protocol.InferBatchReply(4, Status.OK)
    with pytest.raises(ProtocolError, match=r"results\[0\]: must be an InferReply with the batch"):
        protocol.InferBatchReply(5, Status.OK, results=(ok,))


def test_a_batch_reply_with_a_bad_result_names_it() -> None:
    frames = protocol.encode_batch_reply(6, [
        (0, "", "dla0", protocol.timing_fields(queue_us=0, pre_us=0, device_us=1, post_us=0,
                                              total_us=1, start_ns=1, end_ns=2),
         np.zeros((1, 6), np.float32)),
    ])  # fmt: skip
    header = msgpack.unpackb(frames[0])
    header["results"][0]["count"] = 2
    with pytest.raises(ProtocolError, match=r"frames\[1\]: detections payload is 24 bytes"):
        decode_reply([msgpack.packb(header), frames[1]])
    header["results"][0] |= {"count": 1, "device": 7}
    with pytest.raises(ProtocolError, match=r"results\[0\]\.device") as info:
        decode_reply([msgpack.packb(header), frames[1]])
    assert info.value.request_id == 6
    with pytest.raises(ProtocolError, match="INFER_BATCH_REPLY has 2 frame"):
        decode_reply([frames[0]])


def test_moving_a_checked_request_into_shared_memory_keeps_everything_else() -> None:
    ref = protocol.ShmRef("seg", 64, 4096, bytes(16))
    items = _items(3, 2, conf=0.4, max_det=7)
    moved = items[0].in_shared_memory(ref)
    assert moved.shm == ref
    assert (moved.id, moved.stream, moved.conf, moved.max_det, moved.image is items[0].image) == (
        3, "cam0", 0.4, 7, True)  # fmt: skip
    with pytest.raises(ProtocolError, match="shm: must be a ShmRef"):
        items[0].in_shared_memory({"name": "seg"})  # type: ignore[arg-type]
    batch = protocol.InferBatchRequest(3, "demo", items)
    assert batch.with_images((moved, items[1])).images[0].shm == ref
    other = InferRequest(3, "demo", items[1].image, stream="elsewhere", conf=0.4, max_det=7)
    with pytest.raises(ProtocolError, match="at most its shm changed"):
        batch.with_images((moved, other))
    with pytest.raises(ProtocolError, match="at most its shm changed"):
        batch.with_images((moved,))


@pytest.mark.parametrize(("value", "depth"), [
    (1, 0), ([], 1), ({"a": 1, "b": [2, {"c": []}]}, 4), ([[1], 2, [[3]]], 3),
])  # fmt: skip
def test_nesting_counts_containers_only(value: object, depth: int) -> None:
    assert wire._nesting(value, 10) == depth


# -------------------------------------------------- generated INFER messages, good and broken

_SMALL = Limits(max_message_bytes=1 << 12, max_header_bytes=1 << 10, max_width=8, max_height=8,
                max_image_pixels=48)  # fmt: skip
_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-3, U64), st.floats(), st.text(max_size=4),
    st.sampled_from(["RGB", "GRAY", "uint8", "seg", "gone"]), st.binary(max_size=2),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.sampled_from(["height", "name", "x"]), st.integers(0, 4), max_size=2),
)  # fmt: skip
_OPTIONAL = {
    "stream": st.none() | names, "priority": st.none() | st.integers(PRIORITY_MIN, PRIORITY_MAX),
    "deadline_ms": st.none() | st.integers(1, MAX_DEADLINE_MS),
    "conf": st.none() | st.floats(0.0, 1.0, exclude_max=True),
    "iou": st.none() | st.floats(0.0, 1.0, exclude_min=True),
    "max_det": st.none() | st.integers(1, MAX_DET),
}  # fmt: skip
_SEGMENT = memoryview(bytes(1 << 10))


def _resolve(ref: protocol.ShmRef, nbytes: int) -> memoryview:
    """A daemon's shared-memory lookup: segments ``gone`` and ``odd`` are refused."""
    if ref.name == "gone":
        raise BadRequest("segment 'gone' is not open")
    if ref.name == "odd":
        raise ProtocolError("shm.name: not a segment of this client's", field="shm.name")
    return _SEGMENT[ref.offset : ref.offset + nbytes]


@st.composite
def infer_messages(draw: st.DrawFn) -> list[bytes]:
    """An INFER's frames, well formed or broken in a few places: a field set to anything,
    dropped, or one added; a payload of the wrong size; a frame too many or missing."""
    fmt = draw(formats)
    height, width = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    image = {"height": height, "width": width, "format": fmt, "dtype": "uint8"}
    if draw(st.booleans()):
        image["colorspace"] = draw(st.sampled_from([*protocol.COLORSPACES, "bt2020"]))
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": int(Kind.INFER), "id": draw(ids),
                              "model": draw(names), "image": image}  # fmt: skip
    for key, values in _OPTIONAL.items():
        if draw(st.booleans()):
            header[key] = draw(values)
    in_shm = draw(st.booleans())
    if in_shm:
        header["shm"] = {"name": draw(st.sampled_from(["seg", "gone", "odd"])),
                         "offset": draw(st.integers(60, 68)), "size": 1 << 10,
                         "token": draw(st.sampled_from([bytes(16), bytes(15)]))}  # fmt: skip
    for _ in range(draw(st.integers(0, 2))):
        where = draw(st.sampled_from(["header", "image", "shm"]))
        m = header.get(where) if where != "header" else header
        if not isinstance(m, dict):
            continue
        change = draw(st.sampled_from(["set", "drop", "add"]))
        if change == "add":
            m[draw(st.sampled_from(["extra", "shm", "images", "load"]))] = draw(_ANY)
        elif m:
            key = draw(st.sampled_from(sorted(m)))
            if change == "set":
                m[key] = draw(_ANY)
            else:
                del m[key]
    frames = [msgpack.packb(header)]
    if not in_shm or draw(st.integers(0, 9)) == 0:
        size = math.prod(protocol.frame_shape(fmt, height, width))
        size += draw(st.sampled_from([0, 0, -1, 1]))
        frames.append(bytes(max(size, 0)))
    if draw(st.integers(0, 9)) == 0:
        frames.append(b"")
    return frames
