"""The daemon's one request decoder (dlad/native/wire.cpp, through protocol.decode_request) and
the native plane's reply writer.

The decoder is held to the protocol: every well-formed request, in every msgpack encoding of each
value, decodes to the fields it was built from; each bound is taken at its edge and refused just
past it, naming the field; anything else (broken in a few places, truncated, random bytes) is
refused with a message that starts with the field it names, and what is taken keeps every bound.
The writer must give the bytes msgpack-python gives. The decoder's constants and field names are
the protocol's (one declaration, ``dlad/protocol.py``).
"""

from __future__ import annotations

import contextlib
import math
import struct
import sys
import unicodedata
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlad import protocol
from dlad.errors import DladError, ProtocolError, Status
from dlad.protocol import (
    MAX_MESSAGE_CHARS,
    InferBatchRequest,
    InferReply,
    InferRequest,
    Limits,
    ShmRef,
    Timing,
)
from dlad_wire import protocol as wire
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

_FIELDS = (*wire._INFER_SCALARS, "format", "shm", "colour")


def decode(frames: list[Any], limits: Limits = protocol.DEFAULT_LIMITS) -> dict[str, Any]:
    """An INFER's fields as decode_request gives them (its refusal raises)."""
    request = protocol.decode_request(frames, limits, _resolve)
    assert isinstance(request, InferRequest)
    fields = {name: getattr(request, name) for name in _FIELDS}
    fields["shape"] = request.image.shape
    return fields


def taken(frames: list[Any], limits: Limits = protocol.DEFAULT_LIMITS) -> bool:
    try:
        decode(frames, limits)
    except ProtocolError:
        return False
    return True


def refused_at(frames: list[Any], limits: Limits = protocol.DEFAULT_LIMITS) -> str:
    """The field a refusal names (its message starts with it)."""
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    field = info.value.field
    assert field is not None
    assert info.value.message.startswith(field + ": "), info.value.message
    return field


def test_the_decoders_constants_are_the_protocols() -> None:
    """One declaration (dlad/protocol.py): the C++ decoder's constants, default limits and the
    field names it takes must be the protocol's."""
    from dlad import _native

    shm_name_chars = int(wire._SHM_NAME.pattern.rsplit(",", 1)[1].rstrip("}")) + 1
    requests = (protocol.Kind.INFER, protocol.Kind.CANCEL, protocol.Kind.STATUS,
                protocol.Kind.INFER_BATCH)  # fmt: skip
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
        "shm_header_bytes": protocol.SHM_HEADER_BYTES,
        "shm_token_bytes": protocol.SHM_TOKEN_BYTES,
        "max_batch_images": protocol.MAX_BATCH_IMAGES,
        "max_request_depth": protocol.MAX_REQUEST_DEPTH,
        "limits": protocol._native_limits(protocol.DEFAULT_LIMITS),
        "header": {int(k): tuple(map(list, wire._HEADER_FIELDS[k])) for k in requests},
        "image": list(protocol.IMAGE_FIELDS),
        "image_optional": list(protocol.IMAGE_OPTIONAL_FIELDS),
        "shm": list(protocol.SHM_FIELDS),
    }


def test_a_name_is_printable_as_python_says_of_every_assigned_character() -> None:
    """Names (model, stream) hold printable characters: the decoder's table is Python's
    str.isprintable on every character this Python's Unicode database assigns."""
    from dlad_wire import _rules

    wrong = [
        hex(c) for c in range(sys.maxunicode + 1)
        if unicodedata.category(chr(c)) != "Cn" and _rules.printable(c) != chr(c).isprintable()
    ]  # fmt: skip
    assert wrong == []


@pytest.mark.parametrize("name", ["\u0b4e", "cam\U000e0100x", "modèle", "a\u200b", "\ud800", ""])
def test_the_sdk_and_the_decoder_share_the_one_rule_of_a_name(name: str) -> None:
    """A name the decoder takes, the SDK builds, and the other way round (an unassigned
    character such as U+0B4E included: Python's isprintable refuses it, the rule takes it)."""
    from dlad_wire import _rules

    try:
        request = InferRequest(id=1, model=name, image=np.zeros((3, 4, 3), np.uint8))
    except ProtocolError:
        built = False
    else:
        built = True
        assert decode(protocol.encode(request))["model"] == name
    assert built == _rules.is_name(name)
    if "\ud800" not in name:  # a lone surrogate cannot be sent at all
        head = msgpack.unpackb(
            protocol.encode(InferRequest(1, "m", np.zeros((3, 4, 3), np.uint8)))[0]
        )
        assert taken([msgpack.packb(head | {"model": name}), bytes(36)]) == built


