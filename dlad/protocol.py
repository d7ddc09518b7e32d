"""The wire protocol on the daemon's side: ``dlad_wire.protocol`` (the wire, declared once and
shared with the SDK in the ``dlad-client`` distribution), re-exported, and what only the daemon
does with it: decode a request with its one request decoder (:func:`decode_request`, the C++
decoder the native plane serves INFERs with) and write error replies (:func:`encode_error_reply`,
the plane's C++ writer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from dlad_wire.errors import DladError, ProtocolError
from dlad_wire.protocol import *  # noqa: F403  # the wire, one declaration
from dlad_wire.protocol import (  # the wire's internals the decoder builds messages with
    DEFAULT_LIMITS,
    MAX_MESSAGE_CHARS,
    CancelRequest,
    FrameLike,
    InferBatchRequest,
    InferRequest,
    Kind,
    Limits,
    PixelFormat,
    Request,
    ShmResolver,
    StatusRequest,
    _buffers,
    _checked_ref,
    _fail,
    _set,
    frame_shape,
)
from dlad_wire.protocol import __all__ as _WIRE

__all__ = [*_WIRE, "decode_request", "encode_error_reply"]  # noqa: PLE0604


def encode_error_reply(
    error: DladError, *, request_id: int | None = None, request_kind: int | None = None
) -> list[bytes]:
    """The frames of the reply answering a request that failed with ``error``: the daemon's one
    writer of error replies, in C++ (``dlad/native/wire.hpp``, ``write_refusal_reply``, which
    the native plane answers refusals with too).

    ``request_id``/``request_kind`` default to what ``error`` carries (a ProtocolError carries
    what the decoder could read, a shared-memory refusal its request's). A known request kind
    and id give that kind's reply (an INFER_REPLY with an empty payload frame); anything else an
    ERROR_REPLY. The message is cut to :data:`MAX_MESSAGE_CHARS`.
    """
    from dlad import _native  # noqa: PLC0415  # the daemon's side only: the SDK never answers

    rid = request_id if request_id is not None else error.request_id
    kind = request_kind if request_kind is not None else error.request_kind
    header, payload = _native.write_refusal_reply(
        rid, kind, int(error.status), error.message[:MAX_MESSAGE_CHARS]
    )
    return [header, b""] if payload else [header]


def _native_limits(limits: Limits) -> tuple[int, int, int, int, int]:
    return (limits.max_message_bytes, limits.max_header_bytes, limits.max_width,
            limits.max_height, limits.max_image_pixels)  # fmt: skip


def decode_request(
    frames: Sequence[FrameLike], limits: Limits = DEFAULT_LIMITS, shm: ShmResolver | None = None
) -> Request:
    """Decode the frames of a request (without the ROUTER's identity frames).

    The header is decoded by the daemon's one request decoder, in C++ (``dlad/native/wire.hpp``,
    the one the native plane serves INFERs with). An INFER's image is a read-only view over
    ``frames[1]``'s buffer (no copy), or, for a shared-memory frame, over what ``shm`` resolves
    its ``shm`` field to (None: such frames are refused). Raises ProtocolError for anything that
    is not a valid v1 request: its ``field`` names the problem, and
    ``request_id``/``request_kind`` hold what the header yielded, if anything; a DladError of
    ``shm``'s propagates, with the request's id and kind attached.
    """
    from dlad import _native  # noqa: PLC0415  # the daemon's side only: the SDK never decodes one

    views = _buffers(frames)
    if not views:
        _fail("frames", "a message has its header frame at least")
    decoded = _native.decode_request(
        views[0], [v.nbytes for v in views[1:]], _native_limits(limits), shm is not None
    )
    if not decoded[0]:
        _, field, message, rid, raw_kind = decoded
        raise ProtocolError(message, field=field, request_id=rid, request_kind=raw_kind)
    _, kind, rid, model, priority, deadline_ms, conf, iou, max_det, load, images = decoded
    if kind == Kind.CANCEL:
        return CancelRequest(rid)
    if kind == Kind.STATUS:
        return StatusRequest(rid, load=load)
    built = []
    for fmt, height, width, colour, stream, at, frame in images:
        shape = frame_shape(fmt, height, width)
        ref = None if at is None else _checked_ref(*at)
        if ref is None:
            payload = views[frame]
        else:
            assert shm is not None  # the decoder refuses a shared-memory frame without one
            try:
                payload = shm(ref, math.prod(shape))
            except DladError as exc:  # answered in the request's own kind of reply
                if exc.request_id is None:
                    exc.request_id, exc.request_kind = rid, int(kind)
                raise
        image = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
        image.flags.writeable = False  # the daemon never writes into a client's frame
        scalars = (rid, model, stream, priority, deadline_ms, conf, iou, max_det)
        built.append(InferRequest._decoded(image, cast("PixelFormat", fmt), scalars, ref, colour))
    if kind == Kind.INFER:
        return built[0]
    batch = object.__new__(InferBatchRequest)
    _set(batch, "id", rid)
    _set(batch, "model", model)
    _set(batch, "images", tuple(built))
    return batch
