"""The native data plane's codec (dlad/native/wire.cpp) against dlad/protocol.py.

What the reader takes, the Python decoder (``protocol.decode_request``, which decodes what the
plane forwards) takes too, reading the same fields; it takes every well-formed INFER whose names
are ASCII (a non-ASCII name is left to the Python decoder, by design), and on every other message
it answers "not mine" (the plane forwards it). Held to that on generated INFERs, broken in a few
places or whole, in every msgpack encoding of each value, at every truncation and on random
bytes. The writer must give the bytes msgpack-python gives. The reader's constants are the
protocol's (one declaration, ``dlad/protocol.py``).
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlad import protocol
from dlad.errors import DladError, Status
from dlad.protocol import MAX_MESSAGE_CHARS, InferReply, InferRequest, Limits, ShmRef, Timing
from tests.dlad.test_protocol import (
    _SMALL,
    _resolve,
    formats,
    ids,
    infer_messages,
    infer_requests,
    timings,
)

pytestmark = [
    pytest.mark.timeout(120),
]

ascii_names = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1,
                      max_size=24)  # fmt: skip
_FIELDS = (*protocol._INFER_SCALARS, "format")


def _limits(limits: Limits) -> tuple[int, int, int, int, int]:
    return (limits.max_message_bytes, limits.max_header_bytes, limits.max_width,
            limits.max_height, limits.max_image_pixels)  # fmt: skip


def native(frames: list[Any], limits: Limits) -> dict[str, Any] | None:
    """What the native reader takes from ``frames``, as the request's fields (None: not its),
    the shared-memory frame found as a daemon finds it (``_resolve``, which may raise)."""
    from dlad import _native

    payload = len(frames[1]) if len(frames) == 2 else 0
    read = _native.read_infer(frames[0], len(frames), payload, _limits(limits), True)
    if read is None:
        return None
    *scalars, fmt, height, width, channels, ref = read
    fields: dict[str, Any] = dict(zip(_FIELDS, (*scalars, fmt), strict=True))
    fields["shape"] = (height, width, channels)
    fields["shm"] = None if ref is None else ShmRef(*ref)
    need = height * width * channels
    if ref is not None and _resolve(fields["shm"], need).nbytes != need:
        return None  # the image runs past the segment's end
    return fields


def python(frames: list[Any], limits: Limits) -> dict[str, Any] | None:
    """The same from protocol.decode_request (None: not an INFER; its refusal raises)."""
    request = protocol.decode_request(frames, limits, _resolve)
    if not isinstance(request, InferRequest):
        return None
    fields = {name: getattr(request, name) for name in (*_FIELDS, "shm")}
    fields["shape"] = request.image.shape
    return fields


def _both(frames: list[Any], limits: Limits) -> tuple[Any, Any]:
    """(native, Python), each the fields or None, or the error the segment's lookup raised."""
    return _outcome(native, frames, limits), _outcome(python, frames, limits)


def _outcome(read: Any, frames: list[Any], limits: Limits) -> Any:
    try:
        return read(frames, limits)
    except DladError as exc:
        return type(exc), exc.message


def check(frames: list[Any], limits: Limits = _SMALL) -> Any:
    got, want = _both(frames, limits)
    if got is not None:  # taken: Python takes it too, and reads the same
        assert got == want
    return got


def test_the_readers_constants_are_the_protocols() -> None:
    """One declaration (dlad/protocol.py): the C++ reader's constants, default limits and the
    field names it takes must be the protocol's."""
    from dlad import _native

    shm_name_chars = int(protocol._SHM_NAME.pattern.rsplit(",", 1)[1].rstrip("}")) + 1
    assert _native.wire_constants() == {
        "protocol_version": protocol.PROTOCOL_VERSION,
        "infer": int(protocol.Kind.INFER),
        "infer_reply": int(protocol.Kind.INFER_REPLY),
        "priority_max": protocol.PRIORITY_MAX,
        "max_deadline_ms": protocol.MAX_DEADLINE_MS,
        "max_det": protocol.MAX_DET,
        "max_name_chars": protocol.MAX_NAME_CHARS,
        "max_shm_bytes": protocol.MAX_SHM_BYTES,
        "max_shm_name": shm_name_chars,
        "limits": _limits(protocol.DEFAULT_LIMITS),
        "required": list(protocol._HEADER_FIELDS[protocol.Kind.INFER][0]),
        "optional": list(protocol._HEADER_FIELDS[protocol.Kind.INFER][1]),
        "image": list(protocol.IMAGE_FIELDS),
        "shm": list(protocol.SHM_FIELDS),
    }


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(infer_messages())
def test_the_reader_takes_what_python_takes_and_reads_the_same(frames: list[bytes]) -> None:
    check(frames)


