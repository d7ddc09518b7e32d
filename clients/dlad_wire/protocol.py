"""Wire protocol v1: every message dlad and its clients exchange, with strict encoders and decoders.

Transport is ZeroMQ, DEALER (client) ↔ ROUTER (daemon). A message is a list of frames: one
msgpack map (the header) followed by at most one payload frame (an INFER_BATCH and its reply:
one per image). The ROUTER's identity frames are
the frontend's business and never reach this module. ``docs/protocol.md`` is the specification
(field tables, ranges, a byte-level example); this module is its implementation::

    request             frames                reply                     frames
    INFER       (0x01)  header, image         INFER_REPLY       (0x81)  header, detections
    CANCEL      (0x02)  header                CANCEL_REPLY      (0x82)  header
    STATUS      (0x03)  header                STATUS_REPLY      (0x83)  header
    INFER_BATCH (0x04)  header, an image per  INFER_BATCH_REPLY (0x84)  header, detections per
                        image not in shm                                image
                                              ERROR_REPLY       (0x80)  header (kind unreadable)

A reply kind is its request kind with bit 7 set. Every reply carries ``status`` (a
:class:`~dlad_wire.errors.Status`) and ``message``.

Messages are frozen dataclasses that validate themselves on construction, so an invalid message
cannot be built, encoded or decoded. Every refusal raises
:class:`~dlad_wire.errors.ProtocolError` (a ``BadRequest``) whose ``field`` names the offending
field; decoders never leak KeyError, TypeError or ValueError, and fill in the request id and
kind when the header still yields them, so the daemon can address its ``BAD_REQUEST`` reply
(``dlad.protocol.encode_error_reply``).

This module is the wire, declared once, in the ``dlad-client`` distribution: the SDK builds
requests and decodes replies with it, and the daemon (``dlad.protocol``, which re-exports it)
answers with it. Requests are decoded by the daemon's one request decoder, in C++
(``dlad/native/wire.hpp``, the native plane's, behind ``dlad.protocol.decode_request``); this
module declares the constants and field names it must follow (``tests/dlad/test_native_wire.py``
holds it to them). The rules both sides check, a name's and a pixel format's shapes, are C++
headers of this package (``native/names.hpp``, ``native/frames.hpp``) that the daemon compiles
too; the SDK reads them through ``dlad_wire._rules``.

Payloads cross without copies: :func:`encode` returns the image (or detections) as a memoryview
over the caller's array, for ``send_multipart(frames, copy=False)``; the decoders return read-only
numpy views over the received frames' buffers (``zmq.Frame`` or any bytes-like object), which keep
those buffers alive. msgpack only, no pickle; zmq itself is not imported.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
import re
import reprlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Final,
    Literal,
    NoReturn,
    TypeAlias,
    TypedDict,
    TypeGuard,
    cast,
)

import msgpack
import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import Meta

from dlad_wire import _rules
from dlad_wire.errors import ProtocolError, Status

if TYPE_CHECKING:
    import zmq

__all__ = [
    "COLORSPACES",
    "COLOR_RANGES",
    "DEFAULT_LIMITS",
    "IMAGE_FIELDS",
    "IMAGE_OPTIONAL_FIELDS",
    "MAX_BATCH",
    "MAX_BATCH_IMAGES",
    "MAX_DEADLINE_MS",
    "MAX_DET",
    "MAX_IMAGE_SIDE",
    "MAX_MESSAGE_CHARS",
    "MAX_NAME_CHARS",
    "MAX_REPLY_DEPTH",
    "MAX_REQUEST_DEPTH",
    "MAX_SHM_BYTES",
    "PIXEL_FORMATS",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "PROTOCOL_VERSION",
    "SHM_FIELDS",
    "SHM_HEADER_BYTES",
    "SHM_MAGIC",
    "SHM_TOKEN_BYTES",
    "SUPPORTED_VERSIONS",
    "BatchResult",
    "CancelReply",
    "CancelRequest",
    "DaemonState",
    "DaemonStatus",
    "DeviceLoad",
    "DeviceStatus",
    "ErrorReply",
    "Frame",
    "FrameLike",
    "InferBatchReply",
    "InferBatchRequest",
    "InferReply",
    "InferRequest",
    "Kind",
    "Limits",
    "LimitsStatus",
    "LoadStatus",
    "Message",
    "ModelStatus",
    "PixelFormat",
    "QueueStatus",
    "Reply",
    "Request",
    "ShmRef",
    "ShmResolver",
    "StatusReply",
    "StatusRequest",
    "Timing",
    "YuvFormat",
    "colour_code",
    "decode_reply",
    "encode",
    "encode_batch_reply",
    "endpoint_error",
    "frame_shape",
    "frame_size",
    "shm_header",
    "timing_fields",
]

PROTOCOL_VERSION: Final = 1
"""The version this module writes in every header's ``v``."""
SUPPORTED_VERSIONS: Final = (1,)
"""The versions the decoders accept; anything else is refused naming ``v``."""
PRIORITY_MIN: Final = 0
"""``priority``: 0 is normal (the default) and the lowest; higher is served sooner."""
PRIORITY_MAX: Final = 7
MAX_DEADLINE_MS: Final = 3_600_000
"""Longest ``deadline_ms`` accepted (one hour); anything longer is a client bug."""
MAX_DET: Final = 1000
"""Most detections a request may ask for (``max_det``) and a reply may carry."""
MAX_BATCH: Final = 64
"""The largest batch a device reports (``[devices.*] max_batch`` is at most this)."""
MAX_IMAGE_SIDE: Final = 65_535
"""Absolute bound on image height and width; :class:`Limits` sets the operational one."""
MAX_BATCH_IMAGES: Final = 16
"""Most images one INFER_BATCH carries (a camera rig's frames of one instant)."""
MAX_REQUEST_DEPTH: Final = 4
"""How deeply a request's header nests: the header map, then ``image`` or ``shm`` (an
INFER_BATCH: ``images``, an image's map, its ``shm``; every other field is a scalar). A deeper
header is refused before anything walks it."""
MAX_REPLY_DEPTH: Final = 8
"""How deeply a reply's header nests (a STATUS report's tables of lists of tables)."""
MAX_NAME_CHARS: Final = 128
"""Longest model, stream or device name (characters, all printable)."""
MAX_MESSAGE_CHARS: Final = 1024
"""Longest reply ``message``; the daemon's error replies are cut to it."""
PIXEL_FORMATS: Final[tuple[PixelFormat, ...]] = ("RGB", "BGR", "GRAY", "NV12", "YUYV")
"""``image.format``'s values, in the order of their codes (``dlad/native/frame_rules.hpp``):
packed RGB, BGR and GRAY; NV12 (a luma plane, then half-height rows of interleaved U,V pairs:
width and height even) and YUYV (4:2:2, ``Y0 U Y1 V`` per two pixels: width even)."""
COLORSPACES: Final = ("bt601", "bt709")
"""A YUV frame's ``image.colorspace`` (its matrix); the first is the default."""
COLOR_RANGES: Final = ("limited", "full")
"""A YUV frame's ``image.color_range`` (limited: Y 16..235, chroma 16..240); the first is the
default."""

_U64_MAX: Final = 2**64 - 1
_I64_MAX: Final = 2**63 - 1
_REPLY_BIT: Final = 0x80
_DETECTION: Final = np.dtype("<f4")
_DET_ROW_BYTES: Final = 6 * _DETECTION.itemsize