def _keeps_the_promises(request: protocol.Request) -> None:
    """What is taken keeps every bound, and encodes back to a message that decodes the same."""
    images = request.images if isinstance(request, InferBatchRequest) else (request,)
    for item in images:
        assert isinstance(item, InferRequest)
        InferRequest(**{f: getattr(item, f) for f in wire._REQUEST_FIELDS})  # checks all
    again = protocol.decode_request(protocol.encode(request), _SMALL, _resolve)
    assert type(again) is type(request)
    assert again.id == request.id


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(infer_messages())
def test_a_message_is_taken_keeping_every_bound_or_refused_naming_the_field(
    frames: list[bytes],
) -> None:
    try:
        request = protocol.decode_request(frames, _SMALL, _resolve)
    except ProtocolError as exc:
        refusal = exc
    except DladError:  # the segment's lookup (``_resolve``) refused it
        return
    else:
        _keeps_the_promises(request)
        return
    assert refusal.field is not None
    assert refusal.message.startswith(refusal.field + ": "), refusal.message


@settings(max_examples=400)
@given(infer_requests(), st.booleans())
def test_every_well_formed_infer_is_taken_as_it_was_built(
    request: InferRequest, in_shm: bool
) -> None:
    if in_shm:
        request = request.in_shared_memory(ShmRef("seg", 64, 1 << 10, bytes(16)))
    got = decode(protocol.encode(request))
    assert got == {name: getattr(request, name) for name in _FIELDS} | {
        "shape": request.image.shape
    }


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
    if isinstance(value, bytes):
        n = len(value)
        options = [b"\xc6" + struct.pack(">I", n) + value]
        if n < 2**8:
            options.append(b"\xc4" + struct.pack(">B", n) + value)
        if n < 2**16:
            options.append(b"\xc5" + struct.pack(">H", n) + value)
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
@given(st.data(), infer_requests(), st.booleans())
def test_every_encoding_of_a_value_reads_the_same(
    data: st.DataObject, request: InferRequest, in_shm: bool
) -> None:
    if in_shm:
        request = request.in_shared_memory(ShmRef("seg", 64, 1 << 10, bytes(16)))
    frames = protocol.encode(request)
    header = msgpack.unpackb(frames[0])
    if data.draw(st.booleans()):  # conf and iou as ints and floats of their value
        header["iou"] = 1
        header["conf"] = data.draw(st.sampled_from([0, 0.25, 0.5, -0.0]))
    smallest = [msgpack.packb(header), *frames[1:]]
    frames[0] = data.draw(packed(header))
    assert decode(frames) == decode(smallest)


_BOUNDS: dict[str, Any] = {
    # field: whether a value is taken (Python's view of the msgpack value)
    "v": lambda x: _is_int(x) and x == 1,
    "kind": lambda x: _is_int(x) and x == 1,
    "id": lambda x: _is_int(x) and 0 <= x < 2**64,
    "priority": lambda x: _is_int(x) and 0 <= x <= protocol.PRIORITY_MAX,
    "deadline_ms": lambda x: _is_int(x) and 1 <= x <= protocol.MAX_DEADLINE_MS,
    "max_det": lambda x: _is_int(x) and 1 <= x <= protocol.MAX_DET,
    "conf": lambda x: _is_number(x) and 0.0 <= x < 1.0,
    "iou": lambda x: _is_number(x) and 0.0 < x <= 1.0,
    "height": lambda x: _is_int(x) and x == 3,  # the payload is 3 x 4 x 3
    "width": lambda x: _is_int(x) and x == 4,
}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@settings(max_examples=300)
@given(
    st.data(),
    st.sampled_from(["v", "kind", "id", "priority", "deadline_ms", "max_det", "conf", "iou",
                     "height", "width"]),
    st.integers(-(2**63), 2**64 - 1) | st.floats() | st.booleans(),
)  # fmt: skip
def test_numbers_at_and_past_their_bounds(data: st.DataObject, field: str, value: Any) -> None:
    """Each number field set to anything numeric, in any encoding: taken within its bounds,
    else refused naming it."""
    request = InferRequest(id=1, model="m", image=np.zeros((3, 4, 3), np.uint8))
    frames = protocol.encode(request)
    header = msgpack.unpackb(frames[0])
    if field in ("height", "width"):
        header["image"][field] = value
    else:
        header[field] = value
    frames[0] = data.draw(packed(header))
    want = _BOUNDS[field](value)
    assert taken(frames) == want
    if not want and field not in ("kind", "height", "width"):  # those refuse by frame counts too
        assert refused_at(frames) == field


