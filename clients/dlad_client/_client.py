"""The synchronous :class:`Client`, and the pieces :mod:`clients.dlad_client._async` shares with it.

Both clients speak wire protocol v1 through :mod:`dlad.protocol` (they never build a header by
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

import heapq
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Generic, TypeVar, final

import numpy as np
import numpy.typing as npt
import zmq

from dlad.errors import InternalError, ProtocolError, Status, error_for
from dlad.protocol import (
    CHANNELS,
    CancelReply,
    CancelRequest,
    DaemonStatus,
    ErrorReply,
    FrameLike,
    InferReply,
    InferRequest,
    Kind,
    PixelFormat,
    Request,
    StatusReply,
    StatusRequest,
    Timing,
    decode_reply,
    encode,
)

__all__ = ["Client", "ClientClosed", "ClientTimeout", "Handle", "Result"]

DEFAULT_TIMEOUT_S: Final = 10.0
DEFAULT_MAX_IN_FLIGHT: Final = 64
DEFAULT_HWM: Final = 1000
MAX_REPLY_BYTES: Final = 1 << 20
"""``ZMQ_MAXMSGSIZE`` of the client socket. The largest valid reply is a header far under 64 KiB
plus 1000 detections of 24 bytes, so a peer sending more is not a dlad daemon."""

_log = logging.getLogger("dlad_client")


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
    """

    request_id: int
    detections: npt.NDArray[np.float32]
    device: str | None
    timing: Timing

    def __len__(self) -> int:
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


# ------------------------------------------------------------------------------ settings


def _check_settings(
    timeout_s: float, max_in_flight: int, sndhwm: int, rcvhwm: int, linger: int
) -> None:
    _check_timeout(timeout_s, "timeout_s")
    for name, value, lo in (
        ("max_in_flight", max_in_flight, 1),
        # 0 would mean "unbounded" to ZeroMQ: the client's back-pressure would turn into memory.
        ("sndhwm", sndhwm, 1),
        ("rcvhwm", rcvhwm, 1),
        ("linger", linger, 0),
    ):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= lo):
            raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def _check_timeout(value: float, name: str) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _endpoints(endpoints: str | Sequence[str]) -> tuple[str, ...]:
    out = (endpoints,) if isinstance(endpoints, str) else tuple(endpoints)
    if not out or not all(isinstance(e, str) and e for e in out):
        raise ValueError(f"endpoints must be one or more endpoint strings, got {endpoints!r}")
    return out


def _configure(
    socket: zmq.Socket[Any], endpoints: Sequence[str], sndhwm: int, rcvhwm: int, linger: int
) -> None:
    """Set the options of a client DEALER and connect it. Raises ValueError on a bad endpoint."""
    socket.setsockopt(zmq.LINGER, linger)
    socket.setsockopt(zmq.SNDHWM, sndhwm)
    socket.setsockopt(zmq.RCVHWM, rcvhwm)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    for endpoint in endpoints:
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect to {endpoint!r}: {exc}") from None


