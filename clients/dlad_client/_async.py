"""The asynchronous :class:`AsyncClient`: many concurrent calls multiplexed over one socket.

One background task, owned by the client's own task group, receives every reply and settles the
call it answers (an ``anyio.Event`` per call); callers only send and wait. The client runs on
anyio's asyncio backend (its socket is a ``zmq.asyncio`` socket); trio is not supported.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, final

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

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
    _shm_plan,
    _timed_out,
)
from dlad_wire.errors import Cancelled, DladError, Status
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

__all__ = ["AsyncClient", "AsyncHandle"]


@dataclass(eq=False, slots=True)
class _AsyncCall(_Call):
    event: anyio.Event = field(default_factory=anyio.Event)
    release: Callable[[], None] | None = None  # gives back the INFER's in-flight slot

    def settled(self) -> None:
        self.event.set()
        if self.release is not None:
            self.release()


@final
class AsyncHandle:
    """A submitted INFER (from :meth:`AsyncClient.submit`): the way to its :class:`Result`."""

    __slots__ = ("_call", "_client")

    def __init__(self, client: AsyncClient, call: _AsyncCall) -> None:
        self._client = client
        self._call = call

    def __repr__(self) -> str:
        state = "done" if self._call.outcome is not None else "pending"
        return f"<AsyncHandle request_id={self._call.id} {state}>"

    @property
    def request_id(self) -> int:
        """The request's id on the wire."""
        return self._call.id

    def done(self) -> bool:
        """Whether the outcome is known (never waits)."""
        return self._call.outcome is not None

    async def result(self) -> Result:
        """Wait for the reply (at most until the request's deadline) and return the detections.

        Cancelling the waiting task (an anyio cancel scope) stops the wait only: the request
        stays in flight (use :meth:`AsyncClient.cancel`, or :meth:`AsyncClient.detect`, whose
        cancellation withdraws the request).

        Raises:
            DladError: the daemon answered with a non-OK status (its class in
                :mod:`dlad_wire.errors`).
            ClientTimeout: the request's deadline passed (it is abandoned and a CANCEL sent).
            ClientClosed: the client was closed before the reply came.
        """
        await self._client._wait(self._call, withdraw_on_cancel=False)
        return _result(self._call)


