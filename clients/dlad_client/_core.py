"""What :class:`~dlad_client.Client` and :class:`~dlad_client.AsyncClient`
share: their errors and :class:`Result`, settings and input checks, and the table of calls in
flight that matches replies to requests.

Both clients speak wire protocol v1 through :mod:`dlad_wire.protocol` (they never build a header by
hand) over one ZeroMQ ``DEALER`` socket connected to every endpoint they are given. Each request
gets the next id of a per-client counter (unique and increasing), and replies, which may arrive
in any order, are matched to requests by ``(reply kind, id)`` in a :class:`_Calls` table. Every
request carries its own deadline (the client's ``timeout_s`` unless the call overrides it); a
request still unanswered at its deadline is failed with :class:`ClientTimeout` and, for an
INFER, a best-effort CANCEL is sent so that the daemon does not run work nobody waits for.

The socket sets ``ZMQ_IMMEDIATE``: a request is only queued to a daemon whose connection is up, so
with several endpoints a daemon that is down does not swallow every other request, and with none
up a send waits (within the request's timeout) instead of filling a queue nobody reads.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import math
import os
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar, cast, final

import numpy as np
import numpy.typing as npt
import zmq

from dlad_client._draw import draw_detections
from dlad_wire.errors import DladError, InternalError, NotFound, ProtocolError, Status, error_for
from dlad_wire.protocol import (
    DEFAULT_LIMITS,
    MAX_BATCH_IMAGES,
    SHM_HEADER_BYTES,
    SHM_TOKEN_BYTES,
    CancelReply,
    DaemonStatus,
    ErrorReply,
    Frame,
    FrameLike,
    InferBatchReply,
    InferBatchRequest,
    InferReply,
    InferRequest,
    Kind,
    PixelFormat,
    Request,
    ShmRef,
    StatusReply,
    Timing,
    YuvFormat,
    decode_reply,
    encode,
    endpoint_error,
    frame_size,
    shm_header,
)

__all__ = ["ClientClosed", "ClientTimeout", "CurveKeys", "Result"]

DEFAULT_TIMEOUT_S: Final = 10.0
DEFAULT_MAX_IN_FLIGHT: Final = 64
DEFAULT_HWM: Final = 1000
MAX_REPLY_BYTES: Final = 1 << 20
"""``ZMQ_MAXMSGSIZE`` of the client socket. The largest valid reply is a header far under 64 KiB
plus 1000 detections of 24 bytes, so a peer sending more is not a dlad daemon."""

_log = logging.getLogger("dlad_client")

Outcome = InferReply | CancelReply | StatusReply | InferBatchReply | Exception
"""What settles a call: its reply, or the error that ended it."""


class ClientTimeout(TimeoutError):
    """No reply arrived within the client's own time limit (not a wire status: the daemon may
    still answer, and that late reply is dropped). ``request_id`` names the request."""

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class ClientClosed(RuntimeError):
    """The client was closed: before this request was answered, or before this call."""


@final
@dataclass(frozen=True, slots=True, eq=False)
class Result:
    """The detections of one INFER, in the original image's pixels.

    ``detections`` is ``N x 6`` float32 ``x1 y1 x2 y2 score class``, sorted by score, and a
    read-only view over the received frame (copy it to write into it). ``device`` is the device
    that ran it (``"dla0"``, ``"dla1"``, ``"gpu"``); ``timing`` is the daemon's breakdown in µs.
    ``class_names`` are the model's, as the client knew them when it sent the request (it
    learns them from its first ``class_names(model)`` or ``status()`` call; empty before, or
    from a daemon that does not report them).
    """

    request_id: int
    detections: npt.NDArray[np.float32]
    device: str | None
    timing: Timing
    class_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        """The number of detections (so a result without any is falsy)."""
        return int(self.detections.shape[0])

    @property
    def boxes(self) -> npt.NDArray[np.float32]:
        """``N x 4`` ``x1 y1 x2 y2`` (a view)."""
        return self.detections[:, :4]

    @property
    def scores(self) -> npt.NDArray[np.float32]:
        """``N`` confidences (a view)."""
        return self.detections[:, 4]

    @property
    def classes(self) -> npt.NDArray[np.int64]:
        """``N`` class indices as integers (a copy)."""
        return self.detections[:, 5].astype(np.int64)

    @property
    def labels(self) -> list[str]:
        """``N`` class names; a class the names do not cover (none known) is its index as text."""
        names = self.class_names
        return [names[c] if 0 <= c < len(names) else str(c) for c in self.classes.tolist()]

    def to_dict(self) -> dict[str, Any]:
        """The result as plain Python values (``json.dumps`` takes it): ``request_id``,
        ``device``, ``timing`` (µs, and the device's ``start_ns``/``end_ns``) and
        ``detections``, each ``{"box": [x1, y1, x2, y2], "score", "class_id", "class_name"}``
        in the original image's pixels, by score."""
        return {
            "request_id": self.request_id,
            "device": self.device,
            "timing": {name: getattr(self.timing, name) for name in _TIMING_NAMES},
            "detections": [
                {
                    "box": [x1, y1, x2, y2],
                    "score": score,
                    "class_id": int(cls),
                    "class_name": label,
                }
                for (x1, y1, x2, y2, score, cls), label in zip(
                    self.detections.tolist(), self.labels, strict=True
                )
            ],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as one line of JSON."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def draw(
        self, image: npt.NDArray[np.uint8], *, bgr: bool = False, line_width: int | None = None
    ) -> npt.NDArray[np.uint8]:
        """A copy of ``image`` (the frame this result is of: ``H x W x 3`` RGB, BGR with
        ``bgr``, or gray) with each box and ``label score`` drawn in its class's colour
        (Pillow). Raises ValueError for another shape (an NV12 or YUYV frame is converted to
        RGB first: :func:`dlad.imaging.pre.yuv_to_rgb`)."""
        return draw_detections(image, self.detections, self.labels, bgr=bgr,
                               line_width=line_width)  # fmt: skip


_TIMING_NAMES: Final = tuple(Timing.__dataclass_fields__)


# ------------------------------------------------------------------------------ settings


def _check_settings(
    timeout_s: float, max_in_flight: int, sndhwm: int, rcvhwm: int, linger: int
) -> None:
    """Raise ValueError naming the first setting out of range (callers may be untyped)."""
    _check_timeout(timeout_s, "timeout_s")
    settings: tuple[tuple[str, object, int], ...] = (
        ("max_in_flight", max_in_flight, 1),
        # 0 would mean "unbounded" to ZeroMQ: the client's back-pressure would turn into memory.
        ("sndhwm", sndhwm, 1),
        ("rcvhwm", rcvhwm, 1),
        ("linger", linger, 0),
    )
    for name, value, lo in settings:
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= lo):
            raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def _check_timeout(value: object, name: str) -> float:
    """``value`` as float seconds; raises ValueError unless it is a finite number > 0."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _endpoints(endpoints: str | Sequence[str]) -> tuple[str, ...]:
    """One endpoint or several as a tuple; raises ValueError if empty, not strings, or an
    endpoint without a ``tcp://``/``ipc://``/``inproc://`` scheme (the message says which)."""
    items: tuple[object, ...] = (endpoints,) if isinstance(endpoints, str) else tuple(endpoints)
    out = tuple(e for e in items if isinstance(e, str) and e)
    if not out or len(out) != len(items):
        raise ValueError(f"endpoints must be one or more endpoint strings, got {endpoints!r}")
    for endpoint in out:
        problem = endpoint_error(endpoint)
        if problem is not None:
            raise ValueError(problem)
    return out