@st.composite
def ascii_requests(draw: st.DrawFn) -> InferRequest:
    request: InferRequest = draw(infer_requests())
    header = {"model": draw(ascii_names), "stream": draw(st.none() | ascii_names)}
    return InferRequest(**{f: getattr(request, f) for f in protocol._REQUEST_FIELDS} | header)


@settings(max_examples=400)
@given(ascii_requests(), st.booleans())
def test_every_well_formed_infer_is_taken(request: InferRequest, in_shm: bool) -> None:
    if in_shm:
        request = request.in_shared_memory(ShmRef("seg", 0, 1 << 10))
    frames = protocol.encode(request)
    got = check(frames, protocol.DEFAULT_LIMITS)
    assert got is not None
    assert got["id"] == request.id
    assert got["shape"] == request.image.shape


# -------------------------------------------------------------- every encoding msgpack allows


_INT_FORMATS = (
    (0xCC, ">B", 0, 2**8), (0xCD, ">H", 0, 2**16), (0xCE, ">I", 0, 2**32), (0xCF, ">Q", 0, 2**64),
    (0xD0, ">b", -(2**7), 2**7), (0xD1, ">h", -(2**15), 2**15), (0xD2, ">i", -(2**31), 2**31),
    (0xD3, ">q", -(2**63), 2**63),
)  # fmt: skip


def _pack_any_width(value: object, draw: st.DrawFn) -> bytes:
    """``value`` in msgpack, each int, float, string and map in an encoding drawn from those
    that hold it (msgpack-python packs the smallest; a client in another language need not)."""
    if value is None:
        return b"\xc0"
    if isinstance(value, bool):
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        options = []
        if 0 <= value <= 0x7F:
            options.append(bytes([value]))
        if -32 <= value < 0:
            options.append(struct.pack(">b", value))
        for code, fmt, lo, hi in _INT_FORMATS:
            if lo <= value < hi:
                options.append(bytes([code]) + struct.pack(fmt, value))
        return draw(st.sampled_from(options))
    if isinstance(value, float):
        options = [b"\xcb" + struct.pack(">d", value)]
        with contextlib.suppress(OverflowError):  # past float32's range
            single = struct.pack(">f", value)
            if struct.unpack(">f", single)[0] == value or math.isnan(value):
                options.append(b"\xca" + single)
        return draw(st.sampled_from(options))
    if isinstance(value, str):
        raw = value.encode()
        n = len(raw)
        options = [b"\xdb" + struct.pack(">I", n) + raw]
        if n < 32:
            options.append(bytes([0xA0 | n]) + raw)
        if n < 2**8:
            options.append(b"\xd9" + struct.pack(">B", n) + raw)
        if n < 2**16:
            options.append(b"\xda" + struct.pack(">H", n) + raw)
        return draw(st.sampled_from(options))
    assert isinstance(value, dict)
    n = len(value)
    heads = [b"\xdf" + struct.pack(">I", n), b"\xde" + struct.pack(">H", n)]
    if n < 16:
        heads.append(bytes([0x80 | n]))
    items = list(value.items())
    items = draw(st.permutations(items))  # a map's order means nothing
    body = b"".join(_pack_any_width(k, draw) + _pack_any_width(v, draw) for k, v in items)
    return draw(st.sampled_from(heads)) + body


def packed(value: object) -> st.SearchStrategy[bytes]:
    return st.composite(lambda draw: _pack_any_width(value, draw))()


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), ascii_requests(), st.booleans())
def test_every_encoding_of_a_value_reads_the_same(
    data: st.DataObject, request: InferRequest, in_shm: bool
) -> None:
    if in_shm:
        request = request.in_shared_memory(ShmRef("seg", 0, 1 << 10))
    frames = protocol.encode(request)
    header = msgpack.unpackb(frames[0])
    if data.draw(st.booleans()):  # conf and iou as ints and floats of their value
        header["iou"] = 1
        header["conf"] = data.draw(st.sampled_from([0, 0.25, 0.5, -0.0]))
    frames[0] = data.draw(packed(header))
    got = check(frames, protocol.DEFAULT_LIMITS)
    assert got is not None