PixelFormat: TypeAlias = Literal["RGB", "BGR", "GRAY", "NV12", "YUYV"]
Colorspace: TypeAlias = Literal["bt601", "bt709"]
ColorRange: TypeAlias = Literal["limited", "full"]
DaemonState: TypeAlias = Literal["RUNNING", "DRAINING", "STOPPED"]
Frame: TypeAlias = "bytes | memoryview"
"""What :func:`encode` returns per frame: ready for ``send_multipart(frames, copy=False)``."""
FrameLike: TypeAlias = "bytes | bytearray | memoryview | zmq.Frame"
"""What the decoders accept per frame: ``recv_multipart(copy=False)`` output or bytes-like."""


class Kind(enum.IntEnum):
    """Message kind, the header's ``kind`` (msgpack int). A reply is its request's kind | 0x80."""

    INFER = 0x01
    CANCEL = 0x02
    STATUS = 0x03
    INFER_BATCH = 0x04
    ERROR_REPLY = 0x80
    INFER_REPLY = 0x81
    CANCEL_REPLY = 0x82
    STATUS_REPLY = 0x83
    INFER_BATCH_REPLY = 0x84

    @property
    def is_reply(self) -> bool:
        return bool(self & _REPLY_BIT)


TRANSPORTS: Final = ("tcp", "ipc", "inproc")
"""The ZeroMQ transports the protocol runs over (``docs/protocol.md`` §1)."""


def endpoint_error(endpoint: object) -> str | None:
    """Why ``endpoint`` cannot name a daemon to connect to, or None when it can (its address
    is then ZeroMQ's to judge): it is not a string, it lacks a ``tcp://``, ``ipc://`` or
    ``inproc://`` scheme, or a tcp endpoint lacks its port. The message suggests the fix
    (``tcp://`` for a bare ``host:port``)."""
    if not isinstance(endpoint, str) or not endpoint:
        return f"an endpoint is a non-empty string, got {endpoint!r}"
    scheme, sep, address = endpoint.partition("://")
    if not sep:
        hint = f"; did you mean 'tcp://{endpoint}'?" if ":" in endpoint else ""
        schemes = "tcp://host:port, ipc://path, inproc://name"
        return f"endpoint {endpoint!r} has no scheme ({schemes}){hint}"
    if scheme not in TRANSPORTS:
        return f"endpoint {endpoint!r}: unknown transport {scheme!r} (tcp, ipc or inproc)"
    if not address:
        return f"endpoint {endpoint!r} has no address after {scheme}://"
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not host or not (port.isdigit() or port == "*"):
            return f"endpoint {endpoint!r} has no port (tcp://host:port, e.g. tcp://{address}:5555)"
    return None


def _is_int(value: object) -> TypeGuard[int]:
    # msgpack decodes true/false to bool, a subclass of int that must not pass as a number.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Limits:
    """Size bounds the decoders enforce before and while parsing (set from the daemon's config).

    ``max_message_bytes`` bounds the sum of all frames; ``max_header_bytes`` the header frame;
    the image bounds are checked against the header before the payload is looked at. Raises
    ValueError on construction if a bound is not a positive int or the bounds contradict.
    """

    max_message_bytes: int = 64 * 2**20
    max_header_bytes: int = 64 * 2**10
    max_width: int = 8192
    max_height: int = 8192
    max_image_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_header_bytes", "max_image_pixels"):
            if not (_is_int(value := getattr(self, name)) and value > 0):
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        for name in ("max_width", "max_height"):
            if not (_is_int(value := getattr(self, name)) and 1 <= value <= MAX_IMAGE_SIDE):
                raise ValueError(f"Limits.{name} must be in [1, {MAX_IMAGE_SIDE}], got {value!r}")
        if self.max_header_bytes > self.max_message_bytes:
            raise ValueError("Limits.max_header_bytes exceeds Limits.max_message_bytes")


DEFAULT_LIMITS: Final = Limits()


# ------------------------------------------------------------------------------ field checks
# Each check takes the raw value and its dotted field path, and returns the value normalised
# (plain int/float/str, enum members) or raises ProtocolError naming the path.


def _fail(path: str, reason: str) -> NoReturn:
    raise ProtocolError(f"{path}: {reason}", field=path)


_REPR: Final = reprlib.Repr()  # keyword settings need Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 36, 36, 36
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def _show(value: object) -> str:
    # Never echo a whole attacker-sized (or attacker-deep) value back into a reply or a log line:
    # reprlib stops at two levels and a few items, so it costs little whatever the value is.
    text = _REPR.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _nesting(value: object, limit: int) -> int:
    """How deeply ``value``'s lists and maps nest (a scalar 0, ``[]`` 1), counted without
    recursion, up to ``limit + 1`` (a deeper value is not walked further)."""
    nested = (list, tuple, dict)
    if not isinstance(value, nested):
        return 0
    deepest, stack = 1, [(value, 1)]
    while stack:  # only containers are pushed: a header is mostly scalars
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if depth > limit:
                return depth
        inner = depth + 1
        stack.extend((v, inner) for v in (item.values() if isinstance(item, dict) else item)
                     if isinstance(v, nested))  # fmt: skip
    return deepest


def _int(value: object, path: str, lo: int, hi: int) -> int:
    if not _is_int(value) or not lo <= value <= hi:
        _fail(path, f"must be an int in [{lo}, {hi}], got {_show(value)}")
    return int(value)


def _opt_int(value: object, path: str, lo: int, hi: int) -> int | None:
    return None if value is None else _int(value, path, lo, hi)


def _float(
    value: object, path: str, lo: float, hi: float, *, lo_open: bool, hi_open: bool
) -> float:
    x = math.nan  # NaN and infinities fail every comparison below
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int beyond float range
            x = float(value)
    if not ((lo < x if lo_open else lo <= x) and (x < hi if hi_open else x <= hi)):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        _fail(path, f"must be a finite number in {interval}, got {_show(value)}")
    return x


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"must be a bool, got {_show(value)}")
    return value


def _name(value: object, path: str) -> str:
    if not (isinstance(value, str) and _rules.is_name(value)):  # the C++ decoder's rule
        _fail(path, f"must be 1 to {MAX_NAME_CHARS} printable characters, got {_show(value)}")
    return value


def _opt_name(value: object, path: str) -> str | None:
    return None if value is None else _name(value, path)


def _text(value: object, path: str) -> str:
    if not (isinstance(value, str) and len(value) <= MAX_MESSAGE_CHARS):
        _fail(path, f"must be a string of at most {MAX_MESSAGE_CHARS} characters")
    return value


def _choice(value: object, path: str, choices: Collection[str]) -> str:
    if not (isinstance(value, str) and value in choices):
        _fail(path, f"must be one of {sorted(choices)}, got {_show(value)}")
    return value


def _status(value: object, path: str) -> Status:
    code = _int(value, path, 0, _U64_MAX)
    if code not in Status._value2member_map_:
        _fail(path, f"unknown status {code}")
    return Status(code)


def _count(value: object, path: str) -> int:
    return _int(value, path, 0, _I64_MAX)


def _map(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, f"must be a msgpack map, got {type(value).__name__}")
    return value