def _infer_batch_request(
    request_id: int,
    images: Sequence[npt.NDArray[np.uint8]],
    *,
    model: str,
    pixel_format: PixelFormat | YuvFormat | None,
    streams: Sequence[str | None] | None,
    priority: int,
    deadline_ms: int | None,
    conf: float | None,
    iou: float | None,
    max_det: int | None,
    max_in_flight: int,
) -> InferBatchRequest:
    """:func:`_infer_request`'s checks for each image of an INFER_BATCH (``streams``: one name
    or None per image). Raises TypeError/ValueError for a bad image, an empty or too long list
    (more than ``MAX_BATCH_IMAGES``, or than the client's ``max_in_flight``), or ``streams`` of
    another length; ProtocolError for another field."""
    if isinstance(cast("object", images), np.ndarray) or not isinstance(images, Sequence):
        raise TypeError("images must be a sequence of numpy arrays (one batch of frames)")
    most = min(MAX_BATCH_IMAGES, max_in_flight)
    if not 1 <= len(images) <= most:
        raise ValueError(f"a batch has 1 to {most} images (MAX_BATCH_IMAGES and the client's "
                         f"max_in_flight), got {len(images)}")  # fmt: skip
    names = [None] * len(images) if streams is None else list(streams)
    if len(names) != len(images):
        raise ValueError(f"streams has {len(names)} names for {len(images)} images")
    fields = {"model": model, "pixel_format": pixel_format, "priority": priority,
              "deadline_ms": deadline_ms, "conf": conf, "iou": iou, "max_det": max_det}  # fmt: skip
    items = tuple(
        _infer_request(request_id, image, stream=stream, **fields)  # type: ignore[arg-type]
        for image, stream in zip(images, names, strict=True)
    )
    return InferBatchRequest(request_id, model, items)