@settings(max_examples=300)
@given(
    st.data(),
    st.sampled_from(["v", "kind", "id", "priority", "deadline_ms", "max_det", "conf", "iou",
                     "height", "width"]),
    st.integers(-(2**63), 2**64 - 1) | st.floats() | st.booleans(),
)  # fmt: skip
def test_numbers_at_and_past_their_bounds(data: st.DataObject, field: str, value: Any) -> None:
    """Each number field set to anything numeric, in any encoding: the bounds are Python's."""
    request = InferRequest(id=1, model="m", image=np.zeros((3, 4, 3), np.uint8))
    frames = protocol.encode(request)
    header = msgpack.unpackb(frames[0])
    if field in ("height", "width"):
        header["image"][field] = value
    else:
        header[field] = value
    frames[0] = data.draw(packed(header))
    check(frames, protocol.DEFAULT_LIMITS)


@pytest.mark.parametrize("value", [2, 0, 7, 8, -1, None, 1.0, True])
def test_bounds_of_priority(value: Any) -> None:
    request = InferRequest(id=1, model="m", image=np.zeros((3, 4, 3), np.uint8))
    header = msgpack.unpackb(protocol.encode(request)[0])
    header["priority"] = value
    got = check([msgpack.packb(header), bytes(36)], protocol.DEFAULT_LIMITS)
    assert (got is not None) == (value in (2, 0, 7, None))


def _edited(edit: dict[str, Any], shm: dict[str, Any] | None = None) -> list[Any]:
    request = InferRequest(id=1, model="m", image=np.zeros((3, 4, 3), np.uint8))
    header = msgpack.unpackb(protocol.encode(request)[0])
    for key, value in edit.items():
        if key in ("height", "width"):
            header["image"][key] = value
        else:
            header[key] = value
    if shm is not None:
        return [msgpack.packb(header | {"shm": shm})]
    return [msgpack.packb(header), bytes(3 * 4 * 3)]


_SEG = {"name": "seg", "offset": 0, "size": 1 << 10}


@pytest.mark.parametrize(("edit", "shm", "taken"), [
    ({"conf": 0.0}, None, True), ({"conf": 1.0}, None, False), ({"conf": 1}, None, False),
    ({"conf": -0.0}, None, True), ({"conf": float("nan")}, None, False),
    ({"iou": 1.0}, None, True), ({"iou": 0.0}, None, False), ({"iou": 0}, None, False),
    ({"model": "a\x7f"}, None, False), ({"model": "a\x1f"}, None, False),
    ({"model": " ~"}, None, True), ({"model": "m" * 128}, None, True),
    ({"model": "m" * 129}, None, False), ({"stream": ""}, None, False),
    ({}, _SEG, True), ({}, _SEG | {"name": ".seg"}, False), ({}, _SEG | {"name": "s.e-g_0"}, True),
    ({}, _SEG | {"name": "s" * 200}, True), ({}, _SEG | {"name": "s" * 201}, False),
    ({}, _SEG | {"name": "se/g"}, False), ({}, _SEG | {"offset": 988}, True),
    ({}, _SEG | {"offset": 989}, False),
    ({}, _SEG | {"offset": 1 << 10}, False), ({}, _SEG | {"size": 0, "offset": 0}, False),
    ({}, _SEG | {"size": (1 << 40) + 1}, False), ({}, _SEG | {"extra": 1}, False),
    ({}, {"name": "seg", "offset": 0}, False), ({"id": 2**64 - 1}, None, True),
    ({"deadline_ms": 3_600_000}, None, True), ({"deadline_ms": 3_600_001}, None, False),
    ({"deadline_ms": 0}, None, False), ({"max_det": 1000}, None, True),
    ({"max_det": 1001}, None, False), ({"v": 2}, None, False), ({"kind": 2}, None, False),
])  # fmt: skip
def test_edges(edit: dict[str, Any], shm: dict[str, Any] | None, taken: bool) -> None:
    """Each bound at and just past it (and, through check, Python's verdict on the same)."""
    got = check(_edited(edit, shm), protocol.DEFAULT_LIMITS)
    assert (got is not None) == taken


@pytest.mark.parametrize(("height", "width", "taken"), [
    (4, 5, True), (5, 4, True), (3, 7, False), (7, 3, False), (8, 1, True), (9, 1, False),
    (1, 8, True), (1, 9, False), (0, 1, False),
])  # fmt: skip
def test_image_bounds(height: int, width: int, taken: bool) -> None:
    limits = Limits(max_message_bytes=1 << 12, max_header_bytes=1 << 10, max_width=8,
                    max_height=8, max_image_pixels=20)  # fmt: skip
    frames = _edited({"height": height, "width": width})
    frames[1] = bytes(height * width * 3)
    got = check(frames, limits)
    assert (got is not None) == taken