def _keys(
    m: Mapping[str, Any], prefix: str, required: Collection[str], optional: Collection[str] = ()
) -> None:
    for key in m:
        if not isinstance(key, str):
            _fail(prefix.rstrip(".") or "header", f"field names must be strings, got {_show(key)}")
        if key not in required and key not in optional:
            _fail(prefix + key, "unknown field")
    for key in required:
        if key not in m:
            _fail(prefix + key, "missing required field")


def _set(obj: object, name: str, value: object) -> None:
    # Frozen dataclasses normalise their own fields once, in __post_init__.
    object.__setattr__(obj, name, value)


# ------------------------------------------------------------------------------ requests


MAX_SHM_BYTES: Final = 1 << 40
"""The largest shared-memory segment an INFER may name (1 TiB: a bound, not a budget)."""
SHM_MAGIC: Final = b"DLADSHM1"
SHM_TOKEN_BYTES: Final = 16
SHM_HEADER_BYTES: Final = 64
"""A segment's header (docs/protocol.md, Shared-memory frames): ``SHM_MAGIC``, then the
segment's token, then zeros; frames lie after it. Who names a segment proves it is theirs
with the token, which only those who can read the segment know."""
_SHM_NAME: Final = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where a same-host client put an INFER's image (docs/protocol.md, Shared-memory frames):
    the POSIX shared-memory segment ``name`` (as in ``/dev/shm/<name>``: letters, digits,
    ``_ - .``, not starting with a dot; at most 200), ``offset`` bytes into it (past its
    ``SHM_HEADER_BYTES`` header), the segment's ``size`` as the client created it, and the
    ``token`` its header holds (``SHM_TOKEN_BYTES``; :func:`shm_header`). Raises ProtocolError on
    a bad field."""

    name: str
    offset: int
    size: int
    token: bytes

    def __post_init__(self) -> None:
        name: object = self.name
        if not (isinstance(name, str) and _SHM_NAME.fullmatch(name)):
            _fail("shm.name", f"must be a segment name ([A-Za-z0-9._-], 1 to 200, no leading "
                              f"dot), got {_show(self.name)}")  # fmt: skip
        _set(self, "size", _int(self.size, "shm.size", SHM_HEADER_BYTES + 1, MAX_SHM_BYTES))
        _set(self, "offset", _int(self.offset, "shm.offset", SHM_HEADER_BYTES, self.size - 1))
        token: object = self.token
        if not (isinstance(token, bytes) and len(token) == SHM_TOKEN_BYTES):
            _fail("shm.token", f"must be {SHM_TOKEN_BYTES} bytes, got {_show(self.token)}")


def shm_header(token: bytes) -> bytes:
    """The ``SHM_HEADER_BYTES`` a segment starts with, holding ``token`` (a client's secret:
    ``secrets.token_bytes(SHM_TOKEN_BYTES)``, one per segment)."""
    if len(token) != SHM_TOKEN_BYTES:
        raise ValueError(f"a segment's token is {SHM_TOKEN_BYTES} bytes, got {len(token)}")
    return SHM_MAGIC + token + bytes(SHM_HEADER_BYTES - len(SHM_MAGIC) - SHM_TOKEN_BYTES)


ShmResolver = Callable[[ShmRef, int], memoryview]
"""The daemon's lookup of a shared-memory frame: ``(ref, nbytes) -> a read-only view`` of
``nbytes`` bytes; raises a DladError (BadRequest, Overloaded) the INFER is answered with."""


@dataclass(frozen=True, slots=True, eq=False)
class InferRequest:
    """Run ``model`` on one image. ``image`` is uint8, C-contiguous, of the shape
    :func:`frame_shape` gives for ``format``; after decoding it is a read-only view over the
    received frame. ``colorspace`` and ``color_range`` are a YUV frame's (None: the default,
    BT.601 limited range; an RGB, BGR or GRAY frame has neither).

    ``None`` in ``deadline_ms``, ``conf``, ``iou`` or ``max_det`` means the daemon's default.
    ``shm``: the image lies in a shared-memory segment (``image`` is the sender's view of those
    bytes; the message then carries no payload frame). Raises ProtocolError (naming the field)
    when a value is out of its documented range.
    """

    id: int
    model: str
    image: npt.NDArray[np.uint8]
    format: PixelFormat = "RGB"
    stream: str | None = None
    priority: int = PRIORITY_MIN
    deadline_ms: int | None = None
    conf: float | None = None
    iou: float | None = None
    max_det: int | None = None
    shm: ShmRef | None = None
    colorspace: Colorspace | None = None
    color_range: ColorRange | None = None
    kind: ClassVar[Kind] = Kind.INFER

    def __post_init__(self) -> None:
        if self.shm is not None and not isinstance(self.shm, ShmRef):
            _fail("shm", f"must be a ShmRef, got {_show(self.shm)}")
        fmt = _choice(self.format, "image.format", PIXEL_FORMATS)
        for name, choices in (("colorspace", COLORSPACES), ("color_range", COLOR_RANGES)):
            value = getattr(self, name)
            if value is not None and fmt not in ("NV12", "YUYV"):
                _fail(f"image.{name}", "is for NV12 and YUYV frames only")
            if value is not None:
                _choice(value, f"image.{name}", choices)
        image: object = self.image
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
            _fail(
                "image.dtype",
                f"only uint8 images are supported, got {_show(getattr(image, 'dtype', image))}",
            )
        try:
            height, width = frame_size(fmt, image.shape)
        except ValueError as exc:
            sides = zip(("height", "width"), image.shape[:2], strict=False)
            empty = [f"image.{side}" for side, n in sides if n < 1]
            _fail(empty[0] if empty else "image", str(exc))
        _int(height, "image.height", 1, MAX_IMAGE_SIDE)
        _int(width, "image.width", 1, MAX_IMAGE_SIDE)
        if not image.flags.c_contiguous:
            _fail("image", "must be C-contiguous (frames are sent without copies)")
        fields = _infer_fields(
            self.id, self.model, stream=self.stream, priority=self.priority,
            deadline_ms=self.deadline_ms, conf=self.conf, iou=self.iou, max_det=self.max_det,
        )  # fmt: skip
        for name, value in zip(_INFER_SCALARS, fields, strict=True):
            _set(self, name, value)

    @classmethod
    def _decoded(
        cls, image: npt.NDArray[np.uint8], fmt: PixelFormat, scalars: tuple[Any, ...],
        shm: ShmRef | None = None, colour: int = 0,
    ) -> InferRequest:  # fmt: skip
        """One built from a header ``dlad.protocol.decode_request`` has checked in full (no second
        pass over the same fields on the daemon's hot path); ``colour`` is a YUV frame's code
        (:func:`colour_code`)."""
        request = object.__new__(cls)
        put = object.__setattr__  # frozen: each field set once, here
        put(request, "image", image)
        put(request, "format", fmt)
        put(request, "shm", shm)
        yuv = fmt in ("NV12", "YUYV")
        put(request, "colorspace", COLORSPACES[colour & 1] if yuv else None)
        put(request, "color_range", COLOR_RANGES[colour >> 1 & 1] if yuv else None)
        rid, model, stream, priority, deadline_ms, conf, iou, max_det = scalars  # _INFER_SCALARS
        put(request, "id", rid)
        put(request, "model", model)
        put(request, "stream", stream)
        put(request, "priority", priority)
        put(request, "deadline_ms", deadline_ms)
        put(request, "conf", conf)
        put(request, "iou", iou)
        put(request, "max_det", max_det)
        return request

    def in_shared_memory(self, ref: ShmRef) -> InferRequest:
        """This request with its image at ``ref`` (its fields were checked when it was built:
        the copy is not checked again)."""
        if not isinstance(cast("object", ref), ShmRef):
            _fail("shm", f"must be a ShmRef, got {_show(ref)}")
        moved = object.__new__(InferRequest)
        for name in _REQUEST_FIELDS:
            _set(moved, name, getattr(self, name))
        _set(moved, "shm", ref)
        return moved

    @property
    def height(self) -> int:
        rows = int(self.image.shape[0])
        return rows * 2 // 3 if self.format == "NV12" else rows

    @property
    def width(self) -> int:
        return int(self.image.shape[1])

    @property
    def colour(self) -> int:
        """A YUV frame's colour code (:func:`colour_code`; 0 for any other)."""
        return colour_code(self.colorspace, self.color_range)


_REQUEST_FIELDS: Final = tuple(f.name for f in dataclass_fields(InferRequest))
_INFER_SCALARS: Final = ("id", "model", "stream", "priority", "deadline_ms", "conf", "iou",
                         "max_det")  # fmt: skip
_SHARED_SCALARS: Final = ("priority", "deadline_ms", "conf", "iou", "max_det")


@dataclass(frozen=True, slots=True, eq=False)
class InferBatchRequest:
    """Run ``model`` on several images in one message (docs/protocol.md, INFER_BATCH): each of
    ``images`` is an INFER of its own (its image, format, ``stream`` and shared-memory slot)
    with this message's ``id`` and ``model`` and the same priority, deadline and thresholds.
    The one reply carries a result per image, in order. Raises ProtocolError when there are
    none or more than :data:`MAX_BATCH_IMAGES`, or the images disagree on a shared field.
    """

    id: int
    model: str
    images: tuple[InferRequest, ...]
    kind: ClassVar[Kind] = Kind.INFER_BATCH

    def __post_init__(self) -> None:
        _set(self, "id", _int(self.id, "id", 0, _U64_MAX))
        _set(self, "model", _name(self.model, "model"))
        images: object = self.images
        if not isinstance(images, (tuple, list)) or not 1 <= len(images) <= MAX_BATCH_IMAGES:
            _fail("images", f"must be 1 to {MAX_BATCH_IMAGES} InferRequests")
        _set(self, "images", tuple(images))
        first = self.images[0]
        for i, item in enumerate(self.images):
            if not isinstance(item, InferRequest):
                _fail(f"images[{i}]", f"must be an InferRequest, got {_show(item)}")
            if item.id != self.id or item.model != self.model:
                _fail(f"images[{i}]", "must have the batch's id and model")
            for name in _SHARED_SCALARS:
                if getattr(item, name) != getattr(first, name):
                    _fail(f"images[{i}].{name}", "must be the same for every image of a batch")

    def with_images(self, images: tuple[InferRequest, ...]) -> InferBatchRequest:
        """This batch with ``images`` in place of its own: each the same request with at most
        its ``shm`` changed (an image moved into a slot), which is all that is checked here."""
        fields = [n for n in _REQUEST_FIELDS if n not in ("shm", "image")]
        if len(images) != len(self.images) or any(
            getattr(new, n) != getattr(old, n) or new.image is not old.image
            for new, old in zip(images, self.images, strict=False) for n in fields
        ):  # fmt: skip
            _fail("images", "must be this batch's images, each with at most its shm changed")
        moved = object.__new__(InferBatchRequest)
        _set(moved, "id", self.id)
        _set(moved, "model", self.model)
        _set(moved, "images", tuple(images))
        return moved

    @property
    def priority(self) -> int:
        return self.images[0].priority

    @property
    def deadline_ms(self) -> int | None:
        return self.images[0].deadline_ms


def _infer_fields(
    rid: object,
    model: object,
    *,
    stream: object,
    priority: object,
    deadline_ms: object,
    conf: object,
    iou: object,
    max_det: object,
) -> tuple[int, str, str | None, int, int | None, float | None, float | None, int | None]:
    """An INFER's scalar fields, checked and normalised, in :data:`_INFER_SCALARS` order."""
    return (
        _int(rid, "id", 0, _U64_MAX),
        _name(model, "model"),
        _opt_name(stream, "stream"),
        _int(priority, "priority", PRIORITY_MIN, PRIORITY_MAX),
        _opt_int(deadline_ms, "deadline_ms", 1, MAX_DEADLINE_MS),
        None if conf is None else _float(conf, "conf", 0.0, 1.0, lo_open=False, hi_open=True),
        None if iou is None else _float(iou, "iou", 0.0, 1.0, lo_open=True, hi_open=False),
        _opt_int(max_det, "max_det", 1, MAX_DET),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _IdOnly:
    id: int

    def __post_init__(self) -> None:
        _set(self, "id", _int(self.id, "id", 0, _U64_MAX))


@dataclass(frozen=True, slots=True)
class CancelRequest(_IdOnly):
    """Cancel the queued INFER with this ``id`` (same connection). Raises ProtocolError."""

    kind: ClassVar[Kind] = Kind.CANCEL


@dataclass(frozen=True, slots=True)
class StatusRequest(_IdOnly):
    """Ask for the daemon's :class:`DaemonStatus`; with ``load``, its report also carries the
    recent-load figures (:class:`LoadStatus`). Raises ProtocolError."""

    load: bool = False
    kind: ClassVar[Kind] = Kind.STATUS

    def __post_init__(self) -> None:
        _IdOnly.__post_init__(self)
        _bool(self.load, "load")


# ------------------------------------------------------------------------------ replies


@dataclass(frozen=True, slots=True)
class Timing:
    """Where an INFER's time went, in microseconds, and when its device work ran.

    ``total_us`` is receipt to reply on the daemon. ``start_ns``/``end_ns`` bracket the device
    execution on the daemon's monotonic clock (both ``None`` if it never reached a device).
    Raises ProtocolError on a negative value, or only one of the two stamps, or end < start.
    """

    queue_us: int = 0
    pre_us: int = 0
    device_us: int = 0
    post_us: int = 0
    total_us: int = 0
    start_ns: int | None = None
    end_ns: int | None = None

    def __post_init__(self) -> None:
        for name in _TIMING_FIELDS[:5]:
            _set(self, name, _count(getattr(self, name), f"timing.{name}"))
        start = _opt_int(self.start_ns, "timing.start_ns", 0, _U64_MAX)
        end = _opt_int(self.end_ns, "timing.end_ns", 0, _U64_MAX)
        if (start is None) != (end is None):
            _fail("timing.end_ns", "start_ns and end_ns are both set or both nil")
        if start is not None and end is not None and end < start:
            _fail("timing.end_ns", f"ends before start_ns ({end} < {start})")
        _set(self, "start_ns", start)
        _set(self, "end_ns", end)


_TIMING_FIELDS: Final = tuple(Timing.__dataclass_fields__)


def _no_detections() -> npt.NDArray[np.float32]:
    return np.empty((0, 6), dtype=np.float32)


@dataclass(frozen=True, slots=True, eq=False)
class InferReply:
    """The answer to one INFER: ``detections`` is ``N x 6`` float32 ``x1 y1 x2 y2 score class``
    in the original image's pixels (decoded: a read-only view over the frame). ``N == 0``
    unless ``status`` is OK; ``message`` is empty on OK. ``device`` is ``None`` if no device
    ran it. Raises ProtocolError when these rules or the field ranges are broken.
    """

    id: int
    status: Status
    message: str = ""
    device: str | None = None
    timing: Timing = field(default_factory=Timing)
    detections: npt.NDArray[np.float32] = field(default_factory=_no_detections)
    kind: ClassVar[Kind] = Kind.INFER_REPLY

    def __post_init__(self) -> None:
        _reply_envelope(self, self.id, self.status, self.message)
        _opt_name(self.device, "device")
        if not isinstance(self.timing, Timing):
            _fail("timing", "must be a Timing")
        det: object = self.detections
        if not (isinstance(det, np.ndarray) and det.dtype in (np.dtype("<f4"), np.dtype(">f4"))):
            _fail("detections", "must be a float32 array")
        if det.ndim != 2 or det.shape[1] != 6:
            _fail("detections", f"must have shape N x 6, got {det.shape}")
        _int(det.shape[0], "count", 0, MAX_DET if self.status == Status.OK else 0)

    @property
    def count(self) -> int:
        return int(self.detections.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class InferBatchReply:
    """The answer to an INFER_BATCH: with status OK, ``results`` has one :class:`InferReply`
    per image, in the request's order, each with its own status (an image can be superseded
    or refused while the others run); any other status refuses the whole batch and
    ``results`` is empty. Raises ProtocolError when these rules are broken."""

    id: int
    status: Status
    message: str = ""
    results: tuple[InferReply, ...] = ()
    kind: ClassVar[Kind] = Kind.INFER_BATCH_REPLY

    def __post_init__(self) -> None:
        _reply_envelope(self, self.id, self.status, self.message)
        results: object = self.results
        if not isinstance(results, (tuple, list)):
            _fail("results", "must be a sequence of InferReply")
        _set(self, "results", tuple(results))
        if self.status != Status.OK:
            if self.results:
                _fail("results", "must be empty when status is not OK")
            return
        if not 1 <= len(self.results) <= MAX_BATCH_IMAGES:
            _fail("results", f"must hold 1 to {MAX_BATCH_IMAGES} results when status is OK")
        for i, item in enumerate(self.results):
            if not isinstance(cast("object", item), InferReply) or item.id != self.id:
                _fail(f"results[{i}]", "must be an InferReply with the batch's id")


@dataclass(frozen=True, slots=True)
class CancelReply:
    """OK: the INFER was queued and is now cancelled (it is answered CANCELLED); NOT_FOUND:
    nothing queued had that id. Raises ProtocolError on an invalid field."""

    id: int
    status: Status
    message: str = ""
    kind: ClassVar[Kind] = Kind.CANCEL_REPLY

    def __post_init__(self) -> None:
        _reply_envelope(self, self.id, self.status, self.message)


# The STATUS report, declared once: these types are what the daemon builds (dlad/daemon.py),
# what a client's decoder checks (msgspec validates each field's type and bounds; fields a newer
# daemon adds are left out, not refused: docs/protocol.md §10) and what docs/protocol.md lists.
_PRINTABLE: Final = r"^[^\x00-\x1f\x7f]+$"  # no control character
_Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS, pattern=_PRINTABLE)]
_Count = Annotated[int, Meta(ge=0, le=_I64_MAX)]
_Rate = Annotated[float, Meta(ge=0.0, le=1e12)]
_Side = Annotated[int, Meta(ge=1, le=MAX_IMAGE_SIDE)]


class _DeviceAdded(TypedDict, total=False):
    """A device's fields added with engine health: absent from the reports of older daemons."""

    state: Literal["warming", "serving", "quarantined", "failed"]  # placed: serving
    reason: Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS)]  # why it is not serving, or not
    # healthy ("" when it is both)