@pytest.mark.parametrize("value", [2, 0, 7, 8, -1, None, 1.0, True])
def test_bounds_of_priority(value: Any) -> None:
    request = InferRequest(id=1, model="m", image=np.zeros((3, 4, 3), np.uint8))
    header = msgpack.unpackb(protocol.encode(request)[0])
    header["priority"] = value
    assert taken([msgpack.packb(header), bytes(36)]) == (value in (2, 0, 7, None))


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


_SEG = {"name": "seg", "offset": 64, "size": 1 << 10, "token": bytes(16)}


@pytest.mark.parametrize(("edit", "shm", "taken"), [
    ({"conf": 0.0}, None, True), ({"conf": 1.0}, None, False), ({"conf": 1}, None, False),
    ({"conf": -0.0}, None, True), ({"conf": float("nan")}, None, False),
    ({"iou": 1.0}, None, True), ({"iou": 0.0}, None, False), ({"iou": 0}, None, False),
    ({"model": "a\x7f"}, None, False), ({"model": "a\x1f"}, None, False),
    ({"model": " ~"}, None, True), ({"model": "m" * 128}, None, True),
    ({"model": "m" * 129}, None, False), ({"stream": ""}, None, False),
    ({"model": "modèle"}, None, True), ({"stream": "カメラ1"}, None, True),
    ({"model": "é" * 128}, None, True), ({"model": "é" * 129}, None, False),
    ({"stream": "cam\u200b"}, None, False), ({"stream": "cam\u202e"}, None, False),
    ({"model": "a\u3000b"}, None, False), ({"model": "a\ue000"}, None, False),
    ({}, _SEG, True), ({}, _SEG | {"name": ".seg"}, False), ({}, _SEG | {"name": "s.e-g_0"}, True),
    ({}, _SEG | {"name": "s" * 200}, True), ({}, _SEG | {"name": "s" * 201}, False),
    ({}, _SEG | {"name": "se/g"}, False), ({}, _SEG | {"offset": 988}, True),
    ({}, _SEG | {"offset": 989}, False),
    ({}, _SEG | {"offset": 1 << 10}, False), ({}, _SEG | {"size": 0, "offset": 0}, False),
    ({}, _SEG | {"offset": 63}, False), ({}, _SEG | {"size": 64}, False),
    ({}, _SEG | {"token": bytes(15)}, False), ({}, _SEG | {"token": "x" * 16}, False),
    ({}, {k: v for k, v in _SEG.items() if k != "token"}, False),
    ({}, _SEG | {"size": (1 << 40) + 1}, False), ({}, _SEG | {"extra": 1}, False),
    ({}, {"name": "seg", "offset": 64}, False), ({"id": 2**64 - 1}, None, True),
    ({"deadline_ms": 3_600_000}, None, True), ({"deadline_ms": 3_600_001}, None, False),
    ({"deadline_ms": 0}, None, False), ({"max_det": 1000}, None, True),
    ({"max_det": 1001}, None, False), ({"v": 2}, None, False), ({"kind": 2}, None, False),
])  # fmt: skip
def test_edges(edit: dict[str, Any], shm: dict[str, Any] | None, taken: bool) -> None:
    taken_ = globals()["taken"]
    """Each bound at and just past it."""
    assert taken_(_edited(edit, shm)) == taken