def _infer_request(
    request_id: int,
    image: npt.NDArray[np.uint8],
    *,
    model: str,
    pixel_format: PixelFormat | None,
    stream: str | None,
    priority: int,
    deadline_ms: int | None,
    conf: float | None,
    iou: float | None,
    max_det: int | None,
) -> InferRequest:
    """Validate an image and the INFER's fields; the image is sent without a copy when it is
    C-contiguous, else it is made contiguous (one copy).

    Raises TypeError (not an array), ValueError (not uint8, not ``H x W``/``H x W x 1``/
    ``H x W x 3``, empty, or contradicting ``pixel_format``), ProtocolError (a ``BadRequest``:
    another field out of the range of ``docs/protocol.md``, or a side over 65 535).
    """
    if not isinstance(image, np.ndarray):
        raise TypeError(f"image must be a numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise ValueError(f"image must be uint8, got {image.dtype}")
    if image.ndim == 2:
        image = image[:, :, np.newaxis]
    if image.ndim != 3 or image.shape[2] not in (1, 3):
        raise ValueError(f"image must be H x W (gray), H x W x 1 or H x W x 3, got {image.shape}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ValueError(f"image is empty: {image.shape}")
    channels = int(image.shape[2])
    fmt = pixel_format if pixel_format is not None else ("GRAY" if channels == 1 else "RGB")
    if CHANNELS.get(fmt) != channels:
        raise ValueError(f"pixel_format {fmt!r} does not fit an image of shape {image.shape}")
    return InferRequest(
        id=request_id, model=model, image=np.ascontiguousarray(image), format=fmt, stream=stream,
        priority=priority, deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det,
    )  # fmt: skip


# ------------------------------------------------------------------------------ pending calls


@dataclass(eq=False, slots=True)
class _Call:
    """One request awaiting its reply. ``outcome`` is set exactly once (a reply or an error)."""

    id: int
    kind: Kind  # the reply kind that answers it
    deadline: float  # on the owning client's clock
    timeout: float  # seconds from sending to ``deadline``, for messages
    outcome: InferReply | CancelReply | StatusReply | Exception | None = None

    def settled(self) -> None:
        """Called once, right after ``outcome`` is set."""


C = TypeVar("C", bound=_Call)
R = TypeVar("R", InferReply, CancelReply, StatusReply)
_REPLY_KINDS: Final = (Kind.INFER_REPLY, Kind.CANCEL_REPLY, Kind.STATUS_REPLY)


class _Calls(Generic[C]):
    """Requests in flight, keyed by ``(reply kind, id)``: an INFER and its CANCEL share an id
    and differ by the kind of their replies. Deadlines sit in a heap for :meth:`expired`."""

    def __init__(self) -> None:
        self._calls: dict[tuple[Kind, int], C] = {}
        self._counts: Counter[Kind] = Counter()
        self._heap: list[tuple[float, int, C]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._calls)

    def pending(self, kind: Kind) -> int:
        return self._counts[kind]

    def get(self, kind: Kind, request_id: int) -> C | None:
        return self._calls.get((kind, request_id))

    def add(self, call: C) -> None:
        key = (call.kind, call.id)
        if key in self._calls:
            raise InternalError(f"request id {call.id} is already in flight")
        self._calls[key] = call
        self._counts[call.kind] += 1
        # Answered calls stay in the heap until their deadline; rebuild it when they dominate,
        # so it stays proportional to what is in flight (amortised O(1) per call).
        if len(self._heap) > 2 * len(self._calls) + 1024:
            self._heap = [entry for entry in self._heap if entry[2].outcome is None]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (call.deadline, next(self._seq), call))

    def finish(self, call: C, outcome: InferReply | CancelReply | StatusReply | Exception) -> bool:
        """Settle ``call`` unless it already is; returns whether this call settled it."""
        if call.outcome is not None:
            return False
        call.outcome = outcome
        key = (call.kind, call.id)
        if self._calls.get(key) is call:
            del self._calls[key]
            self._counts[call.kind] -= 1
        call.settled()
        return True

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
            targets = self._addressed(exc.request_id, exc.request_kind)
            if not targets:
                _log.warning("dropped an undecodable reply: %s", exc.message)
            for call in targets:
                self.finish(call, exc)
            return
        if isinstance(reply, ErrorReply):
            targets = self._addressed(reply.id, None)
            if not targets:
                _log.warning("error reply for no pending request (id %s): %s", reply.id, reply)
            for call in targets:
                self.finish(call, error_for(reply.status, reply.message, request_id=reply.id))
            return
        call = self._calls.get((reply.kind, reply.id))
        if call is None:
            _log.debug("dropped a %s for id %d: no longer pending", reply.kind.name, reply.id)
            return
        self.finish(call, reply)


def _reply(call: _Call, cls: type[R]) -> R:
    """The reply of a settled call, or raise what settled it (a non-OK status as its class)."""
    outcome = call.outcome
    if isinstance(outcome, Exception):
        raise outcome
    if not isinstance(outcome, cls):  # calls are keyed by reply kind: only a bug gets here
        raise InternalError(f"request {call.id} got {type(outcome).__name__}", request_id=call.id)
    # A CANCEL answered NOT_FOUND is an answer ("too late"), not a failure.
    if outcome.status != Status.OK and not (
        isinstance(outcome, CancelReply) and outcome.status == Status.NOT_FOUND
    ):
        raise error_for(outcome.status, outcome.message, request_id=outcome.id)
    return outcome


def _result(call: _Call) -> Result:
    reply = _reply(call, InferReply)
    return Result(reply.id, reply.detections, reply.device, reply.timing)


def _report(call: _Call) -> DaemonStatus:
    report = _reply(call, StatusReply).report
    if report is None:  # StatusReply guarantees a report with OK
        raise InternalError("STATUS reply without a report", request_id=call.id)
    return report


def _timed_out(call: _Call) -> ClientTimeout:
    what = {Kind.INFER_REPLY: "INFER", Kind.CANCEL_REPLY: "CANCEL", Kind.STATUS_REPLY: "STATUS"}
    sent_cancel = "; a CANCEL was sent" if call.kind is Kind.INFER_REPLY else ""
    return ClientTimeout(
        f"{what.get(call.kind, call.kind.name)} request {call.id} was not answered "
        f"within {call.timeout:g} s{sent_cancel}",
        request_id=call.id,
    )


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


# ------------------------------------------------------------------------------ Client


@final
class Handle:
    """A submitted INFER (from :meth:`Client.submit`): the way to its :class:`Result`.

    Belongs to its client and so to that client's thread.
    """

    __slots__ = ("_call", "_client")

    def __init__(self, client: Client, call: _Call) -> None:
        self._client = client
        self._call = call

    def __repr__(self) -> str:
        state = "done" if self._call.outcome is not None else "pending"
        return f"<Handle request_id={self._call.id} {state}>"

    @property
    def request_id(self) -> int:
        """The request's id on the wire."""
        return self._call.id

    def done(self) -> bool:
        """Whether the outcome is known. Takes in the replies already waiting on the socket
        (never blocks). Raises RuntimeError from another thread than the client's."""
        if self._call.outcome is None and not self._client.closed:
            self._client._pump(0.0, lambda: self._call.outcome is not None)
        return self._call.outcome is not None

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the reply and return the detections.

        Waits until the request's own deadline (``timeout_s`` after it was submitted), or at most
        ``timeout`` seconds if given. Replies to other requests that arrive meanwhile are kept
        for their handles.

        Raises:
            DladError: the daemon answered with a non-OK status: its class in
                :mod:`dlad.errors` (``Overloaded``, ``NotFound``, ...).
            ClientTimeout: the request's deadline passed (it is abandoned and a CANCEL sent),
                or ``timeout`` passed first (the request stays in flight: call again).
            ClientClosed: the client was closed before the reply came.
            ValueError: ``timeout`` is negative or not finite.
            RuntimeError: called from another thread than the client's.
        """
        call = self._call
        if call.outcome is None:
            client = self._client
            client._check()
            until = call.deadline
            if timeout is not None:
                if not (math.isfinite(timeout) and timeout >= 0):
                    raise ValueError(f"timeout must be finite and >= 0, got {timeout!r}")
                until = min(until, time.monotonic() + timeout)
            if not client._pump(until, lambda: call.outcome is not None):
                if until < call.deadline:
                    raise ClientTimeout(
                        f"request {call.id} not answered within {timeout} s (still in flight)",
                        request_id=call.id,
                    )
                client._abandon(call, _timed_out(call))
        return _result(call)


@final
class Client:
    """A synchronous dlad client: one DEALER socket connected to every endpoint.

    Several endpoints spread requests round-robin over the daemons that are connected (ZeroMQ's
    DEALER load balancing); each reply comes from the daemon that took the request. Requests can
    be pipelined: :meth:`submit` returns at once, and many requests may be in flight (at most
    ``max_in_flight`` INFERs; a further submit first waits, reading replies, for one to finish).

    **One thread.** A Client belongs to the thread that created it, like the ZeroMQ socket it
    owns; every method raises RuntimeError from another thread. Use one Client per thread, or
    :class:`~clients.dlad_client.AsyncClient` for many concurrent calls on one socket.

    **Images cross without copies**: a C-contiguous uint8 array is handed to ZeroMQ as it is, so
    do not write into it until its request is answered; a non-contiguous one is copied once.

    ``timeout_s`` bounds every call (waiting for a slot, sending, and the reply) unless the call
    passes its own. ``context``: a ``zmq.Context`` to create the socket in (the client closes
    its socket, never a context it was given); by default the client creates its own context
    and terminates it on :meth:`close`. ``linger`` is the socket's ``ZMQ_LINGER`` (ms).

    Raises ValueError on a bad setting or an endpoint ZeroMQ cannot connect to.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        sndhwm: int = DEFAULT_HWM,
        rcvhwm: int = DEFAULT_HWM,
        linger: int = 0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._endpoints = _endpoints(endpoints)
        _check_settings(timeout_s, max_in_flight, sndhwm, rcvhwm, linger)
        self._timeout_s = float(timeout_s)
        self._max_in_flight = max_in_flight
        self._linger = linger
        self._owner = threading.get_ident()
        self._owns_context = context is None
        self._context: zmq.Context[Any] = zmq.Context() if context is None else context
        self._socket: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        try:
            _configure(self._socket, self._endpoints, sndhwm, rcvhwm, linger)
        except BaseException:
            self._socket.close(linger=0)
            if self._owns_context:
                self._context.term()
            raise
        self._calls: _Calls[_Call] = _Calls()
        self._ids = itertools.count(1)
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._calls)} in flight"
        return f"<Client {list(self._endpoints)} {state}>"

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints the socket is connected to."""
        return self._endpoints

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered (as far as the replies read so far tell)."""
        return len(self._calls)

    def close(self) -> None:
        """Close the socket (``linger`` ms for unsent messages) and the context the client
        created. Unanswered requests fail with :class:`ClientClosed`. Idempotent.

        Raises RuntimeError from another thread than the client's.
        """
        if self._closed:
            return
        self._check_thread()
        self._closed = True
        self._calls.fail_all(lambda c: ClientClosed(f"client closed before request {c.id}'s reply"))
        self._socket.close(linger=self._linger)
        if self._owns_context:
            self._context.term()

    def detect(
        self,
        image: npt.NDArray[np.uint8],
        *,
        model: str = "demo",
        pixel_format: PixelFormat | None = None,
        stream: str | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        conf: float | None = None,
        iou: float | None = None,
        max_det: int | None = None,
        timeout_s: float | None = None,
    ) -> Result:
        """Run ``model`` on ``image`` and wait for the detections (``submit(...).result()``).

        ``image`` is ``H x W x 3`` (``pixel_format`` ``"RGB"``, the default, or ``"BGR"``) or
        ``H x W`` / ``H x W x 1`` (``"GRAY"``, inferred) uint8. ``stream``, ``priority``
        (0-7), ``deadline_ms`` (the daemon's dispatch budget), ``conf``, ``iou`` and
        ``max_det`` are INFER's fields of ``docs/protocol.md``; ``None`` means the daemon's
        default. ``timeout_s`` overrides the client's for this call.

        Raises:
            TypeError, ValueError: ``image`` is not a uint8 array of a supported shape, or does
                not fit ``pixel_format``; nothing is sent.
            BadRequest: another field is out of range (raised before sending, as the daemon's
                own ``ProtocolError``), or the daemon refused the request.
            NotFound, Overloaded, DeadlineExceeded, Cancelled, ShuttingDown, DeviceFailed,
                InternalError: the daemon's answer (see :mod:`dlad.errors`).
            ClientTimeout: no reply within the timeout (a CANCEL was sent).
            ClientClosed, RuntimeError: the client is closed, or used from another thread.
        """
        handle = self.submit(
            image, model=model, pixel_format=pixel_format, stream=stream, priority=priority,
            deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det, timeout_s=timeout_s,
        )  # fmt: skip
        return handle.result()

    def submit(
        self,
        image: npt.NDArray[np.uint8],
        *,
        model: str = "demo",
        pixel_format: PixelFormat | None = None,
        stream: str | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        conf: float | None = None,
        iou: float | None = None,
        max_det: int | None = None,
        timeout_s: float | None = None,
    ) -> Handle:
        """Send an INFER without waiting for its reply; :meth:`Handle.result` waits for it.

        The arguments are :meth:`detect`'s; the request's timeout starts now. If
        ``max_in_flight`` INFERs are already in flight, this first reads replies until one
        finishes.

        Raises:
            TypeError, ValueError, BadRequest: invalid input, as in :meth:`detect`; nothing
                is sent.
            ClientTimeout: no slot freed up, or no daemon took the message, within the timeout.
            ClientClosed, RuntimeError: the client is closed, or used from another thread.
        """
        self._check()
        timeout = self._timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        request = _infer_request(
            next(self._ids), image, model=model, pixel_format=pixel_format, stream=stream,
            priority=priority, deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det,
        )  # fmt: skip
        return Handle(self, self._start(request, Kind.INFER_REPLY, timeout))

    def cancel(self, handle: Handle, *, timeout_s: float | None = None) -> bool:
        """Ask the daemon to drop a queued INFER, and wait for its answer.

        Returns True if the daemon removed it (its handle then raises
        :class:`~dlad.errors.Cancelled`), False if it was too late (already running or
        answered: the handle gets its normal outcome) or the handle is already done. With
        several endpoints, the CANCEL may reach another daemon than the INFER did, which
        answers "too late".

        Raises:
            ValueError: ``handle`` belongs to another client.
            ShuttingDown, BadRequest, InternalError: the daemon refused the CANCEL itself.
            ClientTimeout: no answer within the timeout.
            ClientClosed, RuntimeError: the client is closed, or used from another thread.
        """
        self._check()
        if handle._client is not self:
            raise ValueError("the handle belongs to another client")
        if handle._call.outcome is not None:
            return False
        timeout = self._timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        call = self._calls.get(Kind.CANCEL_REPLY, handle.request_id)
        if call is None:
            call = self._start(CancelRequest(handle.request_id), Kind.CANCEL_REPLY, timeout)
        self._await(call)
        return _reply(call, CancelReply).status == Status.OK

    def status(self, *, timeout_s: float | None = None) -> DaemonStatus:
        """The STATUS report of one daemon (with several endpoints, the next one in turn;
        ``report["name"]`` says which): state, readiness, devices, models, queue depth.

        Raises:
            DladError: the daemon answered with a non-OK status (its class).
            ClientTimeout: no answer within the timeout.
            ClientClosed, RuntimeError: the client is closed, or used from another thread.
        """
        self._check()
        timeout = self._timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        call = self._start(StatusRequest(next(self._ids)), Kind.STATUS_REPLY, timeout)
        self._await(call)
        return _report(call)

    # -------------------------------------------------------------------------- internals

    def _check_thread(self) -> None:
        # A ZeroMQ socket must not be used from two threads at once; the cheapest reliable
        # guard is to refuse every thread but the creator's.
        if threading.get_ident() != self._owner:
            raise RuntimeError(
                "a Client is used only by the thread that created it; "
                "create one per thread, or use AsyncClient"
            )

    def _check(self) -> None:
        self._check_thread()
        if self._closed:
            raise ClientClosed("the client is closed")

    def _start(self, message: Request, kind: Kind, timeout: float) -> _Call:
        until = time.monotonic() + timeout
        if kind is Kind.INFER_REPLY and not self._pump(
            until, lambda: self._calls.pending(Kind.INFER_REPLY) < self._max_in_flight
        ):
            raise ClientTimeout(
                f"{self._max_in_flight} requests stayed in flight for {timeout:g} s; "
                f"request {message.id} was not sent",
                request_id=message.id,
            )
        frames = encode(message)
        while True:
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                # No connected daemon, or its send queue is full: wait for room, taking in
                # replies meanwhile (they may be what frees the daemon).
                remaining = until - time.monotonic()
                if remaining <= 0:
                    raise ClientTimeout(
                        f"no daemon took request {message.id} within {timeout:g} s "
                        f"(none connected at {list(self._endpoints)}, or all busy)",
                        request_id=message.id,
                    ) from None
                if self._socket.poll(_ms(remaining), zmq.POLLIN | zmq.POLLOUT) & zmq.POLLIN:
                    self._receive_ready()
        call = _Call(message.id, kind, until, timeout)
        self._calls.add(call)
        return call

    def _await(self, call: _Call) -> None:
        if not self._pump(call.deadline, lambda: call.outcome is not None):
            self._abandon(call, _timed_out(call))

    def _pump(self, until: float, done: Callable[[], bool]) -> bool:
        """Take in replies until ``done()`` or the monotonic time ``until``; returns ``done()``."""
        while True:
            self._receive_ready()
            self._expire()
            if done():
                return True
            remaining = until - time.monotonic()
            if remaining <= 0:
                return False
            self._socket.poll(_ms(remaining), zmq.POLLIN)

    def _receive_ready(self) -> None:
        # ZMQ_EVENTS says whether a whole message is waiting, so no recv here ever blocks and
        # no EAGAIN exception is raised per call.
        while self._socket.get(zmq.EVENTS) & zmq.POLLIN:
            self._calls.deliver(self._socket.recv_multipart(copy=False))

    def _expire(self) -> None:
        for call in self._calls.expired(time.monotonic()):
            self._abandon(call, _timed_out(call))

    def _abandon(self, call: _Call, error: Exception) -> None:
        """Fail ``call`` locally; an INFER also gets a CANCEL (unless one is already pending),
        sent only if the socket takes it at once: a CANCEL is an optimisation, never a wait."""
        if (
            self._calls.finish(call, error)
            and call.kind is Kind.INFER_REPLY
            and self._calls.get(Kind.CANCEL_REPLY, call.id) is None
        ):
            try:
                self._socket.send_multipart(encode(CancelRequest(call.id)), flags=zmq.NOBLOCK)
            except zmq.Again:
                _log.debug("CANCEL for request %d not sent: send queue full", call.id)