class _DeviceAddedPrePost(TypedDict, total=False):
    """A device's field added with camera sources: absent from the reports of older daemons."""

    pre_post: Literal["gpu", "cpu", "off"]  # where its frames are pre/post-processed: a camera
    # sends NV12 where the GPU converts it (dlad-cam), RGB where the CPU would


class DeviceStatus(_DeviceAdded, _DeviceAddedPrePost):
    """One accelerator as the scheduler sees it."""

    name: _Name  # "dla0", "dla1", "gpu"
    kind: Literal["dla", "gpu", "cpu"]
    core: Annotated[int, Meta(ge=0, le=15)] | None  # DLA core index; None for other kinds
    healthy: bool  # False while warming up, after a failed warm-up, or 3+ failed tasks in a row
    busy: bool  # a task is executing now
    in_flight: _Count  # submitted, not yet completed
    queue_depth: _Count  # waiting for this device
    completed: _Count  # since start
    failed: _Count  # since start
    service_time_us: _Rate  # current estimate used for placement (at batch 1)
    host_us: _Rate  # host CPU a frame costs (plane + engine threads), learned; 0: none yet
    max_batch: Annotated[int, Meta(ge=1, le=MAX_BATCH)]  # the most jobs it runs at once
    batches: Annotated[list[_Count], Meta(max_length=MAX_BATCH)]  # [i]: batches of i + 1 jobs
    # it ran since start (len == max_batch)