def _encode(message: Request) -> list[Frame]:
    """The message's frames; raises the daemon's ``BadRequest`` at once for one over the
    protocol's message limit (``DEFAULT_LIMITS.max_message_bytes``, the daemon's default): a
    daemon refuses it, and one twice the limit never even reaches its decoder, so sending it
    would only wait for the timeout."""
    frames = encode(message)
    total = sum(len(f) if isinstance(f, bytes) else memoryview(f).nbytes for f in frames)
    limit = DEFAULT_LIMITS.max_message_bytes
    if total > limit:
        raise error_for(
            Status.BAD_REQUEST,
            f"frames: message of {total} bytes is over the limit of {limit}",
            request_id=message.id,
        )
    return frames


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """What a client needs to reach a daemon that runs ``[auth] mode = "curve"``: the daemon's
    public key and the client's own key pair (whose public key the daemon allows)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(
        cls, server_key: str | os.PathLike[str], client_secret_key: str | os.PathLike[str]
    ) -> CurveKeys:
        """Read ``server_key`` (the daemon's public certificate file, ``*.key``) and
        ``client_secret_key`` (this client's ``*.key_secret``, as ``dlad keygen`` writes them).
        Raises ValueError naming a file that cannot be read or lacks its key."""
        import zmq.auth  # noqa: PLC0415 (only clients that authenticate need it)

        try:
            server_public, _ = zmq.auth.load_certificate(os.fspath(server_key))
            public, secret = zmq.auth.load_certificate(os.fspath(client_secret_key))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read a CURVE key: {exc}") from None
        if secret is None:
            raise ValueError(f"{os.fspath(client_secret_key)} holds no secret key (.key_secret)")
        return cls(server_public, public, secret)


def _configure(
    socket: zmq.Socket[Any],
    endpoints: Sequence[str],
    sndhwm: int,
    rcvhwm: int,
    linger: int,
    *,
    curve: CurveKeys | None = None,
) -> None:
    """Set the options of a client DEALER and connect it. Raises ValueError on a bad endpoint."""
    if curve is not None:
        socket.curve_serverkey = curve.server_public
        socket.curve_publickey = curve.public
        socket.curve_secretkey = curve.secret
    socket.setsockopt(zmq.LINGER, linger)
    socket.setsockopt(zmq.SNDHWM, sndhwm)
    socket.setsockopt(zmq.RCVHWM, rcvhwm)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    endpoint = ""
    try:
        for endpoint in endpoints:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"cannot connect to {endpoint!r}: {exc}") from None


def _infer_request(
    request_id: int,
    image: npt.NDArray[np.uint8],
    *,
    model: str,
    pixel_format: PixelFormat | YuvFormat | None,
    stream: str | None,
    priority: int,
    deadline_ms: int | None,
    conf: float | None,
    iou: float | None,
    max_det: int | None,
) -> InferRequest:
    """Validate an image and the INFER's fields; the image is sent without a copy when it is
    C-contiguous, else it is made contiguous (one copy).

    ``pixel_format`` None means GRAY or RGB by the image's channels; ``"NV12"`` (a ``3H/2 x W``
    frame) and ``"YUYV"`` (``H x W x 2``) are BT.601 limited range, a :class:`YuvFormat` names
    another colour.

    Raises TypeError (not an array), ValueError (not uint8, empty, not of ``pixel_format``'s
    shape: ``H x W``/``H x W x 1`` gray, ``H x W x 3``, ``3H/2 x W`` NV12 or ``H x W x 2``
    YUYV), ProtocolError (a ``BadRequest``: another field out of the range of
    ``docs/protocol.md``, or a side over 65 535).
    """
    if not isinstance(image, np.ndarray):
        raise TypeError(f"image must be a numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise ValueError(f"image must be uint8, got {image.dtype}")
    if 0 in image.shape:
        raise ValueError(f"image is empty: {image.shape}")
    yuv = pixel_format if isinstance(pixel_format, YuvFormat) else None
    fmt: str | None = yuv.layout if yuv is not None else cast("str | None", pixel_format)
    if image.ndim == 2 and fmt in (None, "GRAY"):
        image = image[:, :, np.newaxis]
    if fmt is None:
        if image.ndim != 3 or image.shape[2] not in (1, 3):
            raise ValueError(
                f"image must be H x W (gray), H x W x 1 or H x W x 3, got {image.shape} "
                "(an NV12 or YUYV frame names its pixel_format)"
            )
        fmt = "GRAY" if image.shape[2] == 1 else "RGB"
    try:
        frame_size(fmt, image.shape)
    except ValueError as exc:
        raise ValueError(f"pixel_format {fmt!r} does not fit an image of shape {image.shape}: "
                         f"{exc}") from None  # fmt: skip
    return InferRequest(
        id=request_id, model=model, image=np.ascontiguousarray(image),
        format=cast("PixelFormat", fmt), stream=stream, priority=priority,
        deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det,
        colorspace=None if yuv is None else yuv.colorspace,
        color_range=None if yuv is None else yuv.color_range,
    )  # fmt: skip


# ------------------------------------------------------------------------------ shared memory


def _local(endpoint: str) -> bool:
    """Whether ``endpoint`` reaches a daemon on this host (``ipc://``, or loopback tcp)."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class ShmSlots:
    """Shared-memory slots for a client's frames (docs/protocol.md, Shared-memory frames).

    One POSIX segment of a header (``SHM_HEADER_BYTES``, holding a random token that proves the
    segment is this client's) and ``slots x slot_bytes`` bytes, created by the client (mode
    0600, a random name) and unlinked on :meth:`close`; Python's resource tracker unlinks it if
    the process dies first. A slot is the daemon's from the INFER that names it until the daemon
    answers that request: a late reply frees it too, a reply that never comes keeps it (frames
    then go inline once every slot is taken).
    """

    def __init__(self, slots: int, slot_bytes: int) -> None:
        _check_slots(slots, slot_bytes)
        from multiprocessing import shared_memory  # noqa: PLC0415 (only shm clients need it)

        self.slot_bytes = slot_bytes
        self._segment = shared_memory.SharedMemory(
            name=f"dlad-{os.getpid()}-{secrets.token_hex(6)}",
            create=True,
            size=SHM_HEADER_BYTES + slots * slot_bytes,
        )
        self.size = self._segment.size  # as the OS reports it (a page multiple on some)
        buf = self._segment.buf
        assert buf is not None  # an open segment
        self._token = secrets.token_bytes(SHM_TOKEN_BYTES)
        buf[:SHM_HEADER_BYTES] = shm_header(self._token)
        self._buffer = np.frombuffer(buf, np.uint8)[SHM_HEADER_BYTES:]
        self._free = list(range(slots - 1, -1, -1))
        self._reserved: set[int] = set()  # handed out by frame(), not yet submitted
        self._busy: dict[int, list[int]] = {}  # request id -> its slots (a batch has several)
        self.inline = 0  # frames sent in the message because no slot was free or big enough

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def free(self) -> int:
        return len(self._free)

    def frame(self, shape: tuple[int, ...]) -> npt.NDArray[np.uint8] | None:
        """A writable uint8 array of ``shape`` in a free slot (None: none free, or too big):
        fill it and submit it, and it crosses without a copy."""
        nbytes = math.prod(shape)
        if nbytes > self.slot_bytes or not self._free:
            return None
        slot = self._free.pop()
        self._reserved.add(slot)
        start = slot * self.slot_bytes
        return self._buffer[start : start + nbytes].reshape(shape)

    def place(self, request_id: int, image: npt.NDArray[np.uint8]) -> ShmRef | None:
        """Put ``image`` (C-contiguous uint8) in a slot for ``request_id``: in place if it is
        a :meth:`frame`, else copied into a free one. None: it goes inline."""
        slot = self._slot_of(image)
        if slot is None:
            if image.nbytes > self.slot_bytes or not self._free:
                self.inline += 1
                return None
            slot = self._free.pop()
            start = slot * self.slot_bytes
            self._buffer[start : start + image.nbytes] = image.reshape(-1)
        else:
            self._reserved.discard(slot)
        self._busy.setdefault(request_id, []).append(slot)
        return ShmRef(self.name, SHM_HEADER_BYTES + slot * self.slot_bytes, self.size, self._token)

    def release(self, image: npt.NDArray[np.uint8]) -> None:
        """A :meth:`frame` that will not be sent: its slot is free again (anything else: no
        effect)."""
        slot = self._slot_of(image)
        if slot is not None:
            self._reserved.discard(slot)
            self._free.append(slot)

    def unplace(self, request_id: int) -> None:
        """``request_id`` was never sent: its slot is free again."""
        self.answered(request_id)

    def answered(self, request_id: int) -> None:
        """The daemon answered ``request_id``: its slots are free."""
        self._free.extend(self._busy.pop(request_id, ()))

    def close(self) -> None:
        """Unlink the segment (the daemon's mapping, if any, stays valid until it unmaps)."""
        self._buffer = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):  # a frame() array still alive: the GC frees it
            self._segment.close()
        with contextlib.suppress(FileNotFoundError):
            self._segment.unlink()

    def _slot_of(self, image: npt.NDArray[np.uint8]) -> int | None:
        """The reserved slot ``image`` starts at, if it is a :meth:`frame` of this segment."""
        if not self._reserved or self._buffer.size == 0:
            return None
        offset = int(image.ctypes.data) - int(self._buffer.ctypes.data)
        slot, rest = divmod(offset, self.slot_bytes)
        if rest or slot not in self._reserved or image.nbytes > self.slot_bytes:
            return None
        return slot


def _shm_plan(
    endpoints: Sequence[str], slot_bytes: int | None, slots: int | None, max_in_flight: int
) -> tuple[int, int] | None:
    """The client's shared-memory slots as (slots, bytes each), if asked for. Raises ValueError
    for a bad size or an endpoint on another host (a segment in this host's memory means
    nothing there)."""
    if slot_bytes is None:
        if slots is not None:
            raise ValueError("shm_slots needs shm_slot_bytes")
        return None
    remote = [e for e in endpoints if not _local(e)]
    if remote:
        raise ValueError(
            f"shared-memory frames need a daemon on this host (ipc:// or loopback tcp); "
            f"{remote[0]!r} is not"
        )
    count = max_in_flight if slots is None else slots
    _check_slots(count, slot_bytes)
    return count, slot_bytes


def _check_slots(slots: object, slot_bytes: object) -> None:
    if not (isinstance(slots, int) and slots >= 1):
        raise ValueError(f"shm_slots must be an int >= 1, got {slots!r}")
    if not (isinstance(slot_bytes, int) and slot_bytes >= 4096):
        raise ValueError(f"shm_slot_bytes must be an int >= 4096, got {slot_bytes!r}")


def _shm_slots(
    endpoints: Sequence[str], slot_bytes: int | None, slots: int | None, max_in_flight: int
) -> ShmSlots | None:
    """The client's shared-memory slots, if asked for (:func:`_shm_plan`'s checks first)."""
    plan = _shm_plan(endpoints, slot_bytes, slots, max_in_flight)
    return None if plan is None else ShmSlots(*plan)


def _in_shm(slots: ShmSlots, request: Request) -> Request:
    """``request`` with its image (an INFER_BATCH: each image) in a shared-memory slot, or
    as it is (inline) where none fits; other requests as they are."""
    if isinstance(request, InferBatchRequest):
        items = tuple(_in_shm(slots, item) for item in request.images)
        return request.with_images(cast("tuple[InferRequest, ...]", items))
    if not isinstance(request, InferRequest):
        return request
    ref = slots.place(request.id, request.image)
    return request if ref is None else request.in_shared_memory(ref)


# ------------------------------------------------------------------------------ pending calls


@dataclass(eq=False, slots=True)
class _Call:
    """One request awaiting its reply. ``outcome`` is set exactly once (a reply or an error)."""

    id: int
    kind: Kind  # the reply kind that answers it
    deadline: float  # on the owning client's clock
    timeout: float  # seconds from sending to ``deadline``, for messages
    outcome: Outcome | None = None
    images: int = 1  # an INFER_BATCH's: how many of the client's in-flight images it holds
    names: tuple[str, ...] = ()  # an INFER's: its model's class names, as the client knows them

    def settled(self) -> None:
        """Called once, right after ``outcome`` is set."""


C = TypeVar("C", bound=_Call)
R = TypeVar("R", InferReply, CancelReply, StatusReply, InferBatchReply)
_REPLY_KINDS: Final = (Kind.INFER_REPLY, Kind.CANCEL_REPLY, Kind.STATUS_REPLY,
                       Kind.INFER_BATCH_REPLY)  # fmt: skip
INFERS: Final = (Kind.INFER_REPLY, Kind.INFER_BATCH_REPLY)
"""The reply kinds of requests that hold images in flight (and get a CANCEL when abandoned)."""


class _Calls(Generic[C]):
    """Requests in flight, keyed by ``(reply kind, id)``: an INFER and its CANCEL share an id
    and differ by the kind of their replies. Deadlines sit in a heap for :meth:`expired`.

    ``on_answer(id)`` is called for every reply the daemon sends to an INFER (late ones after a
    timeout included): the daemon is done with that request's frame then (shared-memory slots).
    """

    def __init__(self, on_answer: Callable[[int], None] | None = None) -> None:
        self._on_answer = on_answer
        self._calls: dict[tuple[Kind, int], C] = {}
        self._counts: Counter[Kind] = Counter()
        self.images = 0  # images in flight: INFERs, and each INFER_BATCH's images
        self._heap: list[tuple[float, int, C]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._calls)

    def pending(self, kind: Kind) -> int:
        return self._counts[kind]

    def has_room(self, images: int, most: int) -> bool:
        """Whether ``images`` more images keep the client within ``most`` in flight."""
        return self.images + images <= most

    def get(self, kind: Kind, request_id: int) -> C | None:
        return self._calls.get((kind, request_id))

    def add(self, call: C) -> None:
        key = (call.kind, call.id)
        if key in self._calls:
            raise InternalError(f"request id {call.id} is already in flight")
        self._calls[key] = call
        self._counts[call.kind] += 1
        if call.kind in INFERS:
            self.images += call.images
        # Answered calls stay in the heap until their deadline; rebuild it when they dominate,
        # so it stays proportional to what is in flight (amortised O(1) per call).
        if len(self._heap) > 2 * len(self._calls) + 1024:
            self._heap = [entry for entry in self._heap if entry[2].outcome is None]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (call.deadline, next(self._seq), call))

    def finish(self, call: C, outcome: Outcome) -> bool:
        """Settle ``call`` unless it already is; returns whether this call settled it."""
        if call.outcome is not None:
            return False
        call.outcome = outcome
        key = (call.kind, call.id)
        if self._calls.get(key) is call:
            del self._calls[key]
            self._counts[call.kind] -= 1
            if call.kind in INFERS:
                self.images -= call.images
        call.settled()
        return True

    def next_deadline(self) -> float:
        """The earliest deadline of a pending call (``inf`` if none): when to call
        :meth:`expired` next."""
        while self._heap and self._heap[0][2].outcome is not None:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else math.inf

    def expired(self, now: float) -> list[C]:
        """The unsettled calls whose deadline is ``<= now`` (each returned once)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            call = heapq.heappop(self._heap)[2]
            if call.outcome is None:
                out.append(call)
        return out

    def fail_all(self, error: Callable[[C], Exception]) -> None:
        for call in list(self._calls.values()):
            self.finish(call, error(call))

    def _addressed(self, request_id: int | None, kind: int | None) -> list[C]:
        if request_id is None:
            return []
        kinds = [Kind(kind)] if kind in _REPLY_KINDS else _REPLY_KINDS
        return [c for k in kinds if (c := self._calls.get((k, request_id))) is not None]

    def deliver(self, frames: Sequence[FrameLike]) -> None:
        """Decode one reply and settle the call it answers; never raises for a bad reply.

        An undecodable reply whose id can still be read fails that request with the decoder's
        ProtocolError; an ERROR_REPLY fails every request with its id; anything else that
        matches no pending request (a late reply after a timeout, the reply to a CANCEL sent
        on a timeout) is dropped.
        """
        try:
            reply = decode_reply(frames)
        except ProtocolError as exc:
            if self._on_answer is not None and exc.request_id is not None:
                self._on_answer(exc.request_id)
            targets = self._addressed(exc.request_id, exc.request_kind)
            if not targets:
                _log.warning("dropped an undecodable reply: %s", exc.message)
            for call in targets:
                self.finish(call, exc)
            return
        answered_id = (
            reply.id if isinstance(reply, (InferReply, ErrorReply, InferBatchReply)) else None
        )
        if self._on_answer is not None and answered_id is not None:
            self._on_answer(answered_id)
        if isinstance(reply, ErrorReply):
            targets = self._addressed(reply.id, None)
            if not targets:
                _log.warning("error reply for no pending request (id %s): %s", reply.id, reply)
            for call in targets:
                self.finish(call, error_for(reply.status, reply.message, request_id=reply.id))
            return
        answered = self._calls.get((reply.kind, reply.id))
        if answered is None:
            _log.debug("dropped a %s for id %d: no longer pending", reply.kind.name, reply.id)
            return
        self.finish(answered, reply)


def _reply(call: _Call, cls: type[R]) -> R:
    """The reply of a settled call, or raise what settled it (a non-OK status as its class)."""
    outcome = call.outcome
    if isinstance(outcome, Exception):
        raise outcome
    if not isinstance(outcome, cls):  # calls are keyed by reply kind: only a bug gets here
        raise InternalError(f"request {call.id} got {type(outcome).__name__}", request_id=call.id)
    # A CANCEL answered NOT_FOUND is an answer ("too late"), not a failure.
    answers = (Status.OK, Status.NOT_FOUND) if call.kind is Kind.CANCEL_REPLY else (Status.OK,)
    if outcome.status not in answers:
        raise error_for(outcome.status, outcome.message, request_id=outcome.id)
    return outcome


def _result(call: _Call) -> Result:
    reply = _reply(call, InferReply)
    return Result(reply.id, reply.detections, reply.device, reply.timing, call.names)


def _batch_results(call: _Call) -> list[Result | DladError]:
    """An INFER_BATCH's outcome per image, in order: its Result, or the error its status names
    (a superseded or refused image does not fail the others); a refusal of the whole batch
    raises, as :func:`_reply` does."""
    reply = _reply(call, InferBatchReply)
    return [
        Result(r.id, r.detections, r.device, r.timing, call.names) if r.status == Status.OK
        else error_for(r.status, r.message, request_id=r.id)
        for r in reply.results
    ]  # fmt: skip


def _report(call: _Call, names: dict[str, tuple[str, ...]]) -> DaemonStatus:
    """The STATUS report of a settled call; the class names of its models are put in
    ``names`` (a client's, by model)."""
    report = _reply(call, StatusReply).report
    if report is None:  # StatusReply guarantees a report with OK
        raise InternalError("STATUS reply without a report", request_id=call.id)
    for model in report["models"]:
        if "class_names" in model:
            names[model["name"]] = tuple(model["class_names"])
    return report


def _class_names(report: DaemonStatus, model: str) -> tuple[str, ...]:
    """``model``'s class names in ``report``. Raises NotFound where it is not served there,
    InternalError where the daemon does not report names (older than model families)."""
    for m in report["models"]:
        if m["name"] == model:
            if "class_names" not in m:
                raise InternalError(f"daemon {report['name']!r} does not report class names")
            return tuple(m["class_names"])
    raise NotFound(f"daemon {report['name']!r} serves no model {model!r}")


def _timed_out(call: _Call) -> ClientTimeout:
    what = {Kind.INFER_REPLY: "INFER", Kind.CANCEL_REPLY: "CANCEL", Kind.STATUS_REPLY: "STATUS",
            Kind.INFER_BATCH_REPLY: "INFER_BATCH"}  # fmt: skip
    sent_cancel = "; a CANCEL was sent" if call.kind in INFERS else ""
    return ClientTimeout(
        f"{what.get(call.kind, call.kind.name)} request {call.id} was not answered "
        f"within {call.timeout:g} s{sent_cancel}",
        request_id=call.id,
    )