def test_a_key_given_twice_is_left_to_the_full_decoder() -> None:
    head = msgpack.packb(msgpack.unpackb(_edited({})[0]))
    assert head[0] == 0x85  # a fixmap of five: give it a sixth entry, "id" again
    twice = bytes([0x86]) + head[1:] + msgpack.packb("id") + msgpack.packb(1)
    assert check([twice, bytes(36)], protocol.DEFAULT_LIMITS) is None
    image = msgpack.packb({"height": 3, "width": 4, "format": "RGB", "dtype": "uint8"})
    header = msgpack.unpackb(head)
    del header["image"]
    image_twice = bytes([0x85]) + image[1:] + msgpack.packb("width") + msgpack.packb(4)
    whole = bytes([0x85]) + msgpack.packb(header)[1:] + msgpack.packb("image") + image_twice
    assert check([whole, bytes(36)], protocol.DEFAULT_LIMITS) is None


def test_a_truncated_header_is_never_taken() -> None:
    request = InferRequest(id=2**40, model="demo", image=np.zeros((2, 2, 3), np.uint8),
                           stream="cam", conf=0.25, iou=0.5, max_det=10)  # fmt: skip
    head, payload = protocol.encode(request)
    assert check([head, payload], protocol.DEFAULT_LIMITS) is not None
    for n in range(len(head)):
        assert check([head[:n], payload], protocol.DEFAULT_LIMITS) is None
    assert check([bytes(head) + b"\x00", payload], protocol.DEFAULT_LIMITS) is None  # extra data


@settings(max_examples=500)
@given(st.binary(max_size=64), st.integers(1, 2), st.integers(0, 64))
def test_random_bytes_are_never_taken(head: bytes, frames: int, payload: int) -> None:
    message = [head, bytes(payload)][:frames]
    assert check(message, protocol.DEFAULT_LIMITS) is None


def test_a_non_ascii_name_is_left_to_the_full_decoder() -> None:
    request = InferRequest(id=1, model="modèle", image=np.zeros((1, 1, 1), np.uint8), format="GRAY")
    frames = protocol.encode(request)
    got, want = _both(frames, protocol.DEFAULT_LIMITS)
    assert got is None
    assert want is not None


# ------------------------------------------------------------------------------ the writer


@settings(max_examples=500)
@given(ids, st.sampled_from(["dla0", "dla1", "gpu", "a" * 40, "é" * 128]), timings(),
       st.integers(0, protocol.MAX_DET))  # fmt: skip
def test_an_ok_reply_is_packed_as_msgpack_python_packs_it(
    rid: int, device: str, timing: Timing, count: int
) -> None:
    from dlad import _native

    fields = {name: getattr(timing, name) for name in protocol._TIMING_FIELDS}
    detections = np.zeros((count, 6), np.float32)
    want = protocol.encode_infer_ok(rid, device, fields, detections)
    got = _native.write_infer_reply(rid, 0, "", device, tuple(fields.values()), count)
    assert got == bytes(want[0])
    reply = protocol.decode_reply([got, want[1]])
    assert isinstance(reply, InferReply)
    assert (reply.id, reply.device, reply.timing, reply.count) == (rid, device, timing, count)


@settings(max_examples=300)
@given(ids, st.sampled_from([s for s in Status if s is not Status.OK]),
       st.text(min_size=1, max_size=MAX_MESSAGE_CHARS), st.none() | st.sampled_from(["dla0"]),
       timings())  # fmt: skip
def test_an_error_reply_is_packed_as_msgpack_python_packs_it(
    rid: int, status: Status, message: str, device: str | None, timing: Timing
) -> None:
    from dlad import _native

    want = protocol.encode(InferReply(rid, status, message, device, timing))
    fields = tuple(getattr(timing, name) for name in protocol._TIMING_FIELDS)
    got = _native.write_infer_reply(rid, int(status), message, device, fields, 0)
    assert got == bytes(want[0])


@given(formats)
def test_formats_have_their_channels(fmt: str) -> None:
    shape = (2, 3, protocol.CHANNELS[fmt])
    request = InferRequest(id=1, model="m", image=np.zeros(shape, np.uint8), format=fmt)  # type: ignore[arg-type]
    got = check(protocol.encode(request), protocol.DEFAULT_LIMITS)
    assert got is not None
    assert got["shape"] == shape