class _ModelAdded(TypedDict, total=False):
    """A model's fields added with model families: absent from the reports of older daemons."""

    family: _Name  # its model family ("yolov5", ...): how its heads are decoded
    class_names: Annotated[list[Annotated[str, Meta(max_length=MAX_NAME_CHARS)]],
                           Meta(max_length=65_535)]  # fmt: skip  # [i]: the name of class i


class ModelStatus(_ModelAdded):
    """One servable model and the devices holding it."""

    name: _Name
    devices: Annotated[list[_Name], Meta(max_length=64)]
    input_height: _Side
    input_width: _Side
    classes: Annotated[int, Meta(ge=1, le=65_535)]


class QueueStatus(TypedDict):
    """Admission queue: requests accepted and waiting for a device."""

    depth: _Count
    capacity: _Count
    streams: _Count  # distinct stream ids among the waiting requests


class LimitsStatus(TypedDict):
    """What the daemon accepts from one client (``report.limits``)."""

    max_in_flight_per_client: _Count  # INFERs admitted and unanswered at once, per client
    max_message_bytes: _Count  # the largest message answered (ZeroMQ drops those over twice it)
    max_image_width: _Side
    max_image_height: _Side
    cheap_requests_per_s: _Rate  # STATUS and CANCEL, per client (bursts of twice as many)


class DeviceLoad(TypedDict):
    """One device's recent load, over :class:`LoadStatus` ``window_s``."""

    name: _Name
    busy_ratio: Annotated[float, Meta(ge=0.0, le=1.0)]  # fraction of the window it executed
    rate_hz: _Rate  # INFERs it answered OK, per second
    p99_us: _Rate  # 99th percentile receipt → reply of those, µs (0 when there were none)


class LoadStatus(TypedDict):
    """The daemon's recent load (``report.load``; only when the STATUS request sets ``load``)."""

    window_s: _Rate  # the span the figures cover (shorter just after start)
    rate_hz: _Rate  # INFER replies per second, every status
    ok_rate_hz: _Rate  # OK replies per second
    p50_us: _Rate  # median receipt → reply of OK replies, µs (0 when there were none)
    p99_us: _Rate  # 99th percentile of the same
    devices: Annotated[list[DeviceLoad], Meta(max_length=64)]