@pytest.mark.parametrize(("height", "width", "taken"), [
    (4, 5, True), (5, 4, True), (3, 7, False), (7, 3, False), (8, 1, True), (9, 1, False),
    (1, 8, True), (1, 9, False), (0, 1, False),
])  # fmt: skip
def test_image_bounds(height: int, width: int, taken: bool) -> None:
    taken_ = globals()["taken"]
    limits = Limits(max_message_bytes=1 << 12, max_header_bytes=1 << 10, max_width=8,
                    max_height=8, max_image_pixels=20)  # fmt: skip
    frames = _edited({"height": height, "width": width})
    frames[1] = bytes(height * width * 3)
    assert taken_(frames, limits) == taken


def test_a_key_given_twice_is_refused() -> None:
    head = msgpack.packb(msgpack.unpackb(_edited({})[0]))
    assert head[0] == 0x85  # a fixmap of five: give it a sixth entry, "id" again
    twice = bytes([0x86]) + head[1:] + msgpack.packb("id") + msgpack.packb(1)
    with pytest.raises(ProtocolError, match=r"^header: duplicate field 'id'$"):
        decode([twice, bytes(36)])
    image = msgpack.packb({"height": 3, "width": 4, "format": "RGB", "dtype": "uint8"})
    header = msgpack.unpackb(head)
    del header["image"]
    image_twice = bytes([0x85]) + image[1:] + msgpack.packb("width") + msgpack.packb(4)
    whole = bytes([0x85]) + msgpack.packb(header)[1:] + msgpack.packb("image") + image_twice
    with pytest.raises(ProtocolError, match=r"^header: duplicate field 'width'$"):
        decode([whole, bytes(36)])


def test_a_truncated_header_is_refused() -> None:
    request = InferRequest(id=2**40, model="demo", image=np.zeros((2, 2, 3), np.uint8),
                           stream="cam", conf=0.25, iou=0.5, max_det=10)  # fmt: skip
    head, payload = protocol.encode(request)
    assert taken([head, payload])
    for n in range(len(head)):
        with pytest.raises(ProtocolError, match=r"^header: not a valid msgpack document \("):
            decode([head[:n], payload])
    with pytest.raises(ProtocolError, match=r"^header: .*\(trailing data\)"):
        decode([bytes(head) + b"\x00", payload])


@settings(max_examples=500)
@given(st.binary(max_size=64), st.integers(1, 2), st.integers(0, 64))
def test_random_bytes_are_refused_naming_a_field(head: bytes, frames: int, payload: int) -> None:
    message = [head, bytes(payload)][:frames]
    try:
        request = protocol.decode_request(message, protocol.DEFAULT_LIMITS, _resolve)
    except ProtocolError as exc:
        refusal = exc
    else:
        _keeps_the_promises(request)
        return
    assert refusal.field is not None
    assert refusal.message.startswith(refusal.field + ": ")


@pytest.mark.parametrize("value", [
    0.1, 1e16, 1e-05, 123456789.0, -2.5e-7, 1.5e300, float("inf"), float("nan"), -0.0,
    "it's", 'say "hi"', "'\"", "a\nb\t\\", "x" * 50, "é" * 60, "a'b" * 20, "\x00\x7f\x85\u200b",
    "カメラ" * 20, b"\x00a'", [1, [2, [3]]], [1, 2, 3, 4, 5], [], {"a": 1}, {"a": [{"b": 1}]},
    True, -(2**63), -1, "\U0001f600",
])  # fmt: skip
def test_a_refusal_shows_the_value_as_python_would(value: Any) -> None:
    """The value in a refusal's words is Python's repr of it, cut as wire._show cuts (the
    SDK's own words for the same value)."""
    request = InferRequest(id=1, model="m", image=np.zeros((3, 4, 3), np.uint8))
    header = msgpack.unpackb(protocol.encode(request)[0])
    header["id"] = value
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(header, use_bin_type=True), bytes(36)])
    bound = f"[0, {2**64 - 1}]"
    assert info.value.message == f"id: must be an int in {bound}, got {wire._show(value)}"


