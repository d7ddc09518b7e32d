"""The synchronous client against a fake daemon over real tcp loopback sockets.

Every test runs a :class:`FakeDaemon` (a ROUTER thread that decodes with ``dlad.protocol``) on a
random port; the client's context is the test's, terminated at teardown to prove the client
closed its socket. Ordering on one connection is what tests synchronise on: a STATUS round trip
after a batch of requests proves the fake has taken them all in. The only clocks are the
client-side timeouts under test.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any, cast

import anyio
import numpy as np
import numpy.typing as npt
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dlad_client as sdk
from dlad import errors
from dlad.errors import STATUS_CLASSES, Status
from dlad.protocol import (
    CancelRequest,
    ErrorReply,
    InferReply,
    InferRequest,
    Kind,
    Reply,
    Request,
    StatusRequest,
    encode,
)
from dlad_client import (
    AsyncClient,
    BadRequest,
    Cancelled,
    Client,
    ClientClosed,
    ClientTimeout,
    ProtocolError,
)
from dlad_client._core import _Call, _Calls, _infer_request
from tests.clients.fake_daemon import (
    CLASS_NAMES,
    TIMING,
    FakeDaemon,
    Holding,
    Image,
    check_result,
    images,
    infers,
    report,
)

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------------------ sync client


def test_round_trip_decodes_detections_and_timing(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon()
    (image,) = images(1, seed=1)
    with Client(daemon.endpoint, context=context) as client:
        result = client.detect(
            image, model="demo", stream="cam0", priority=3, deadline_ms=200, conf=0.3, iou=0.5,
            max_det=10,
        )  # fmt: skip
        assert client.in_flight == 0
    (sent,) = daemon.requests
    assert isinstance(sent, InferRequest)
    assert (sent.id, sent.model, sent.format) == (result.request_id, "demo", "RGB")
    assert (sent.stream, sent.priority, sent.deadline_ms) == ("cam0", 3, 200)
    assert (sent.conf, sent.iou, sent.max_det) == (0.3, 0.5, 10)
    np.testing.assert_array_equal(sent.image, image)
    check_result(result, image)
    assert result.detections.dtype == np.float32
    assert result.detections.shape == (1, 6)
    assert len(result) == 1
    np.testing.assert_array_equal(result.boxes, result.detections[:, :4])
    assert result.classes.tolist() == [result.request_id % 80]
    assert (result.device, result.timing) == ("dla0", TIMING)
    assert client.closed


def test_pipelining_100_requests_with_replies_out_of_order(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding(release=100, seed=7))
    batch = images(100, seed=2)
    with Client(daemon.endpoint, context=context, max_in_flight=128) as client:
        handles = [client.submit(image, model="hold") for image in batch]
        ids = [h.request_id for h in handles]
        assert ids == sorted(set(ids))  # unique and increasing
        results = [h.result() for h in handles]
    for handle, result, image in zip(handles, results, batch, strict=True):
        assert result.request_id == handle.request_id
        check_result(result, image)
    arrival = [r.id for r in infers(daemon.requests)]
    assert arrival == ids


@pytest.mark.parametrize("status", [s for s in Status if s != Status.OK], ids=lambda s: s.name)
def test_each_error_status_raises_its_class(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon], status: Status
) -> None:
    def refuse(request: Request) -> list[Reply]:
        if isinstance(request, InferRequest):
            return [InferReply(request.id, status, f"boom {request.id}")]
        return [ErrorReply(request.id, status, "kind refused")]

    daemon = make_daemon(refuse)
    (image,) = images(1, seed=3)
    with Client(daemon.endpoint, context=context) as client:
        with pytest.raises(STATUS_CLASSES[status]) as infer_error:
            client.detect(image)
        with pytest.raises(STATUS_CLASSES[status]) as status_error:
            client.status()
    assert type(infer_error.value) is STATUS_CLASSES[status]
    assert type(status_error.value) is STATUS_CLASSES[status]
    rid = daemon.requests[0].id
    assert (infer_error.value.request_id, infer_error.value.message) == (rid, f"boom {rid}")
    assert status_error.value.message == "kind refused"


def test_client_timeout_sends_cancel_and_drops_the_late_reply(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding())
    first, second = images(2, seed=4)
    with Client(daemon.endpoint, context=context, timeout_s=0.2) as client:
        client.status(timeout_s=5.0)  # connected: the short timeout below is the reply's only
        with pytest.raises(ClientTimeout) as timeout:
            client.detect(first, model="hold")
        assert isinstance(timeout.value, TimeoutError)
        client.status(timeout_s=5.0)  # ordered after the CANCEL on this connection
        held = infers(daemon.requests)[0].id
        assert timeout.value.request_id == held
        assert [r for r in daemon.requests if isinstance(r, CancelRequest)] == [CancelRequest(held)]
        # The fake answered the CANCEL and the cancelled INFER; both replies are dropped.
        check_result(client.detect(second, timeout_s=5.0), second)
        assert client.in_flight == 0


def test_result_timeout_leaves_the_request_in_flight(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding(release=2))
    first, second = images(2, seed=5)
    with Client(daemon.endpoint, context=context) as client:
        handle = client.submit(first, model="hold")
        with pytest.raises(ClientTimeout):
            handle.result(timeout=0.05)
        assert not handle.done()
        other = client.submit(second, model="hold")  # the second held request releases both
        check_result(handle.result(), first)
        check_result(other.result(), second)
    assert not any(isinstance(r, CancelRequest) for r in daemon.requests)


def test_two_endpoints_both_receive_requests_round_robin(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    one, two = make_daemon(), make_daemon()
    batch = images(20, seed=6)
    with Client([one.endpoint, two.endpoint], context=context) as client:
        # ZMQ_IMMEDIATE: requests go to connected daemons only; both are once each has
        # answered something.
        while not (one.requests and two.requests):
            client.status()
        before = (len(one.requests), len(two.requests))
        handles = [client.submit(image) for image in batch]
        for handle, image in zip(handles, batch, strict=True):
            check_result(handle.result(), image)
    assert (len(one.requests) - before[0], len(two.requests) - before[1]) == (10, 10)


@pytest.mark.parametrize(
    ("shape", "pixel_format", "expected"),
    [
        ((20, 30), None, "GRAY"),
        ((20, 30, 1), None, "GRAY"),
        ((20, 30), "GRAY", "GRAY"),
        ((20, 30, 3), None, "RGB"),
        ((20, 30, 3), "BGR", "BGR"),
    ],
)
def test_pixel_format_is_inferred_or_given(
    context: zmq.Context[Any],
    make_daemon: Callable[..., FakeDaemon],
    shape: tuple[int, ...],
    pixel_format: Any,
    expected: str,
) -> None:
    daemon = make_daemon()
    (image,) = images(1, seed=7, shape=shape)
    with Client(daemon.endpoint, context=context) as client:
        check_result(client.detect(image, pixel_format=pixel_format), image)
    (sent,) = infers(daemon.requests)
    assert sent.format == expected
    np.testing.assert_array_equal(sent.image, image.reshape(20, 30, -1))


BAD_IMAGES: list[tuple[object, dict[str, Any], type[Exception]]] = [
    (np.zeros((8, 8, 3), np.float32), {}, ValueError),
    (np.zeros((8, 8, 3), np.uint16), {}, ValueError),
    (np.zeros((8, 8, 4), np.uint8), {}, ValueError),
    (np.zeros((8, 8, 2), np.uint8), {}, ValueError),
    (np.zeros(64, np.uint8), {}, ValueError),
    (np.zeros((1, 8, 8, 3), np.uint8), {}, ValueError),
    (np.zeros((0, 8, 3), np.uint8), {}, ValueError),
    (np.zeros((8, 8), np.uint8), {"pixel_format": "RGB"}, ValueError),
    (np.zeros((8, 8, 3), np.uint8), {"pixel_format": "GRAY"}, ValueError),
    (np.zeros((8, 8, 3), np.uint8), {"pixel_format": "RGBA"}, ValueError),
    ([[1, 2], [3, 4]], {}, TypeError),
    (np.zeros((8, 8, 3), np.uint8), {"priority": 8}, BadRequest),
    (np.zeros((8, 8, 3), np.uint8), {"conf": 1.0}, BadRequest),
    (np.zeros((8, 8, 3), np.uint8), {"max_det": 0}, BadRequest),
    (np.zeros((8, 8, 3), np.uint8), {"model": ""}, BadRequest),
    (np.zeros((8, 8, 3), np.uint8), {"deadline_ms": 0}, BadRequest),
    (np.zeros((8, 8, 3), np.uint8), {"timeout_s": 0.0}, ValueError),
]


@pytest.mark.parametrize(("image", "fields", "error"), BAD_IMAGES)
def test_bad_input_raises_before_anything_is_sent(
    context: zmq.Context[Any],
    make_daemon: Callable[..., FakeDaemon],
    image: object,
    fields: dict[str, Any],
    error: type[Exception],
) -> None:
    daemon = make_daemon()
    with Client(daemon.endpoint, context=context) as client:
        with pytest.raises(error):
            client.detect(cast("Image", image), **fields)
        client.status()  # anything sent before it would have arrived before it
    assert [type(r) for r in daemon.requests] == [StatusRequest]
    assert daemon.refused == []


def test_images_are_sent_without_copies_unless_not_contiguous(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    # Over pyzmq's 64 KiB copy threshold, so the zero-copy path is the one exercised.
    (image,) = images(1, seed=8, shape=(160, 200, 3))
    image.flags.writeable = False  # a read-only buffer is sent as it is too
    fields: dict[str, Any] = {"model": "demo", "pixel_format": None, "stream": None,
                              "priority": 0, "deadline_ms": None, "conf": None, "iou": None,
                              "max_det": None}  # fmt: skip
    assert np.shares_memory(_infer_request(1, image, **fields).image, image)
    gray = image[:, :, 0].copy()
    assert np.shares_memory(_infer_request(1, gray, **fields).image, gray)
    strided = image[:, ::2]
    copied = _infer_request(1, strided, **fields).image
    assert copied.flags.c_contiguous
    assert not np.shares_memory(copied, image)
    daemon = make_daemon()
    with Client(daemon.endpoint, context=context) as client:
        check_result(client.detect(strided), strided)
        check_result(client.detect(image), image)
    sent = infers(daemon.requests)
    np.testing.assert_array_equal(sent[0].image, strided)
    np.testing.assert_array_equal(sent[1].image, image)


def test_cancel_a_queued_request_and_a_finished_one(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding())
    first, second = images(2, seed=9)
    with Client(daemon.endpoint, context=context) as client:
        handle = client.submit(first, model="hold")
        assert client.cancel(handle) is True
        with pytest.raises(Cancelled) as cancelled:
            handle.result()
        assert cancelled.value.request_id == handle.request_id
        assert client.cancel(handle) is False  # done: nothing sent
        answered = client.submit(second)
        assert client.cancel(answered) is False  # the fake answers NOT_FOUND
        check_result(answered.result(), second)
    cancels = [r.id for r in daemon.requests if isinstance(r, CancelRequest)]
    assert cancels == [handle.request_id, answered.request_id]


def test_status_returns_the_report(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon()
    with Client(daemon.endpoint, context=context) as client:
        assert client.status() == report()


def test_results_carry_the_class_names_the_client_learned(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    """The names come from one STATUS (``class_names``, or ``status``) and every later result
    of the model carries them; before, a label is the class index."""
    daemon = make_daemon()
    image = images(1, seed=4)[0]
    with Client(daemon.endpoint, context=context) as client:
        before = client.detect(image, model="demo")
        assert before.class_names == ()
        assert before.labels == [str(before.classes[0])]
        assert client.class_names("demo") == CLASS_NAMES
        assert client.class_names("demo") == CLASS_NAMES  # remembered: no second STATUS
        after = client.detect(image, model="demo")
        assert after.labels == [CLASS_NAMES[after.classes[0]]]
        assert sum(isinstance(r, StatusRequest) for r in daemon.requests) == 1
        with pytest.raises(sdk.NotFound, match="serves no model 'other'"):
            client.class_names("other")


def test_max_in_flight_bounds_what_is_sent(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding())
    batch = images(3, seed=10)
    with Client(daemon.endpoint, context=context, max_in_flight=2) as client:
        held = [client.submit(image, model="hold") for image in batch[:2]]
        with pytest.raises(ClientTimeout):
            client.submit(batch[2], model="hold", timeout_s=0.1)
        client.status()
        assert len(infers(daemon.requests)) == 2
        assert client.in_flight == 2
    for handle in held:
        with pytest.raises(ClientClosed):
            handle.result()


def test_close_fails_pending_requests_and_terminates_its_own_context(
    make_daemon: Callable[..., FakeDaemon],
) -> None:
    daemon = make_daemon(Holding())
    (image,) = images(1, seed=11)
    client = Client(daemon.endpoint)
    handle = client.submit(image, model="hold")
    client.close()
    client.close()  # idempotent
    assert client.closed
    assert client._socket.closed
    assert client._context.closed
    with pytest.raises(ClientClosed):
        handle.result()
    with pytest.raises(ClientClosed):
        client.detect(image)


def test_a_client_belongs_to_its_thread(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon()
    errors: list[BaseException] = []
    with Client(daemon.endpoint, context=context) as client:

        def use() -> None:
            try:
                client.status()
            except RuntimeError as exc:
                errors.append(exc)

        thread = threading.Thread(target=use)
        thread.start()
        thread.join(5.0)
    assert len(errors) == 1
    assert "thread" in str(errors[0])
    assert daemon.requests == []


@pytest.mark.parametrize(
    ("endpoints", "settings_"),
    [
        ([], {}),
        ("", {}),
        ("tcp://127.0.0.1", {}),  # no port
        ("tcp://127.0.0.1:1", {"timeout_s": 0}),
        ("tcp://127.0.0.1:1", {"timeout_s": float("inf")}),
        ("tcp://127.0.0.1:1", {"max_in_flight": 0}),
        ("tcp://127.0.0.1:1", {"sndhwm": 0}),
        ("tcp://127.0.0.1:1", {"rcvhwm": 0}),
        ("tcp://127.0.0.1:1", {"linger": -1}),
    ],
)
def test_bad_settings_raise_value_error(
    context: zmq.Context[Any], endpoints: Any, settings_: dict[str, Any]
) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case names a different setting
        Client(endpoints, context=context, **settings_)


def test_replies_that_do_not_decode_fail_their_request_or_are_dropped() -> None:
    calls: _Calls[_Call] = _Calls()
    call = _Call(5, Kind.INFER_REPLY, deadline=1.0, timeout=1.0)
    calls.add(call)
    calls.deliver([b"\xc1 not msgpack"])  # no id to address: dropped
    assert len(calls) == 1
    header, _ = encode(InferReply(5, Status.OK, "", "dla0", TIMING, np.zeros((1, 6), np.float32)))
    calls.deliver([header, b"\x00" * 23])  # count says 24 bytes: refused, id 5 readable
    assert isinstance(call.outcome, ProtocolError)
    assert len(calls) == 0
    late = encode(InferReply(6, Status.OK, ""))
    calls.deliver(late)  # nobody waits for id 6
    assert calls.expired(2.0) == []


@settings(max_examples=80, deadline=None)
@given(
    image=hnp.arrays(
        st.sampled_from([np.uint8, np.int8, np.uint16, np.float32]),
        hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5),
    ),
    pixel_format=st.sampled_from([None, "RGB", "BGR", "GRAY"]),
)
def test_image_validation_accepts_exactly_the_protocol_images(
    image: npt.NDArray[Any], pixel_format: Any
) -> None:
    shape = image.shape
    channels = 1 if len(shape) == 2 else (shape[2] if len(shape) == 3 else 0)
    fmt = pixel_format or ("GRAY" if channels == 1 else "RGB")
    valid = (
        image.dtype == np.uint8
        and channels in (1, 3)
        and min(shape[:2]) > 0
        and (channels == 1) == (fmt == "GRAY")
    )
    fields: dict[str, Any] = {"model": "demo", "stream": None, "priority": 0,
                              "deadline_ms": None, "conf": None, "iou": None,
                              "max_det": None}  # fmt: skip
    if not valid:
        with pytest.raises(ValueError):  # noqa: PT011 - the message varies with the defect
            _infer_request(1, image, pixel_format=pixel_format, **fields)
        return
    request = _infer_request(1, image, pixel_format=pixel_format, **fields)
    assert request.format == fmt
    assert request.image.shape == (shape[0], shape[1], channels)
    np.testing.assert_array_equal(request.image.reshape(shape), image)


# ------------------------------------------------------------------------------ public surface


def test_public_surface_is_explicit_documented_and_final() -> None:
    public = {name for name in vars(sdk) if not name.startswith("_")} - {
        "annotations"  # from __future__
    }
    modules = {name for name in public if inspect.ismodule(getattr(sdk, name))}
    assert sorted(public - modules) == sorted(sdk.__all__)
    for name in sdk.__all__:
        obj = getattr(sdk, name)
        if inspect.isclass(obj) and issubclass(obj, errors.DladError):
            assert obj is getattr(errors, name)  # the daemon's own classes, not copies
    for cls in (sdk.Client, sdk.AsyncClient, sdk.Handle, sdk.AsyncHandle, sdk.BatchHandle,
                sdk.Result, sdk.AsyncFleet, sdk.Fleet, sdk.FleetHandle):  # fmt: skip
        assert getattr(cls, "__final__", False), cls
        assert cls.__doc__
        for member_name, member in vars(cls).items():
            if member_name.startswith("_") or not callable(member):
                continue
            assert member.__doc__, f"{cls.__name__}.{member_name}"
    raising = [sdk.Client.detect, sdk.Client.submit, sdk.Client.cancel, sdk.Client.status]
    raising += [sdk.AsyncClient.detect, sdk.AsyncClient.submit, sdk.AsyncClient.cancel]
    raising += [sdk.AsyncClient.status, sdk.Handle.result, sdk.AsyncHandle.result]
    raising += [sdk.Client.detect_batch, sdk.AsyncClient.detect_batch, sdk.BatchHandle.result]
    raising += [sdk.AsyncFleet.detect, sdk.Fleet.detect, sdk.Fleet.submit, sdk.FleetHandle.result]
    for method in raising:
        assert "Raises:" in (method.__doc__ or ""), method.__qualname__
    assert issubclass(sdk.ClientTimeout, TimeoutError)
    assert not issubclass(sdk.ClientTimeout, errors.DladError)


def test_a_dropped_handle_gives_its_slot_back_at_its_deadline(
    context: zmq.Context[Any], make_daemon: Callable[..., FakeDaemon]
) -> None:
    daemon = make_daemon(Holding())
    first, second = images(2, seed=17)
    with Client(daemon.endpoint, context=context, max_in_flight=1) as client:
        client.status()  # connected: the short timeout below is the reply's only
        dropped = client.submit(first, model="hold", timeout_s=0.1).request_id
        check_result(client.detect(second, timeout_s=5.0), second)
    kinds = [type(r) for r in daemon.requests]
    assert kinds == [StatusRequest, InferRequest, CancelRequest, InferRequest]
    assert daemon.requests[2].id == dropped


# ------------------------------------------------------------------ errors at once, not timeouts
@pytest.mark.parametrize("endpoint", ["127.0.0.1:5555", "localhost:5555", "udp://h:1", "tcp://"])
def test_an_endpoint_without_a_usable_scheme_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"scheme|transport|no address") as info:
        Client(endpoint)
    if endpoint.endswith(":5555"):
        assert f"tcp://{endpoint}" in str(info.value)  # the fix, spelled out
    with pytest.raises(ValueError, match=r"scheme|transport|no address"):
        AsyncClient(["tcp://127.0.0.1:5555", endpoint])


def test_an_oversized_frame_is_the_daemons_bad_request_at_once() -> None:
    """Over the protocol's 64 MiB a daemon refuses the message (beyond twice that it never
    reaches the decoder): the SDK raises that BadRequest before sending, with no daemon at all
    and a timeout far longer than the test's."""
    image = np.zeros((8192, 8192, 1), np.uint8)  # 64 MiB of pixels + the header: over
    with (
        Client("ipc:///nonexistent/dlad.sock", timeout_s=3600) as client,
        pytest.raises(errors.BadRequest, match="over the limit of 67108864"),
    ):
        client.detect(image)

    async def go() -> None:
        async with AsyncClient("ipc:///nonexistent/dlad.sock", timeout_s=3600) as client:
            with pytest.raises(errors.BadRequest, match="over the limit"):
                await client.detect(image)

    anyio.run(go)