@final
class AsyncClient:
    """An asynchronous dlad client for anyio on asyncio: ``async with AsyncClient(...) as c``.

    Any number of tasks may ``await c.detect(...)`` at once on one DEALER socket (at most
    ``max_in_flight`` INFERs in flight; more wait for a slot, within their timeout). A
    background task owned by the client's task group receives the replies; it starts when the
    ``async with`` block is entered and stops, with the socket closed, when it is left. Calls
    must come from tasks of the same event loop; trio is not supported.

    Timeouts: every call ends by ``timeout_s`` (the client's, or the call's own) with
    :class:`ClientTimeout`, and an abandoned INFER gets a CANCEL. Cancelling a task awaiting
    :meth:`detect` (any anyio cancel scope, e.g. ``anyio.fail_after``) also withdraws its
    request with a CANCEL and leaves every other call undisturbed.

    The settings are :class:`~dlad_client.Client`'s; ``context`` is a
    ``zmq.asyncio.Context`` (by default the client creates one and terminates it on exit).
    Images cross without copies, so do not write into one until its request is answered.

    Raises ValueError on a bad setting; entering raises ValueError for an endpoint ZeroMQ
    cannot connect to, and RuntimeError outside asyncio or when entered twice.
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
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = None,
        shm_slot_bytes: int | None = None,
        shm_slots: int | None = None,
    ) -> None:
        self._endpoints = _endpoints(endpoints)
        _check_settings(timeout_s, max_in_flight, sndhwm, rcvhwm, linger)
        # Checked now, created on entry (a client never entered leaves no segment behind).
        self._shm_plan = _shm_plan(self._endpoints, shm_slot_bytes, shm_slots, max_in_flight)
        self._shm: ShmSlots | None = None
        self._timeout_s = float(timeout_s)
        self._max_in_flight = max_in_flight
        self._hwm = (sndhwm, rcvhwm)
        self._linger = linger
        self._given_context = context
        self._curve = curve
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._slots: anyio.Semaphore | None = None  # made on entry, inside the event loop
        self._batch_turn: anyio.Lock | None = None  # one batch at a time takes several slots
        self._calls: _Calls[_AsyncCall] = _Calls(self._shm_answered)
        self._ids = itertools.count(1)
        self._names: dict[str, tuple[str, ...]] = {}  # class names by model, from STATUS
        self._state: Literal["new", "open", "closed"] = "new"
        self._receive_scope: anyio.CancelScope | None = None

    def __repr__(self) -> str:
        state = f"{len(self._calls)} in flight" if self._state == "open" else self._state
        return f"<AsyncClient {list(self._endpoints)} {state}>"

    async def __aenter__(self) -> AsyncClient:
        if self._state != "new":
            raise RuntimeError("an AsyncClient can be entered once")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("AsyncClient runs on asyncio only; trio is not supported") from None
        if self._shm_plan is not None:
            self._shm = ShmSlots(*self._shm_plan)  # OSError: /dev/shm refused it
        context = zmq.asyncio.Context() if self._given_context is None else self._given_context
        socket = context.socket(zmq.DEALER)
        task_group = anyio.create_task_group()
        self._slots = anyio.Semaphore(self._max_in_flight)
        self._batch_turn = anyio.Lock()
        try:
            _configure(socket, self._endpoints, *self._hwm, self._linger, curve=self._curve)
            self._context, self._socket = context, socket
            await task_group.__aenter__()
        except BaseException:
            self._close_socket(context, socket)
            raise
        try:
            await task_group.start(self._receive, socket)
        except BaseException:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
            self._close_socket(context, socket)
            raise
        self._task_group = task_group
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != "open" or self._task_group is None:
            return
        self._state = "closed"
        self._calls.fail_all(lambda c: ClientClosed(f"client closed before request {c.id}'s reply"))
        task_group, self._task_group = self._task_group, None
        task_group.cancel_scope.cancel()
        try:
            # The block's own exception, if any, propagates after this returns: handing it to
            # the task group would wrap it in an ExceptionGroup. An error of the receive task
            # (a bug) does propagate from here.
            await task_group.__aexit__(None, None, None)
        finally:
            if self._context is not None and self._socket is not None:
                self._close_socket(self._context, self._socket)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints the socket is connected to."""
        return self._endpoints

    @property
    def closed(self) -> bool:
        """Whether the ``async with`` block has been left."""
        return self._state == "closed"

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._calls)

    async def detect(
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
        """Run ``model`` on ``image`` and wait for the detections.

        The arguments are :meth:`Client.detect <dlad_client.Client.detect>`'s.
        Cancelling the calling task withdraws the request (a CANCEL is sent) and re-raises the
        cancellation.

        Raises:
            TypeError, ValueError: ``image`` is not a uint8 array of a supported shape, or does
                not fit ``pixel_format``; nothing is sent.
            BadRequest: another field is out of range (before sending), or the daemon refused.
            NotFound, Overloaded, DeadlineExceeded, Cancelled, ShuttingDown, DeviceFailed,
                InternalError: the daemon's answer (see :mod:`dlad_wire.errors`).
            ClientTimeout: no reply within the timeout (a CANCEL was sent).
            ClientClosed, RuntimeError: the client is closed, or not entered.
        """
        call = await self._submit(
            image, model=model, pixel_format=pixel_format, stream=stream, priority=priority,
            deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det, timeout_s=timeout_s,
        )  # fmt: skip
        await self._wait(call, withdraw_on_cancel=True)
        return _result(call)

    async def submit(
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
    ) -> AsyncHandle:
        """Send an INFER and return once it is sent; :meth:`AsyncHandle.result` waits for it.

        The arguments are :meth:`detect`'s; the request's timeout starts now.

        Raises:
            TypeError, ValueError, BadRequest: invalid input, as in :meth:`detect`.
            ClientTimeout: no in-flight slot or no daemon took it within the timeout.
            ClientClosed, RuntimeError: the client is closed, or not entered.
        """
        call = await self._submit(
            image, model=model, pixel_format=pixel_format, stream=stream, priority=priority,
            deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det, timeout_s=timeout_s,
        )  # fmt: skip
        return AsyncHandle(self, call)

    async def detect_batch(
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
        """Run ``model`` on several frames in one message and wait for them all:
        :meth:`Client.detect_batch <dlad_client.Client.detect_batch>`, each image's Result or
        error in order. It first waits for room for all its images in flight. Cancelling the
        calling task withdraws the batch (a CANCEL is sent) and re-raises the cancellation.

        Raises:
            TypeError, ValueError: not 1 to ``min(16, max_in_flight)`` valid images, or
                ``streams`` of another length; nothing is sent.
            BadRequest, Overloaded, ShuttingDown: the daemon refused the whole batch.
            ClientTimeout, ClientClosed, RuntimeError: as :meth:`detect`.
        """
        self._check()
        timeout = self._timeout(timeout_s)
        request = _infer_batch_request(
            next(self._ids), images, model=model, pixel_format=pixel_format, streams=streams,
            priority=priority, deadline_ms=deadline_ms, conf=conf, iou=iou, max_det=max_det,
            max_in_flight=self._max_in_flight,
        )  # fmt: skip
        call = await self._start(request, Kind.INFER_BATCH_REPLY, timeout, len(request.images))
        await self._wait(call, withdraw_on_cancel=True)
        return _batch_results(call)

    async def cancel(self, handle: AsyncHandle, *, timeout_s: float | None = None) -> bool:
        """Ask the daemon to drop a queued INFER, and wait for its answer.

        Returns True if the daemon removed it (its handle then raises
        :class:`~dlad_wire.errors.Cancelled`), False if it was too late or the handle is already
        done. With several endpoints the CANCEL may reach another daemon, which says "too late".

        Raises:
            ValueError: ``handle`` belongs to another client.
            ShuttingDown, BadRequest, InternalError: the daemon refused the CANCEL itself.
            ClientTimeout: no answer within the timeout.
            ClientClosed, RuntimeError: the client is closed, or not entered.
        """
        self._check()
        if handle._client is not self:
            raise ValueError("the handle belongs to another client")
        if handle.done():
            return False
        timeout = self._timeout(timeout_s)
        call = self._calls.get(Kind.CANCEL_REPLY, handle.request_id)
        if call is None:  # a second concurrent cancel() shares the first one's CANCEL
            call = await self._start(CancelRequest(handle.request_id), Kind.CANCEL_REPLY, timeout)
        await self._wait(call, withdraw_on_cancel=False)
        return _reply(call, CancelReply).status == Status.OK

    async def status(self, *, load: bool = False, timeout_s: float | None = None) -> DaemonStatus:
        """The STATUS report of one daemon (the next one in turn with several endpoints); with
        ``load``, its recent load too (``report["load"]``).

        Raises:
            DladError: the daemon answered with a non-OK status (its class).
            ClientTimeout: no answer within the timeout.
            ClientClosed, RuntimeError: the client is closed, or not entered.
        """
        self._check()
        timeout = self._timeout(timeout_s)
        request = StatusRequest(next(self._ids), load=load)
        call = await self._start(request, Kind.STATUS_REPLY, timeout)
        await self._wait(call, withdraw_on_cancel=False)
        return _report(call, self._names)

    async def class_names(self, model: str, *, timeout_s: float | None = None) -> tuple[str, ...]:
        """``model``'s class names (``[i]`` names class ``i``), from a STATUS the first time
        (then remembered; every later result of the model carries them, ``Result.labels``).

        Raises:
            NotFound: the daemon does not serve ``model``.
            InternalError: the daemon does not report class names (older than model families).
            DladError, ClientTimeout, ClientClosed, RuntimeError: as :meth:`status`.
        """
        if model not in self._names:
            return _class_names(await self.status(timeout_s=timeout_s), model)
        return self._names[model]

    # -------------------------------------------------------------------------- internals

    def _check(self) -> None:
        if self._state == "new":
            raise RuntimeError("enter the client first: async with AsyncClient(...) as client")
        if self._state == "closed":
            raise ClientClosed("the client is closed")

    def _timeout(self, timeout_s: float | None) -> float:
        return self._timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")

    async def _submit(
        self, image: npt.NDArray[np.uint8], *, timeout_s: float | None, **fields: Any
    ) -> _AsyncCall:
        self._check()
        timeout = self._timeout(timeout_s)
        request = _infer_request(next(self._ids), image, **fields)
        return await self._start(request, Kind.INFER_REPLY, timeout)

    @property
    def shm(self) -> ShmSlots | None:
        """The shared-memory slots (None without ``shm_slot_bytes``)."""
        return self._shm

    def frame(self, shape: tuple[int, ...]) -> npt.NDArray[np.uint8] | None:
        """:meth:`Client.frame <dlad_client.Client.frame>`: a shared-memory slot to render
        into, or None."""
        self._check()
        return None if self._shm is None else self._shm.frame(shape)

    async def _start(
        self, message: Request, kind: Kind, timeout_s: float, images: int = 1
    ) -> _AsyncCall:
        until = anyio.current_time() + timeout_s
        release = None
        if kind in INFERS and self._slots is not None:
            release = await self._take_slots(message.id, images, until, timeout_s)
            if self._state != "open":  # closed while this task waited for the slot
                release()
                self._check()
        if self._shm is not None:
            message = _in_shm(self._shm, message)  # a slot is free once in-flight room is
        call = _AsyncCall(message.id, kind, until, timeout_s, release=release, images=images)
        if isinstance(message, (InferRequest, InferBatchRequest)):
            call.names = self._names.get(message.model, ())
        # Registered before sending: the reply may be taken in before the send returns.
        self._calls.add(call)
        if self._receive_scope is not None and until < self._receive_scope.deadline:
            self._receive_scope.deadline = until
        sent = False
        try:
            with anyio.CancelScope(deadline=until):
                if self._socket is None:  # unreachable once open; narrows the type
                    raise ClientClosed("the client is closed")
                await self._socket.send_multipart(_encode(message), copy=False)
                sent = True
        except BaseException:
            self._unplace(message)
            self._abandon(call, Cancelled(f"request {call.id} withdrawn", request_id=call.id))
            raise
        if not sent:
            self._unplace(message)
            error = ClientTimeout(
                f"no daemon took request {message.id} within {timeout_s:g} s "
                f"(none connected at {list(self._endpoints)}, or all busy)",
                request_id=message.id,
            )
            self._abandon(call, error)
            raise error
        return call

    async def _take_slots(
        self, request_id: int, images: int, until: float, timeout_s: float
    ) -> Callable[[], None]:
        """Take ``images`` of the ``max_in_flight`` slots (a batch takes its turn, so that two
        batches never each hold part of what both need); returns what gives them back."""
        slots, turn = self._slots, self._batch_turn
        assert slots is not None
        assert turn is not None
        taken = 0

        def release() -> None:
            for _ in range(taken):
                slots.release()

        try:
            with anyio.CancelScope(deadline=until) as scope:
                if images == 1:
                    await slots.acquire()
                    taken = 1
                else:
                    async with turn:
                        while taken < images:
                            await slots.acquire()
                            taken += 1
        except BaseException:  # the calling task cancelled: what it took goes back
            release()
            raise
        if scope.cancelled_caught:
            release()
            raise ClientTimeout(
                f"{self._max_in_flight} requests stayed in flight for {timeout_s:g} s; "
                f"request {request_id} was not sent",
                request_id=request_id,
            )
        return release

    def _shm_answered(self, request_id: int) -> None:
        if self._shm is not None:
            self._shm.answered(request_id)

    def _unplace(self, message: Request) -> None:
        """A message not sent frees its shared-memory slot (were it sent after all, its late
        reply finds the slot free already, and the frame it read is nobody's)."""
        if self._shm is not None:
            self._shm.unplace(message.id)

    async def _wait(self, call: _AsyncCall, *, withdraw_on_cancel: bool) -> None:
        if call.outcome is None:
            self._check()
        try:
            with anyio.CancelScope(deadline=call.deadline):
                await call.event.wait()
        except anyio.get_cancelled_exc_class():
            if withdraw_on_cancel:
                self._abandon(call, Cancelled(f"request {call.id} withdrawn", request_id=call.id))
            raise
        if call.outcome is None:
            self._abandon(call, _timed_out(call))

    def _abandon(self, call: _AsyncCall, error: Exception) -> None:
        """Fail ``call`` locally; an INFER also gets a CANCEL unless one is pending already.

        The CANCEL is sent by a task of the client's group, so that this works from a task
        that is being cancelled, and never waits longer than the client's timeout.
        """
        if (
            self._calls.finish(call, error)
            and call.kind in INFERS
            and self._calls.get(Kind.CANCEL_REPLY, call.id) is None
            and self._state == "open"
            and self._task_group is not None
        ):
            self._task_group.start_soon(self._send_cancel, call.id)

    async def _send_cancel(self, request_id: int) -> None:
        # Best effort: a CANCEL saves the daemon work, and failing to send one loses nothing
        # else, so it never takes the client's task group down.
        with anyio.move_on_after(self._timeout_s) as scope:
            try:
                if self._socket is not None:
                    await self._socket.send_multipart(encode(CancelRequest(request_id)))
            except zmq.ZMQError as exc:
                _log.debug("CANCEL for request %d not sent: %s", request_id, exc)
        if scope.cancelled_caught:
            _log.debug("CANCEL for request %d not sent: send queue full", request_id)

    async def _receive(
        self,
        socket: zmq.asyncio.Socket,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        while True:
            # The receive also wakes at the earliest deadline in flight, so that calls nobody
            # awaits (dropped handles) expire on time and give their slots back. anyio does not
            # cancel a task whose awaited future is already done, so no message is lost here.
            frames = None
            with anyio.CancelScope(deadline=self._calls.next_deadline()) as scope:
                self._receive_scope = scope
                frames = await socket.recv_multipart(copy=False)
            self._receive_scope = None
            if frames is not None:
                self._calls.deliver(frames)
            for call in self._calls.expired(anyio.current_time()):
                self._abandon(call, _timed_out(call))

    def _close_socket(self, context: zmq.asyncio.Context, socket: zmq.asyncio.Socket) -> None:
        socket.close(linger=self._linger)
        if self._given_context is None:
            context.term()
        if self._shm is not None:
            self._shm.close()