class _DaemonOptional(TypedDict, total=False):
    load: LoadStatus  # present exactly when the STATUS request asked for it
    limits: LimitsStatus  # what one client may send (absent from older daemons)


class DaemonStatus(_DaemonOptional):
    """The ``report`` of a STATUS reply: health, readiness and load."""

    name: _Name  # this daemon's configured name (one per device in a fleet)
    state: DaemonState
    live: bool  # the event loop is turning
    ready: bool  # every configured device is loaded and healthy; accepting INFER
    version: _Name  # dlad version
    protocol: Annotated[int, Meta(ge=1, le=255)]  # PROTOCOL_VERSION of the daemon
    devices: Annotated[list[DeviceStatus], Meta(max_length=64)]
    models: Annotated[list[ModelStatus], Meta(max_length=256)]
    queues: QueueStatus


_MISSING: Final = re.compile(r"Object missing required field `(.+)`")


def _report(value: object, path: str) -> DaemonStatus:
    """A STATUS report checked against :class:`DaemonStatus` (a copy without the fields it
    does not know). Raises ProtocolError naming the first field that is wrong."""
    _map(value, path)
    try:
        return msgspec.convert(value, DaemonStatus)
    except msgspec.ValidationError as exc:
        what, _, at = str(exc).partition(" - at `$")
        missing = _MISSING.fullmatch(what)
        field = path + at.rstrip("`") + (f".{missing[1]}" if missing else "")
        reason = "missing required field" if missing else what[:1].lower() + what[1:]
        _fail(field, reason)


@dataclass(frozen=True, slots=True)
class StatusReply:
    """The answer to STATUS: ``report`` is set exactly when ``status`` is OK (a validated copy
    of what was given). Raises ProtocolError on an invalid field."""

    id: int
    status: Status
    message: str = ""
    report: DaemonStatus | None = None
    kind: ClassVar[Kind] = Kind.STATUS_REPLY

    def __post_init__(self) -> None:
        _reply_envelope(self, self.id, self.status, self.message)
        if self.status == Status.OK:
            _set(self, "report", _report(self.report, "report"))
        elif self.report is not None:
            _fail("report", "must be nil when status is not OK")


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The answer to a request whose kind could not be read; ``id`` is ``None`` when the id
    could not be read either. ``status`` is never OK. Raises ProtocolError."""

    id: int | None
    status: Status
    message: str = ""
    kind: ClassVar[Kind] = Kind.ERROR_REPLY

    def __post_init__(self) -> None:
        _reply_envelope(self, self.id, self.status, self.message, optional_id=True)
        if self.status == Status.OK:
            _fail("status", "an ERROR_REPLY cannot be OK")


def _reply_envelope(
    reply: object, rid: object, status: object, message: object, *, optional_id: bool = False
) -> None:
    """Check and normalise the fields every reply has: ``id``, ``status``, ``message``."""
    if not (optional_id and rid is None):
        _set(reply, "id", _int(rid, "id", 0, _U64_MAX))
    code = _status(status, "status")
    _set(reply, "status", code)
    if _text(message, "message") and code == Status.OK:
        _fail("message", "must be empty when status is OK")


Request: TypeAlias = "InferRequest | CancelRequest | StatusRequest | InferBatchRequest"
Reply: TypeAlias = "InferReply | CancelReply | StatusReply | ErrorReply | InferBatchReply"
Message: TypeAlias = "Request | Reply"


# ------------------------------------------------------------------------------ encode


def _pack(header: dict[str, Any]) -> bytes:
    return cast("bytes", msgpack.packb(header, use_bin_type=True))


def encode(message: Message) -> list[Frame]:
    """The frames of ``message``: ``[header]`` or ``[header, payload]``.

    The payload is a memoryview over the message's own array (the detections are converted to
    little-endian first only on a big-endian host), so keep the message alive until
    ``send_multipart(..., copy=False)`` has handed the frames to ZeroMQ, and do not write to
    the array meanwhile. The message was validated when it was built, so this does not raise.
    """
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": int(message.kind), "id": message.id}
    if isinstance(message, InferRequest):
        header["model"] = message.model
        optional = {"stream": message.stream, "deadline_ms": message.deadline_ms}
        if message.priority != PRIORITY_MIN:
            optional["priority"] = message.priority
        header |= {k: v for k, v in optional.items() if v is not None}
        header["image"] = _image_map(message)
        thresholds = {"conf": message.conf, "iou": message.iou, "max_det": message.max_det}
        header |= {k: v for k, v in thresholds.items() if v is not None}
        if message.shm is not None:  # the image is in the segment: no payload frame
            header["shm"] = _shm_map(message.shm)
            return [_pack(header)]
        return [_pack(header), message.image.data.cast("B")]
    if isinstance(message, InferBatchRequest):
        header["model"] = message.model
        _shared_fields(header, message.images[0])
        images, payloads = [], []
        for item in message.images:
            image = _image_map(item)
            if item.stream is not None:
                image["stream"] = item.stream
            if item.shm is not None:
                image["shm"] = _shm_map(item.shm)
            else:
                payloads.append(item.image.data.cast("B"))
            images.append(image)
        header["images"] = images
        return [_pack(header), *payloads]
    if isinstance(message, (CancelRequest, StatusRequest)):
        if isinstance(message, StatusRequest) and message.load:
            header["load"] = True  # only when asked: a daemon older than the field refuses it
        return [_pack(header)]
    header["status"] = int(message.status)
    header["message"] = message.message
    if isinstance(message, InferReply):
        header["device"] = message.device
        header["timing"] = {name: getattr(message.timing, name) for name in _TIMING_FIELDS}
        return _with_detections(header, message.detections)
    if isinstance(message, InferBatchReply):
        results = [(int(r.status), r.message, r.device,
                    {name: getattr(r.timing, name) for name in _TIMING_FIELDS}, r.detections)
                   for r in message.results]  # fmt: skip
        return _batch_frames(header, results)
    if isinstance(message, StatusReply):
        header["report"] = message.report
    return [_pack(header)]


def _shared_fields(header: dict[str, Any], message: InferRequest) -> None:
    """The fields an INFER and an INFER_BATCH share, where they differ from the default."""
    if message.priority != PRIORITY_MIN:
        header["priority"] = message.priority
    optional = {"deadline_ms": message.deadline_ms, "conf": message.conf, "iou": message.iou,
                "max_det": message.max_det}  # fmt: skip
    header |= {k: v for k, v in optional.items() if v is not None}


def _image_map(message: InferRequest) -> dict[str, Any]:
    image = {"height": message.height, "width": message.width, "format": message.format,
             "dtype": "uint8"}  # fmt: skip
    if message.colorspace is not None:
        image["colorspace"] = message.colorspace
    if message.color_range is not None:
        image["color_range"] = message.color_range
    return image


def _shm_map(ref: ShmRef) -> dict[str, Any]:
    return {"name": ref.name, "offset": ref.offset, "size": ref.size, "token": ref.token}


BatchResult: TypeAlias = (
    "tuple[int, str, str | None, dict[str, int | None], npt.NDArray[np.float32]]"
)
"""One image's part of an INFER_BATCH_REPLY: status, message, device, ``timing`` (from
:func:`timing_fields`) and the ``N x 6`` float32 detections (none unless the status is OK)."""


def _batch_frames(header: dict[str, Any], results: Sequence[BatchResult]) -> list[Frame]:
    entries: list[dict[str, Any]] = []
    payloads: list[Frame] = []
    for status, message, device, timing, detections in results:
        count = len(detections)
        entries.append({"status": status, "message": message, "device": device,
                        "timing": timing, "count": count})  # fmt: skip
        if count:
            payloads.append(np.ascontiguousarray(detections, dtype=_DETECTION).data.cast("B"))
        else:
            payloads.append(b"")
    header["results"] = entries
    return [_pack(header), *payloads]


def encode_batch_reply(request_id: int, results: Sequence[BatchResult]) -> list[Frame]:
    """The frames of an OK INFER_BATCH_REPLY from the daemon's own values, one entry per image
    (see :data:`BatchResult`; ``message`` empty exactly when the status is OK), without building
    an :class:`InferBatchReply` (decoding checks all of it)."""
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION, "kind": int(Kind.INFER_BATCH_REPLY), "id": request_id,
        "status": int(Status.OK), "message": "",
    }  # fmt: skip
    return _batch_frames(header, results)


def _with_detections(header: dict[str, Any], detections: npt.NDArray[np.float32]) -> list[Frame]:
    header["count"] = count = len(detections)
    if count == 0:
        return [_pack(header), b""]
    det = np.ascontiguousarray(detections, dtype=_DETECTION)
    return [_pack(header), det.data.cast("B")]


def timing_fields(
    *,
    queue_us: float,
    pre_us: float,
    device_us: float,
    post_us: float,
    total_us: float,
    start_ns: int,
    end_ns: int,
) -> dict[str, int | None]:
    """A reply's ``timing`` map from an outcome's figures (µs; stamps 0 when it never ran)."""
    return {
        "queue_us": max(int(queue_us), 0), "pre_us": max(int(pre_us), 0),
        "device_us": max(int(device_us), 0), "post_us": max(int(post_us), 0),
        "total_us": max(int(total_us), 0), "start_ns": start_ns or None,
        "end_ns": end_ns or None,
    }  # fmt: skip


# ------------------------------------------------------------------------------ decode


def _buffers(frames: object) -> list[memoryview]:
    if not isinstance(frames, Sequence) or isinstance(frames, (bytes, bytearray, str)):
        _fail("frames", "a message is a list of frames")
    views = []
    for i, frame in enumerate(frames):
        try:
            # zmq.Frame, bytes, memoryview, numpy arrays: anything exporting a C-contiguous
            # buffer. cast() gives a flat byte view without copying.
            view = memoryview(cast("Any", frame))
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
        except (TypeError, ValueError):
            _fail(f"frames[{i}]", "not a contiguous bytes-like buffer")
        views.append(view)
    return views


def _views(frames: object, limits: Limits) -> list[memoryview]:
    """A reply's frames as byte views, their count and sizes checked (a request's are the C++
    decoder's)."""
    views = _buffers(frames)
    if not 1 <= len(views) <= 1 + MAX_BATCH_IMAGES:
        _fail("frames", f"a v1 message has 1 to {1 + MAX_BATCH_IMAGES} frames, got {len(views)}")
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        _fail("frames", f"message of {total} bytes is over the limit of {limits.max_message_bytes}")
    if views[0].nbytes > limits.max_header_bytes:
        _fail("header", f"{views[0].nbytes} bytes is over the limit of {limits.max_header_bytes}")
    return views