@pytest.mark.parametrize(("value", "shown"), [
    (0.1, "0.1"), (1e16, "1e+16"), (1e-05, "1e-05"), (-0.0, "-0.0"),
    ("x" * 40, "'" + "x" * 15 + "..."),
])  # fmt: skip
def test_shown_values_are_short(value: Any, shown: str) -> None:
    request = InferRequest(id=1, model="m", image=np.zeros((3, 4, 3), np.uint8))
    header = msgpack.unpackb(protocol.encode(request)[0]) | {"max_det": value}
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(header), bytes(36)])
    assert info.value.message.startswith(f"max_det: must be an int in [1, 1000], got {shown}")


def test_a_refusal_is_addressed_to_the_request() -> None:
    request = InferRequest(id=77, model="m", image=np.zeros((3, 4, 3), np.uint8))
    header = msgpack.unpackb(protocol.encode(request)[0])
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(header | {"conf": 2}), bytes(36)])
    assert (info.value.request_id, info.value.request_kind) == (77, 1)
    assert info.value.field == "conf"


# ------------------------------------------------------------------------------ the writer


@settings(max_examples=500)
@given(ids, st.sampled_from(["dla0", "dla1", "gpu", "a" * 40, "é" * 128]), timings(),
       st.integers(0, protocol.MAX_DET))  # fmt: skip
def test_an_ok_reply_is_the_one_the_sdk_reads(
    rid: int, device: str, timing: Timing, count: int
) -> None:
    """The plane's INFER_REPLY writer (the daemon's only one), read by the SDK."""
    from dlad import _native

    fields = {name: getattr(timing, name) for name in wire._TIMING_FIELDS}
    got = _native.write_infer_reply(rid, 0, "", device, tuple(fields.values()), count)
    reply = protocol.decode_reply([got, np.zeros((count, 6), np.float32).tobytes()])
    assert isinstance(reply, InferReply)
    assert (reply.id, reply.device, reply.timing, reply.count) == (rid, device, timing, count)


@settings(max_examples=300)
@given(ids, st.sampled_from([s for s in Status if s is not Status.OK]),
       st.text(min_size=1, max_size=MAX_MESSAGE_CHARS), st.none() | st.sampled_from(["dla0"]),
       timings())  # fmt: skip
def test_an_infer_reply_with_its_words_is_the_one_the_sdk_reads(
    rid: int, status: Status, message: str, device: str | None, timing: Timing
) -> None:
    from dlad import _native

    fields = tuple(getattr(timing, name) for name in wire._TIMING_FIELDS)
    got = _native.write_infer_reply(rid, int(status), message, device, fields, 0)
    reply = protocol.decode_reply([got, b""])
    assert isinstance(reply, InferReply)
    assert (reply.id, reply.status, reply.message, reply.device, reply.timing, reply.count) == (
        rid, status, message, device, timing, 0)  # fmt: skip


@given(st.none() | ids, st.none() | st.integers(-3, 300),
       st.sampled_from([s for s in Status if s is not Status.OK]),
       st.text(st.characters(exclude_categories=["Cs"]), min_size=1,
               max_size=MAX_MESSAGE_CHARS))  # fmt: skip
def test_an_error_reply_is_the_one_the_sdk_reads_for_its_request(
    rid: int | None, kind: int | None, status: Status, message: str
) -> None:
    """The daemon's one writer of error replies (the plane's refusals past a client's rate and
    the control plane's answers both): for every id and kind a refusal can yield, the SDK reads
    the request's own reply kind where the id and the kind are known, else an ERROR_REPLY, with
    the status and the words."""
    error = DladError(message, request_id=rid, request_kind=kind)
    error.status = status  # type: ignore[misc]  # a DladError of each status
    reply = protocol.decode_reply(protocol.encode_error_reply(error))
    kinds = {1: protocol.InferReply, 2: protocol.CancelReply, 3: protocol.StatusReply,
             4: protocol.InferBatchReply}  # fmt: skip
    want: type = protocol.ErrorReply
    if rid is not None and kind is not None:
        want = kinds.get(kind, protocol.ErrorReply)
    assert type(reply) is want
    assert (reply.id, reply.status, reply.message) == (rid, status, message)


@given(formats)
def test_formats_have_their_channels(fmt: str) -> None:
    shape = protocol.frame_shape(fmt, 2, 4)
    request = InferRequest(id=1, model="m", image=np.zeros(shape, np.uint8), format=fmt)  # type: ignore[arg-type]
    assert decode(protocol.encode(request))["shape"] == shape
