"""The daemon: one root task group, a ROUTER frontend, the scheduler and the device workers.

Lifecycle: ``RUNNING → DRAINING → STOPPED``. The first SIGTERM/SIGINT (or :meth:`Daemon.stop`)
starts draining: new INFERs are answered SHUTTING_DOWN, queued ones too, and jobs already on a
device finish and are answered, within ``daemon.drain_timeout_s``; then the task group is
cancelled and the cores are closed. A second signal forces the exit at once. Every accepted
request gets exactly one reply: a result or a typed error.

The frontend is the only owner of the socket, and the event loop only moves small objects: the
image stays in the received ZeroMQ frame (a zero-copy numpy view) until a worker thread
letterboxes it into the DLA's input buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import structlog
import zmq
import zmq.asyncio

import dlad
from dlad import protocol
from dlad.config import Config, Plan
from dlad.devices.base import DlaError
from dlad.devices.emulated import FaultConfig
from dlad.devices.factory import cudla_loadable_for
from dlad.errors import (
    BadRequest,
    Cancelled,
    DeadlineExceeded,
    DladError,
    InternalError,
    NotFound,
    Overloaded,
    ShuttingDown,
    Status,
)
from dlad.metrics import DeviceSample, Metrics, MetricsServer
from dlad.scheduler import Job, Scheduler
from dlad.worker import DeviceWorker, Outcome, Work

if TYPE_CHECKING:
    from dlad.gpu.service import GpuService

log = structlog.get_logger("dlad")


class StartupError(RuntimeError):
    """The daemon could not start serving: a port or socket it must bind is taken or refused,
    or a device cannot open its core or load its loadable. ``key`` names the config setting
    to look at (``frontend.endpoints[0]``, ``metrics.port``, ``devices.dla0``)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class State(enum.Enum):
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