_STR: Final = itertools.repeat(str)  # isinstance's second argument, for map()


def _pairs(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Build each msgpack map: string keys only, and no key twice (a repeated key would make
    the header mean different things to different decoders)."""
    out = dict(pairs)
    if len(out) != len(pairs) or not all(map(isinstance, out, _STR)):
        seen: set[Any] = set()
        for key, _ in pairs:
            if not isinstance(key, str):
                _fail("header", f"field names must be strings, got {_show(key)}")
            if key in seen:
                _fail("header", f"duplicate field {_show(key)}")
            seen.add(key)
    return out


def _unpack(view: memoryview, max_depth: int) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(view, raw=False, strict_map_key=True, object_pairs_hook=_pairs)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # msgpack signals truncation, bad bytes, trailing data, bad UTF-8 and nesting depth
        # (its own stack stops at 1024) as ValueError subclasses; the others guard odd map keys
        # and extension payloads.
        _fail("header", f"not a valid msgpack document ({type(exc).__name__})")
    header = _map(header, "header")
    # Before anything walks the header (checks, messages, logs), bound how deep it nests: a
    # 1 KB document can nest a thousand levels, deeper than Python's recursion will follow.
    if _nesting(header, max_depth) > max_depth:
        deep = ProtocolError(f"header: nests deeper than the {max_depth} levels a message has",
                             field="header")  # fmt: skip
        _attach(deep, header.get("id"), header.get("kind"))
        raise deep
    return header


def _open_reply(
    frames: object, limits: Limits, kinds: Collection[Kind]
) -> tuple[Kind, dict[str, Any], list[memoryview]]:
    """A reply's frames and header, its envelope checked (a request's is the C++ decoder's)."""
    views = _views(frames, limits)
    header = _unpack(views[0], MAX_REPLY_DEPTH)
    rid, raw_kind = header.get("id"), header.get("kind")
    try:
        if "v" not in header:
            _fail("v", "missing required field")
        version = header["v"]
        if not _is_int(version) or version not in SUPPORTED_VERSIONS:
            supported = ", ".join(map(str, SUPPORTED_VERSIONS))
            _fail("v", f"version {_show(version)} is not supported (supported: {supported})")
        if "kind" not in header:
            _fail("kind", "missing required field")
        code = _int(raw_kind, "kind", 0, 255)
        if code not in kinds:
            _fail("kind", f"{code} is not a reply kind")
        kind = _KINDS[code]
        want = 2 if kind == Kind.INFER_REPLY else 1
        if len(views) != want and kind != Kind.INFER_BATCH_REPLY:
            _fail("frames", f"{kind.name} has {want} frame(s), got {len(views)}")
        _keys(header, "", *_HEADER_FIELDS[kind])
    except ProtocolError as exc:
        _attach(exc, rid, raw_kind)
        raise
    return kind, header, views


def _attach(exc: ProtocolError, rid: object, raw_kind: object) -> None:
    """Record the id and kind the header yielded, so the refusal can be addressed."""
    if _is_int(rid) and 0 <= rid <= _U64_MAX:
        exc.request_id = rid
    if _is_int(raw_kind):
        exc.request_kind = raw_kind


_KINDS: Final[Mapping[int, Kind]] = {int(k): k for k in Kind}  # a dict lookup, not Enum()
_ENVELOPE: Final = ("v", "kind", "id")
_REPLY_ENVELOPE: Final = (*_ENVELOPE, "status", "message")
IMAGE_FIELDS: Final = ("height", "width", "format", "dtype")
"""An INFER's ``image`` map: all of these, and of :data:`IMAGE_OPTIONAL_FIELDS` no other."""
IMAGE_OPTIONAL_FIELDS: Final = ("colorspace", "color_range")
"""A YUV frame's colour in its ``image`` map (an INFER_BATCH's image map: these, ``stream``
and ``shm``)."""
SHM_FIELDS: Final = ("name", "offset", "size", "token")
"""An INFER's ``shm`` map: all of these, no other."""
_HEADER_FIELDS: Final[Mapping[Kind, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    # kind: (required fields, optional fields); every other field is refused.
    Kind.INFER: ((*_ENVELOPE, "model", "image"),
                 ("stream", "priority", "deadline_ms", "conf", "iou", "max_det", "shm")),
    Kind.CANCEL: (_ENVELOPE, ()),
    Kind.STATUS: (_ENVELOPE, ("load",)),
    Kind.INFER_BATCH: ((*_ENVELOPE, "model", "images"),
                       ("priority", "deadline_ms", "conf", "iou", "max_det")),
    Kind.INFER_REPLY: ((*_REPLY_ENVELOPE, "device", "timing", "count"), ()),
    Kind.INFER_BATCH_REPLY: ((*_REPLY_ENVELOPE, "results"), ()),
    Kind.CANCEL_REPLY: (_REPLY_ENVELOPE, ()),
    Kind.STATUS_REPLY: ((*_REPLY_ENVELOPE, "report"), ()),
    Kind.ERROR_REPLY: (_REPLY_ENVELOPE, ()),
}  # fmt: skip


def _checked_ref(name: str, offset: int, size: int, token: bytes) -> ShmRef:
    """A ShmRef the decoder has checked (not checked again)."""
    ref = object.__new__(ShmRef)
    _set(ref, "name", name)
    _set(ref, "offset", offset)
    _set(ref, "size", size)
    _set(ref, "token", token)
    return ref


def _infer_reply(
    h: dict[str, Any], payload: memoryview, rid: object = None, path: str = "", frame: int = 1
) -> InferReply:
    timing = _map(h["timing"], f"{path}timing")
    _keys(timing, f"{path}timing.", _TIMING_FIELDS)
    count = _int(h["count"], f"{path}count", 0, MAX_DET)
    if payload.nbytes != count * _DET_ROW_BYTES:
        need = count * _DET_ROW_BYTES
        _fail(f"frames[{frame}]",
              f"detections payload is {payload.nbytes} bytes, count says {need}")  # fmt: skip
    det = np.frombuffer(payload, dtype=_DETECTION).reshape(count, 6)
    det.flags.writeable = False
    try:
        return InferReply(cast("int", h["id"] if rid is None else rid), h["status"],
                          h["message"], h["device"], Timing(**timing), det)  # fmt: skip
    except ProtocolError as exc:
        if not path:
            raise
        field = f"{path}{exc.field}"
        raise ProtocolError(f"{path}{exc.message}", field=field) from None


def _infer_batch_reply(h: dict[str, Any], payloads: list[memoryview]) -> InferBatchReply:
    raw: object = h["results"]
    if not isinstance(raw, list) or len(raw) > MAX_BATCH_IMAGES:
        _fail("results", f"must be an array of at most {MAX_BATCH_IMAGES} result maps")
    if len(payloads) != len(raw):
        _fail("frames", f"INFER_BATCH_REPLY has {1 + len(raw)} frame(s) (one per result), "
                        f"got {1 + len(payloads)}")  # fmt: skip
    results = []
    for i, item in enumerate(raw):
        path = f"results[{i}]."
        entry = _map(item, f"results[{i}]")
        _keys(entry, path, ("status", "message", "device", "timing", "count"))
        results.append(_infer_reply(entry, payloads[i], h["id"], path, i + 1))
    return InferBatchReply(h["id"], h["status"], h["message"], tuple(results))


def decode_reply(frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS) -> Reply:
    """Decode the frames of a reply (a client's side of the daemon's request decoder).

    An INFER_REPLY's detections are a read-only ``N x 6`` float32 view over ``frames[1]``.
    Raises ProtocolError for anything that is not a valid v1 reply (field named).
    """
    replies = (Kind.INFER_REPLY, Kind.CANCEL_REPLY, Kind.STATUS_REPLY, Kind.ERROR_REPLY,
               Kind.INFER_BATCH_REPLY)  # fmt: skip
    kind, h, views = _open_reply(frames, limits, replies)
    try:
        if kind == Kind.INFER_REPLY:
            return _infer_reply(h, views[1])
        if kind == Kind.INFER_BATCH_REPLY:
            return _infer_batch_reply(h, views[1:])
        if kind == Kind.STATUS_REPLY:
            return StatusReply(h["id"], h["status"], h["message"], h["report"])
        cls = CancelReply if kind == Kind.CANCEL_REPLY else ErrorReply
        return cls(h["id"], h["status"], h["message"])
    except ProtocolError as exc:
        _attach(exc, h.get("id"), h.get("kind"))
        raise


# ------------------------------------------------------------------------------ pixel formats


def frame_shape(fmt: str, height: int, width: int) -> tuple[int, ...]:
    """The numpy shape of a ``width x height`` frame in ``fmt`` (one of :data:`PIXEL_FORMATS`):
    ``H x W x 3`` (RGB, BGR), ``H x W x 1`` (GRAY), ``3H/2 x W`` (NV12, as FFmpeg and OpenCV
    lay it out) or ``H x W x 2`` (YUYV). The rule is ``native/frames.hpp``'s, the daemon's."""
    return _rules.frame_shape(PIXEL_FORMATS.index(fmt), height, width)


def frame_size(fmt: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """``(height, width)`` of a frame of numpy ``shape`` in ``fmt``; raises ValueError where the
    shape is not one of ``fmt``'s (:func:`frame_shape`), an NV12 frame's sides odd included
    (``native/frames.hpp``'s rule, the daemon's)."""
    if fmt not in PIXEL_FORMATS:
        raise ValueError(f"pixel format must be one of {list(PIXEL_FORMATS)}, got {fmt!r}")
    height, width, problem = _rules.frame_size(PIXEL_FORMATS.index(fmt), list(shape))
    if problem == 1:
        raise ValueError(f"a {fmt} frame has shape {_shape_words(fmt)}, got {tuple(shape)}")
    if problem == 2:
        sides = "width and height" if fmt == "NV12" else "width"
        raise ValueError(f"a {fmt} frame's {sides} must be even, got {width} x {height}")
    return height, width


def _shape_words(fmt: str) -> str:
    return {"NV12": "3H/2 x W", "YUYV": "H x W x 2", "GRAY": "H x W x 1"}.get(fmt, "H x W x 3")


def colour_code(colorspace: str | None, color_range: str | None) -> int:
    """A YUV frame's colour as the code the data plane and the kernels read (bit 0: BT.709,
    bit 1: full range); None means the default (BT.601, limited)."""
    return int(colorspace == "bt709") | (2 if color_range == "full" else 0)


@dataclass(frozen=True, slots=True)
class YuvFormat:
    """A YUV frame's pixel format with its colour, for the SDK's ``pixel_format``: ``layout``
    ``"NV12"`` or ``"YUYV"``, ``colorspace`` ``"bt601"`` or ``"bt709"``, ``color_range``
    ``"limited"`` or ``"full"`` (a plain ``"NV12"`` is BT.601, limited range). Raises
    ValueError for any other value."""

    layout: Literal["NV12", "YUYV"] = "NV12"
    colorspace: Colorspace = "bt601"
    color_range: ColorRange = "limited"

    def __post_init__(self) -> None:
        for value, name, choices in ((self.layout, "layout", ("NV12", "YUYV")),
                                     (self.colorspace, "colorspace", COLORSPACES),
                                     (self.color_range, "color_range", COLOR_RANGES)):  # fmt: skip
            if value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
