"""Many daemons behind one client: :class:`AsyncFleet` (anyio on asyncio) and :class:`Fleet`.

One dlad owns one Orin; a fleet of Orins is many daemons, each knowing only its own queues. A
Kubernetes Service or a broker would spread requests blindly, so the routing is done here, in
the client (docs/fleet.md):

- **Members** come from a static list of endpoints or from DNS (a headless Service's A/AAAA
  records, re-resolved every ``refresh_s``). Each is reached through an
  :class:`~dlad_client.AsyncClient` of its own, so the fleet knows which daemon holds what.
- **Load**: every ``heartbeat_s`` each member is asked for its STATUS (with ``load``): its queue
  depth, the work on its engines, whether it drains. Replies add the latency this client sees
  at it (an exponentially weighted mean).
- **Choice**: power of two choices. Two members are drawn at random among the available ones
  and the one with the smaller expected wait (latency times 1 + outstanding work per engine) gets
  the frame, unless some member's wait is under half of it (two slow daemons drawn together);
  this avoids both herding onto one "best" daemon and the blindness of round robin.
- **Streams** stay on the member that took their first frame while it is available (its
  ``stream`` is the daemon's latest-frame-wins unit, and an engine's caches stay warm).
- **Retries**: an answer that says another daemon may do better (``OVERLOADED``,
  ``DEVICE_FAILED``, ``SHUTTING_DOWN``) or no answer within ``attempt_timeout_s`` is retried on
  another member, after a jittered exponential backoff, within the request's own ``timeout_s``.
- **Circuit breaker**: a member that misses ``breaker_after`` heartbeats or attempts in a row, or
  whose connection drops (the daemon's process died), is taken out of the choice for
  ``breaker_open_s`` (doubling up to ``breaker_max_s``) and its frames in flight are retried
  elsewhere at once; it returns when a STATUS is answered again.

The wire protocol is unchanged: a fleet is many v1 connections.
"""

from __future__ import annotations

import contextlib
import functools
import random
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal, TypeVar, cast, final

import anyio
import anyio.abc
import anyio.from_thread
import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dlad_client._async import AsyncClient
from dlad_client._core import (
    DEFAULT_TIMEOUT_S,
    ClientClosed,
    ClientTimeout,
    CurveKeys,
    Result,
    _check_timeout,
)
from dlad_wire.errors import DeviceFailed, DladError, Overloaded, ShuttingDown
from dlad_wire.protocol import DaemonStatus, PixelFormat, YuvFormat, endpoint_error

__all__ = ["AsyncFleet", "Fleet", "FleetHandle", "MemberState"]

RETRYABLE: Final = (Overloaded, DeviceFailed, ShuttingDown)
"""Answers after which another daemon may succeed (docs/protocol.md §8, "retryable")."""
MAX_STREAMS: Final = 10_000
"""Streams whose daemon is remembered (more: the least recently used are forgotten)."""
_EWMA: Final = 0.2  # weight of a new latency sample

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MemberState:
    """One daemon as the fleet sees it (:attr:`AsyncFleet.members`)."""

    endpoint: str
    available: bool  # taking frames now (breaker closed, not draining, answering)
    in_flight: int  # this client's requests at it
    queued: int  # its queue depth and engine work at its last STATUS
    engines: int  # its ready engines at its last STATUS
    latency_ms: float  # the mean reply latency this client sees there (0: none yet)
    failures: int  # heartbeats or attempts unanswered in a row
    sent: int  # attempts sent to it
    ok: int  # of which answered OK


