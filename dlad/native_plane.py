"""The native data plane (``dlad/native/plane.hpp``) on a pyzmq ROUTER socket.

The plane is the hot path of an INFER without the interpreter: a C++ thread that owns the
ROUTER once :meth:`NativePlane.start` hands it over, reads each INFER with the C++ reader of
``dlad/protocol.py``'s fast path, checks it against the frontend's bounds, admits it into the
scheduler's C++ core, runs it on an engine of its own and sends the reply. Every other message
(STATUS, CANCEL, INFER_BATCH, an INFER the fast path leaves, a malformed message) reaches
:attr:`NativePlane.forwarded`, a PAIR socket, as ``[routing id, peer address, user id,
connection, *parts]`` (the sender's ``Peer-Address`` and ``User-Id``, its CURVE key or "": a
message's metadata does not cross the pair; its connection: 16 bytes naming the fd, its
generation and the socket's SO_COOKIE); whoever reads it answers through
:meth:`NativePlane.send` with that connection, which the plane's thread sends (the ROUTER is
never touched from two threads) unless the connection has closed since.

The control plane reaches the plane's state through calls its thread runs between two turns of
its loop (the caller waits that long at most): :meth:`NativePlane.cancel`,
:meth:`NativePlane.submit` (images the control plane decoded: an INFER the fast path left, an
INFER_BATCH's images, whose answers come back on :attr:`NativePlane.forwarded`), and
:meth:`NativePlane.state`; :meth:`NativePlane.observations` hands over the replies for the
daemon's metrics.

Engines: the emulated DLA core in timing mode (tasks back to back at the core's service time),
or a real one through cuDLA (a :class:`PlaneCudla`: the handle, module, buffers and semaphores
:class:`~dlad.devices.cudla.backend.CudlaDlaCore` opened, which the plane submits tasks to,
``dlad/native/cudla_engine.hpp``); with pre/post-processing off, or on the GPU: a
:class:`PlaneGpu` per core, which :meth:`dlad.gpu.service.GpuService.plane_gpu` builds, hands the
plane the CUDA stream, buffers, fences and post graphs of each slot, and the plane queues each
frame's chain around the core's task itself (``dlad/native/gpu_chain.hpp``) and replies with its
detections. That is what the daemon serves every request with (docs/daemon.md, "The
native data plane").

Linux only (eventfd), and only where ``pip install`` built ``dlad._native``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import itertools
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import zmq

from dlad import protocol
from dlad.config import ModelConfig
from dlad.devices.dram import SharedDram

if TYPE_CHECKING:
    from dlad import _native

__all__ = [
    "CancelResult",
    "CudaFunctions",
    "CudlaFunctions",
    "DeviceState",
    "EventKind",
    "Frame",
    "Health",
    "HealthEvent",
    "Item",
    "NativePlane",
    "Outcome",
    "PlaneCudla",
    "PlaneCudlaSlot",
    "PlaneDevice",
    "PlaneGpu",
    "PlaneGpuSlot",
    "PlaneUnavailable",
    "PythonRun",
    "available",
    "loaded_libzmq",
    "missing_core",
]

_FORWARD_HWM: Final = 100_000  # messages the control plane may fall behind by (then the
# plane stops reading the ROUTER until it catches up: the clients' sockets push back)
_FORWARD_LAST_WAIT_MS: Final = 2000  # at the plane's end, for a reader that may be gone
_ids = itertools.count()


class PlaneUnavailable(RuntimeError):
    """The native data plane cannot run here: dlad was built without its C++ core, or this
    process has no libzmq loaded that the plane can call."""


def _load_core() -> tuple[Any, str]:
    try:
        return importlib.import_module("dlad._native"), ""
    except ImportError as exc:
        return None, str(exc)


_CORE, _CORE_MISSING = _load_core()


def available() -> bool:
    """Whether this install has the C++ core (``dlad._native``, built by ``pip install``)."""
    return _CORE is not None


def missing_core() -> str:
    """Why the C++ core is not here, in one line for a user ("" where it is)."""
    if _CORE is not None:
        return ""
    return (f"dlad was installed without its C++ core, which serves every request "
            f"(dlad._native: {_CORE_MISSING}); install a release wheel, or reinstall with a "
            f"C++ compiler present")  # fmt: skip


def loaded_libzmq() -> str:
    """The path of the libzmq this process has loaded (pyzmq's: its wheel's own copy, or the
    system's). Raises PlaneUnavailable where none is mapped (a pyzmq without libzmq, not Linux)."""
    maps = Path("/proc/self/maps")
    try:
        lines = maps.read_text().splitlines()
    except OSError as exc:
        raise PlaneUnavailable(f"cannot read {maps}: {exc.strerror}") from None
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset dev inode path
        path = fields[5] if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libzmq") and ".so" in path:
            return path
    raise PlaneUnavailable("no libzmq is loaded in this process (is pyzmq's backend libzmq?)")


@dataclass(frozen=True, slots=True)
class CudaFunctions:
    """The CUDA driver functions the plane calls, by address in the libcuda this process
    loaded (:func:`dlad.gpu.driver.plane_functions`), and ``CU_STREAM_WAIT_VALUE_GEQ``."""

    ctx_set_current: int
    memcpy_htod_async: int
    launch_kernel: int
    write_value32: int
    wait_value32: int
    graph_launch: int
    launch_host_func: int
    wait_geq: int
    signal_external: int = 0  # cuSignalExternalSemaphoresAsync: a cuDLA core's chain
    wait_external: int = 0  # cuWaitExternalSemaphoresAsync


@dataclass(frozen=True, slots=True)
class CudlaFunctions:
    """The cuDLA and NvSciSync functions a cuDLA core of the plane calls, by address in the
    libraries :class:`~dlad.devices.cudla.abi.Libraries` loaded."""

    submit_task: int
    get_last_error: int
    fence_wait: int
    fence_clear: int


@dataclass(frozen=True, slots=True)
class PlaneCudlaSlot:
    """One slot of a cuDLA core: the registered pointers of its input and output buffers, in
    the module's order, and of the DLA-signalled semaphore its tasks signal."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    signal: int


@dataclass(frozen=True, slots=True)
class PlaneCudla:
    """A real DLA core, opened by :class:`~dlad.devices.cudla.backend.CudlaDlaCore`
    (:meth:`~dlad.devices.cudla.backend.CudlaDlaCore.plane_core` makes this): its handle and
    module, a CPU wait context of its NvSciSync module, cudlaSubmitTask's flags, how long an
    EOF fence is waited for (µs), and one :class:`PlaneCudlaSlot` per core slot. The core
    keeps all of it alive until the plane is closed."""

    device: int
    module: int
    wait_context: int
    flags: int
    timeout_us: int
    slots: tuple[PlaneCudlaSlot, ...]


@dataclass(frozen=True, slots=True)
class PlaneGpuSlot:
    """One DLA slot's CUDA side (a :class:`~dlad.gpu.prepost.GpuPipeline` and the slot's fence
    words), as addresses and handles: see ``GpuSlotSpec`` in ``dlad/native/gpu_chain.hpp``."""

    stream: int
    image: int  # device buffer for uploads (0: frames are staged)
    staging: int  # pinned host buffer the pre kernel reads (0: frames are uploaded)
    staging_device: int
    image_bytes: int  # the largest frame either takes
    input: int  # the DLA input buffer
    ready: int  # host address of the word the stream writes after pre
    ready_device: int
    done: int  # host address of the word the core writes
    done_device: int
    post_copy: int  # the post graph that copies the frame's settings first
    post_reuse: int  # the same without the copy
    frame: int  # host address of the settings (FrameParams, Geometry)
    out: int  # host address of the result record
    # A cuDLA core's fences instead of the words (then 0): CUDA's imports of the NvSciSync
    # objects the stream signals and the DLA task signals
    ready_semaphore: int = 0
    done_semaphore: int = 0
    # An emulated core's output buffers, host addresses in the module's order: its task writes
    # PlaneGpu.patterns there (none for a cuDLA core, whose DLA writes them)
    outputs: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PlaneGpu:
    """A core's GPU pre/post: the context, the model's pre kernel (int8 ``DLA_HWC4`` input with
    ``input_scale``, else fp16 ``CHW16``), its canvas ``(height, width)``, the pipelines'
    largest ``max_det``, the model's defaults for an INFER that sets none, and one
    :class:`PlaneGpuSlot` per core slot. Its owner (a :class:`~dlad.gpu.service.GpuService`)
    keeps all of it alive until the plane is closed."""

    context: int
    pre_kernel: int
    int8: bool
    input_scale: float
    canvas: tuple[int, int]
    max_det: int
    slots: tuple[PlaneGpuSlot, ...]
    # what an emulated core in timing mode writes into each output (EmulatedDlaCore's patterns,
    # dlad.devices.emulated.timing_pattern), so that both data planes answer a frame alike
    patterns: tuple[bytes, ...] = ()


PythonRun = Callable[
    [list[tuple[int, memoryview | None, tuple[Any, ...]]]],
    tuple[int, int, Sequence[tuple[Any, ...]]],
]
"""A Python engine's work (``dlad/native/python_engine.hpp`` states the contract): a batch of
``(job, pixels, (height, width, channels, bgr, conf, iou, max_det))`` in, ``(start_ns, end_ns,
results)`` out, one ``(failure, message, detections, pre_us, post_us)`` per job."""


_MODEL_DEFAULTS: Final[dict[str, Any]] = {
    f.name: f.default for f in dataclasses.fields(ModelConfig)
}


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """A model's detection settings for an INFER that sets none (``[models.*]``'s, by default
    their defaults): the plane resolves them for every engine."""

    conf: float = _MODEL_DEFAULTS["conf_threshold"]
    iou: float = _MODEL_DEFAULTS["iou_threshold"]
    max_det: int = _MODEL_DEFAULTS["max_det"]


@dataclass(frozen=True, slots=True)
class PlaneDevice:
    """One engine of the plane: ``slots`` batches on it at once, ``capacity`` jobs queued for
    it, ``max_batch`` jobs a batch (a partial batch waiting ``max_queue_delay_us`` at most for
    more), ``curve_us`` its service time by batch size where more than batch 1 is known.

    Its engine, the first that applies: ``run``, a Python engine (that callable on ``slots``
    threads of its own, ``latency_us`` the scheduler's first estimate); ``gpu`` with
    ``graphs``, the GPU's inference (the model's CUDA graph for a batch of n at ``graphs[n -
    1]``, ``gpu.slots`` one per frame of each slot's batch, slot-major, all on one stream:
    ``dlad/native/gpu_batch_engine.hpp``); ``gpu``, a DLA core whose frames are
    pre/post-processed on the GPU (``slots`` is then ``len(gpu.slots)``);
    ``cudla``, a real core (``slots`` is then ``len(cudla.slots)``, ``latency_us`` the
    scheduler's first estimate of a task); else an emulated core in timing mode,
    ``latency_us`` a task. Without ``gpu`` or ``run`` the replies carry no detections."""

    name: str
    latency_us: float
    slots: int = 2
    capacity: int = 4
    gpu: PlaneGpu | None = None
    cudla: PlaneCudla | None = None
    kind: str = "dla"
    max_batch: int = 1
    max_queue_delay_us: float = 0.0
    curve_us: Mapping[int, float] = dataclasses.field(default_factory=dict)
    tier: int = 0
    run: PythonRun | None = None
    graphs: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Frame:
    """An image's shape and settings, which a core with GPU pre/post needs (``None``: the
    model's default)."""

    height: int
    width: int
    format: int = 0  # a code of protocol.PIXEL_FORMATS
    colour: int = 0  # a YUV frame's (protocol.colour_code)
    conf: float | None = None
    iou: float | None = None
    max_det: int | None = None


_NO_FRAME: Final = Frame(0, 0)


@dataclass(frozen=True, slots=True)
class Item:
    """An image the control plane decoded, for :meth:`NativePlane.submit`: ``size`` its bytes
    in the daemon's budget; for a core with GPU pre/post its ``frame`` and its ``pixels``
    (empty where it lies in the segment ``shm``, at ``shm_offset``)."""

    model: str
    stream: str | None
    priority: int
    deadline_ms: int | None
    size: int
    shm: str | None = None  # the registered segment its frame lies in (size 0 then)
    shm_offset: int = 0
    frame: Frame = _NO_FRAME
    pixels: bytes = b""


@dataclass(frozen=True, slots=True)
class DeviceState:
    """One engine in :meth:`NativePlane.state`."""

    name: str
    queue_depth: int
    capacity: int
    in_flight: int
    service_time_us: float
    completed: int
    busy_ns: int  # its tasks' time so far
    failed: int  # its frames answered DEVICE_FAILED (a GPU chain not queued, a cuDLA task)
    failing: int  # of them, the last in a row (0 after a frame that went through)
    last_failure: str  # the last one's words ("" before any)
    quarantined: str | None  # why it is out of placement (None: it serves)
    quarantines: int  # how often it was quarantined since start
    max_batch: int
    batches: tuple[int, ...]  # batches run by size: batches[i] of i + 1 jobs
    host_us: float  # host CPU a frame (the plane's thread and the engine's own), learned


@dataclass(frozen=True, slots=True)
class Health:
    """``[health]`` for the plane (docs/daemon.md, "Engine health", states the rules it
    keeps)."""

    quarantine_after: int = 5
    retry: bool = True
    probe_after_s: float = 1.0
    probe_max_s: float = 30.0


class EventKind(enum.IntEnum):
    """What the plane's health keeping did (:meth:`NativePlane.events`)."""

    QUARANTINED = 0
    RETURNED = 1
    PROBE_FAILED = 2
    RETRIED = 3
    WARMED = 4


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """One thing the plane's health keeping did: ``device`` the engine (RETRIED: the one the
    frame failed on), ``reason`` why (WARMED: "" where the warm-up went through); ``seconds``:
    QUARANTINED, the queued frames moved; RETURNED, how long it was out; PROBE_FAILED, the next
    rest. RETRIED names the request (``client``, ``request_id``) and the engine it went to
    (``to``)."""

    kind: EventKind
    device: str
    reason: str
    seconds: float
    client: bytes
    request_id: int
    to: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """An image's answer to a :meth:`NativePlane.submit` with a tag, read off
    :attr:`NativePlane.forwarded` by :meth:`NativePlane.outcome`: ``header`` is the
    INFER_REPLY header the plane would have sent, ``detections`` the frame that follows it
    (N x 6 float32; empty with pre/post off)."""

    tag: int
    index: int
    header: bytes
    detections: bytes = b""


class CancelResult(enum.IntEnum):
    """What :meth:`NativePlane.cancel` found."""

    CANCELLED = 0  # queued: answered CANCELLED
    NOT_QUEUED = 1  # no such request
    RUNNING = 2  # on an engine (or an INFER_BATCH's images all there): it gets its result


_OUTCOME = struct.Struct("<qq")


def _gpu_tuple(gpu: PlaneGpu | None) -> tuple[Any, ...] | None:
    if gpu is None:
        return None
    slots = [(s.stream, s.image, s.staging, s.staging_device, s.image_bytes, s.input, s.ready,
              s.ready_device, s.done, s.done_device, s.ready_semaphore, s.done_semaphore,
              s.post_copy, s.post_reuse, s.frame, s.out, list(s.outputs))
             for s in gpu.slots]  # fmt: skip
    return (gpu.context, gpu.pre_kernel, gpu.int8, gpu.input_scale, gpu.canvas[0],
            gpu.canvas[1], gpu.max_det, slots,
            list(gpu.patterns))  # fmt: skip


def _cudla_tuple(core: PlaneCudla | None) -> tuple[Any, ...] | None:
    if core is None:
        return None
    slots = [(list(s.inputs), list(s.outputs), s.signal) for s in core.slots]
    return (core.device, core.module, core.wait_context, core.flags, core.timeout_us, slots)


class NativePlane:
    """The plane on ``router`` (created and configured by the caller, which keeps it open, and
    never uses it between :meth:`start` and :meth:`drain`'s return).

    Args:
        router: the daemon's ROUTER (set ROUTER_MANDATORY on it: a reply that cannot be queued
            is then counted as dropped instead of vanishing).
        devices: the plane's engines.
        models: each model's devices.
        limits: the decoder's bounds (``[frontend]``).
        default_deadline_ms, max_deadline_ms: ``[daemon]``'s deadline rule.
        max_in_flight_per_client, max_buffered_bytes: ``[frontend]``'s bounds.
        policy, alpha, pins: ``[scheduler]``.
        shm: take INFERs whose frame lies in a shared-memory segment registered with
            :meth:`add_segment` (others naming a segment are forwarded).
        curve: clients authenticate (CURVE): a client is its key, for the in-flight cap.
        cuda: the driver functions, where a device has ``gpu``.
        cudla: cuDLA's and NvSciSync's functions, where a device has ``cudla``.
        dram: the emulated DRAM (``[soc] dram_contention``, :mod:`dlad.devices.dram`) the
            timing cores share with the daemon's other emulated engines; None: they never slow
            each other.

    Raises:
        PlaneUnavailable: see the class.
        ValueError: a device's settings out of range, a model naming a device that is not one.
    """

    def __init__(
        self,
        router: zmq.Socket[Any],
        *,
        devices: Sequence[PlaneDevice],
        models: Mapping[str, Sequence[str]],
        settings: Mapping[str, ModelSettings] | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        default_deadline_ms: float = 1000.0,
        max_deadline_ms: float = 60_000.0,
        max_in_flight_per_client: int = 256,
        max_buffered_bytes: int = 512 * 2**20,
        policy: str = "latency",
        alpha: float = 0.2,
        pins: Mapping[str, str] | None = None,
        shm: bool = False,
        curve: bool = False,
        cuda: CudaFunctions | None = None,
        cudla: CudlaFunctions | None = None,
        dram: SharedDram | None = None,
        health: Health = Health(),
        cheap_requests_per_s: float = 100.0,
    ) -> None:
        if _CORE is None:
            raise PlaneUnavailable(missing_core())
        core: Any = _CORE

        libzmq = loaded_libzmq()
        ctx = router.context
        address = f"inproc://dlad-plane-{os.getpid()}-{next(_ids)}"
        # plain sockets whatever the context (an asyncio one's would return futures)
        self.forwarded: zmq.Socket[Any] = zmq.Socket(ctx, zmq.PAIR)
        self._plane_end: zmq.Socket[Any] = zmq.Socket(ctx, zmq.PAIR)
        for sock in (self.forwarded, self._plane_end):
            sock.setsockopt(zmq.SNDHWM, _FORWARD_HWM)
            sock.setsockopt(zmq.RCVHWM, _FORWARD_HWM)
            sock.setsockopt(zmq.LINGER, 0)
        self._plane_end.setsockopt(zmq.SNDTIMEO, _FORWARD_LAST_WAIT_MS)
        self.forwarded.bind(address)
        self._plane_end.connect(address)
        bounds = (limits.max_message_bytes, limits.max_header_bytes, limits.max_width,
                  limits.max_height, limits.max_image_pixels)  # fmt: skip
        try:
            self._plane: _native.Plane = core.Plane(
                libzmq, router.underlying, self._plane_end.underlying, bounds,
                [(d.name, float(d.latency_us), d.slots, d.capacity, _gpu_tuple(d.gpu),
                  _cudla_tuple(d.cudla), d.kind, d.max_batch, float(d.max_queue_delay_us),
                  {int(k): float(v) for k, v in d.curve_us.items()}, d.tier, d.run,
                  list(d.graphs))
                 for d in devices],
                {m: list(ds) for m, ds in models.items()},
                {m: (float(s.conf), float(s.iou), int(s.max_det))
                 for m, s in ((m, (settings or {}).get(m, ModelSettings())) for m in models)},
                float(default_deadline_ms),
                float(max_deadline_ms), max_in_flight_per_client, max_buffered_bytes, policy,
                float(alpha), dict(pins or {}), shm, curve,
                None if cuda is None else dataclasses.astuple(cuda),
                None if cudla is None else dataclasses.astuple(cudla),
                None if dram is None else dram.model, (health.quarantine_after, health.retry,
                                    float(health.probe_after_s), float(health.probe_max_s)),
                float(cheap_requests_per_s),
            )  # fmt: skip
        except (RuntimeError, ValueError):
            self._close_pair()
            raise
        self._started = False

    def start(self) -> None:
        """Hand the ROUTER to the plane's thread (idempotent)."""
        self._plane.start()
        self._started = True

    def send(self, client: bytes, frames: Sequence[bytes], conn: bytes = b"") -> None:
        """Send a reply (its frames, without the routing id) to ``client`` from the plane's
        thread: the answer to a message of :attr:`forwarded`, whose connection frame ``conn``
        is (b"": any connection of that routing id). Where that connection has closed since,
        the reply is dropped (counted as orphaned): a newcomer on the routing id gets none."""
        self._plane.send(client, [bytes(f) for f in frames], conn)

    def drain(self, timeout_s: float) -> None:
        """Stop taking INFERs (they are answered SHUTTING_DOWN), answer what is queued and
        running as it finishes, and after ``timeout_s`` answer the rest SHUTTING_DOWN; returns
        once the plane's thread has ended and the ROUTER is the caller's again. Safe to call
        from several threads: each returns once the thread has ended."""
        self._plane.drain(timeout_s * 1e3)

    def cancel(self, client: bytes, request_id: int) -> CancelResult:
        """CANCEL of ``client``'s request ``request_id`` (an INFER, or an INFER_BATCH's
        images): what is queued of it is answered CANCELLED."""
        return CancelResult(self._plane.cancel(client, request_id))

    def submit(
        self, client: bytes, owner: str, request_id: int, items: Sequence[Item],
        tag: int | None = None, *, conn: bytes = b"",
    ) -> tuple[int, str] | None:  # fmt: skip
        """Admit ``items`` as ``client``'s request ``request_id`` (``owner``: who it is for the
        in-flight cap). Its room is checked as a whole first: a refusal admits none and is
        returned as (status, message). Else each image is admitted and answered as the plane's
        INFERs are: to the client without a ``tag``, else as an :class:`Outcome` on
        :attr:`forwarded` (a message whose routing id is empty). ``conn``: the connection the
        request came on (as :meth:`send`'s); its images are cancelled when it closes."""
        return self._plane.submit(
            client, owner, request_id, tag,
            [(i.model, i.stream, i.priority, i.deadline_ms, i.size, i.shm, i.shm_offset,
              dataclasses.astuple(i.frame), i.pixels) for i in items],
            conn,
        )  # fmt: skip

    @staticmethod
    def outcome(parts: Sequence[bytes]) -> Outcome:
        """The :class:`Outcome` a message of :attr:`forwarded` with an empty routing id holds
        (``parts``: that message without its routing id)."""
        tag, index = _OUTCOME.unpack(parts[0] + parts[1])
        return Outcome(tag, index, parts[2], parts[3] if len(parts) > 3 else b"")

    def state(self) -> tuple[list[DeviceState], int, int]:
        """(each engine's state, jobs queued, streams waiting)."""
        devices, queued, streams = self._plane.state()
        return [DeviceState(*d) for d in devices], queued, streams

    def quarantine(self, device: str, reason: str) -> None:
        """Take ``device`` out of placement now (its queued frames placed again on its model's
        other engines, or answered), to be probed after ``health.probe_after_s``: an engine
        whose warm-up failed. Raises KeyError for a device the plane does not have."""
        self._plane.quarantine(device, reason)

    def warm_up(self, devices: Sequence[str]) -> None:
        """Run one task on a blank frame on each of ``devices`` ahead of any client's; each
        ends in a WARMED event (see :meth:`events`). A failed one quarantines its engine where
        ``health.quarantine_after > 0``. Raises KeyError for a device the plane does not have."""
        self._plane.warm_up(list(devices))

    def probe_now(self, device: str) -> bool:
        """Probe the quarantined ``device`` now rather than after its rest (False where it is
        not quarantined). Raises KeyError for a device the plane does not have."""
        return bool(self._plane.probe_now(device))

    def events(self) -> list[HealthEvent]:
        """What the plane's health keeping did since the last call, in order. The plane tells
        :attr:`forwarded` when there is news: a message ``[b"", b"health"]``, sent once until
        this is called."""
        return [
            HealthEvent(EventKind(kind), device, reason, seconds, client, request_id, to)
            for kind, device, reason, seconds, client, request_id, to in self._plane.take_events()
        ]

    def add_segment(
        self, owner: str, name: str, size: int, token: bytes, *, host: int = 0, device: int = 0
    ) -> bool:
        """Register ``owner``'s shared-memory segment ``name`` of ``size`` bytes whose header
        holds ``token`` (mapped and checked by the caller, at ``host``; ``device``: its address
        for the GPU, 0 where it is not registered there): the plane takes INFERs with that token
        whose frame lies inside it. False where it is registered at another size while frames
        of it are in flight. The mapping must stay until :meth:`idle_segments` (or
        :meth:`drop_segment`) has let it go."""
        return self._plane.add_segment(owner, name, size, token, host, device)

    def drop_segment(self, owner: str, name: str) -> bool:
        """Unregister a segment; False while frames of it are in flight (it stays)."""
        return self._plane.drop_segment(owner, name)

    def idle_segments(self, idle_s: float) -> list[tuple[str, str]]:
        """Unregister the segments no frame holds that have idled ``idle_s``; returns them as
        (owner, name), for the caller to unmap."""
        return self._plane.idle_segments(idle_s * 1e3)

    def observations(self) -> list[tuple[str, str, int, int, int, int]]:
        """The INFER replies the plane has made since the last call, each (model, device or
        "", status, queue_us, device_us, total_us)."""
        return self._plane.take_observations()

    def spoke(self, fd: int) -> bool:
        """Whether a message came from the connection on ``fd`` since :meth:`reset_spoke`."""
        return self._plane.spoke(fd)

    def connection_opened(self, fd: int) -> None:
        """A connection was accepted on ``fd`` (the socket's monitor): it has not spoken yet,
        and nothing of an earlier connection on ``fd`` is its."""
        self._plane.connection_opened(fd)

    def connection_closed(self, fd: int) -> int:
        """The connection on ``fd`` closed: its replies are dropped from now on and its queued
        INFERs cancelled (counted: ``orphaned``, ``cancelled_on_close``); returns how many were
        cancelled."""
        return self._plane.connection_closed(fd)

    @property
    def pending(self) -> int:
        """The plane's jobs admitted and not yet answered."""
        return self._plane.pending

    @property
    def buffered_bytes(self) -> int:
        """The image bytes of the plane's frames admitted and not yet answered."""
        return self._plane.buffered_bytes

    @property
    def draining(self) -> bool:
        """Whether a drain has begun (INFERs are answered SHUTTING_DOWN from then on)."""
        return self._plane.draining

    def counters(self) -> dict[str, Any]:
        """``received`` (messages read), ``forwarded`` (of them, to :attr:`forwarded`),
        ``replied`` and ``by_status`` (the plane's own INFER replies, by status name),
        ``dropped`` (replies ZeroMQ could not queue, the control plane's included),
        ``forward_lost`` (messages for :attr:`forwarded` still waiting when the plane ended and
        its reader had gone: while it runs, the plane waits for room instead),
        ``observations_lost``, ``gpu_errors`` (frames whose GPU chain could not be queued:
        answered DEVICE_FAILED) and ``last_gpu_error`` (the last one's words)."""
        return self._plane.counters()

    def close(self) -> None:
        """Drain at once (:meth:`drain` with no time), stop the engines, wait for the GPU
        chains still running (the GPU's resources may be freed after this), and close the
        forwarding pair."""
        self._plane.close()
        self._close_pair()

    def _close_pair(self) -> None:
        self.forwarded.close(0)
        self._plane_end.close(0)
