"""The synchronous :class:`Client`: pipelined requests on one DEALER socket, for one thread.

Replies are taken in only while a call of the client's thread waits (``Handle.result``,
``detect``, ...), and each is kept on the call it answers (see :mod:`._core`).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, cast, final

import numpy as np
import numpy.typing as npt
import zmq

from dlad_client._core import (
    DEFAULT_HWM,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_TIMEOUT_S,
    INFERS,
    ClientClosed,
    ClientTimeout,
    CurveKeys,
    Result,
    ShmSlots,
    _batch_results,
    _Call,
    _Calls,
    _check_settings,
    _check_timeout,
    _class_names,
    _configure,
    _encode,
    _endpoints,
    _in_shm,
    _infer_batch_request,
    _infer_request,
    _log,
    _reply,
    _report,
    _result,
    _shm_slots,
    _timed_out,
)
from dlad_wire.errors import DladError, Status
from dlad_wire.protocol import (
    CancelReply,
    CancelRequest,
    DaemonStatus,
    InferBatchRequest,
    InferRequest,
    Kind,
    PixelFormat,
    Request,
    StatusRequest,
    YuvFormat,
    encode,
)

__all__ = ["BatchHandle", "Client", "Handle"]


def _ms(seconds: float) -> int:
    """A poll timeout in whole milliseconds, rounded up so that a wait never ends early."""
    return max(1, math.ceil(seconds * 1000))


# ------------------------------------------------------------------------------ Client


class _Pending:
    """What :class:`Handle` and :class:`BatchHandle` share: a call of one client (and so of
    that client's thread) and the way to wait for its outcome."""

    __slots__ = ("_call", "_client")

    def __init__(self, client: Client, call: _Call) -> None:
        self._client = client
        self._call = call

    def __repr__(self) -> str:
        state = "done" if self._call.outcome is not None else "pending"
        return f"<{type(self).__name__} request_id={self._call.id} {state}>"

    @property
    def request_id(self) -> int:
        """The request's id on the wire."""
        return self._call.id

    def done(self) -> bool:
        """Whether the outcome is known. Takes in the replies already waiting on the socket
        (never blocks). Raises RuntimeError from another thread than the client's."""
        if self._call.outcome is None and not self._client.closed:
            self._client._check_thread()
            self._client._pump(0.0, lambda: self._call.outcome is not None)
        return self._call.outcome is not None


@final
class Handle(_Pending):
    """A submitted INFER (from :meth:`Client.submit`): the way to its :class:`Result`.

    Belongs to its client and so to that client's thread.
    """

    __slots__ = ()

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the reply and return the detections.

        Waits until the request's own deadline (``timeout_s`` after it was submitted), or at most
        ``timeout`` seconds if given. Replies to other requests that arrive meanwhile are kept
        for their handles.

        Raises:
            DladError: the daemon answered with a non-OK status: its class in
                :mod:`dlad_wire.errors` (``Overloaded``, ``NotFound``, ...).
            ClientTimeout: the request's deadline passed (it is abandoned and a CANCEL sent),
                or ``timeout`` passed first (the request stays in flight: call again).
            ClientClosed: the client was closed before the reply came.
            ValueError: ``timeout`` is negative or not finite.
            RuntimeError: called from another thread than the client's.
        """
        _settle(self._client, self._call, timeout)
        return _result(self._call)


@final
class BatchHandle(_Pending):
    """A submitted INFER_BATCH (from :meth:`Client.submit_batch`): the way to its results.

    Belongs to its client and so to that client's thread.
    """

    __slots__ = ()

    def result(self, timeout: float | None = None) -> list[Result | DladError]:
        """Wait for the reply and return each image's outcome, in order: its :class:`Result`,
        or the error its status names (``Cancelled`` for a frame superseded by a newer one of
        its stream, ``Overloaded`` for one the full queues refused, ...): one image's failure
        is not the others'. Waits as :meth:`Handle.result` does.

        Raises:
            DladError: the daemon refused the whole batch (``Overloaded``: past the client's
                in-flight cap on the daemon, ``BadRequest``, ``ShuttingDown``).
            ClientTimeout, ClientClosed, ValueError, RuntimeError: as :meth:`Handle.result`.
        """
        _settle(self._client, self._call, timeout)
        return _batch_results(self._call)


def _settle(client: Client, call: _Call, timeout: float | None) -> None:
    """Wait for ``call``'s outcome (see :meth:`Handle.result`); abandon it at its deadline."""
    if call.outcome is not None:
        return
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


@final
class Client:
    """A synchronous dlad client: one DEALER socket connected to every endpoint.

    Several endpoints spread requests round-robin over the daemons that are connected (ZeroMQ's
    DEALER load balancing); each reply comes from the daemon that took the request. Requests can
    be pipelined: :meth:`submit` returns at once, and many requests may be in flight (at most
    ``max_in_flight`` INFERs; a further submit first waits, reading replies, for one to finish).

    **One thread.** A Client belongs to the thread that created it, like the ZeroMQ socket it
    owns; every method raises RuntimeError from another thread. Use one Client per thread, or
    :class:`~dlad_client.AsyncClient` for many concurrent calls on one socket.

    **Images cross without copies**: a C-contiguous uint8 array is handed to ZeroMQ as it is, so
    do not write into it until its request is answered; a non-contiguous one is copied once.

    ``timeout_s`` bounds every call (waiting for a slot, sending, and the reply) unless the call
    passes its own. ``context``: a ``zmq.Context`` to create the socket in (the client closes
    its socket, never a context it was given); by default the client creates its own context
    and terminates it on :meth:`close`. ``linger`` is the socket's ``ZMQ_LINGER`` (ms).
    ``curve``: the keys for a daemon with ``[auth] mode = "curve"``
    (``CurveKeys.from_files(server_key, client_secret_key)``); a daemon that does not allow the
    key never answers (ZeroMQ refuses the handshake), so calls end in ClientTimeout.

    **Shared-memory frames** (``shm_slot_bytes``; docs/protocol.md): for a daemon on this host
    (``ipc://`` or loopback tcp endpoints only), frames go through ``shm_slots`` (default
    ``max_in_flight``) slots of a shared-memory segment the client owns, and the message carries
    only a small header: the frame never crosses the kernel. :meth:`frame` gives a slot to
    render into (no copy at all); any other image is copied into a free slot once. A frame too
    big for a slot, or sent while every slot is the daemon's, goes in the message as usual.

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
        curve: CurveKeys | None = None,
        shm_slot_bytes: int | None = None,
        shm_slots: int | None = None,
    ) -> None:
        self._endpoints = _endpoints(endpoints)
        _check_settings(timeout_s, max_in_flight, sndhwm, rcvhwm, linger)
        self._shm = _shm_slots(self._endpoints, shm_slot_bytes, shm_slots, max_in_flight)
        self._timeout_s = float(timeout_s)
        self._max_in_flight = max_in_flight
        self._linger = linger
        self._owner = threading.get_ident()
        self._owns_context = context is None
        self._context: zmq.Context[Any] = zmq.Context() if context is None else context
        self._socket: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        try:
            _configure(self._socket, self._endpoints, sndhwm, rcvhwm, linger, curve=curve)
        except BaseException:
            self._socket.close(linger=0)
            if self._owns_context:
                self._context.term()
            if self._shm is not None:
                self._shm.close()
            raise
        self._calls: _Calls[_Call] = _Calls(None if self._shm is None else self._shm.answered)
        self._ids = itertools.count(1)
        self._names: dict[str, tuple[str, ...]] = {}  # class names by model, from STATUS
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
        if self._shm is not None:
            self._shm.close()

    @property
    def shm(self) -> ShmSlots | None:
        """The shared-memory slots (None without ``shm_slot_bytes``)."""
        return self._shm

    def frame(self, shape: tuple[int, ...]) -> npt.NDArray[np.uint8] | None:
        """A writable ``shape`` uint8 array in a free shared-memory slot, to render a frame
        into and pass to :meth:`submit` or :meth:`detect` (it then crosses without any copy);
        None when the client has no shared memory, no slot is free or ``shape`` does not fit.
        Do not write to it after submitting it until its request is answered."""
        self._check()
        return None if self._shm is None else self._shm.frame(shape)

    def detect(
        self,
        image: npt.NDArray[np.uint8],
        *,
        model: str = "demo",
        pixel_format: PixelFormat | YuvFormat | None = None,
        stream: str | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        conf: float | None = None,
        iou: float | None = None,
        max_det: int | None = None,
        timeout_s: float | None = None,
    ) -> Result:
        """Run ``model`` on ``image`` and wait for the detections (``submit(...).result()``).

        ``image`` is ``H x W x 3`` (``pixel_format`` ``"RGB"``, the default, or ``"BGR"``),
        ``H x W`` / ``H x W x 1`` (``"GRAY"``, inferred), ``3H/2 x W`` (``"NV12"``) or ``H x W
        x 2`` (``"YUYV"``) uint8, a YUV frame BT.601 limited range unless ``pixel_format`` is a
        :class:`YuvFormat` naming its colour (the daemon converts it on the GPU, or the CPU,
        with the letterbox). ``stream``, ``priority``
        (0-7), ``deadline_ms`` (the daemon's dispatch budget), ``conf``, ``iou`` and
        ``max_det`` are INFER's fields of ``docs/protocol.md``; ``None`` means the daemon's
        default. ``timeout_s`` overrides the client's for this call; keep it above
        ``deadline_ms``, or the client gives up before the daemon has answered.

        Raises:
            TypeError, ValueError: ``image`` is not a uint8 array of a supported shape, or does
                not fit ``pixel_format``; nothing is sent.
            BadRequest: another field is out of range (raised before sending, as the daemon's
                own ``ProtocolError``), or the daemon refused the request.
            NotFound, Overloaded, DeadlineExceeded, Cancelled, ShuttingDown, DeviceFailed,
                InternalError: the daemon's answer (see :mod:`dlad_wire.errors`).
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
        pixel_format: PixelFormat | YuvFormat | None = None,
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
        return Handle(self, self._send_infer(request, Kind.INFER_REPLY, 1, timeout))

    def detect_batch(
        self,
        images: Sequence[npt.NDArray[np.uint8]],
        *,
        model: str = "demo",
        pixel_format: PixelFormat | YuvFormat | None = None,
        streams: Sequence[str | None] | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        conf: float | None = None,
        iou: float | None = None,
        max_det: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Result | DladError]:
        """Run ``model`` on several frames in one message and wait for them all
        (``submit_batch(...).result()``): e.g. the frames of a camera rig taken at one instant.

        Each image is an INFER of its own on the daemon (any engine may run it) and counts
        against ``max_in_flight``; ``streams`` names each image's stream (or None). The other
        arguments are :meth:`detect`'s, for every image. Returns each image's Result or error,
        in order (:meth:`BatchHandle.result`).

        Raises:
            TypeError, ValueError: not a sequence of 1 to ``min(16, max_in_flight)`` valid
                images, or ``streams`` of another length; nothing is sent.
            BadRequest, Overloaded, ShuttingDown: the daemon refused the whole batch.
            ClientTimeout, ClientClosed, RuntimeError: as :meth:`detect`.
        """
        return self.submit_batch(
            images, model=model, pixel_format=pixel_format, streams=streams, priority=priority,
            deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det, timeout_s=timeout_s,
        ).result()  # fmt: skip

    def submit_batch(
        self,
        images: Sequence[npt.NDArray[np.uint8]],
        *,
        model: str = "demo",
        pixel_format: PixelFormat | YuvFormat | None = None,
        streams: Sequence[str | None] | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        conf: float | None = None,
        iou: float | None = None,
        max_det: int | None = None,
        timeout_s: float | None = None,
    ) -> BatchHandle:
        """Send an INFER_BATCH without waiting for its reply; :meth:`BatchHandle.result` waits
        for it. The arguments are :meth:`detect_batch`'s; it first waits for room for all its
        images in flight. Raises as :meth:`submit` does."""
        self._check()
        timeout = self._timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        request = _infer_batch_request(
            next(self._ids), images, model=model, pixel_format=pixel_format, streams=streams,
            priority=priority, deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det,
            max_in_flight=self._max_in_flight,
        )  # fmt: skip
        n = len(request.images)
        return BatchHandle(self, self._send_infer(request, Kind.INFER_BATCH_REPLY, n, timeout))

    def _send_infer(self, request: Request, kind: Kind, images: int, timeout: float) -> _Call:
        if self._shm is None:
            return self._start(request, kind, timeout, images)
        # First wait for room in flight (replies free slots), then take slots.
        self._wait_room(request.id, timeout, images)
        request = _in_shm(self._shm, request)
        try:
            return self._start(request, kind, timeout, images)
        except BaseException:
            self._shm.unplace(request.id)  # never sent: its slots are free again
            raise

    def cancel(self, handle: Handle, *, timeout_s: float | None = None) -> bool:
        """Ask the daemon to drop a queued INFER, and wait for its answer.

        Returns True if the daemon removed it (its handle then raises
        :class:`~dlad_wire.errors.Cancelled`), False if it was too late (already running or
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

    def status(self, *, load: bool = False, timeout_s: float | None = None) -> DaemonStatus:
        """The STATUS report of one daemon (with several endpoints, the next one in turn;
        ``report["name"]`` says which): state, readiness, devices, models, queue depth; with
        ``load``, its recent load too (``report["load"]``: rates, p50/p99, busy ratios).

        Raises:
            DladError: the daemon answered with a non-OK status (its class).
            ClientTimeout: no answer within the timeout.
            ClientClosed, RuntimeError: the client is closed, or used from another thread.
        """
        self._check()
        timeout = self._timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        request = StatusRequest(next(self._ids), load=load)
        call = self._start(request, Kind.STATUS_REPLY, timeout)
        self._await(call)
        return _report(call, self._names)

    def class_names(self, model: str, *, timeout_s: float | None = None) -> tuple[str, ...]:
        """``model``'s class names (``[i]`` names class ``i``), from a STATUS the first time
        (then remembered; every later result of the model carries them, ``Result.labels``).

        Raises:
            NotFound: the daemon does not serve ``model``.
            InternalError: the daemon does not report class names (older than model families).
            DladError, ClientTimeout, ClientClosed, RuntimeError: as :meth:`status`.
        """
        if model not in self._names:
            return _class_names(self.status(timeout_s=timeout_s), model)
        return self._names[model]

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

    def _wait_room(self, request_id: int, timeout_s: float, images: int = 1) -> None:
        """Read replies until ``images`` more images keep ``max_in_flight`` in flight."""
        if not self._pump(
            time.monotonic() + timeout_s,
            lambda: self._calls.has_room(images, self._max_in_flight),
        ):
            raise ClientTimeout(
                f"{self._max_in_flight} requests stayed in flight for {timeout_s:g} s; "
                f"request {request_id} was not sent",
                request_id=request_id,
            )

    def _start(self, message: Request, kind: Kind, timeout_s: float, images: int = 1) -> _Call:
        until = time.monotonic() + timeout_s
        if kind in INFERS:
            self._wait_room(message.id, timeout_s, images)
        frames = _encode(message)
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
                        f"no daemon took request {message.id} within {timeout_s:g} s "
                        f"(none connected at {list(self._endpoints)}, or all busy)",
                        request_id=message.id,
                    ) from None
                if self._socket.poll(_ms(remaining), zmq.POLLIN | zmq.POLLOUT) & zmq.POLLIN:
                    self._receive_ready()
        call = _Call(message.id, kind, until, timeout_s, images=images)
        if isinstance(message, (InferRequest, InferBatchRequest)):
            call.names = self._names.get(message.model, ())
        self._calls.add(call)
        return call

    def _await(self, call: _Call) -> None:
        if not self._pump(call.deadline, lambda: call.outcome is not None):
            self._abandon(call, _timed_out(call))

    def _pump(self, until: float, done: Callable[[], bool]) -> bool:
        """Take in replies until ``done()`` or the monotonic time ``until``; returns ``done()``.

        Also wakes at the deadlines of other calls, so that one nobody waits for (a dropped
        handle) still gives its slot back and gets its CANCEL in time.
        """
        while True:
            self._receive_ready()
            self._expire()
            if done():
                return True
            now = time.monotonic()
            if until <= now:
                return False
            wake = min(until, self._calls.next_deadline())
            self._socket.poll(_ms(wake - now), zmq.POLLIN)

    def _receive_ready(self) -> None:
        # ZMQ_EVENTS says whether a whole message is waiting, so no recv here ever blocks and
        # no EAGAIN exception is raised per call.
        while cast("int", self._socket.get(zmq.EVENTS)) & zmq.POLLIN:
            self._calls.deliver(self._socket.recv_multipart(copy=False))

    def _expire(self) -> None:
        for call in self._calls.expired(time.monotonic()):
            self._abandon(call, _timed_out(call))

    def _abandon(self, call: _Call, error: Exception) -> None:
        """Fail ``call`` locally; an INFER also gets a CANCEL (unless one is already pending),
        sent only if the socket takes it at once: a CANCEL is an optimisation, never a wait."""
        if (
            self._calls.finish(call, error)
            and call.kind in INFERS
            and self._calls.get(Kind.CANCEL_REPLY, call.id) is None
        ):
            try:
                self._socket.send_multipart(encode(CancelRequest(call.id)), flags=zmq.NOBLOCK)
            except zmq.Again:
                _log.debug("CANCEL for request %d not sent: send queue full", call.id)