@dataclass(eq=False, slots=True)
class _Member:
    endpoint: str
    client: AsyncClient
    closing: anyio.Event  # set: its task leaves the client's context (the client closes)
    in_flight: int = 0
    queued: int = 0
    capacity: int = 1  # its queues' bound at the last STATUS
    engines: int = 1
    latency_s: float = 0.0
    prior_s: float = 0.0  # the daemon's own p50 from its STATUS load, until replies come
    failures: int = 0
    open_until: float = 0.0
    rest_s: float = 0.0
    draining: bool = False
    gone: bool = False  # no longer resolved: closed once its frames are answered
    sent: int = 0
    ok: int = 0
    attempts: set[anyio.CancelScope] = field(default_factory=set)

    def available(self, now: float, breaker_after: int) -> bool:
        return (not self.gone and not self.draining and self.failures < breaker_after
                and now >= self.open_until)  # fmt: skip

    def cost(self) -> float:
        """The expected wait for one more frame here (s), in the same units for every member:
        the latency seen (or advertised) times the work ahead per engine."""
        service = self.latency_s or self.prior_s or 1e-3
        return service * (1.0 + (self.in_flight + self.queued) / max(self.engines, 1))

    def state(self, now: float, breaker_after: int) -> MemberState:
        return MemberState(self.endpoint, self.available(now, breaker_after), self.in_flight,
                           self.queued, self.engines, self.latency_s * 1e3, self.failures,
                           self.sent, self.ok)  # fmt: skip


def dns_endpoints(
    name: str, *, nameserver: tuple[str, int] | None = None
) -> Callable[[], list[str]]:
    """A resolver for ``AsyncFleet(resolve=...)``, looked up at each call:

    - ``"host:port"`` (a headless Service's name, e.g. ``"dlad.dlad.svc.cluster.local:5555"``):
      one ``tcp://address:port`` per A/AAAA record (the system's resolver);
    - ``"_service._proto.name"`` (an SRV name, e.g. ``"_zmq._tcp.dlad.dlad.svc.cluster.local"``,
      the Service's named port): one ``tcp://target:port`` per SRV record, each target's
      addresses resolved (dnspython; ``nameserver`` overrides the system's).

    Raises ValueError for a name of neither form; a lookup that fails raises OSError (the
    fleet then keeps the members it has)."""
    if name.startswith("_"):
        return _srv_endpoints(name, nameserver)
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"resolve must be 'host:port' or an SRV name '_svc._tcp.host', got {name!r}"
        )

    def resolve() -> list[str]:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        found = []
        for family, *_, address in infos:
            ip = address[0]
            found.append(f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else
                         f"tcp://{ip}:{port}")  # fmt: skip
        return sorted(set(found))

    return resolve


def _srv_endpoints(name: str, nameserver: tuple[str, int] | None) -> Callable[[], list[str]]:
    try:
        import dns.exception  # noqa: PLC0415 (SRV names only: dnspython is the fleet extra)
        import dns.rdatatype  # noqa: PLC0415
        import dns.resolver  # noqa: PLC0415
    except ImportError:
        raise ValueError("SRV names need dnspython (pip install 'dlad[fleet]')") from None
    resolver = dns.resolver.Resolver(configure=nameserver is None)
    if nameserver is not None:
        resolver.nameservers, resolver.port = [nameserver[0]], nameserver[1]

    def resolve() -> list[str]:
        try:
            answer = resolver.resolve(name, "SRV", lifetime=5.0)
        except dns.exception.DNSException as exc:
            raise OSError(f"SRV lookup of {name!r} failed: {exc}") from None
        found = []
        for record in answer:
            target = record.target.to_text(omit_final_dot=True)
            additional = [r for rrset in answer.response.additional if rrset.name == record.target
                          for r in rrset if r.rdtype == dns.rdatatype.A]  # fmt: skip
            addresses = [r.address for r in additional] or [target]
            found += [f"tcp://{a}:{record.port}" for a in addresses]
        return sorted(set(found))

    return resolve


