"""The frontend: the daemon's control plane for what clients send.

It owns the ROUTER socket (binding, CURVE, the connection cap, heartbeats), and hands it to the
native data plane (:mod:`dlad.native_plane`) with :meth:`Frontend.start_plane`: the plane's
C++ thread reads every INFER off the socket, admits, schedules, runs and answers it without the
interpreter. What the plane's reader leaves it forwards here, the same messages in the same
shape: STATUS, CANCEL, INFER_BATCH, malformed messages, and an INFER whose shared-memory
segment is not yet mapped. This frontend decodes them (a malformed one costs its sender one
typed reply and the daemon nothing), answers through the plane, and puts an INFER's and an
INFER_BATCH's images back into the plane once decoded (a batch's answers return as outcomes,
gathered here into its one reply). Once the plane has drained, the socket is this frontend's
again, for the linger and the last messages (each INFER answered SHUTTING_DOWN).

The forwarding socket is a plain (synchronous) pyzmq socket driven from the event loop: the
loop watches its file descriptor, and the receive loop then reads every waiting message
without blocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgpack
import numpy as np
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from dlad import protocol
from dlad.auth import ZAP_DOMAIN, ClientKeys, Gate, configure_server, read_server_keys, start_gate
from dlad.config import Config
from dlad.devices.dram import SharedDram
from dlad.errors import (
    BadRequest,
    DladError,
    InternalError,
    NotFound,
    ShuttingDown,
    StartupError,
    Status,
    error_for,
)
from dlad.metrics import Metrics
from dlad.native_plane import (
    CancelResult,
    CudaFunctions,
    CudlaFunctions,
    DeviceState,
    Frame,
    Health,
    Item,
    ModelSettings,
    NativePlane,
    PlaneDevice,
    PlaneUnavailable,
)
from dlad.shm import SharedFrames

__all__ = ["Counters", "Frontend"]

_NO_DETECTIONS = np.zeros((0, 6), np.float32)
_NO_DETECTIONS.flags.writeable = False

log = structlog.get_logger("dlad")


@dataclass
class Counters:
    received: int = 0
    replied: int = 0  # replies sent or dropped
    by_status: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # replies ZeroMQ could not queue (the client's queue full, or it gone)


@dataclass(slots=True, eq=False)
class _Batch:
    """An INFER_BATCH being answered: a result per image, sent in one reply once all are in."""

    client: bytes
    request_id: int
    results: list[protocol.BatchResult | None]
    waiting: int  # images not answered yet
    tag: int = -1  # the native plane's tag for its images' outcomes (-1: none)
    conn: bytes = b""  # the connection it came on (its reply is for that connection only)


@dataclass(slots=True, eq=False)
class _Local:
    """An image another front door of the daemon's (the KServe ports) submitted: its answer
    resolves ``answer``; one that is no longer awaited is dropped when it comes."""

    request_id: int
    answer: asyncio.Future[protocol.BatchResult]


_LOCAL_CLIENT: Final = b"\x00local"
"""The plane's client id for what :meth:`Frontend.infer_local` submits (no ROUTER routing id is
empty-led: ZeroMQ's own ids start with a zero byte and are 5 bytes long, a peer's set id cannot
start with one)."""


# The hot path's flags as plain ints: pyzmq's are enum flags, and combining those per call
# builds enum members.
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_MORE: Final = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_STATUS_NAMES: Final = {s: s.name for s in Status}  # an enum's ``name`` is a Python property
_STATUSES: Final = {int(s): s for s in Status}
_CONNECTION: contextvars.ContextVar[bytes] = contextvars.ContextVar("connection", default=b"")
"""The connection (NativePlane.send's ``conn``) of the forwarded message being handled."""


def _not_on_gpu(address: int) -> int:
    """Frontend.shm_device without a GPU: no segment is registered there."""
    return 0


def _waiting(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (reading ``ZMQ_EVENTS`` also re-arms its fd)."""
    return bool(cast("int", sock.getsockopt(_EVENTS)) & _POLLIN)


def _receive(sock: zmq.Socket[bytes]) -> list[zmq.Frame]:
    """One whole message's parts (zero-copy frames), without blocking: zmq.Again when none
    waits. Each part's ``more`` says whether another follows; pyzmq's ``recv_multipart``
    reads ``ZMQ_RCVMORE`` instead, an option lookup a part."""
    part = sock.recv(_NOBLOCK, copy=False)
    parts = [part]
    while part.more:  # the rest of a message has arrived with its first part
        part = sock.recv(_NOBLOCK, copy=False)
        parts.append(part)
    return parts


class Frontend:
    """Sockets and replies for one daemon (see the module docstring).

    Args:
        config: the daemon's config (frontend limits, deadlines, model defaults).
        metrics: replies are counted there.
        status: builds the STATUS report (``load``: include recent load).
        accepting: whether INFERs are still accepted (False once draining starts).
    """

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        *,
        status: Callable[[bool], dict[str, Any]],
        accepting: Callable[[], bool],
        curve: tuple[Path, Path] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._status = status
        self._accepting = accepting
        self.counters = Counters()
        f = config.frontend
        self.limits = protocol.Limits(
            max_message_bytes=f.max_message_bytes,
            max_width=f.max_image_width,
            max_height=f.max_image_height,
            max_image_pixels=f.max_image_width * f.max_image_height,
        )
        self.bound: list[str] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._readable = asyncio.Event()  # the socket's fd fired, or a send may have hidden input
        self._asleep = False  # the receive loop waits on _readable
        self._batches: dict[tuple[bytes, int], _Batch] = {}  # (client, request id) -> batch
        self._models = {m.name: m for m in config.models}
        self._curve = curve  # (server secret key file, client keys directory), or None
        self._drop_logged = -1.0
        self._gate: Gate | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._refusal_logged = -1.0
        self.connections = 0  # open connections, as the socket's monitor counts them
        self._accepted: dict[int, float] = {}  # their file descriptors -> when accepted
        self.client_keys: ClientKeys | None = None
        self.shm = SharedFrames(config.shm) if config.shm.enabled else None
        self.plane: NativePlane | None = None  # from start_plane() to close_plane()
        self._plane_done = anyio.Event()  # the plane has drained: the socket is ours again
        self._inbox: zmq.Socket[bytes] | None = None  # what the receive loop reads now
        self._tags: dict[int, _Batch | _Local] = {}  # the plane's outcome tag -> its request
        self._registered: set[tuple[str, str]] = set()  # segments the plane takes frames of
        self._plane_counters: dict[str, Any] | None = None  # the plane's, once it has closed
        self.plane_state: list[DeviceState] = []  # each engine's, once the plane has closed
        self._plane_seen: dict[str, Any] = {}  # its counters at the last observe_plane()
        self._plane_pixels = False  # an engine reads pixels: submitted images carry them
        self.on_plane_health: Callable[[], None] = lambda: None
        """Called on the loop when the plane has news of its health keeping
        (NativePlane.events): the daemon's log and metrics take it."""
        self.shm_device: Callable[[int], int] = _not_on_gpu
        """The GPU address of a segment mapped at a host address (0: not registered there): the
        daemon's GpuService.segment_device where the plane runs GPU pre/post."""
        self._next_tag = 0
        self._next_local = 0  # infer_local's request ids
        self._known_models = frozenset(self._models)

    # ------------------------------------------------------------------ socket
    def open(self, endpoints: Sequence[str]) -> None:
        """Create the ROUTER socket and bind it to ``endpoints`` (their bound addresses land in
        :attr:`bound`). Raises StartupError naming ``frontend.endpoints[i]`` for one that cannot
        be bound."""
        ctx = zmq.asyncio.Context()  # the monitor and the ZAP handler are asyncio sockets
        sock: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.ROUTER)
        self._ctx, self._socket = ctx, sock
        f = self.config.frontend
        if self._curve is not None:  # before any bind: every endpoint is a CURVE server
            secret_file, keys_dir = self._curve
            public, secret = read_server_keys(secret_file)
            self.client_keys = ClientKeys(keys_dir, on_refused=self.metrics.auth_refused)
            configure_server(sock, public, secret)
        # Every handshake asks the ZAP handler (CURVE or not): it caps the connections, which
        # the monitor counts, and judges CURVE keys.
        self._gate = start_gate(
            ctx, f.max_connections, keys=self.client_keys, on_refused=self._connection_refused
        )
        sock.zap_domain = ZAP_DOMAIN.encode()
        # an asyncio PAIR socket: the context makes the sockets it creates asyncio ones
        self._monitor = cast(
            "zmq.asyncio.Socket",
            sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED),
        )
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, f.sndhwm)
        # No inbound high-water mark: libzmq 4.3.5 aborts the process (stream_engine_base.cpp,
        # out_event's "!_io_error") when a peer whose inbound pipe is full hangs up and a PING
        # or a heartbeat then asks that engine to write. The plane reads every message as it
        # comes and answers or drops it, so nothing queues unread (docs/reliability.md, "A
        # flood that vanishes").
        sock.setsockopt(zmq.RCVHWM, 0)
        # A hard memory guard at twice the limit (ZeroMQ drops such a peer without a word);
        # between the limit and the guard the decoder answers BAD_REQUEST, naming the size.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * f.max_message_bytes)
        # A reply that cannot be queued (the client's SNDHWM is full, or it has gone) raises
        # instead of vanishing, so that it is counted and logged (_send); nothing ever blocks.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Peers that stop answering ZeroMQ heartbeats are disconnected (their queues freed);
        # a handshake not finished in time is dropped (a half-open or non-ZeroMQ peer).
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(f.heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * f.heartbeat_s * 1000))
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(f.handshake_timeout_s * 1000))
        for i, ep in enumerate(endpoints):
            try:
                sock.bind(ep)
            except zmq.ZMQError as exc:
                raise StartupError(
                    f"cannot bind {ep}: {exc.strerror}", key=f"frontend.endpoints[{i}]"
                ) from None
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            bound = last.decode() if isinstance(last, bytes) else str(last)
            path = bound.removeprefix("ipc://")
            if bound.startswith("ipc://") and not path.startswith("@"):  # a file, not abstract
                os.chmod(path, f.ipc_mode)
            self.bound.append(bound)

    def start_plane(
        self,
        devices: Sequence[PlaneDevice],
        cuda: CudaFunctions | None = None,
        cudla: CudlaFunctions | None = None,
        dram: SharedDram | None = None,
    ) -> None:
        """Hand the socket to the native data plane, serving the
        config's models on ``devices`` (``cuda``: the driver's functions, where a device has
        GPU pre/post; ``cudla``: cuDLA's, where one is a real core; ``dram``: the emulated DRAM
        its timing cores share with the daemon's other emulated engines). Raises StartupError
        where the plane cannot run."""
        assert self._socket is not None  # opened first
        c = self.config
        models = {m.name: list(m.devices) for m in c.models}
        try:
            self.plane = NativePlane(
                self._socket,
                devices=devices,
                models=models,
                settings={m.name: ModelSettings(m.conf_threshold, m.iou_threshold,
                                                min(m.max_det, protocol.MAX_DET))
                          for m in c.models},
                limits=self.limits,
                default_deadline_ms=c.daemon.default_deadline_ms,
                max_deadline_ms=c.daemon.max_deadline_ms,
                max_in_flight_per_client=c.frontend.max_in_flight_per_client,
                max_buffered_bytes=c.frontend.max_buffered_bytes,
                policy=c.scheduler.policy,
                pins=c.scheduler.pins,
                shm=self.shm is not None,
                curve=self._curve is not None,
                cuda=cuda,
                cudla=cudla,
                dram=dram,
                health=Health(c.health.quarantine_after, c.health.retry, c.health.probe_after_s,
                              c.health.probe_max_s),
                cheap_requests_per_s=c.frontend.cheap_requests_per_s,
            )  # fmt: skip
        except (PlaneUnavailable, ValueError) as exc:
            raise StartupError(f"the native data plane cannot run: {exc}",
                               key="frontend") from None  # fmt: skip
        self._plane_pixels = any(d.gpu is not None or d.run is not None for d in devices)
        self.plane.start()

    def close_plane(self) -> None:
        """Close the native plane, if any (idempotent): its thread, engines and GPU chains
        end; the socket stays open."""
        if self.plane is not None:
            self.observe_plane()
            self.plane.close()
            self._plane_counters = self.plane.counters()  # its last word, for totals()
            self.plane_state = self.plane.state()[0]
            self.plane = None

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (replies already queued get ``linger_ms`` to leave) and its context
        (idempotent)."""
        self.close_plane()  # its thread ends before the socket it uses closes
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None
        if self._socket is not None:
            self._socket.close(linger_ms)
            self._socket = None
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.shm is not None:
            self.shm.close()

    @property
    def pending(self) -> int:
        """Frames admitted and not yet answered."""
        return 0 if self.plane is None else self.plane.pending

    @property
    def buffered_bytes(self) -> int:
        """Image bytes of the frames admitted and not yet answered (the byte budget's)."""
        return 0 if self.plane is None else self.plane.buffered_bytes

    @property
    def shm_frames(self) -> int:
        """Frames read from clients' shared-memory segments (by the plane, or here where the
        segment was not mapped yet)."""
        counters = self._plane_counters if self.plane is None else self.plane.counters()
        plane = 0 if counters is None else int(counters["shm_frames"])
        return plane + (0 if self.shm is None else self.shm.stats.frames)

    # ------------------------------------------------------------------ requests
    async def receive_loop(self) -> None:
        """Read and handle messages until cancelled: off the native plane's forwarding socket
        until it has drained, then off the ROUTER."""
        assert self._socket is not None  # opened before the loop starts
        assert self.plane is not None  # started before the loop starts
        await self._read(self.plane.forwarded, until=self._plane_done)
        await self._read(self._socket)

    async def _read(self, sock: zmq.Socket[bytes], until: anyio.Event | None = None) -> None:
        """Handle ``sock``'s messages until cancelled, or until ``until`` is set and none
        waits."""
        loop = asyncio.get_running_loop()
        readable = self._readable
        self._inbox = sock
        handle = self._handler(sock)
        loop.add_reader(sock.FD, readable.set)
        try:
            more = _waiting(sock)
            while True:
                if not more:
                    if until is not None and until.is_set():
                        return
                    # ZeroMQ's fd is edge-triggered: sleep only once the socket itself says no
                    # message waits (a send may take the edge meanwhile: _send_frames re-checks).
                    readable.clear()
                    self._asleep = True
                    try:
                        await readable.wait()
                    finally:
                        self._asleep = False
                    more = _waiting(sock)
                    continue
                try:
                    frames = _receive(sock)
                except zmq.Again:  # the message went (a peer's connection closed meanwhile)
                    more = _waiting(sock)
                    continue
                await handle(frames)
                more = _waiting(sock)
                if more:
                    # Under a flood this loop would find a message at every read and run alone:
                    # yield before the next (with none waiting, the wait above yields).
                    await asyncio.sleep(0)
        finally:
            loop.remove_reader(sock.FD)
            self._inbox = None

    async def watch_connections(self) -> None:
        """Follow the socket's connections from its monitor events (the file descriptor each
        is on, and when it was accepted), for the connection cap and the ``dlad_connections``
        gauge, until cancelled."""
        monitor, gate = self._monitor, self._gate
        assert monitor is not None
        assert gate is not None
        gate.established = self.established_connections
        while True:
            event = await recv_monitor_message(monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted[fd] = time.monotonic()
                if self.plane is not None:
                    self.plane.connection_opened(fd)
            else:
                self._accepted.pop(fd, None)
                if self.plane is not None:  # its replies and queued work go with it
                    self.plane.connection_closed(fd)
            self.connections = len(self._accepted)
            self.metrics.connections(self.connections)

    def established_connections(self) -> int:
        """The open connections the cap counts: those that have sent a message (the plane saw
        one from their fd) or have been open past ``handshake_timeout_s`` (libzmq cuts one that
        has not finished its handshake by then). A connection that never speaks and is cut at
        its deadline is never counted, however many of them are opened."""
        settled = time.monotonic() - self.config.frontend.handshake_timeout_s
        plane = self.plane
        return sum(
            1 for fd, at in self._accepted.items()
            if at <= settled or plane is None or plane.spoke(fd)
        )  # fmt: skip

    def _connection_refused(self) -> None:
        self.metrics.connection_refused()
        now = time.monotonic()
        if now - self._refusal_logged >= 1.0:  # at most a line a second
            self._refusal_logged = now
            log.warning("connection_refused", reason="too many connections",
                        max_connections=self.config.frontend.max_connections)  # fmt: skip

    async def answer_what_is_queued(self) -> int:
        """Read and answer, without waiting, every message the socket holds (the last step
        before it closes, once :meth:`receive_loop` is cancelled: nothing read goes unanswered).
        Returns how many there were."""
        assert self._socket is not None
        assert self.plane is not None
        n = 0
        for sock in (self.plane.forwarded, self._socket):
            while True:
                try:
                    frames = _receive(sock)
                except zmq.Again:
                    break
                n += 1
                await self._handler(sock)(frames)
        return n

    def _handler(self, sock: zmq.Socket[bytes]) -> Callable[[list[Any]], Awaitable[None]]:
        """What handles ``sock``'s messages: the ROUTER's, or the native plane's pair's."""
        return self._handle if sock is self._socket else self._handle_forwarded

    async def _handle_forwarded(self, frames: list[Any]) -> None:
        """A message of the native plane's pair: [routing id, peer address, user id,
        connection, *parts], an image's answer ([b"", tag, index, header]), or news of its
        health keeping ([b"", b"health"])."""
        if not frames[0].bytes:
            if len(frames) == 2 and frames[1].bytes == b"health":
                self.on_plane_health()
            else:
                self._plane_outcome(frames[1:])
            return
        peer, user = (f.bytes.decode(errors="replace") for f in frames[1:3])
        replying = _CONNECTION.set(frames[3].bytes)  # its replies go to this connection only
        try:
            await self._handle([frames[0], *frames[4:]], peer, user)
        finally:
            _CONNECTION.reset(replying)

    async def _handle(
        self, frames: list[Any], peer: str | None = None, user: str | None = None
    ) -> None:
        """Answer one message (``peer``, ``user``: its sender's address and CURVE key where
        the frames do not carry them). Whatever goes wrong on the way costs its sender a typed
        reply (INTERNAL for a bug) and the daemon a log line with the client and request id,
        never the receive loop."""
        client = bytes(frames[0].buffer)
        self.counters.received += 1
        request: protocol.Request | None = None
        try:
            owner = self._identity(client, frames, user)
            shm = (
                None if self.shm is None
                else functools.partial(self._shm_frame, owner, frames, peer)
            )  # fmt: skip
            request = protocol.decode_request(frames[1:], self.limits, shm)
            await self._dispatch(client, owner, request)
        except DladError as exc:
            if request is None:
                log.bind(client=client.hex(), request_id=exc.request_id).info(
                    "bad_request", reason=exc.message
                )
                self.metrics.observe_reply("", None, exc.status)
                await self._reply_safely(client, exc)
                return
            if isinstance(request, (protocol.InferRequest, protocol.InferBatchRequest)):
                # refused at admission; an unknown model's name is the client's: a label ""
                # keeps the series bounded
                model = request.model if request.model in self._models else ""
                self.metrics.observe_reply(model, None, exc.status)
            await self._reply_safely(client, exc, request.id, int(request.kind))
        except Exception as exc:  # noqa: BLE001  # a bug on the request path: answered, logged
            request_id = request.id if request is not None else None
            log.bind(client=client.hex(), request_id=request_id).error(
                "internal_error", error=f"{type(exc).__name__}: {exc}"[:200], exc_info=exc
            )
            err = InternalError(f"internal error ({type(exc).__name__}); see the daemon's log")
            self.metrics.observe_reply("", None, err.status)
            kind = int(request.kind) if request is not None else None
            await self._reply_safely(client, err, request_id, kind)

    def _identity(self, client: bytes, frames: list[Any], user: str | None = None) -> str:
        """Who sent ``frames``: its CURVE public key when clients authenticate (the same for
        all its connections), else its connection (the ROUTER's routing id)."""
        if self._curve is not None and user:
            return user
        if self._curve is not None and user is None:
            with contextlib.suppress(zmq.ZMQError, AttributeError):
                return str(frames[-1].get("User-Id"))
        return client.hex()

    def _shm_frame(
        self, owner: str, frames: list[Any], peer: str | None, ref: protocol.ShmRef, nbytes: int
    ) -> memoryview:
        """The shared-memory frame an INFER names (``protocol.ShmResolver``), for a client on
        this host only."""
        assert self.shm is not None  # only passed to the decoder when enabled
        if peer is None:
            try:
                peer = str(frames[-1].get("Peer-Address"))
            except (zmq.ZMQError, AttributeError):
                peer = ""
        if not self.shm.peer_is_local(peer):
            raise BadRequest(
                "shm: shared-memory frames are taken from ipc:// and loopback tcp connections "
                "only; send the image in the message"
            )
        assert self.plane is not None
        # The plane takes this segment's frames once it is mapped here and registered there;
        # the registration holds it mapped until the plane lets it go (reclaim_shm).
        key = (owner, ref.name)
        truncated = self.shm.broken(owner, ref.name)  # the file shrank under the mapping
        if key in self._registered and (truncated or self.shm.size_of(owner, ref.name) != ref.size):
            if not self.plane.drop_segment(owner, ref.name):
                what = "was truncated" if truncated else "changed size"
                raise BadRequest(
                    f"shm: segment {ref.name!r} {what} while frames of it are in flight; "
                    "a client must not resize a segment in use"
                )
            self._registered.discard(key)
            self.shm.release(owner, ref.name)
        view = self.shm.resolve(owner, ref, nbytes)
        if key not in self._registered:
            host = self.shm.address_of(owner, ref.name)
            device = self.shm_device(host)
            if self.plane.add_segment(
                owner, ref.name, ref.size, ref.token, host=host, device=device
            ):
                self._registered.add(key)
                self.shm.hold(owner, ref.name)
        return view

    def reclaim_shm(self) -> None:
        """Unmap the client segments idle past ``[shm] idle_s`` (the heartbeat's): with the
        native plane, those it has let go first."""
        if self.shm is None or self.plane is None:
            return
        for owner, name in self.plane.idle_segments(self.shm.config.idle_s):
            self._registered.discard((owner, name))
            self.shm.unmap(owner, name)
        self.shm.reclaim()

    async def _reply_safely(
        self, client: bytes, error: DladError, request_id: int | None = None,
        request_kind: int | None = None,
    ) -> None:  # fmt: skip
        """Answer a request that failed with ``error`` (``protocol.encode_error_reply``)."""
        try:
            frames = protocol.encode_error_reply(
                error, request_id=request_id, request_kind=request_kind
            )
            self._send_frames(client, error.status, frames)
        except Exception as exc:  # noqa: BLE001  # the receive loop must outlive any one reply
            log.bind(client=client.hex()).error("reply_failed", error=type(exc).__name__)

    async def _dispatch(self, client: bytes, owner: str, request: protocol.Request) -> None:
        if isinstance(request, protocol.InferRequest):
            await self._infer(client, owner, request)
            return
        if isinstance(request, protocol.InferBatchRequest):
            await self._infer_batch(client, owner, request)
            return
        # STATUS and CANCEL: the plane has taken this one from its client's rate (past it, the
        # plane answered OVERLOADED itself: a flood never queues here)
        if isinstance(request, protocol.CancelRequest):
            await self._cancel(client, request)
        else:
            report = self._status(request.load)
            reply = protocol.StatusReply(request.id, Status.OK, report=report)  # type: ignore[arg-type]
            await self._send(client, reply)

    async def _infer(self, client: bytes, owner: str, req: protocol.InferRequest) -> None:
        self._submit(client, owner, req.id, [req])  # one the plane's reader left: it runs it

    async def _infer_batch(
        self, client: bytes, owner: str, req: protocol.InferBatchRequest
    ) -> None:
        """Admit each image of an INFER_BATCH as an INFER of its own; one that is refused (full
        queues, a model no device serves) gets its status in the reply, the others run."""
        images = req.images
        batch = _Batch(client, req.id, [None] * len(images), len(images), tag=self._next_tag,
                       conn=_CONNECTION.get())  # fmt: skip
        self._next_tag += 1
        self._submit(client, owner, req.id, images, batch.tag)  # raises: nothing to undo
        self._tags[batch.tag] = batch
        self._batches[(client, req.id)] = batch

    async def _cancel(self, client: bytes, req: protocol.CancelRequest) -> None:
        assert self.plane is not None
        batch = self._batches.get((client, req.id))
        found = self.plane.cancel(client, req.id)
        if found is CancelResult.CANCELLED:
            await self._send(client, protocol.CancelReply(req.id, Status.OK))
        elif found is CancelResult.NOT_QUEUED and batch is None:
            raise NotFound(f"request {req.id} is not queued")
        else:
            raise NotFound(f"request {req.id} is already running (or answered)")

    # ------------------------------------------------------------------ the native plane
    def _submit(
        self, client: bytes, owner: str, request_id: int, images: Sequence[protocol.InferRequest],
        tag: int | None = None,
    ) -> None:  # fmt: skip
        """Admit decoded images into the plane (see NativePlane.submit); its refusal of the
        whole request is raised as the frontend's own would be."""
        assert self.plane is not None
        if (client, request_id) in self._batches:  # the plane knows INFERs, not batches
            raise BadRequest(f"request id {request_id} is already in flight on this connection")
        items = [self._item(i) for i in images]
        refused = self.plane.submit(client, owner, request_id, items, tag, conn=_CONNECTION.get())
        if refused is not None:
            raise error_for(*refused)

    def _item(self, req: protocol.InferRequest) -> Item:
        """What the plane needs of a decoded image: where a core pre/post-processes, its
        shape, settings and (unless in shared memory) a copy of its pixels."""
        frame = Frame(0, 0)
        if self._plane_pixels:
            code = protocol.PIXEL_FORMATS.index(req.format)
            frame = Frame(req.height, req.width, code, req.colour, req.conf, req.iou, req.max_det)
        if req.shm is not None:
            return Item(req.model, req.stream, req.priority, req.deadline_ms, 0, req.shm.name,
                        req.shm.offset, frame)  # fmt: skip
        pixels = req.image.tobytes() if self._plane_pixels else b""
        return Item(req.model, req.stream, req.priority, req.deadline_ms, req.image.nbytes,
                    frame=frame, pixels=pixels)  # fmt: skip

    def _plane_outcome(self, parts: Sequence[Any]) -> None:
        """An INFER_BATCH image's answer from the plane: the header it would have sent, and its
        detections."""
        assert self.plane is not None
        out = self.plane.outcome([p.bytes for p in parts])  # zero-copy frames
        batch = self._tags.get(out.tag)
        if batch is None:  # cannot happen: a batch's tag lives until its last answer
            log.error("outcome_without_batch", tag=out.tag, index=out.index)
            return
        h = msgpack.unpackb(out.header)  # the plane's own INFER_REPLY header
        found = (np.frombuffer(out.detections, "<f4").reshape(-1, 6) if out.detections
                 else _NO_DETECTIONS)  # fmt: skip
        result = (h["status"], h["message"], h["device"], h["timing"], found)
        if isinstance(batch, _Local):
            del self._tags[out.tag]
            if not batch.answer.done():  # else its asker has gone (cancelled)
                batch.answer.set_result(result)
            return
        self._fill(batch, out.index, result)

    async def infer_local(self, owner: str, request: protocol.InferRequest) -> protocol.BatchResult:
        """Run one decoded image through the plane as an INFER of ``owner``'s (who it is for
        the in-flight cap), for a front door of the daemon's own (the KServe ports): the same
        admission, scheduling, engines and answers as a ZeroMQ INFER's. Returns its
        (status, message, device, timing, detections); raises the plane's refusal (full, no
        device for the model, draining) as the ZeroMQ frontend would answer it. Cancelled, it
        cancels the image where it is still queued."""
        if self.plane is None or not self._accepting():
            raise ShuttingDown("the daemon is shutting down")
        request_id, tag = self._next_local, self._next_tag
        self._next_local += 1
        self._next_tag += 1
        answer: asyncio.Future[protocol.BatchResult] = asyncio.get_running_loop().create_future()
        self._submit(_LOCAL_CLIENT, owner, request_id, [request], tag)  # raises: nothing to undo
        self._tags[tag] = _Local(request_id, answer)
        try:
            return await answer
        finally:
            gone = answer.cancelled() or not answer.done()  # its asker has gone
            if gone and self.plane is not None:
                self.plane.cancel(_LOCAL_CLIENT, request_id)

    def observe_plane(self) -> None:
        """Hand the plane's replies since the last call to the metrics, with what it dropped
        and lost meanwhile (the heartbeat's)."""
        if self.plane is None:
            return
        known, observe = self._known_models, self.metrics.observe_reply
        for model, device, status, queue_us, device_us, total_us in self.plane.observations():
            observe(model if model in known else "", device or None, _STATUSES[status],
                    queue_us=queue_us, device_us=device_us, total_us=total_us)  # fmt: skip
        now = self.plane.counters()
        seen, self._plane_seen = self._plane_seen, now
        # dropped: ZeroMQ could not queue them; orphaned: their connection had closed (a new
        # one on the same routing id gets none of them)
        total = now["dropped"] + now["orphaned"]
        dropped = total - seen.get("dropped", 0) - seen.get("orphaned", 0)
        if dropped:
            self.metrics.reply_dropped(dropped)
            log.warning("reply_dropped", reason="a client's queue was full, or it had gone",
                        dropped=dropped, dropped_total=total)  # fmt: skip
        keys = ("refused_over_rate", "dropped_over_rate", "cut", "refused_busy")
        new = {k: now[k] - seen.get(k, 0) for k in keys}
        if new["refused_over_rate"] or new["dropped_over_rate"]:  # never reaching this loop
            why = ("malformed messages and refusals past a client's cheap-message rate: "
                   "answered OVERLOADED, then dropped, then the connection cut")  # fmt: skip
            log.warning("bad_requests_over_rate", refused=new["refused_over_rate"],
                        dropped=new["dropped_over_rate"], connections_cut=new["cut"],
                        reason=why)  # fmt: skip
        if new["refused_busy"]:  # the plane answered OVERLOADED what this loop could not take
            log.warning("control_plane_behind", refused=new["refused_busy"])
        failed = now["gpu_errors"] - seen.get("gpu_errors", 0)
        if failed:  # each frame was answered DEVICE_FAILED with these words
            log.error("gpu_chain_failed", frames=failed, last=now["last_gpu_error"])
        for what, key in (("message", "forward_lost"), ("observation", "observations_lost")):
            lost = now[key] - seen.get(key, 0)
            if lost:
                self.metrics.plane_lost(what, lost)
                why = "the event loop was gone, or fell a million replies behind"
                log.error("plane_lost", what=what, lost=lost, reason=why)

    def totals(self) -> Counters:
        """Messages received and replies sent, by status: this frontend's and the plane's."""
        plane = self._plane_counters if self.plane is None else self.plane.counters()
        if plane is None:
            return self.counters
        mine = self.counters
        by_status = dict(mine.by_status)
        for name, n in plane["by_status"].items():
            by_status[name] = by_status.get(name, 0) + n
        return Counters(
            received=mine.received + plane["received"] - plane["forwarded"],
            replied=mine.replied + plane["replied"],
            by_status=by_status,
            dropped=mine.dropped + plane["dropped"] + plane["orphaned"],
        )

    async def drain(self, timeout_s: float) -> None:
        """Answer every queued frame SHUTTING_DOWN, then wait (at most ``timeout_s``) for the
        frames on a device to be answered: the plane does so, then hands the socket back."""
        assert self.plane is not None
        await anyio.to_thread.run_sync(self.plane.drain, timeout_s)
        self.observe_plane()
        self._plane_done.set()
        self._readable.set()  # the receive loop moves to the socket

    # ------------------------------------------------------------------ replies
    def _fill(self, batch: _Batch, index: int, result: protocol.BatchResult) -> None:
        """Record image ``index``'s result; the last one sends the batch's reply."""
        batch.results[index] = result
        batch.waiting -= 1
        if batch.waiting:
            return
        del self._batches[(batch.client, batch.request_id)]
        self._tags.pop(batch.tag, None)
        results = cast("list[protocol.BatchResult]", batch.results)
        self._send_frames(batch.client, Status.OK,
                          protocol.encode_batch_reply(batch.request_id, results),
                          conn=batch.conn)  # fmt: skip

    async def _send(self, client: bytes, message: Any) -> None:
        self._send_frames(client, getattr(message, "status", Status.OK), protocol.encode(message))

    def _send_frames(
        self, client: bytes, status: Status, frames: list[Any], conn: bytes | None = None
    ) -> None:
        """Queue one reply without blocking; one ZeroMQ cannot queue is counted and logged.
        ``conn``: the connection it is for (default: the one of the message being handled)."""
        self.counters.replied += 1
        by_status, name = self.counters.by_status, _STATUS_NAMES[status]
        by_status[name] = by_status.get(name, 0) + 1
        if self.plane is not None:  # its thread sends (the plane counts what it cannot)
            self.plane.send(client, frames, _CONNECTION.get() if conn is None else conn)
            self._recheck()
            return
        sock = self._socket  # the plane has closed: the daemon's last words
        assert sock is not None
        try:
            # Copied: replies are small (a header, at most MAX_DET rows), and a copy is cheaper
            # than a zero-copy frame's bookkeeping below pyzmq's copy threshold.
            sock.send(client, _MORE)
            for frame in frames[:-1]:
                sock.send(frame, _MORE)
            sock.send(frames[-1], _NOBLOCK)
        except zmq.ZMQError as exc:  # zmq.Again: its queue is full; EHOSTUNREACH: it has gone
            self.counters.dropped += 1
            self.metrics.reply_dropped()
            now = time.monotonic()
            if now - self._drop_logged >= 1.0:  # at most a line a second, with the count
                self._drop_logged = now
                why = "its queue is full" if isinstance(exc, zmq.Again) else "it has gone"
                log.bind(client=client.hex()).warning(
                    "reply_dropped", reason=why, dropped_total=self.counters.dropped
                )
        self._recheck()

    def _recheck(self) -> None:
        # A send processes the socket's pending commands, which can consume the fd's edge for
        # a message that has arrived: wake the receive loop if it sleeps.
        inbox = self._inbox
        if self._asleep and inbox is not None and _waiting(inbox):
            self._readable.set()