@dataclass
class Counters:
    received: int = 0
    replied: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class Daemon:
    """Serve ``plan`` until stopped (see the module docstring).

    Args:
        plan: the checked config (``dlad.config.load_config(path).plan()``).
        endpoints: override ``plan.endpoints`` (tests bind ``tcp://127.0.0.1:0``-style ports).
        pre_post: override ``pre_post.enabled`` of the config.
        metrics_port: override ``metrics.port`` (0: any free port, see ``metrics_server.port``).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        endpoints: Sequence[str] | None = None,
        pre_post: bool | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.plan = plan
        self.config: Config = plan.config
        self.endpoints = tuple(endpoints or plan.endpoints)
        self.pre_post = plan.config.pre_post.enabled if pre_post is None else pre_post
        self.state = State.RUNNING
        self.counters = Counters()
        self.bound: list[str] = []
        self.ready = anyio.Event()
        self.stopped = threading.Event()
        """Set once :meth:`serve` has returned or raised (wait on it from any thread)."""
        self._stop = anyio.Event()
        self._scheduler: Scheduler[Work] = Scheduler(time.monotonic_ns)
        self._workers: dict[str, DeviceWorker] = {}
        self._next_job = 0
        self._pending: dict[tuple[bytes, int], int] = {}  # (client, request id) -> job id
        self._socket: zmq.asyncio.Socket | None = None
        self._idle = anyio.Event()
        self._expiry_wake = anyio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        f = self.config.frontend
        m = self.config.metrics
        self.metrics = Metrics(
            self.config.daemon.name,
            dlad.__version__,
            heartbeat_s=m.heartbeat_s,
            live_timeout_s=m.live_timeout_s,
            load_window_s=m.load_window_s,
        )
        self.metrics_server: MetricsServer | None = None
        self._metrics_at = f"{m.host}:{m.port if metrics_port is None else metrics_port}"
        if m.enabled:
            port = m.port if metrics_port is None else metrics_port
            self.metrics_server = MetricsServer(self.metrics, m.host, port)
        self._gpu: GpuService | None = None
        self._warming = 0
        self._warm = anyio.Event()
        self._healthy: dict[str, bool] = {}  # after warm-up, as last told to the metrics
        self.limits = protocol.Limits(
            max_message_bytes=f.max_message_bytes,
            max_width=f.max_image_width,
            max_height=f.max_image_height,
            max_image_pixels=f.max_image_width * f.max_image_height,
        )

    # ------------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Start draining (idempotent; call it on the daemon's event loop)."""
        self._stop.set()

    def stop_threadsafe(self) -> None:
        """:meth:`stop` from another thread (tests, embedding applications)."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and self.state is not State.STOPPED:
            # RuntimeError: the loop closed meanwhile, so the daemon has already stopped.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stop.set)

    async def serve(self) -> None:
        """Run until stopped and drained. Raises what a device or the socket raised."""
        self._loop = asyncio.get_running_loop()
        limiter = anyio.CapacityLimiter(max(self.config.pre_post.threads, 1))
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.frontend.sndhwm)
        sock.setsockopt(zmq.RCVHWM, self.config.frontend.rcvhwm)
        # A hard memory guard at twice the limit (ZeroMQ drops such a peer without a word);
        # between the limit and the guard the decoder answers BAD_REQUEST, naming the size.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.frontend.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client's reply is dropped
        self._socket = sock
        try:
            if self.metrics_server is not None:  # first, so readiness is seen to flip
                try:
                    self.metrics_server.start()
                except OSError as exc:
                    why = exc.strerror or str(exc)
                    raise StartupError(
                        f"cannot serve metrics on {self._metrics_at}: {why}", key="metrics.port"
                    ) from None
                log.info("metrics", url=self.metrics_server.url)
            for i, ep in enumerate(self.endpoints):
                try:
                    sock.bind(ep)
                except zmq.ZMQError as exc:
                    raise StartupError(
                        f"cannot bind {ep}: {exc.strerror}", key=f"frontend.endpoints[{i}]"
                    ) from None
                last = sock.getsockopt(zmq.LAST_ENDPOINT)
                self.bound.append(last.decode() if isinstance(last, bytes) else str(last))
            for p in self.plan.placements:  # the devices that get a worker (DLA cores)
                if self.config.device(p.device).kind == "dla":
                    self.metrics.device_state(p.device, "loading")
            await self._start_gpu()
            self._start_workers(limiter)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                self._warming = len(self._workers)
                for worker in self._workers.values():
                    tg.start_soon(self._serve_device, worker)
                tg.start_soon(self._expiry_loop)
                tg.start_soon(self._receive_loop, sock)
                if self._workers:
                    await self._warm.wait()
                self.ready.set()
                log.info("listening", endpoints=self.bound, devices=list(self._workers))
                await self._stop.wait()
                await self._drain()
                tg.cancel_scope.cancel()
        finally:
            self.state = State.STOPPED
            if self._gpu is not None:  # after the workers: their streams use its memory
                self._gpu.close()
            if self.metrics_server is not None:
                self.metrics_server.close()
            sock.close(0)
            ctx.term()
            log.info("stopped", replied=self.counters.replied)
            self.stopped.set()

    async def _start_gpu(self) -> None:
        """Choose the pre/post backend (logged): CUDA kernels where a GPU is configured and
        usable, else the numpy reference. Raises RuntimeError when ``cuda`` was required."""
        if not self.pre_post:
            return
        from dlad.gpu.service import GpuService, select_backend  # noqa: PLC0415 (GPU only)

        configured = any(d.kind == "gpu" and d.backend != "cpu" for d in self.config.devices)
        backend, found = select_backend(self.config.pre_post.backend, configured)
        log.info(
            "pre_post",
            backend=backend,
            gpu=found.describe() if found is not None else "not asked for",
        )
        if backend == "cuda":
            self._gpu = await anyio.to_thread.run_sync(GpuService)

    def _start_workers(self, limiter: anyio.CapacityLimiter) -> None:
        for placement in self.plan.placements:
            dev = self.config.device(placement.device)
            if dev.kind != "dla":
                continue  # the gpu device does pre/post-processing (CPU fallback: threads)
            faults = None
            if dev.faults.active:
                faults = FaultConfig(
                    error_rate=dev.faults.error_rate,
                    hang_rate=dev.faults.hang_rate,
                    seed=dev.faults.seed,
                )
            try:
                worker = DeviceWorker(
                    dev.name,
                    int(dev.core or 0),
                    str(placement.path),
                    placement.loadable,
                    self._scheduler,
                    mode=dev.mode,
                    latency_us=placement.latency_us,
                    threads=dev.threads,
                    faults=faults,
                    task_timeout_ms=dev.task_timeout_ms,
                    limiter=limiter,
                    pre_post=self.pre_post,
                    gpu=self._gpu,
                    backend=dev.backend,
                    cudla_loadable=cudla_loadable_for(self.plan, placement),
                )
            except DlaError as exc:  # the core cannot open or load (e.g. no exact INT8 kernel)
                raise StartupError(
                    f"cannot open or load {placement.path}: {exc}", key=f"devices.{dev.name}"
                ) from None
            self._scheduler.add_device(
                dev.name,
                [placement.model],
                capacity=dev.queue_depth,
                service_us=placement.latency_us,
            )
            self._workers[dev.name] = worker

    async def _serve_device(self, worker: DeviceWorker) -> None:
        """Warm ``worker``'s core with one task (readiness waits for every device), then serve."""
        self.metrics.device_state(worker.name, "warming")
        try:
            await worker.warm_up()
        except DladError as exc:  # the device still serves; /health/ready says it failed
            log.error("warm_up_failed", device=worker.name, reason=exc.message)
            self.metrics.device_state(worker.name, "failed")
        except BaseException:
            worker.core.close(force=True)  # cancelled before run() took the core over
            raise
        else:
            self.metrics.device_state(worker.name, "ready")
            self._healthy[worker.name] = True
        self._warming -= 1
        if self._warming == 0:
            self._warm.set()
        await worker.run(self._on_outcome)

    async def _heartbeat_loop(self) -> None:
        """Every ``metrics.heartbeat_s``: prove the loop turns (``/health/live``) and sample the
        queues and devices into the gauges (the scrape itself never touches them)."""
        while True:
            self.metrics.daemon_state(self.state.value)
            snaps = {s.name: s for s in self._scheduler.snapshot()}
            self.metrics.tick(
                DeviceSample(
                    name,
                    snaps[name].queue_depth,
                    snaps[name].capacity,
                    snaps[name].in_flight,
                    worker.stats.busy_ns,
                )
                for name, worker in self._workers.items()
            )
            await anyio.sleep(self.config.metrics.heartbeat_s)

    async def _drain(self) -> None:
        self.state = State.DRAINING
        log.info("draining", queued=self._scheduler.queued(), pending=len(self._pending))
        for job in self._scheduler.drain():
            await self._send_error(job.payload, ShuttingDown("the daemon is shutting down"))
        with anyio.move_on_after(self.config.daemon.drain_timeout_s):
            while self._pending:  # jobs on a device: each reply wakes this
                self._idle = anyio.Event()
                await self._idle.wait()

    # ------------------------------------------------------------------------ frontend
    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            await self._handle(list(frames))

    async def _handle(self, frames: list[Any]) -> None:
        client = bytes(frames[0].buffer)
        self.counters.received += 1
        try:
            request = protocol.decode_request(frames[1:], self.limits)
        except DladError as exc:
            log.bind(client=client.hex(), request_id=exc.request_id).info(
                "bad_request", reason=exc.message
            )
            self.metrics.observe_reply("", None, exc.status)
            await self._send(client, protocol.error_reply(exc))
            return
        try:
            if isinstance(request, protocol.InferRequest):
                await self._infer(client, request)
            elif isinstance(request, protocol.CancelRequest):
                await self._cancel(client, request)
            else:
                await self._send(client, self._status_reply(request.id, load=request.load))
        except DladError as exc:
            if isinstance(request, protocol.InferRequest):  # refused at admission
                self.metrics.observe_reply(request.model, None, exc.status)
            await self._send(
                client,
                protocol.error_reply(exc, request_id=request.id, request_kind=int(request.kind)),
            )

    async def _infer(self, client: bytes, req: protocol.InferRequest) -> None:
        if self.state is not State.RUNNING:
            raise ShuttingDown("the daemon is shutting down")
        key = (client, req.id)
        if key in self._pending:
            raise BadRequest(f"request id {req.id} is already in flight on this connection")
        model = next((m for m in self.config.models if m.name == req.model), None)
        now = time.monotonic_ns()
        d = self.config.daemon
        budget_ms = min(float(req.deadline_ms or d.default_deadline_ms), d.max_deadline_ms)
        work = Work(
            client=client,
            request_id=req.id,
            image=req.image,
            pixel_format=req.format,
            conf=req.conf if req.conf is not None else (model.conf_threshold if model else 0.25),
            iou=req.iou if req.iou is not None else (model.iou_threshold if model else 0.45),
            max_det=req.max_det or (min(model.max_det, protocol.MAX_DET) if model else 300),
            received_ns=now,
            model=req.model,
        )
        job = Job(
            self._next_job,
            req.model,
            now + int(budget_ms * 1e6),
            work,
            priority=req.priority,
            stream=req.stream,
        )
        self._next_job += 1
        superseded = self._scheduler.admit(job)  # NotFound / Overloaded answer at once
        self._pending[key] = job.id
        self._expiry_wake.set()
        for old in superseded:
            await self._send_error(
                old.payload, Cancelled("superseded by a newer frame of its stream")
            )
        self._workers[job.device].wake()

    async def _cancel(self, client: bytes, req: protocol.CancelRequest) -> None:
        job_id = self._pending.get((client, req.id))
        if job_id is None:
            raise NotFound(f"request {req.id} is not queued")
        job = self._scheduler.cancel(job_id)  # NotFound if it is already running
        await self._send_error(job.payload, Cancelled("cancelled by the client"))
        await self._send(client, protocol.CancelReply(req.id, Status.OK))

    async def _expiry_loop(self) -> None:
        """Answer queued jobs whose deadline passed, at their deadline (a timer, not a poll):
        sleep until the earliest queued deadline, or until a new job may have an earlier one."""
        while True:
            for job in self._scheduler.expire():
                await self._send_error(
                    job.payload, DeadlineExceeded("deadline passed while queued")
                )
            self._expiry_wake = anyio.Event()
            nearest = self._scheduler.earliest_deadline()
            if nearest is None:
                await self._expiry_wake.wait()
                continue
            with anyio.move_on_after(max(nearest - time.monotonic_ns(), 0) / 1e9):
                await self._expiry_wake.wait()

    async def _on_outcome(self, out: Outcome) -> None:
        work = out.work
        self._track_health(out.device)
        if out.error is not None:
            err = out.error if isinstance(out.error, DladError) else InternalError(str(out.error))
            await self._send_error(work, err, device=out.device)
            return
        total = (time.monotonic_ns() - work.received_ns) / 1e3
        timing = protocol.Timing(
            queue_us=int(out.queue_us),
            pre_us=int(out.pre_us),
            device_us=int(out.device_us),
            post_us=int(out.post_us),
            total_us=int(total),
            start_ns=out.start_ns or None,
            end_ns=out.end_ns or None,
        )
        dets = out.detections if out.detections is not None else np.zeros((0, 6), np.float32)
        reply = protocol.InferReply(
            work.request_id,
            Status.OK,
            device=out.device,
            timing=timing,
            detections=np.ascontiguousarray(dets[: protocol.MAX_DET], np.float32),
        )
        self._pending.pop((work.client, work.request_id), None)
        self.metrics.observe_reply(
            work.model, out.device, Status.OK, queue_us=timing.queue_us,
            device_us=timing.device_us, total_us=timing.total_us,
        )  # fmt: skip
        await self._send(work.client, reply)

    def _track_health(self, device: str) -> None:
        """Keep /health/ready's view of ``device`` equal to STATUS's ``healthy`` after warm-up:
        ``failed`` while its last tasks all failed, ``ready`` again after a success."""
        worker = self._workers.get(device)
        if worker is None or worker.warm != "ok":
            return  # warming, or warm-up failed: _serve_device set that state
        healthy, why = worker.health()
        if self._healthy.get(device) is not healthy:  # only changes reach the metrics and log
            self._healthy[device] = healthy
            self.metrics.device_state(device, "ready" if healthy else "failed")
            if healthy:
                log.info("device_healthy", device=device)
            else:
                log.warning("device_unhealthy", device=device, reason=why)

    async def _send_error(self, work: Work, err: DladError, device: str | None = None) -> None:
        self._pending.pop((work.client, work.request_id), None)
        log.bind(request_id=work.request_id, client=work.client.hex(), device=device).info(
            "request_failed", status=err.status.name, reason=err.message
        )
        total = int((time.monotonic_ns() - work.received_ns) / 1e3)
        self.metrics.observe_reply(work.model, device, err.status, total_us=total)
        reply = protocol.InferReply(
            work.request_id,
            err.status,
            message=err.message[: protocol.MAX_MESSAGE_CHARS] or err.status.name,
            device=device,
            timing=protocol.Timing(total_us=total),
        )
        await self._send(work.client, reply)

    async def _send(self, client: bytes, message: Any) -> None:
        assert self._socket is not None  # set before any request is read
        if not self._pending:
            self._idle.set()
        status = getattr(message, "status", Status.OK)
        self.counters.replied += 1
        self.counters.by_status[status.name] = self.counters.by_status.get(status.name, 0) + 1
        await self._socket.send_multipart([client, *protocol.encode(message)], copy=False)

    # ------------------------------------------------------------------------ status
    def _status_reply(self, request_id: int, *, load: bool = False) -> protocol.StatusReply:
        snaps = {s.name: s for s in self._scheduler.snapshot()}
        devices = []
        for name, worker in self._workers.items():
            snap = snaps[name]
            devices.append(
                {
                    "name": name,
                    "kind": self.config.device(name).kind,
                    "core": worker.core.core,
                    "healthy": worker.health()[0],
                    "busy": snap.in_flight > 0,
                    "in_flight": snap.in_flight,
                    "queue_depth": snap.queue_depth,
                    "completed": worker.stats.completed,
                    "failed": worker.stats.failed,
                    "service_time_us": float(snap.service_time_us),
                }
            )
        models = []
        for m in self.config.models:
            placements = self.plan.for_model(m.name)
            if not placements:
                continue
            lo = placements[0].loadable
            models.append(
                {
                    "name": m.name,
                    "devices": [p.device for p in placements],
                    "input_height": lo.image_size[0],
                    "input_width": lo.image_size[1],
                    "classes": lo.num_classes,
                }
            )
        capacity = sum(s.capacity for s in snaps.values())
        report: dict[str, Any] = {
            "name": self.config.daemon.name,
            "state": self.state.value,
            "live": True,
            "ready": self.ready.is_set() and self.metrics.ready()[0],
            "version": dlad.__version__,
            "protocol": protocol.PROTOCOL_VERSION,
            "devices": devices,
            "models": models,
            "queues": {
                "depth": self._scheduler.queued(),
                "capacity": capacity,
                "streams": self._scheduler.streams_waiting(),
            },
        }
        if load:
            report["load"] = self.metrics.load_report()
        return protocol.StatusReply(request_id, Status.OK, report=report)  # type: ignore[arg-type]


async def run(plan: Plan) -> None:
    """Serve ``plan`` with signal handling: first SIGTERM/SIGINT drains, a second forces exit."""
    daemon = Daemon(plan)
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    if daemon.state is State.RUNNING:
                        log.info("signal", signal=signal.Signals(signum).name, action="drain")
                        daemon.stop()
                    else:
                        log.warning("signal", signal=signal.Signals(signum).name, action="force")
                        tg.cancel_scope.cancel()
                        return

        tg.start_soon(watch_signals)
        await daemon.serve()
        tg.cancel_scope.cancel()


__all__ = ["Daemon", "Overloaded", "StartupError", "State", "run"]