@final
class AsyncFleet:
    """A client of many daemons (see the module docstring): ``async with AsyncFleet(...) as f``.

    ``endpoints``: the daemons, or ``resolve``: a ``"host:port"`` DNS name (re-resolved every
    ``refresh_s``) or a callable returning the endpoints. ``timeout_s`` bounds each call with
    its retries; ``attempt_timeout_s`` (default: a quarter of it) one attempt at one daemon;
    ``max_attempts`` the daemons one request is tried at. ``max_in_flight`` and ``curve`` are
    each member's :class:`~dlad_client.AsyncClient` settings. ``seed``: the random choices'
    (None: from the OS).

    Raises ValueError on a bad setting.
    """

    def __init__(
        self,
        endpoints: Sequence[str] | None = None,
        *,
        resolve: str | Callable[[], Sequence[str]] | None = None,
        refresh_s: float = 10.0,
        heartbeat_s: float = 0.5,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempt_timeout_s: float | None = None,
        max_attempts: int = 3,
        backoff_s: float = 0.01,
        backoff_max_s: float = 0.25,
        breaker_after: int = 2,
        breaker_open_s: float = 1.0,
        breaker_max_s: float = 30.0,
        max_in_flight: int = 64,
        curve: CurveKeys | None = None,
        seed: int | None = None,
    ) -> None:
        if (endpoints is None) == (resolve is None):
            raise ValueError("give endpoints or resolve (one of them)")
        if endpoints is not None:
            if isinstance(endpoints, str) or not endpoints:
                raise ValueError(f"endpoints must be a non-empty list, got {endpoints!r}")
            for endpoint in endpoints:
                problem = endpoint_error(endpoint)
                if problem is not None:
                    raise ValueError(problem)
        spans = {"refresh_s": refresh_s, "heartbeat_s": heartbeat_s, "backoff_s": backoff_s,
                 "backoff_max_s": backoff_max_s, "breaker_open_s": breaker_open_s,
                 "breaker_max_s": breaker_max_s}  # fmt: skip
        for name, value in spans.items():
            _check_timeout(value, name)
        self._timeout_s = _check_timeout(timeout_s, "timeout_s")
        self._attempt_s = (self._timeout_s / 4 if attempt_timeout_s is None
                           else _check_timeout(attempt_timeout_s, "attempt_timeout_s"))  # fmt: skip
        for name, count in (("max_attempts", max_attempts), ("breaker_after", breaker_after)):
            if not (isinstance(cast("object", count), int) and count >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {count!r}")
        self._static = None if endpoints is None else list(dict.fromkeys(endpoints))
        self._resolve = dns_endpoints(resolve) if isinstance(resolve, str) else resolve
        self._refresh_s, self._heartbeat_s = refresh_s, heartbeat_s
        self._max_attempts, self._breaker_after = max_attempts, breaker_after
        self._backoff = (backoff_s, backoff_max_s)
        self._breaker = (breaker_open_s, breaker_max_s)
        self._client_settings: dict[str, Any] = {"max_in_flight": max_in_flight, "curve": curve}
        self._rng = random.Random(seed)
        self._members: dict[str, _Member] = {}
        self._streams: OrderedDict[str, str] = OrderedDict()
        self._context: zmq.asyncio.Context | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._state: Literal["new", "open", "closed"] = "new"
        self.retries = 0
        """Attempts made after a request's first (a measure of how the fleet routed around)."""

    async def __aenter__(self) -> AsyncFleet:
        if self._state != "new":
            raise RuntimeError("an AsyncFleet is entered once")
        self._context = zmq.asyncio.Context()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._state = "open"
        try:
            await self._update(self._endpoints_now())
            await self._heartbeat_all()  # the first load figures before the first frame
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        self._task_group.start_soon(self._heartbeat_loop)
        if self._resolve is not None:
            self._task_group.start_soon(self._refresh_loop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._state = "closed"
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()
            await self._task_group.__aexit__(exc_type, exc, tb)
        self._members.clear()  # their tasks, cancelled with the group, closed their clients
        if self._context is not None:
            self._context.term()
        return None

    @property
    def members(self) -> list[MemberState]:
        """Each daemon as the fleet sees it now, by endpoint."""
        now = time.monotonic()
        return [m.state(now, self._breaker_after) for _, m in sorted(self._members.items())]

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
        """Run ``model`` on ``image`` at the daemon the fleet chooses, retrying elsewhere as
        the module docstring says; the arguments are :meth:`AsyncClient.detect
        <dlad_client.AsyncClient.detect>`'s.

        Raises:
            TypeError, ValueError, BadRequest: invalid input (nothing is sent).
            Overloaded, DeviceFailed, ShuttingDown: the last daemon's answer, when every
                attempt was refused this way (or no daemon was available at all: Overloaded).
            NotFound, DeadlineExceeded, Cancelled, InternalError: a daemon's answer (not
                retried: another daemon would say the same).
            ClientTimeout: no daemon answered within ``timeout_s``.
            RuntimeError: the fleet is not entered, or closed.
        """
        if self._state != "open":
            raise RuntimeError("enter the fleet first: async with AsyncFleet(...) as fleet")
        fields = {"model": model, "pixel_format": pixel_format, "stream": stream,
                  "priority": priority, "deadline_ms": deadline_ms, "conf": conf, "iou": iou,
                  "max_det": max_det}  # fmt: skip
        timeout = self._timeout_s if timeout_s is None else _check_timeout(timeout_s, "timeout_s")
        deadline = time.monotonic() + timeout
        tried: set[str] = set()
        last: Exception | None = None
        for attempt in range(self._max_attempts):
            member = await self._pick(stream, tried, deadline)
            if member is None:
                break
            if attempt:
                self.retries += 1
            remaining = deadline - time.monotonic()
            outcome = await self._attempt(member, image, fields, min(remaining, self._attempt_s))
            if isinstance(outcome, Result):
                if stream is not None:
                    self._remember(stream, member.endpoint)
                return outcome
            last = outcome
            tried.add(member.endpoint)
            pause = self._rng.uniform(0, min(self._backoff[1], self._backoff[0] * 2**attempt))
            if time.monotonic() + pause >= deadline:
                break
            await anyio.sleep(pause)
        if last is None:
            last = Overloaded("no daemon of the fleet is available")
        raise last

    async def _attempt(
        self, member: _Member, image: npt.NDArray[np.uint8], fields: dict[str, Any],
        timeout_s: float,
    ) -> Result | Exception:  # fmt: skip
        """One try at ``member``: the Result, or the error to retry after (others raise)."""
        member.in_flight += 1
        member.sent += 1
        started = time.monotonic()
        outcome: Result | Exception
        with anyio.CancelScope() as scope:  # cancelled when member's breaker opens
            member.attempts.add(scope)
            try:
                outcome = await member.client.detect(image, timeout_s=max(timeout_s, 1e-3),
                                                     **fields)  # fmt: skip
            except RETRYABLE as exc:
                outcome = exc
                member.draining |= isinstance(exc, ShuttingDown)
                if isinstance(exc, Overloaded):  # full: so it looks until its next STATUS
                    member.queued = max(member.queued, member.capacity)
            except ClientTimeout as exc:
                outcome = exc
                self._missed(member)
            finally:
                member.attempts.discard(scope)
                member.in_flight -= 1
        if scope.cancelled_caught:
            return ClientTimeout(f"{member.endpoint} stopped answering (its circuit opened)")
        if isinstance(outcome, Result):
            member.ok += 1
            member.failures = 0
            took = time.monotonic() - started
            member.latency_s += _EWMA * (took - member.latency_s) if member.latency_s else took
        return outcome

    async def _pick(self, stream: str | None, tried: set[str], deadline: float) -> _Member | None:
        """The member for the next attempt, waiting (within ``deadline``) while none is
        available; None when none becomes available in time."""
        while True:
            now = time.monotonic()
            open_ = [m for m in self._members.values()
                     if m.available(now, self._breaker_after)]  # fmt: skip
            fresh = [m for m in open_ if m.endpoint not in tried] or open_
            if fresh:
                return self._choose(stream, fresh)
            if now + self._heartbeat_s / 4 >= deadline:
                return None
            await anyio.sleep(self._heartbeat_s / 4)  # a heartbeat may bring one back

    def _choose(self, stream: str | None, candidates: list[_Member]) -> _Member:
        if stream is not None:
            home = self._streams.get(stream)
            for m in candidates:
                if m.endpoint == home:
                    self._streams.move_to_end(stream)
                    return m
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        pick = a if a.cost() <= b.cost() else b
        # Two slow daemons drawn together would still get the frame: a member at less than
        # half the cost takes it instead (the choice stays spread: each frame sent raises its
        # member's cost at once, and ties and near-ties stay with the random pair).
        best = min(candidates, key=_Member.cost)
        return best if 2 * best.cost() < pick.cost() else pick

    def _remember(self, stream: str, endpoint: str) -> None:
        self._streams[stream] = endpoint
        self._streams.move_to_end(stream)
        while len(self._streams) > MAX_STREAMS:
            self._streams.popitem(last=False)

    def _missed(self, member: _Member) -> None:
        """No answer from ``member`` (a heartbeat or an attempt): past ``breaker_after`` in a
        row its circuit opens and its frames in flight go elsewhere."""
        member.failures += 1
        if member.failures >= self._breaker_after and time.monotonic() >= member.open_until:
            base, most = self._breaker
            member.rest_s = min(most, member.rest_s * 2 if member.rest_s else base)
            member.open_until = time.monotonic() + member.rest_s
            for scope in list(member.attempts):
                scope.cancel()

    # ------------------------------------------------------------------ membership and load
    def _endpoints_now(self) -> list[str]:
        if self._static is not None:
            return self._static
        assert self._resolve is not None
        try:
            return list(self._resolve())
        except OSError:  # DNS down a while: keep the members there are
            return list(self._members)

    async def _update(self, endpoints: Sequence[str]) -> None:
        assert self._task_group is not None
        wanted = set(endpoints)
        for endpoint in sorted(wanted - set(self._members)):
            self._members[endpoint] = await self._task_group.start(self._run_member, endpoint)
        for endpoint, member in self._members.items():
            member.gone = endpoint not in wanted
        self._close_gone()

    def _close_gone(self) -> None:
        """Close the members no longer resolved once none of their frames is in flight."""
        for endpoint in [e for e, m in self._members.items() if m.gone and not m.in_flight]:
            self._members.pop(endpoint).closing.set()

    async def _run_member(
        self, endpoint: str, *, task_status: anyio.abc.TaskStatus[_Member]
    ) -> None:
        """One member's client, entered and left in a task of its own (anyio's rule)."""
        client = AsyncClient(endpoint, timeout_s=self._timeout_s, context=self._context,
                             **self._client_settings)  # fmt: skip
        async with client, anyio.create_task_group() as tg:
            member = _Member(endpoint, client, anyio.Event())
            tg.start_soon(self._watch_connection, member)
            task_status.started(member)
            await member.closing.wait()
            tg.cancel_scope.cancel()

    async def _watch_connection(self, member: _Member) -> None:
        """A daemon whose connection drops (its process died: the kernel closed the socket) is
        out at once, not at its next missed heartbeat; its frames in flight go elsewhere."""
        sock = member.client._socket  # the member's DEALER (same package)
        if sock is None:
            return
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    member.failures = max(member.failures, self._breaker_after - 1)
                    self._missed(member)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)

    async def _refresh_loop(self) -> None:
        while True:
            await anyio.sleep(self._refresh_s)
            await self._update(self._endpoints_now())

    async def _heartbeat_loop(self) -> None:
        while True:
            await anyio.sleep(self._heartbeat_s)
            await self._heartbeat_all()

    async def _heartbeat_all(self) -> None:
        self._close_gone()
        async with anyio.create_task_group() as tg:
            for member in list(self._members.values()):
                if not member.gone:
                    tg.start_soon(self._heartbeat, member)

    async def _heartbeat(self, member: _Member) -> None:
        try:
            report = await member.client.status(load=True, timeout_s=self._heartbeat_s)
        except ClientTimeout:
            self._missed(member)
            return
        except ClientClosed:  # it left the fleet meanwhile (no longer resolved)
            return
        except DladError:  # answered (rate-limited, say): alive, figures unchanged
            member.failures = 0
            return
        self._learn(member, report)

    def _learn(self, member: _Member, report: DaemonStatus) -> None:
        member.failures = 0
        if member.rest_s and time.monotonic() >= member.open_until:
            member.rest_s = 0.0  # it answers again: the next trip rests the base time
        devices = report["devices"]
        member.engines = max(1, sum(1 for d in devices if d.get("healthy", True)))
        member.capacity = max(1, report["queues"]["capacity"])
        member.queued = report["queues"]["depth"] + sum(d["in_flight"] for d in devices)
        member.queued = max(member.queued - member.in_flight, 0)  # its own count is exact
        member.draining = report["state"] != "RUNNING"
        load = report.get("load")
        if load is not None and load["p50_us"] > 0:
            member.prior_s = load["p50_us"] / 1e6


@final
class FleetHandle:
    """A request submitted with :meth:`Fleet.submit`: :meth:`result` waits for it."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[Result]) -> None:
        self._future = future

    def done(self) -> bool:
        """Whether the outcome is known (never waits)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the outcome (at most ``timeout`` seconds if given).

        Raises:
            DladError, ClientTimeout: as :meth:`AsyncFleet.detect`.
            TimeoutError: ``timeout`` passed first (the request goes on).
        """
        return self._future.result(timeout)


@final
class Fleet:
    """The synchronous face of :class:`AsyncFleet` (its arguments): the fleet runs on an event
    loop thread of its own, so unlike :class:`~dlad_client.Client` a Fleet may be used from any
    number of threads at once. ``with Fleet(...) as fleet: fleet.detect(image)``.

    Raises ValueError on a bad setting, and what entering the fleet raises.
    """

    def __init__(self, endpoints: Sequence[str] | None = None, **settings: Any) -> None:
        self._fleet = AsyncFleet(endpoints, **settings)
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._entered = self._portal.wrap_async_context_manager(self._fleet)
            self._entered.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._closed = False

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close every member's connection and stop the fleet's thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._entered.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)

    @property
    def members(self) -> list[MemberState]:
        """:attr:`AsyncFleet.members`."""
        return self._fleet.members

    @property
    def retries(self) -> int:
        """:attr:`AsyncFleet.retries`."""
        return self._fleet.retries

    def detect(self, image: npt.NDArray[np.uint8], **fields: Any) -> Result:
        """:meth:`AsyncFleet.detect`, waited for.

        Raises:
            DladError, ClientTimeout, TypeError, ValueError: as :meth:`AsyncFleet.detect`.
            RuntimeError: the fleet is closed.
        """
        return self._call(functools.partial(self._fleet.detect, image, **fields))

    def submit(self, image: npt.NDArray[np.uint8], **fields: Any) -> FleetHandle:
        """:meth:`AsyncFleet.detect` without waiting: its :class:`FleetHandle`.

        Raises:
            RuntimeError: the fleet is closed.
        """
        if self._closed:
            raise RuntimeError("the fleet is closed")
        return FleetHandle(self._portal.start_task_soon(
            functools.partial(self._fleet.detect, image, **fields)))  # fmt: skip

    def _call(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._closed:
            raise RuntimeError("the fleet is closed")
        return cast("T", self._portal.call(fn))
