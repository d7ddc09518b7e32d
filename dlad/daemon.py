"""The daemon: lifecycle and wiring of the frontend, the native data plane and its engines.

Lifecycle: ``RUNNING → DRAINING → STOPPED``. The first SIGTERM/SIGINT (or :meth:`Daemon.stop`)
starts draining: new INFERs are answered SHUTTING_DOWN, queued ones too, and jobs already on a
device finish and are answered, within ``daemon.drain_timeout_s``; then the task group is
cancelled and the engines are closed. A second signal forces the exit at once. Every accepted
request gets exactly one reply: a result or a typed error.

One request path: every frame is read, admitted, scheduled, run and answered by the native data
plane (:mod:`dlad.native_plane`, a C++ thread), on engines behind one interface; Python is the
control plane. This module builds the engines from the plan (DLA cores through cuDLA and timing
cores in the plane itself, the rest as Python engines running their executor's per-frame code,
:mod:`dlad.engines.python`), hands the socket to the plane through the frontend
(:mod:`dlad.frontend`, which answers what the plane forwards), turns the plane's health news
into the log and metrics, answers STATUS, tracks readiness for ``/health``, and stops it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import gc
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import structlog

import dlad
from dlad import protocol
from dlad.config import Config, Plan
from dlad.devices.base import DlaError
from dlad.devices.dram import SharedDram
from dlad.devices.factory import resolve_backend
from dlad.engines.python import DlaFrames, GpuBatches
from dlad.errors import DladError, Overloaded, StartupError
from dlad.executors.base import UNHEALTHY_AFTER, Executor, failing_words
from dlad.executors.dla import DlaExecutor
from dlad.executors.factory import ExecutorBuildError, build_executors
from dlad.executors.gpu import GpuExecutor
from dlad.families import family_for
from dlad.frontend import Counters, Frontend
from dlad.kserve.ports import KServePorts
from dlad.metrics import DeviceSample, Metrics, MetricsServer
from dlad.native_plane import (
    CudaFunctions,
    CudlaFunctions,
    DeviceState,
    EventKind,
    HealthEvent,
    PlaneCudla,
    PlaneDevice,
    PlaneGpu,
)
from dlad.plane_cores import PlaneCoreUnsupported
from dlad.systemd import Notifier

if TYPE_CHECKING:
    from dlad.config import Placement
    from dlad.devices.base import DlaCore
    from dlad.gpu.service import GpuService
    from dlad.plane_cores import PlaneCore

__all__ = ["Daemon", "Overloaded", "StartupError", "State", "run"]

log = structlog.get_logger("dlad")

_PLANE_SLOTS = 2  # tasks in flight on each of the native plane's cores (a DlaExecutor's slots)


def _plane_failing(d: DeviceState) -> str:
    """Why a core of the native plane is unhealthy (Executor.health's words), or ""."""
    return "" if d.failing < UNHEALTHY_AFTER else failing_words(d.failing, d.last_failure)


EngineKind = Literal["cudla", "timing", "gpu-graphs", "gpu-timing", "python"]


PrePostWhere = Literal["gpu", "cpu", "off"]


def pre_post_where(plan: Plan, p: Placement, *, pre_post: bool, gpu: bool) -> PrePostWhere:
    """Where placement ``p``'s frames are pre/post-processed (``gpu``: the daemon has its GPU
    pre/post): on the GPU where its family has a CUDA decode and its engine is a DLA core or
    the GPU's own CUDA graphs (torch, TensorRT), else on the CPU; ``off`` without pre/post."""
    if not pre_post:
        return "off"
    d = plan.config.device(p.device)
    on_gpu = gpu and family_for(p.loadable.family).cuda
    if d.kind != "dla" and (d.engine or "emulated") not in ("torch", "tensorrt"):
        on_gpu = False  # only the GPU's graphs keep pre/post there
    return "gpu" if on_gpu else "cpu"


def plane_engine(plan: Plan, p: Placement, *, pre_post: bool, gpu: bool) -> tuple[EngineKind, str]:
    """Which engine serves placement ``p`` on the plane (``gpu``: pre/post-processing runs on
    the GPU), and that in words (``dlad status --platform``, the log): ``cudla``, a real DLA
    core driven by the plane, and ``timing``, an emulated core in timing mode without faults,
    each with pre/post off or as the GPU chain; ``gpu-graphs``, the torch or TensorRT engine's
    batches with pre/post on the GPU, which the plane launches as CUDA graphs
    (``Daemon._plane_batches``; where that cannot be built, the log says why and a Python engine
    serves); ``gpu-timing``, the
    emulated GPU's batches in timing mode with pre/post off; ``python``, a Python engine running
    its executor's per-frame code (a numeric or faulty core, any core whose pre/post-processing
    runs on the CPU, the other GPU batches). The last three are built as executors."""
    d = plan.config.device(p.device)
    # a model family without a CUDA decode is pre/post-processed on the CPU, as the executors
    # do (dlad/families): the plane's GPU chain runs the family's post program
    gpu = gpu and family_for(p.loadable.family).cuda
    where = ("pre/post off" if not pre_post else "pre/post on the GPU" if gpu
             else "pre/post on the CPU")  # fmt: skip
    if d.kind != "dla":
        engine = d.engine or "emulated"
        if not pre_post and engine == "emulated" and d.mode == "timing":
            return "gpu-timing", (f"C++: emulated Orin GPU (timing), batches of up to "
                                  f"{d.batch_limit}, pre/post off")  # fmt: skip
        if pre_post and gpu and engine in ("torch", "tensorrt"):  # graphs the plane launches
            return "gpu-graphs", (f"C++: GPU batches of up to {d.batch_limit} on the {engine} "
                                  f"engine's CUDA graphs, {where}")  # fmt: skip
        on = "pre/post on the CPU" if pre_post else where  # only graphs stay on the GPU
        return (
            "python",
            f"Python: GPU batches of up to {d.batch_limit} on the {engine} engine, {on}",
        )
    in_plane = gpu or not pre_post  # the plane pre/post-processes on the GPU only
    loadable = plan.config.model(p.model).loadables.cudla_for_core(int(d.core or 0))
    if resolve_backend(d.backend, loadable) == "cudla":
        if in_plane:
            return "cudla", f"C++: cuDLA core {d.core}, {where}"
        return "python", f"Python: cuDLA core {d.core}, {where}"
    if d.mode == "timing" and not d.faults.active and in_plane:
        return "timing", f"C++: emulated DLA core {d.core} (timing), {where}"
    faults = ", fault injection" if d.faults.active else ""
    return "python", f"Python: emulated DLA core {d.core} ({d.mode}{faults}), {where}"


class State(enum.Enum):
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


class Daemon:
    """Serve ``plan`` until stopped (see the module docstring).

    Args:
        plan: the checked config (``dlad.config.load_config(path).plan()``).
        endpoints: override ``plan.endpoints`` (tests bind ``tcp://127.0.0.1:0``-style ports).
        pre_post: override ``pre_post.enabled`` of the config.
        metrics_port: override ``metrics.port`` (0: any free port, see ``metrics_server.port``).
        kserve_ports: override ``[kserve]``'s ports ({"http": 0, "grpc": 0}: any free ones, see
            ``kserve.http.port``, ``kserve.grpc.port``).
        notifier: where readiness, the watchdog and the drain are told (``Type=notify`` under
            systemd); by default from ``$NOTIFY_SOCKET``, doing nothing without it.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        endpoints: Sequence[str] | None = None,
        pre_post: bool | None = None,
        metrics_port: int | None = None,
        kserve_ports: dict[str, int] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.plan = plan
        self.notifier = Notifier() if notifier is None else notifier
        self.config: Config = plan.config
        self.endpoints = tuple(endpoints or plan.endpoints)
        self.pre_post = plan.config.pre_post.enabled if pre_post is None else pre_post
        self.state = State.RUNNING
        self.ready = anyio.Event()
        self.stopped = threading.Event()
        """Set once :meth:`serve` has returned or raised (wait on it from any thread)."""
        self.lingering = threading.Event()
        """Set when the drain is over and the frontend answers its last messages (for
        ``daemon.close_linger_ms``) before the socket closes."""
        self.executors: dict[str, Executor] = {}
        """The Python engines' executors, by device (the plane calls their per-frame code)."""
        self.dram = SharedDram(self.config.soc.dram_contention)
        """The emulated DRAM: one model, which the plane's timing cores and the Python engines'
        emulated devices share (``[soc] dram_contention``; :mod:`dlad.devices.dram`)."""
        self._stop = anyio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
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
            self.metrics_server = MetricsServer(
                self.metrics, m.host, port, request_timeout_s=m.request_timeout_s
            )
        self.frontend = Frontend(
            self.config,
            self.metrics,
            status=self._status_report,
            accepting=lambda: self.state is State.RUNNING,
            curve=(
                (plan.server_secret_key, plan.client_keys_dir)
                if plan.server_secret_key is not None and plan.client_keys_dir is not None
                else None
            ),
        )
        self.kserve: KServePorts | None = None
        if self.config.kserve.enabled:
            self.kserve = KServePorts(plan, self.frontend, ready=self._serving,
                                      model_ready=self._model_serving,
                                      ports=kserve_ports)  # fmt: skip
        self._gpu: GpuService | None = None
        self._plane_cores: list[DlaCore] = []  # the native plane's cuDLA cores
        self._plane_sync = threading.Lock()  # the loop's, the metrics thread's _sync_plane
        self._cold: dict[str, str] = {}  # the engines whose warm-up failed: why
        self._pre_post_where: dict[str, PrePostWhere] = {}  # each engine's, once it is built
        self._warming: set[str] = set()  # the engines whose warm-up runs in the plane
        self._warm = anyio.Event()
        self._healthy: dict[str, bool] = {}  # after warm-up, as last told to the metrics

    @property
    def bound(self) -> list[str]:
        """The endpoints the frontend is bound to (ports resolved), once serving."""
        return self.frontend.bound

    @property
    def counters(self) -> Counters:
        """Messages received and replies sent, by status."""
        return self.frontend.totals()

    def quarantines(self, device: str) -> int:
        """How often ``device`` has been quarantined since the daemon started."""
        plane = self.frontend.plane
        states = self.frontend.plane_state if plane is None else plane.state()[0]
        return next(d.quarantines for d in states if d.name == device)

    def probe_now(self, device: str) -> bool:
        """Probe the quarantined ``device`` now rather than after its rest; False where it is
        not quarantined (from any thread)."""
        plane = self.frontend.plane
        if plane is None:
            raise RuntimeError("the daemon is not serving")
        return plane.probe_now(device)

    def _serving(self) -> bool:
        """Whether the daemon serves (its readiness, as ``/health/ready`` tells it)."""
        return self.state is State.RUNNING and self.ready.is_set() and self.metrics.ready()[0]

    def _model_serving(self, model: str) -> bool:
        """Whether a device serving ``model`` serves now."""
        devices = {p.device for p in self.plan.for_model(model)}
        return any(d["state"] == "serving" for d in self._plane_status()[0] if d["name"] in devices)

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
        """Run until stopped and drained.

        Raises StartupError when a port cannot be bound or a device cannot load, and what a
        device or the socket raised.
        """
        self._loop = asyncio.get_running_loop()
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
            self.frontend.open(self.endpoints)
            if self.kserve is not None:
                await self.kserve.start()
            for p in self.plan.placements:
                self.metrics.device_state(p.device, "loading")
            await self._serve_plane()
        finally:
            self.state = State.STOPPED
            if self.kserve is not None:  # first: what it awaits is answered or cancelled
                with anyio.CancelScope(shield=True):
                    await self.kserve.close()
            self.frontend.close_plane()  # its GPU chains use the GPU's memory
            for executor in self.executors.values():  # after the plane that called them
                executor.close()
            self._close_plane_cores()  # after the plane, before the GPU (their CUDA imports)
            if self._gpu is not None:  # after the executors: their streams use its memory
                self._gpu.close()
            if self.metrics_server is not None:
                self.metrics_server.close()
            self.frontend.close(linger_ms=int(self.config.daemon.close_linger_ms))
            log.info("stopped", replied=self.counters.replied)
            self.stopped.set()

    async def _serve_plane(self) -> None:
        """serve() once the socket is bound. Each placement's engine: a real DLA core
        through cuDLA, or an emulated one in timing mode with pre/post-processing off or on the
        GPU, runs in the plane itself (a :class:`~dlad.gpu.service.GpuService` builds each
        core's GPU slots); the rest (a numeric core, pre/post-processing on the CPU, the GPU's
        batches) is a Python engine of the plane's running its executor's per-frame code
        (:mod:`dlad.engines.python`)."""
        gpu, cuda = await self._plane_gpu()
        engines = {p.device: plane_engine(self.plan, p, pre_post=self.pre_post,
                                          gpu=gpu is not None)
                   for p in self.plan.placements}  # fmt: skip
        self._pre_post_where = {
            p.device: pre_post_where(self.plan, p, pre_post=self.pre_post, gpu=gpu is not None)
            for p in self.plan.placements
        }
        log.info("engines", **{name: words for name, (_, words) in engines.items()})
        devices: dict[str, PlaneDevice] = {}
        cudla: CudlaFunctions | None = None
        python: list[Placement] = []
        for p in self.plan.placements:
            d = self.config.device(p.device)
            plane_gpu: PlaneGpu | None = None
            spec: PlaneCudla | None = None
            kind = engines[p.device][0]
            if kind == "cudla":
                try:
                    core = await self._open_plane_core(p, gpu)
                except PlaneCoreUnsupported as exc:
                    log.warning("cudla_python_engine", device=p.device, reason=str(exc))
                    python.append(p)
                    continue
                plane_gpu, spec, cudla = core.gpu, core.spec, core.functions
            elif kind == "timing":
                if gpu is not None:
                    plane_gpu = await self._plane_slots(gpu, p)
            else:
                python.append(p)
                continue
            devices[p.device] = PlaneDevice(p.device, p.latency_us, slots=_PLANE_SLOTS,
                                            capacity=d.queue_depth, gpu=plane_gpu,
                                            cudla=spec)  # fmt: skip
        devices.update(await self._python_engines(python, {p: k for p, (k, _) in engines.items()}))
        self.frontend.on_plane_health = self._sync_plane
        # /health/ready and a scrape see the plane as it is (its events are the loop's)
        self.metrics.refresh = functools.partial(self._sync_plane, events=False)
        self.frontend.start_plane(
            [devices[p.device] for p in self.plan.placements],
            cuda=cuda,
            cudla=cudla,
            dram=self.dram if self.dram.contention > 0 else None,
        )
        plane = self.frontend.plane
        assert plane is not None  # started above
        # The plane's own engines warm up there, ahead of any client's frame; the Python
        # engines did above.
        warming = [p.device for p in self.plan.placements if devices[p.device].run is None]
        self._warming = set(warming)
        for p in self.plan.placements:
            if p.device in self._cold:  # out of placement until a probe passes
                self._warm_up_failed(p.device, self._cold[p.device])
            elif p.device not in self._warming:
                self.metrics.device_state(p.device, "ready")
            else:
                self.metrics.device_state(p.device, "warming")
        plane.warm_up(warming)
        if not warming:
            self._warm.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat_loop)
            tg.start_soon(self.frontend.receive_loop)
            tg.start_soon(self.frontend.watch_connections)
            await self._warm.wait()  # readiness waits for every engine's warm-up
            await self._serve_until_stopped(tg)
        late = await self.frontend.answer_what_is_queued()
        log.info("closing", answered_after_the_drain=late)

    async def _python_engines(
        self, placements: Sequence[Placement], kinds: dict[str, EngineKind]
    ) -> dict[str, PlaneDevice]:
        """The plane's engines for ``placements`` that are built as executors (``kinds``:
        :func:`plane_engine`'s): each placement's executor, as the config builds it, warmed up;
        its per-frame code run by the plane as a Python engine, or, for ``gpu-graphs`` and
        ``gpu-timing``, its GPU's batches handed to the plane's own engine. Raises StartupError
        where one cannot be built."""
        if not placements:
            return {}
        try:
            only = {p.device for p in placements}
            built = build_executors(self.plan, pre_post=self.pre_post, gpu=self._gpu,
                                    dram=self.dram, only=only)  # fmt: skip
        except ExecutorBuildError as exc:
            raise StartupError(exc.message, key=exc.key) from None
        self.executors.update(built)  # closed with the daemon (they hold the cores)
        out: dict[str, PlaneDevice] = {}
        for p in placements:
            executor = built[p.device]
            try:
                await executor.warm_up()
            except DladError as exc:  # quarantined once the plane runs (_serve_plane)
                self._cold[executor.name] = exc.message
            d = self.config.device(p.device)
            if isinstance(executor, GpuExecutor):
                on_soc = (d.engine or "emulated") != "torch"
                native = None
                graphs = kinds[p.device] == "gpu-graphs" and executor.cuda is not None
                if graphs and p.device not in self._cold:
                    native = await self._plane_batches(executor)
                timing = kinds[p.device] == "gpu-timing"  # the plane's own timing engine
                out[p.device] = PlaneDevice(
                    p.device, executor.service_us, slots=executor.slots, capacity=d.queue_depth,
                    kind="gpu" if on_soc else "", max_batch=executor.max_batch,
                    max_queue_delay_us=executor.max_queue_delay_us,
                    curve_us=executor.batch_service_us, tier=1,
                    run=None if native or timing else GpuBatches(executor),
                    gpu=native[0] if native else None, graphs=native[1] if native else (),
                )  # fmt: skip
            elif isinstance(executor, DlaExecutor):
                frames = DlaFrames(executor)
                out[p.device] = PlaneDevice(p.device, executor.service_us, slots=frames.slots,
                                            capacity=d.queue_depth, run=frames)  # fmt: skip
        return out

    async def _plane_batches(
        self, executor: GpuExecutor
    ) -> tuple[PlaneGpu, tuple[int, ...]] | None:
        """The GPU's batches as the plane's own engine: the executor's engine, whose CUDA
        graphs the plane launches between its own pre and post kernels
        (:meth:`GpuService.plane_batches`), the executor's CUDA path freed; None (logged why,
        the executor then serves as a Python engine) where that cannot be built."""
        cuda, gpu = executor.cuda, self._gpu
        assert cuda is not None  # the caller checked
        assert gpu is not None  # the executor's CUDA path is the service's
        from dlad.gpu.driver import CudaError  # noqa: PLC0415 (GPU only)

        build = functools.partial(
            gpu.plane_batches, cuda.engine, executor.loadable, executor.slots,
            executor.max_batch,
        )  # fmt: skip
        try:
            made = await anyio.to_thread.run_sync(build)
        except (CudaError, ValueError, RuntimeError) as exc:
            log.warning("gpu_python_engine", device=executor.name, reason=str(exc))
            return None
        executor.cuda = None  # the plane runs the batches: the executor's path is not used
        await anyio.to_thread.run_sync(cuda.close)
        return made

    async def _plane_gpu(self) -> tuple[GpuService | None, CudaFunctions | None]:
        """With pre/post-processing on the GPU: the GPU and the driver's functions for the
        native plane (else None, None: pre/post-processing, if on, runs on the CPU in Python
        engines). Raises StartupError where ``[pre_post] backend = "cuda"`` and no GPU is
        usable."""
        if not self.pre_post:
            return None, None
        key = "pre_post.backend"
        try:
            await self._start_gpu()
        except RuntimeError as exc:  # cuda required, no GPU usable
            raise StartupError(str(exc), key=key) from None
        gpu = self._gpu
        if gpu is None:
            return None, None
        self._shm_to_gpu(gpu)
        from dlad.gpu.driver import CudaError, plane_functions  # noqa: PLC0415 (GPU only)

        try:
            return gpu, plane_functions()
        except CudaError as exc:
            raise StartupError(f"the native plane's GPU pre/post cannot run: {exc}",
                               key=key) from None  # fmt: skip

    async def _plane_slots(self, gpu: GpuService, p: Placement) -> PlaneGpu:
        """An emulated core's GPU slots for the native plane. Raises StartupError."""
        from dlad.gpu.driver import CudaError  # noqa: PLC0415 (GPU only)

        try:
            return await anyio.to_thread.run_sync(
                functools.partial(gpu.plane_gpu, p.loadable, _PLANE_SLOTS)
            )
        except (CudaError, ValueError) as exc:
            raise StartupError(f"the native plane's GPU pre/post cannot run: {exc}",
                               key="pre_post.backend") from None  # fmt: skip

    async def _open_plane_core(self, p: Placement, gpu: GpuService | None) -> PlaneCore:
        """A real DLA core for the native plane (closed after it). Raises StartupError."""
        from dlad.devices.cudla.cuda_interop import CudaInteropError  # noqa: PLC0415
        from dlad.gpu.driver import CudaError  # noqa: PLC0415 (imports no CUDA until called)
        from dlad.plane_cores import open_plane_core  # noqa: PLC0415

        try:
            opening = functools.partial(open_plane_core, self.plan, p, slots=_PLANE_SLOTS, gpu=gpu)
            core = await anyio.to_thread.run_sync(opening)
        except (DlaError, CudaError, CudaInteropError, ValueError) as exc:
            raise StartupError(
                f"DLA core {self.config.device(p.device).core} cannot serve the native plane: "
                f"{exc}",
                key=f"devices.{p.device}.backend",
            ) from None
        self._plane_cores.append(core.core)
        log.info("cudla_plane_core", device=p.device, gpu_pre_post=gpu is not None)
        return core

    async def _serve_until_stopped(self, tg: anyio.abc.TaskGroup) -> None:
        """Ready: serve until stopped, drain, linger, then cancel ``tg`` (the serving loops)."""
        # What start-up built (models, engines, modules) lives as long as the daemon: out of
        # the collector's sight, a collection walks only what serving allocates.
        gc.collect()
        gc.freeze()
        self.ready.set()
        devices = [p.device for p in self.plan.placements]
        log.info("listening", endpoints=self.bound, devices=devices,
                 event_loop=_loop_name())  # fmt: skip
        self.notifier.ready(f"serving {', '.join(devices) or 'no devices'} on "
                            f"{', '.join(self.bound)}")  # fmt: skip
        await self._stop.wait()
        await self._drain()
        # Go on answering a while (INFER: SHUTTING_DOWN), so that clients still sending learn
        # the daemon is going before the port closes; then stop reading and answer whatever
        # the socket still holds.
        self.lingering.set()
        await anyio.sleep(self.config.daemon.close_linger_ms / 1e3)
        tg.cancel_scope.cancel()

    def _close_plane_cores(self) -> None:
        """Close the native plane's cuDLA cores (after the plane: its engines waited for
        their tasks). A failure is logged: the daemon is stopping."""
        cores, self._plane_cores = self._plane_cores, []
        for core in cores:
            try:
                core.close(force=True)
            except DlaError as exc:  # noqa: PERF203 (two cores at most)
                log.error("cudla_close_failed", core=getattr(core, "core", None), error=str(exc))

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
            # Uploads never grow mid-run (dlad/gpu/prepost.py says why): room for the largest
            # image the frontend admits, allocated before anything runs.
            fe = self.config.frontend
            biggest = fe.max_image_width * fe.max_image_height * 3
            self._gpu = await anyio.to_thread.run_sync(
                functools.partial(
                    GpuService, max_image_bytes=biggest, frames=self.config.pre_post.gpu_frames
                )
            )

    def _health_changed(self, device: str, serving: bool) -> None:
        self._healthy[device] = serving
        self.metrics.device_state(device, "ready" if serving else "quarantined")

    def _track_plane_health(self, d: DeviceState) -> None:
        """Keep /health/ready's view of an engine equal to STATUS's ``healthy`` after warm-up:
        ``failed`` while its last frames all failed, ``ready`` again after one goes through;
        a quarantine's state stands."""
        if d.quarantined is not None or d.name in self._cold or d.name in self._warming:
            return  # that state stands
        healthy = d.failing < UNHEALTHY_AFTER
        self._set_health(d.name, healthy, _plane_failing(d), was=self._healthy.get(d.name, True))

    def _sync_plane(self, *, events: bool = True) -> None:
        """Bring the log and metrics up to the plane: its replies, what its health keeping did
        (``events``: on the event loop only, the heartbeat's and the plane's news), each
        engine's health. From the loop and the metrics server's threads (a scrape,
        /health/ready), one at a time."""
        plane = self.frontend.plane
        if plane is None:
            return
        with self._plane_sync:
            self.frontend.observe_plane()
            if events:
                self._plane_events(plane.events())
            for d in plane.state()[0]:
                self._track_plane_health(d)

    def _warm_up_failed(self, device: str, why: str) -> None:
        """An engine of the plane failed its warm-up: out of placement until a probe passes
        (the plane's own engines were put there by the plane already)."""
        log.error("warm_up_failed", device=device, reason=why)
        self._cold[device] = why
        self.metrics.device_state(device, "failed")
        plane = self.frontend.plane
        if plane is not None and self.config.health.quarantine_after > 0:
            plane.quarantine(device, f"warm-up failed: {why}")

    def _plane_events(self, events: Sequence[HealthEvent]) -> None:
        """The log lines and metrics of what the plane's health keeping did."""
        for e in events:
            if e.kind is EventKind.WARMED:
                self._warming.discard(e.device)
                if e.reason:
                    self._warm_up_failed(e.device, e.reason)
                else:
                    self._healthy[e.device] = True
                    self.metrics.device_state(e.device, "ready")
                if not self._warming:
                    self._warm.set()
            elif e.kind is EventKind.QUARANTINED:
                log.warning("device_quarantined", device=e.device, reason=e.reason,
                            moved=int(e.seconds))  # fmt: skip
                self._health_changed(e.device, serving=False)
            elif e.kind is EventKind.RETURNED:
                log.info("device_returned", device=e.device, quarantined_s=round(e.seconds, 3))
                self._cold.pop(e.device, None)
                self._health_changed(e.device, serving=True)
            elif e.kind is EventKind.PROBE_FAILED:
                log.info("probe_failed", device=e.device, reason=e.reason, next_in_s=e.seconds)
            else:
                log.bind(request_id=e.request_id, client=e.client.hex()).info(
                    "request_retried", failed_on=e.device, device=e.to, reason=e.reason[:200]
                )

    def _set_health(self, device: str, healthy: bool, why: str, *, was: bool | None) -> None:
        """Only changes reach the metrics and the log."""
        if was is healthy:
            return
        self._healthy[device] = healthy
        self.metrics.device_state(device, "ready" if healthy else "failed")
        if healthy:
            log.info("device_healthy", device=device)
        else:
            log.warning("device_unhealthy", device=device, reason=why)

    def _shm_to_gpu(self, gpu: GpuService) -> None:
        """Register each client segment ``dlad/shm.py`` maps with the GPU, so that its frames
        reach the pre kernel without a CPU copy (docs/gpu.md, "The frame's way in"); the
        native plane reads them in place unless ``[pre_post] gpu_frames = "copy"``."""
        if self.frontend.shm is None:
            return
        self.frontend.shm.on_map = gpu.register_frames
        self.frontend.shm.on_unmap = gpu.unregister_frames
        if gpu.read_frames_in_place:
            self.frontend.shm_device = gpu.segment_device

    async def _heartbeat_loop(self) -> None:
        """Every ``metrics.heartbeat_s``: prove the loop turns (``/health/live``) and sample the
        queues and devices into the gauges (the scrape itself never touches them)."""
        keys_checked = tokens_checked = time.monotonic()
        reload_s = self.config.auth.reload_s
        watchdog_s = self.notifier.watchdog_s
        if watchdog_s is not None and self.config.metrics.heartbeat_s > watchdog_s / 2:
            log.warning("watchdog_too_short", watchdog_s=watchdog_s,
                        heartbeat_s=self.config.metrics.heartbeat_s,
                        fix="WatchdogSec at least twice [metrics] heartbeat_s")  # fmt: skip
        while True:
            self.notifier.watchdog()  # the loop turns: systemd's watchdog is fed
            self.metrics.daemon_state(self.state.value)
            keys = self.frontend.client_keys
            if keys is not None and time.monotonic() - keys_checked >= self.config.auth.reload_s:
                keys_checked = time.monotonic()
                try:
                    keys.reload()
                except StartupError as exc:  # the directory went away: keep the last list
                    log.warning("client_keys_unreadable", reason=exc.message)
            self.frontend.reclaim_shm()  # client segments idle past [shm] idle_s
            if self.kserve is not None and time.monotonic() - tokens_checked >= reload_s:
                tokens_checked = time.monotonic()
                self.kserve.reload_tokens()
            plane = self.frontend.plane
            if plane is not None:
                self._sync_plane()
                states = plane.state()[0]
                self.metrics.tick(DeviceSample(d.name, d.queue_depth, d.capacity, d.in_flight,
                                               d.busy_ns, self.config.device(d.name).kind,
                                               d.batches)
                                  for d in states)  # fmt: skip
            await anyio.sleep(self.config.metrics.heartbeat_s)

    async def _drain(self) -> None:
        self.state = State.DRAINING
        self.notifier.stopping(f"draining (at most {self.config.daemon.drain_timeout_s:g} s)")
        queued = 0 if self.frontend.plane is None else self.frontend.plane.state()[1]
        log.info("draining", queued=queued, pending=self.frontend.pending)
        await self.frontend.drain(self.config.daemon.drain_timeout_s)

    # ------------------------------------------------------------------------ status
    def _status_report(self, load: bool = False) -> dict[str, Any]:
        return self._report(*self._plane_status(), load=load)

    def _plane_status(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """STATUS's devices and queues from the native plane's state."""
        plane = self.frontend.plane
        states, queued, streams = (
            (self.frontend.plane_state, 0, 0) if plane is None else plane.state()
        )
        devices = []
        for d in states:
            config = self.config.device(d.name)
            if d.name in self._warming:
                state, reason = "warming", "warming up"
            elif d.quarantined is not None:  # after failing tasks, or its warm-up: probed
                state, reason = "quarantined", d.quarantined
            elif d.name in self._cold:  # quarantine off: it stays so
                state, reason = "failed", f"warm-up failed: {self._cold[d.name]}"
            else:
                state, reason = "serving", _plane_failing(d)
            devices.append(
                {
                    "name": d.name,
                    "kind": config.kind,
                    "core": config.core if config.kind == "dla" else None,
                    "healthy": state == "serving" and d.failing < UNHEALTHY_AFTER,
                    "state": state,
                    "reason": reason[: protocol.MAX_MESSAGE_CHARS],
                    "pre_post": self._pre_post_where.get(d.name, "off"),
                    "busy": d.in_flight > 0,
                    "in_flight": d.in_flight,
                    "queue_depth": d.queue_depth,
                    "completed": d.completed,
                    "failed": d.failed,
                    "service_time_us": float(d.service_time_us),
                    "host_us": float(d.host_us),
                    "max_batch": d.max_batch,
                    "batches": list(d.batches),
                }
            )
        capacity = sum(d.capacity for d in states)
        return devices, {"depth": queued, "capacity": capacity, "streams": streams}

    def _report(
        self, devices: list[dict[str, Any]], queues: dict[str, int], *, load: bool
    ) -> dict[str, Any]:
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
                    "family": lo.family,
                    "class_names": list(lo.class_names),
                }
            )
        fe = self.config.frontend
        report: dict[str, Any] = {
            "name": self.config.daemon.name,
            "state": self.state.value,
            "live": True,
            "ready": self.ready.is_set() and self.metrics.ready()[0],
            "version": dlad.__version__,
            "protocol": protocol.PROTOCOL_VERSION,
            "devices": devices,
            "models": models,
            "queues": queues,
            "limits": {
                "max_in_flight_per_client": fe.max_in_flight_per_client,
                "max_message_bytes": fe.max_message_bytes,
                "max_image_width": fe.max_image_width,
                "max_image_height": fe.max_image_height,
                "cheap_requests_per_s": fe.cheap_requests_per_s,
            },
        }
        if load:
            report["load"] = self.metrics.load_report()
        return report


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


def _loop_name() -> str:
    """The running event loop's kind, for the log: ``uvloop`` or ``asyncio``."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
