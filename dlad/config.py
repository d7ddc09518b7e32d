"""dlad's configuration: one frozen, typed tree read once from a TOML file, and the plan derived
from it.

:func:`load_config` reads a file (``etc/dlad.toml`` is the default: an emulated Orin AGX) into a
:class:`Config`; :meth:`Config.plan` resolves paths and reads the loadables into a
:class:`Plan`. A config is never changed after loading: everything derived from it (absolute
paths, parsed loadable headers, service-time seeds) lives in the plan.

The TOML layout is the class tree below, one table per class, with every key documented on its
field. ``[devices.<name>]`` and ``[models.<name>]`` are tables of tables whose key is the name.
Every problem is a :class:`ConfigError` whose text names the file and the key path::

    etc/dlad.toml: devices.dla1.core: must be 0 or 1, got 2

Only the standard library and numpy (through :mod:`dlad.loadable`) are imported.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

from dlad.families import UnknownFamilyError, family_for
from dlad.loadable import Loadable, LoadableError, read_loadable
from dlad.models import MODELS_DIR
from dlad.protocol import MAX_NAME_CHARS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the daemon's Python on JetPack 6 is 3.10
    import tomli as tomllib

__all__ = [
    "BUNDLED_PREFIX", "DEFAULT_CONFIG", "AuthConfig", "Config", "ConfigError", "DaemonConfig",
    "DeviceConfig", "FaultConfig", "FrontendConfig", "HealthConfig", "KServeConfig",
    "LoadablesConfig", "LoggingConfig", "MetricsConfig", "ModelConfig", "Placement", "Plan",
    "PrePostConfig", "SchedulerConfig", "ShmConfig", "SocConfig", "endpoint_problem",
    "load_config", "parse_config",
]  # fmt: skip

MAX_DET = 1000
"""The most detections a reply can carry (equal to ``dlad.protocol.MAX_DET``; tested)."""
MAX_BATCH = 64
"""The largest ``max_batch`` (equal to ``dlad.protocol.MAX_BATCH``; tested)."""
DEFAULT_CONFIG: Final = Path(__file__).parent / "etc" / "dlad.toml"
"""The default config the package carries (the repository's ``etc/dlad.toml``): an emulated Orin
AGX serving the bundled model, every setting shown and explained."""
BUNDLED_PREFIX: Final = "bundled:"
"""A loadable path ``bundled:<model>/<file>`` names a file of a model that ships with dlad
(``dlad/models/<model>/``; ``bundled:demo/...`` is :data:`dlad.models.DEMO`)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_HOST = re.compile(r"\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_][A-Za-z0-9_.-]*")
_IPC_PATH_MAX: Final = 107
"""``sun_path`` is 108 bytes on Linux, NUL included."""
_KEY: Final = {"from_key": True}
"""Field metadata: the field is the table's key in its parent (``[devices.<name>]``)."""
_NOT_TOML: Final = {"toml": False}
"""Field metadata: set by the loader, never read from the file."""


class ConfigError(ValueError):
    """A configuration that dlad cannot run with. ``str()`` is ``"<file>: <key path>: <reason>"``
    (parts that are unknown are left out); the attributes hold the parts."""

    def __init__(self, reason: str, *, key: str = "", file: str | None = None) -> None:
        self.reason = reason
        """What is wrong, for a reader."""
        self.key = key
        """The key path (``devices.dla1.core``, ``frontend.endpoints[0]``); "" for the file."""
        self.file = file
        """The config file as it was named to :func:`load_config`, or None for an in-memory one."""
        super().__init__(": ".join(p for p in (file, key, reason) if p))

    def within(self, prefix: str) -> ConfigError:
        """The same error with its key path under ``prefix``."""
        return ConfigError(self.reason, key=_join(prefix, self.key), file=self.file)

    def in_file(self, file: str) -> ConfigError:
        """The same error, naming ``file``."""
        return ConfigError(self.reason, key=self.key, file=file)


def _join(prefix: str, key: str) -> str:
    """``prefix`` and ``key`` as one key path (``key`` already quoted, or an ``[index]``)."""
    if not prefix or not key:
        return prefix or key
    return f"{prefix}{key}" if key.startswith("[") else f"{prefix}.{key}"


def _quote(name: str) -> str:
    """A TOML key as it would be written: bare when it can be, quoted otherwise."""
    if _BARE_KEY.fullmatch(name):
        return name
    # JSON string escapes are TOML basic-string escapes, but TOML also forbids a raw DEL.
    return json.dumps(name, ensure_ascii=False).replace("\x7f", "\\u007f")


def _check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise ConfigError(reason, key=key)


def _positive(value: float, key: str) -> None:
    _check(value > 0, key, f"must be > 0, got {value!r}")


def _at_least_one(value: int, key: str) -> None:
    _check(value >= 1, key, f"must be >= 1, got {value!r}")


def _rate(value: float, key: str) -> None:
    _check(0.0 <= value <= 1.0, key, f"must be in [0, 1], got {value!r}")


def _text(value: str, key: str) -> None:
    _check(bool(value.strip()) and value.isprintable(), key, "must be non-empty printable text")


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a ZeroMQ endpoint dlad can bind, or None if it is one:
    ``tcp://host:port`` (host ``*``, a name, an IPv4 address or ``[IPv6]``; port 1-65535 or ``*``),
    ``ipc://path`` (at most 107 bytes, or ``*``) or ``inproc://name``."""
    transport, sep, address = endpoint.partition("://")
    if not sep or not address:
        return "must be tcp://host:port, ipc://path or inproc://name"
    if transport == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not _HOST.fullmatch(host):
            return "a tcp endpoint is tcp://host:port (host: *, a name, an IPv4 address or [IPv6])"
        if port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535):
            return f"tcp port must be 1-65535 or *, got {port!r}"
        return None
    if transport == "ipc":
        if len(os.fsencode(address)) > _IPC_PATH_MAX or "\0" in address:
            return f"an ipc path is at most {_IPC_PATH_MAX} bytes without NUL"
        return None
    if transport == "inproc":
        return None
    return f"unknown transport {transport!r} (tcp, ipc or inproc)"


# ----------------------------------------------------------------------------- the tree


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonConfig:
    """``[daemon]``: the process as a whole."""

    name: str = "dlad"
    """This daemon's name in logs and STATUS replies (one per device in a fleet)."""
    drain_timeout_s: float = 10.0
    """On the first SIGTERM/SIGINT, how long in-flight requests may take to finish before the
    daemon stops anyway (> 0). Keep it below the orchestrator's kill grace period."""
    default_deadline_ms: float = 1000.0
    """The deadline of a request that carries none, from its arrival (> 0, <= max_deadline_ms)."""
    max_deadline_ms: float = 60000.0
    """Longer requested deadlines are shortened to this (> 0)."""
    close_linger_ms: float = 250.0
    """After the drain, how long the frontend goes on answering (INFER: SHUTTING_DOWN) before it
    closes the socket, and how long queued replies then have to leave (>= 0). Every message the
    daemon reads is answered; clients learn to go elsewhere before the port closes."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The event loop the daemon runs on: ``uvloop`` (libuv's loop, a dependency on Linux and
    macOS: less CPU per message, docs/BENCHMARKS.md §9.8) or Python's own ``asyncio``."""

    def __post_init__(self) -> None:
        _text(self.name, "name")
        _positive(self.drain_timeout_s, "drain_timeout_s")
        _check(self.close_linger_ms >= 0, "close_linger_ms",
               f"must be >= 0, got {self.close_linger_ms:g}")  # fmt: skip
        _positive(self.default_deadline_ms, "default_deadline_ms")
        _positive(self.max_deadline_ms, "max_deadline_ms")
        _check(self.default_deadline_ms <= self.max_deadline_ms, "default_deadline_ms",
               f"must be <= max_deadline_ms ({self.max_deadline_ms:g}), "
               f"got {self.default_deadline_ms:g}")  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendConfig:
    """``[frontend]``: the ZeroMQ ROUTER socket clients talk to."""

    endpoints: tuple[str, ...] = ("tcp://127.0.0.1:5555",)
    """Where the ROUTER socket binds, one or more, distinct. tcp loopback is the default because
    it is faster and steadier than ipc on the project's VMs (docs/BENCHMARKS.md §4). A
    relative ipc path is relative to the config file's directory."""
    sndhwm: int = 128
    """ZMQ_SNDHWM: replies queued per client before ZeroMQ pushes back (>= 1; never 0, which
    ZeroMQ reads as unbounded)."""
    max_message_bytes: int = 64 * 2**20
    """ZMQ_MAXMSGSIZE: a larger message drops its sender's connection. Must hold a
    max_image_width x max_image_height x 3 image."""
    max_buffered_bytes: int = 512 * 2**20
    """The most image bytes the daemon holds for admitted INFERs (queued or running) at once,
    all clients together; an INFER that would go past it is OVERLOADED at once (>= one largest
    image). The native plane reads each message as it comes, so what ZeroMQ has read but the
    daemon not yet is what arrived since its last read (docs/protocol.md, Limits)."""
    max_connections: int = 1024
    """The most client connections established at once (>= 1): connections that have sent a
    message, or been open past ``handshake_timeout_s``; one more is refused at its handshake (no
    reply; ZeroMQ retries it). Connections that never finish a handshake are not counted (they
    cannot take a client's place) and are cut at ``handshake_timeout_s``."""
    max_in_flight_per_client: int = 256
    """The most INFERs one client may have admitted and unanswered at once; more are
    OVERLOADED at once (>= 1). A client is its CURVE key when clients authenticate, else its
    connection. Full queues are also shared: a client holding the most of them gives up its
    newest frame to a client holding fewer."""
    cheap_requests_per_s: float = 100.0
    """STATUS, CANCEL and malformed requests per second per client (bursts of twice as many;
    INFERs refused over the client's own cap count too); more are answered OVERLOADED by the
    native plane at once, so that a flood of cheap or junk messages cannot stall the daemon;
    past as many refusals again (64 at least) they are dropped unanswered, and past as many
    drops the connection is closed (> 0)."""
    heartbeat_s: float = 5.0
    """ZeroMQ heartbeats to each client (ZMQ_HEARTBEAT_IVL); one silent for three of them is
    disconnected and its queues freed (> 0)."""
    handshake_timeout_s: float = 10.0
    """A connection that has not finished ZeroMQ's handshake (and CURVE's) by then is closed:
    a half-open or non-ZeroMQ peer holds no descriptor for long (> 0)."""
    ipc_mode: int = 0o660
    """The permissions of each ipc endpoint's socket file, set right after binding (``0o660``:
    the daemon's user and group may connect; ``0o600``: its user only). Who may write the
    file may talk to the daemon: ipc has no other authentication."""
    max_image_width: int = 4096
    """The widest image an INFER request may carry, in pixels (>= 1)."""
    max_image_height: int = 4096
    """The tallest image an INFER request may carry, in pixels (>= 1)."""

    def __post_init__(self) -> None:
        _check(bool(self.endpoints), "endpoints", "needs at least one endpoint")
        for i, endpoint in enumerate(self.endpoints):
            problem = endpoint_problem(endpoint)
            _check(problem is None, f"endpoints[{i}]", f"{problem}, got {endpoint!r}")
            _check(endpoint not in self.endpoints[:i], f"endpoints[{i}]", f"{endpoint} twice")
        for key in ("sndhwm", "max_message_bytes", "max_image_width", "max_image_height"):
            _at_least_one(getattr(self, key), key)
        _at_least_one(self.max_in_flight_per_client, "max_in_flight_per_client")
        _at_least_one(self.max_connections, "max_connections")
        image, budget = self.max_image_width * self.max_image_height * 3, self.max_buffered_bytes
        _check(budget >= image, "max_buffered_bytes",
               f"must hold one largest image ({image} bytes), got {budget}")  # fmt: skip
        _positive(self.cheap_requests_per_s, "cheap_requests_per_s")
        _positive(self.heartbeat_s, "heartbeat_s")
        _positive(self.handshake_timeout_s, "handshake_timeout_s")
        _check(0 <= self.ipc_mode <= 0o777 and not self.ipc_mode & 0o111, "ipc_mode",
               f"permission bits, no execute (e.g. 0o660), got {oct(self.ipc_mode)}")  # fmt: skip
        largest = self.max_image_width * self.max_image_height * 3
        _check(self.max_message_bytes >= largest, "max_message_bytes",
               f"{self.max_message_bytes} cannot hold a {self.max_image_width}x"
               f"{self.max_image_height}x3 image ({largest} bytes)")  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggingConfig:
    """``[logging]``: structlog output on stderr."""

    format: Literal["console", "json"] = "console"
    """``console``: aligned, coloured on a terminal, for people; ``json``: one object a line,
    for collectors."""
    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    """The least severe level written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    """``[metrics]``: Prometheus metrics and health over HTTP (docs/metrics.md)."""

    enabled: bool = False
    """Serve ``/metrics``, ``/health/live`` and ``/health/ready`` over HTTP."""
    host: str = "127.0.0.1"
    """The address the HTTP server binds: loopback by default; ``0.0.0.0`` lets a Prometheus
    or a kubelet on another host reach it (the endpoints are read-only and unauthenticated)."""
    port: int = 9464
    """The HTTP port (1-65535)."""
    heartbeat_s: float = 0.5
    """How often the event loop samples queues and devices into the gauges and proves it is
    turning (> 0)."""
    live_timeout_s: float = 5.0
    """``/health/live`` fails once the loop has not beaten for this long (> heartbeat_s)."""
    load_window_s: float = 10.0
    """The span of the recent-load figures: busy ratio, rates and p99 in ``dlad status
    --watch`` and the ``dlad_device_busy_ratio`` gauge (> 0)."""
    request_timeout_s: float = 2.0
    """An HTTP connection idle this long, or that has not sent its whole request, is closed
    (a half-open or slow client holds a worker no longer; > 0)."""

    def __post_init__(self) -> None:
        _check(1 <= self.port <= 65535, "port", f"must be 1-65535, got {self.port}")
        _positive(self.request_timeout_s, "request_timeout_s")
        _text(self.host, "host")
        _positive(self.heartbeat_s, "heartbeat_s")
        _positive(self.load_window_s, "load_window_s")
        _check(
            self.live_timeout_s > self.heartbeat_s,
            "live_timeout_s",
            f"must be > heartbeat_s ({self.heartbeat_s}), got {self.live_timeout_s!r}",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PrePostConfig:
    """``[pre_post]``: letterbox/quantise before, decode/NMS after the device."""

    backend: Literal["auto", "cpu", "cuda"] = "auto"
    """``cuda``: kernels on the gpu device (needs one whose backend is not ``cpu``); ``cpu``: the
    numpy reference; ``auto``: cuda when CUDA is present at start, else cpu."""
    threads: int = 2
    """CPU threads for the numpy path (>= 1); never the event loop's."""
    enabled: bool = True
    """Off only to benchmark the daemon's own path: images are not letterboxed into the DLA
    input, heads are not decoded, and replies carry no detections."""
    gpu_frames: Literal["auto", "in-place", "copy"] = "auto"
    """cuda only: how the pre kernel of a DLA's frame reaches the image. ``in-place``: it reads
    host memory: a shared-memory frame where the client wrote it, a frame from a message after
    one CPU copy into pinned memory. ``copy``: the frame is DMA-copied to device memory first
    (from a message: staged by the driver). ``auto``: a shared-memory frame in place; a frame
    from a message in place on an integrated GPU (an Orin's), copied on a discrete one, where
    the DMA is faster at the same CPU cost (docs/BENCHMARKS.md §9.8)."""

    def __post_init__(self) -> None:
        _at_least_one(self.threads, "threads")


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultConfig:
    """``[devices.<name>.faults]``: fault injection on an emulated device, for tests. Each task
    draws once: it fails with probability error_rate, hangs (until task_timeout_ms) with
    probability hang_rate, else runs."""

    error_rate: float = 0.0
    """Probability that a task fails with a device error (in [0, 1])."""
    hang_rate: float = 0.0
    """Probability that a task never completes (in [0, 1]; error_rate + hang_rate <= 1)."""
    seed: int | None = None
    """Seed of the draws (>= 0) for reproducible runs; unset: a fresh one every start."""

    def __post_init__(self) -> None:
        _rate(self.error_rate, "error_rate")
        _rate(self.hang_rate, "hang_rate")
        total = self.error_rate + self.hang_rate
        _check(total <= 1.0, "hang_rate", f"error_rate + hang_rate must be <= 1, got {total:g}")
        _check(self.seed is None or self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")

    @property
    def active(self) -> bool:
        """Whether any fault can be injected."""
        return self.error_rate > 0 or self.hang_rate > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """``[scheduler]``: where each request runs among the devices that serve its model."""

    policy: Literal["latency", "throughput", "static"] = "latency"
    """``latency``: the device estimated to finish this frame first (at low load the GPU at
    batch 1 beats a DLA; NVIDIA's SingleStream configurations). ``throughput``: the DLA cores
    first, the GPU takes what they cannot finish by the deadline and batches it (NVIDIA's
    Offline configurations: the efficient engines first, every engine filled at load).
    ``static``: each camera stream is pinned, at its first frame, to one device in proportion to
    the devices' speeds, as DeepStream pins sources (a baseline: it cannot follow skewed
    streams); frames without a stream are placed as ``latency``. Every policy estimates
    completion the same way (``dlad/native/scheduler.hpp``)."""
    pins: Mapping[str, str] = field(default_factory=dict)
    """Policy ``static`` only: streams pinned by hand, stream name → device name (a table, e.g.
    ``pins = { cam0 = 'dla0', cam1 = 'gpu' }``), as a DeepStream deployment binds each source to
    one branch; a stream not named here, or whose device does not serve the frame's model, is
    pinned in proportion to the devices' speeds. At most ``MAX_PINS`` streams."""

    def __post_init__(self) -> None:
        _check(not self.pins or self.policy == "static", "pins",
               f"only policy \"static\" pins streams, not {self.policy!r}")  # fmt: skip
        _check(len(self.pins) <= MAX_PINS, "pins",
               f"at most {MAX_PINS} streams, got {len(self.pins)}")  # fmt: skip
        from dlad_wire import _rules  # noqa: PLC0415  # a stream's name: the wire's one rule

        for stream in self.pins:
            _check(_rules.is_name(stream),
                   f"pins.{_quote(stream)}",
                   f"a stream name is 1 to {MAX_NAME_CHARS} printable characters")  # fmt: skip


MAX_PINS: Final = 1024
"""``[scheduler] pins`` names at most this many streams."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SocConfig:
    """``[soc]``: the emulated Orin as a whole."""

    dram_contention: float = 1.0
    """How much the emulated engines slow each other when they run at once (the DRAM they
    share; ``dlad/devices/dram.py``), in [0, 10]. 1: as measured on AGX Orin for a DRAM-bound
    conv2d (the GPU 1.77x slower beside both DLAs, a DLA 1.17x); 0: never (NVIDIA's MLPerf
    ResNet-50, with native INT8 formats, shows no loss). Real engines contend for real."""

    def __post_init__(self) -> None:
        value = self.dram_contention
        _check(0 <= value <= 10, "dram_contention", f"must be in [0, 10], got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthConfig:
    """``[health]``: engines judged by their results, quarantined and failed over
    (docs/daemon.md, Engine health)."""

    quarantine_after: int = 5
    """Consecutive failed tasks that take an engine out of placement (its queued jobs move to
    the other engines of its model); 0: never (a failed job is still retried elsewhere). A task
    that hangs (its timeout fires) quarantines the engine at once. 5, as Envoy's outlier
    detection ejects a host after 5 consecutive errors: a core that fails now and then still
    adds capacity (its failures retried), one that fails every task is fenced off in 5."""
    retry: bool = True
    """Retry a job that failed on one engine once on another engine of its model, when one can
    take it before the job's deadline (the client's request id stays the same; one reply)."""
    probe_after_s: float = 1.0
    """How long a quarantined engine rests before its first probe (one task on a blank frame);
    each failed probe doubles the rest, up to ``probe_max_s``. A passed probe returns it."""
    probe_max_s: float = 30.0
    """The longest rest between probes."""

    def __post_init__(self) -> None:
        _check(self.quarantine_after >= 0, "quarantine_after",
               f"must be >= 0, got {self.quarantine_after}")  # fmt: skip
        _positive(self.probe_after_s, "probe_after_s")
        least = self.probe_after_s
        _check(self.probe_max_s >= least, "probe_max_s",
               f"must be >= probe_after_s ({least:g}), got {self.probe_max_s:g}")  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmConfig:
    """``[shm]``: frames a client on this host writes into shared memory and names in a small
    INFER, read in place (docs/protocol.md, Shared-memory frames; ``dlad/shm.py``)."""

    enabled: bool = True
    """Take shared-memory INFERs, from ``ipc://`` and loopback tcp connections only (a frame in
    this host's memory means nothing to a remote client, and must not be readable by one)."""
    max_segments: int = 64
    """Client segments mapped at once (one more is refused OVERLOADED until one is reclaimed)."""
    max_bytes: int = 4 << 30
    """Bytes of client segments mapped at once (address space, not memory: the pages are the
    clients')."""
    idle_s: float = 30.0
    """A segment no queued or running frame uses is unmapped after this long unused (a client
    that died or closed leaves nothing mapped)."""

    def __post_init__(self) -> None:
        _check(1 <= self.max_segments <= 4096, "max_segments",
               f"must be 1..4096 (the segments the SIGBUS guard watches), got "
               f"{self.max_segments}")  # fmt: skip
        _check(self.max_bytes >= 1 << 20, "max_bytes", f"must be >= 1 MiB, got {self.max_bytes}")
        _positive(self.idle_s, "idle_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class KServeConfig:
    """``[kserve]``: the Open Inference Protocol (KServe v2) over HTTP and gRPC, for Triton's
    clients and tools (docs/protocol.md, The Open Inference Protocol; ``dlad/kserve/``). Its
    requests run through the same admission, scheduling and engines as ZeroMQ INFERs."""

    enabled: bool = False
    """Serve the protocol (needs the ``kserve`` extra: aiohttp and grpcio)."""
    http: str = "127.0.0.1:8000"
    """``host:port`` of the HTTP/REST server (Triton's port); an empty string: no HTTP."""
    grpc: str = "127.0.0.1:8001"
    """``host:port`` of the gRPC server (Triton's port); an empty string: no gRPC."""
    tokens_file: str | None = None
    """A file of ``name token`` lines: each request (health checks aside) must carry
    ``Authorization: Bearer <token>`` (HTTP header, gRPC metadata), and the token's name is
    the client for the in-flight cap. Absolute or relative to the config file; re-read as it
    changes. Without it, the ports serve beyond loopback only with ``[auth]
    allow_plain_tcp``."""
    tls_cert_file: str | None = None
    """A PEM certificate chain: HTTPS and gRPC over TLS (with ``tls_key_file``)."""
    tls_key_file: str | None = None
    """The PEM private key of ``tls_cert_file``."""
    decode_threads: int = 2
    """Threads that decode ``IMAGE_BYTES`` (JPEG, PNG) off the event loop (>= 1)."""

    def __post_init__(self) -> None:
        for key in ("http", "grpc"):
            address = getattr(self, key)
            if not address:
                continue
            host, colon, port = address.rpartition(":")
            _check(bool(colon) and bool(host) and port.isdigit() and 0 <= int(port) <= 65535,
                   key, f"must be host:port (port 0-65535), got {address!r}")  # fmt: skip
        _check((self.tls_cert_file is None) == (self.tls_key_file is None), "tls_key_file",
               "tls_cert_file and tls_key_file come together")  # fmt: skip
        _at_least_one(self.decode_threads, "decode_threads")
        if self.enabled:
            _check(bool(self.http) or bool(self.grpc), "enabled",
                   "needs http or grpc (or both)")  # fmt: skip

    def addresses(self) -> dict[str, tuple[str, int]]:
        """Each served transport's (host, port)."""
        out = {}
        for key in ("http", "grpc"):
            address = getattr(self, key)
            if address:
                host, _, port = address.rpartition(":")
                out[key] = (host.strip("[]"), int(port))
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthConfig:
    """``[auth]``: who may connect (``dlad/auth.py``; docs/protocol.md, Authentication)."""

    mode: Literal["off", "curve"] = "off"
    """``curve``: ZeroMQ CURVE on every endpoint, clients allowed by public key; ``off``: no
    authentication, which dlad accepts only on loopback tcp, ipc and inproc endpoints unless
    ``allow_plain_tcp``."""
    server_secret_key: str | None = None
    """curve: the daemon's secret certificate file (``dlad keygen`` writes one), absolute or
    relative to the config file."""
    client_keys_dir: str | None = None
    """curve: the directory of the allowed clients' public certificate files (``*.key``),
    re-read every ``reload_s`` (add a key, then remove the old one, to rotate)."""
    reload_s: float = 5.0
    """How often ``client_keys_dir`` is checked for changes (> 0)."""
    allow_plain_tcp: bool = False
    """mode off: serve tcp beyond loopback without authentication all the same (a trusted
    network; anyone who reaches the port can use and starve the daemon)."""

    def __post_init__(self) -> None:
        _positive(self.reload_s, "reload_s")
        if self.mode == "curve":
            for key in ("server_secret_key", "client_keys_dir"):
                _check(getattr(self, key) is not None, key, 'required with mode = "curve"')
        else:
            for key in ("server_secret_key", "client_keys_dir"):
                _check(getattr(self, key) is None, key, 'only with mode = "curve"')


def _loopback(host: str) -> bool:
    return host in ("localhost", "[::1]") or host.startswith("127.")


_DLA_BACKENDS: Final = ("auto", "emulated", "cudla")
_GPU_BACKENDS: Final = ("auto", "cuda", "cpu")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceConfig:
    """``[devices.<name>]``: one accelerator, owned by one worker thread."""

    name: str = field(metadata=_KEY)
    """The table's key (``dla0``); how logs, replies and ``[models]`` name the device."""
    kind: Literal["dla", "gpu"]
    """``dla``: a DLA core; ``gpu``: the GPU, which runs pre/post-processing and serves, in
    batches, any model that lists it."""
    backend: Literal["auto", "emulated", "cudla", "cuda", "cpu"] = "auto"
    """dla: ``cudla`` (libcudla on a Jetson), ``emulated`` (the software DLA core) or ``auto``
    (cudla where libcudla loads, else emulated). gpu: ``cuda``, ``cpu`` or ``auto`` (cuda where
    present, else cpu)."""
    core: int | None = None
    """The DLA core index, 0 or 1, each used once; required for a dla, absent for the gpu."""
    engine: Literal["emulated", "torch", "tensorrt"] | None = None
    """gpu only: what runs the models listed on it. ``emulated`` (the default): the emulated Orin
    GPU (the model's INT8 graph, taking the published Orin GPU batch curve's time). ``torch``: the
    model's ``torch.export`` program on a CUDA GPU, one CUDA graph per batch size (a dGPU host
    without TensorRT; needs torch; ``[models.<name>.loadables] torch``). ``tensorrt``: the
    model's TensorRT GPU engine (a Jetson; ``[models.<name>.loadables] tensorrt``)."""
    queue_depth: int = 4
    """Jobs waiting for this device at most (>= 1); beyond it requests get OVERLOADED."""
    max_batch: int | None = None
    """gpu only: the largest batch of one model it runs (1-64; default 8). A DLA runs batch 1."""
    max_queue_delay_us: float = 0.0
    """gpu only: how long a partial batch may wait for more jobs, counted from its first job's
    arrival (>= 0; 0: take what is queued). A wait never lasts past the point where a full batch
    could still meet the earliest deadline in it."""
    latency_us: float | None = None
    """Emulated service time of one task in microseconds (> 0); unset: the loadable's modelled
    latency (gpu: its batch-1 time; unset, the published batch curve scaled to the model).
    Also the scheduler's first service-time estimate."""
    mode: Literal["numeric", "timing"] = "numeric"
    """Emulated only. ``numeric``: compute real outputs (INT8 engine); ``timing``: take the
    service time and write outputs of the right formats and sizes without computing them."""
    threads: int = 1
    """Emulated only: onnxruntime intra-op threads of the numeric engine (>= 1)."""
    task_timeout_ms: float = 1000.0
    """A task not complete after this long fails the device with a timeout (> 0)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection (emulated devices only)."""

    @property
    def batch_limit(self) -> int:
        """The largest batch this device runs: ``max_batch`` (gpu default 8), 1 for a DLA."""
        if self.kind == "dla":
            return 1
        return 8 if self.max_batch is None else self.max_batch

    def __post_init__(self) -> None:
        if self.kind == "dla":
            _check(self.core is not None, "core", "required for a dla device (0 or 1)")
            _check(self.core in (0, 1), "core", f"must be 0 or 1, got {self.core}")
            allowed = _DLA_BACKENDS
            for key, given in {
                "engine": self.engine is not None,
                "max_batch": self.max_batch not in (None, 1),
                "max_queue_delay_us": self.max_queue_delay_us != 0.0,
            }.items():
                _check(not given, key, "applies to the gpu device only (a DLA runs batch 1)")
        else:
            _check(self.core is None, "core", "only a dla device has a core")
            allowed = _GPU_BACKENDS
            # Settings the emulated GPU does not use would be accepted and silently ignored.
            unused = {"task_timeout_ms": self.task_timeout_ms != 1000.0,
                      "faults": self.faults.active}  # fmt: skip
            for key, given in unused.items():
                _check(not given, key, "applies to dla devices only (the emulated GPU has no "
                       "task timeout or fault injection)")  # fmt: skip
            if self.max_batch is not None:
                _check(1 <= self.max_batch <= MAX_BATCH, "max_batch",
                       f"must be 1 to {MAX_BATCH}, got {self.max_batch}")  # fmt: skip
            _check(self.max_queue_delay_us >= 0, "max_queue_delay_us",
                   f"must be >= 0, got {self.max_queue_delay_us:g}")  # fmt: skip
            if self.engine in ("torch", "tensorrt"):
                # A real engine takes its own time: emulation settings on it are a mistake.
                emulation = {
                    "mode": self.mode == "timing",
                    "latency_us": self.latency_us is not None,
                    "threads": self.threads != 1,
                }
                for key, given in emulation.items():  # fmt: skip
                    _check(not given, key, f"applies to the emulated engine only, not "
                           f"engine = {self.engine!r}")  # fmt: skip
        _check(self.backend in allowed, "backend",
               f"a {self.kind} device's backend is one of {', '.join(allowed)}, "
               f"got {self.backend!r}")  # fmt: skip
        _at_least_one(self.queue_depth, "queue_depth")
        if self.latency_us is not None:
            _positive(self.latency_us, "latency_us")
        _at_least_one(self.threads, "threads")
        _positive(self.task_timeout_ms, "task_timeout_ms")
        if self.backend == "cudla":
            # Real hardware takes its own time and has its own faults: asking to emulate
            # either on it is a config mistake, not something to ignore quietly. (A gpu's
            # backend is its pre/post-processing; its engine is emulated, so it may be timed.)
            emulation = {"mode": self.mode == "timing", "latency_us": self.latency_us is not None,
                         "faults": self.faults.active}  # fmt: skip
            for key, emulated in emulation.items():
                _check(not emulated, key, f"emulation only; backend {self.backend!r} is real")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadablesConfig:
    """``[models.<name>.loadables]``: the model's emulated loadable (``.emu``) for each DLA core.
    A path is absolute, relative to the config file's directory, or ``bundled:<model>/<file>``."""

    core0: str | None = None
    """The loadable built for DLA core 0."""
    core1: str | None = None
    """The loadable built for DLA core 1."""
    cudla_core0: str | None = None
    """The TensorRT DLA standalone loadable built for core 0 (``prep build --target dla --core
    0``): what a cudla device runs; ``core0`` still gives the model's metadata."""
    cudla_core1: str | None = None
    """The TensorRT DLA standalone loadable built for core 1."""
    torch: str | None = None
    """The ``torch.export`` program (``.pt2``, ``prep torch-export``) that a gpu device whose
    engine is torch runs; rebuilt from the same integers as the ``.emu``."""
    tensorrt: str | None = None
    """The TensorRT GPU engine (``prep build --target gpu``) that a gpu device whose engine is
    tensorrt runs."""

    def __post_init__(self) -> None:
        _check(self.core0 is not None or self.core1 is not None, "", "needs core0 or core1")
        for key in ("core0", "core1", "cudla_core0", "cudla_core1", "torch", "tensorrt"):
            value = getattr(self, key)
            _check(value is None or bool(value.strip()), key, "must be a non-empty path")

    def for_core(self, core: int) -> str | None:
        """The configured path of ``core``'s loadable, or None."""
        return self.core0 if core == 0 else self.core1

    def cudla_for_core(self, core: int) -> str | None:
        """The configured path of ``core``'s TensorRT loadable, or None."""
        return self.cudla_core0 if core == 0 else self.cudla_core1


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """``[models.<name>]``: one logical model, served by a pool of devices."""

    name: str = field(metadata=_KEY)
    """The table's key; what INFER requests name."""
    loadables: LoadablesConfig
    """Its loadables; every dla device that serves it needs the one for its core."""
    devices: tuple[str, ...]
    """The devices that serve it (names from ``[devices]``, distinct, at least one)."""
    conf_threshold: float = 0.25
    """Default confidence threshold of a request that sets none (in [0, 1))."""
    iou_threshold: float = 0.45
    """Default class-aware NMS IoU threshold (in (0, 1])."""
    max_det: int = 300
    """Default maximum number of detections in a reply (1 to 1000, the wire's limit)."""

    def __post_init__(self) -> None:
        _check(bool(self.devices), "devices", "needs at least one device")
        for i, device in enumerate(self.devices):
            _check(device not in self.devices[:i], f"devices[{i}]", f"{device!r} twice")
        _check(0 <= self.conf_threshold < 1, "conf_threshold",
               f"must be in [0, 1), got {self.conf_threshold:g}")  # fmt: skip
        _check(0 < self.iou_threshold <= 1, "iou_threshold",
               f"must be in (0, 1], got {self.iou_threshold:g}")  # fmt: skip
        _at_least_one(self.max_det, "max_det")
        # The wire protocol's limit (dlad.protocol.MAX_DET; not imported: config stays light).
        _check(self.max_det <= MAX_DET, "max_det", f"must be <= {MAX_DET}, got {self.max_det}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The whole configuration. Construction checks every field and the cross-references
    (unique DLA cores, known devices, a loadable for each serving core), raising
    :class:`ConfigError`; :meth:`plan` checks the loadables themselves."""

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    """``[daemon]``."""
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    """``[frontend]``."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """``[logging]``."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """``[metrics]``."""
    pre_post: PrePostConfig = field(default_factory=PrePostConfig)
    """``[pre_post]``."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """``[scheduler]``."""
    soc: SocConfig = field(default_factory=SocConfig)
    """``[soc]``."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """``[health]``."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """``[auth]``."""
    shm: ShmConfig = field(default_factory=ShmConfig)
    """``[shm]``."""
    kserve: KServeConfig = field(default_factory=KServeConfig)
    """``[kserve]``."""
    devices: tuple[DeviceConfig, ...]
    """``[devices.<name>]``, in file order (at least one)."""
    models: tuple[ModelConfig, ...]
    """``[models.<name>]``, in file order (at least one)."""
    source: Path | None = field(default=None, metadata=_NOT_TOML)
    """The file this was read from (set by :func:`load_config`); relative paths are resolved
    against its directory, or the working directory when None."""

    def __post_init__(self) -> None:
        _check(bool(self.devices), "devices", "needs at least one [devices.<name>] table")
        _check(bool(self.models), "models", "needs at least one [models.<name>] table")
        owners: dict[int, str] = {}
        for d in self.devices:
            if d.core in owners:
                raise ConfigError(f"DLA core {d.core} is already devices.{owners[d.core]}'s",
                                  key=f"devices.{_quote(d.name)}.core")  # fmt: skip
            if d.core is not None:
                owners[d.core] = _quote(d.name)
        if self.auth.mode == "off" and not self.auth.allow_plain_tcp:
            for i, ep in enumerate(self.frontend.endpoints):
                host = ep.removeprefix("tcp://").rpartition(":")[0]
                plain = ep.startswith("tcp://") and not _loopback(host)
                _check(not plain, f"frontend.endpoints[{i}]",
                       f"{ep} serves beyond loopback without authentication: set [auth] mode = "
                       "\"curve\" (or allow_plain_tcp = true on a trusted network)")  # fmt: skip
        open_ports = self.kserve.enabled and self.kserve.tokens_file is None
        if open_ports and not self.auth.allow_plain_tcp:
            for key, (host, _) in self.kserve.addresses().items():
                _check(_loopback(host) or host == "::1", f"kserve.{key}",
                       f"{host} serves beyond loopback without authentication: set [kserve] "
                       "tokens_file (or [auth] allow_plain_tcp = true on a trusted "
                       "network)")  # fmt: skip
        known = {d.name: d for d in self.devices}
        for stream, name in self.scheduler.pins.items():
            _check(name in known, f"scheduler.pins.{_quote(stream)}",
                   f"no device {name!r} (devices: {', '.join(known)})")  # fmt: skip
        served_by: dict[str, str] = {}
        for m in self.models:
            where = f"models.{_quote(m.name)}"
            for i, name in enumerate(m.devices):
                device = known.get(name)
                if device is None:
                    raise ConfigError(f"no device {name!r} (devices: {', '.join(known)})",
                                      key=f"{where}.devices[{i}]")  # fmt: skip
                if name in served_by:
                    raise ConfigError(f"{name!r} already serves model {served_by[name]!r}: a DLA "
                                      "core loads one loadable (one model per device)",
                                      key=f"{where}.devices[{i}]")  # fmt: skip
                served_by[name] = m.name
                if device.core is not None and m.loadables.for_core(device.core) is None:
                    raise ConfigError(f"core{device.core} is required: devices.{_quote(name)} "
                                      f"(DLA core {device.core}) serves this model",
                                      key=f"{where}.loadables")  # fmt: skip
                engine = device.engine or "emulated"
                if engine != "emulated" and getattr(m.loadables, engine) is None:
                    raise ConfigError(f"{engine} is required: devices.{_quote(name)} runs the "
                                      f"{engine} engine", key=f"{where}.loadables")  # fmt: skip
                cudla = device.backend == "cudla" and device.core is not None
                if cudla and m.loadables.cudla_for_core(int(device.core or 0)) is None:
                    raise ConfigError(f"cudla_core{device.core} is required: devices."
                                      f"{_quote(name)} runs cuDLA on DLA core {device.core}",
                                      key=f"{where}.loadables")  # fmt: skip
        if self.pre_post.backend == "cuda":
            _check(any(d.kind == "gpu" and d.backend != "cpu" for d in self.devices),
                   "pre_post.backend", "cuda needs a gpu device not on cpu")  # fmt: skip

    def device(self, name: str) -> DeviceConfig:
        """The device called ``name``. Raises KeyError."""
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def model(self, name: str) -> ModelConfig:
        """The model called ``name``. Raises KeyError."""
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def plan(self) -> Plan:
        """Resolve paths and read every configured loadable (each checked against the core it is
        configured for; a model's loadables must describe the same network). Reads files every
        call. Raises ConfigError naming the key and the file."""
        return _make_plan(self)


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class Placement:
    """One model on one device: what that device's worker loads."""

    model: str
    """The model's name."""
    device: str
    """The device's name."""
    path: Path
    """The absolute path of the loadable."""
    loadable: Loadable
    """The loadable, read and checked (built for this device's core; for the gpu, core 0's if
    configured, else core 1's)."""
    latency_us: float
    """The service time to emulate and to seed the scheduler's estimate with: the device's
    ``latency_us`` if set, else the loadable's modelled latency."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What a config means on this host; derived, never written back into the config."""

    config: Config
    """The config this plan was made from."""
    base_dir: Path
    """The absolute directory relative paths were resolved against."""
    endpoints: tuple[str, ...]
    """``frontend.endpoints`` with relative ipc paths made absolute."""
    placements: tuple[Placement, ...]
    """Every (model, device) pair, models in config order, each model's devices in its order."""
    server_secret_key: Path | None = None
    """``auth.server_secret_key``, resolved (None: auth off)."""
    client_keys_dir: Path | None = None
    """``auth.client_keys_dir``, resolved (None: auth off)."""

    def for_model(self, name: str) -> tuple[Placement, ...]:
        """The placements of model ``name`` (empty for an unknown name)."""
        return tuple(p for p in self.placements if p.model == name)

    def for_device(self, name: str) -> tuple[Placement, ...]:
        """The placements on device ``name`` (empty for an unknown name)."""
        return tuple(p for p in self.placements if p.device == name)


def _resolve(text: str, base: Path) -> Path:
    if text.startswith(BUNDLED_PREFIX):
        parts = PurePosixPath(text[len(BUNDLED_PREFIX) :]).parts
        bundled = sorted(
            p.name for p in MODELS_DIR.iterdir() if p.is_dir() and p.name[0] not in "._"
        )
        if not parts or parts[0] not in bundled or ".." in parts:
            raise ConfigError(f"{text!r}: use bundled:<model>/<file>, models: {', '.join(bundled)}")
        return MODELS_DIR.joinpath(*parts)
    path = Path(text).expanduser()
    return Path(os.path.normpath(path if path.is_absolute() else base / path))


def _read(path: Path, core: int | None) -> Loadable:
    try:
        loadable = read_loadable(path, expect_core=core)
    except LoadableError as exc:  # names the file, and both cores for LoadableCoreError
        raise ConfigError(str(exc)) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        family_for(loadable.family)
    except UnknownFamilyError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return loadable


_SAME_NETWORK: Final = (
    "inputs",
    "outputs",
    "input_scale",
    "output_scales",
    "heads",
    "num_classes",
    "class_names",
    "anchors_px",
    "strides",
    "image_size",
    "family",
)
"""What the loadables of one model must agree on, whichever core they are built for."""


def _make_plan(config: Config) -> Plan:
    file = None if config.source is None else str(config.source)
    base = Path.cwd() if config.source is None else config.source.parent
    base = Path(os.path.abspath(base))
    try:
        endpoints = []
        for i, given in enumerate(config.frontend.endpoints):
            ipc = given.removeprefix("ipc://")
            # "ipc://*" lets ZeroMQ pick a file; "@name" is Linux's abstract namespace (no file).
            if given.startswith("ipc://") and ipc != "*" and not ipc.startswith("@"):
                endpoint = f"ipc://{os.path.normpath(base / Path(ipc).expanduser())}"
                problem = endpoint_problem(endpoint)
                _check(problem is None, f"frontend.endpoints[{i}]", f"{problem}: {endpoint}")
            else:
                endpoint = given
            endpoints.append(endpoint)
        placements = []
        for m in config.models:
            where = f"models.{_quote(m.name)}.loadables"
            read: dict[int, tuple[Path, Loadable]] = {}
            for core in (0, 1):
                text = m.loadables.for_core(core)
                if text is not None:
                    try:
                        resolved = _resolve(text, base)
                        read[core] = resolved, _read(resolved, core)
                    except ConfigError as exc:
                        raise exc.within(f"{where}.core{core}") from exc.__cause__
            if len(read) == 2:
                a, b = read[0][1], read[1][1]
                differ = [k for k in _SAME_NETWORK if getattr(a, k) != getattr(b, k)]
                _check(not differ, where, f"core0 and core1 are different networks (they "
                       f"differ in {', '.join(differ)}): {read[0][0]}, {read[1][0]}")  # fmt: skip
            for name in m.devices:
                device = config.device(name)
                path, loadable = read[device.core if device.core is not None else min(read)]
                latency = loadable.latency_us if device.latency_us is None else device.latency_us
                placements.append(Placement(m.name, name, path, loadable, latency))
        secret = keys = None
        if config.auth.mode == "curve":
            secret = _resolve(str(config.auth.server_secret_key), base)
            keys = _resolve(str(config.auth.client_keys_dir), base)
            _check(secret.is_file(), "auth.server_secret_key", f"no such file: {secret}")
            _check(keys.is_dir(), "auth.client_keys_dir", f"no such directory: {keys}")
    except ConfigError as exc:
        raise (exc if file is None else exc.in_file(file)) from exc.__cause__
    return Plan(config, base, tuple(endpoints), tuple(placements), secret, keys)


# ----------------------------------------------------------------------------- decoding


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:  # resolving string annotations is slow enough to remember
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_table(tp: object) -> typing.TypeGuard[type[Any]]:
    """Whether annotation ``tp`` is one of the config classes (a TOML table)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _describe(value: object) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)  # fmt: skip
    shown = repr(value)
    return kind if isinstance(value, dict) else f"{kind} {shown[:60]}{'...' * (len(shown) > 60)}"


def _convert(tp: Any, value: object, key: str) -> object:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # X | None: TOML has no null, absent = None
        (tp,) = [a for a in args if a is not type(None)]
        return _convert(tp, value, key)
    if origin is Literal:
        _check(value in args and isinstance(value, str), key,
               f"must be one of {', '.join(map(repr, args))}, got {_describe(value)}")  # fmt: skip
        return value
    if origin in (dict, Mapping):  # a table of plain values, keys as written
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, got {_describe(value)}", key=key)
        return {k: _convert(args[1], v, _join(key, _quote(k))) for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"expected an array, got {_describe(value)}", key=key)
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if _is_table(tp):
        return _decode(tp, value, key)
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key,
               f"expected a number, got {_describe(value)}")  # fmt: skip
        number = float(value)  # type: ignore[arg-type]  # int or float, checked above
        _check(math.isfinite(number), key, f"must be finite, got {number}")
        return number
    wanted = {bool: "a boolean", int: "an integer", str: "a string"}[tp]
    _check(type(value) is tp, key, f"expected {wanted}, got {_describe(value)}")
    return value


_REMOVED: Final = {
    "frontend.data_plane": "every request runs on the native data plane now",
    "scheduler.core": "the scheduler's C++ core is the only scheduler now",
    "frontend.rcvhwm": "the daemon reads every message as it comes (a full inbound queue can "
    "abort libzmq: docs/reliability.md)",
}
"""Keys of earlier versions, and why they went (a config naming one is told so)."""


def _decode(cls: type[Any], raw: object, key: str, name: str | None = None) -> Any:
    """Build dataclass ``cls`` from a TOML table, rejecting unknown keys, missing required ones
    and wrong types; a ``tuple[<dataclass with a key field>, ...]`` is a table of tables."""
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a table, got {_describe(raw)}", key=key)
    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("toml", True)]
    known = [f.name for f in fields if not f.metadata.get("from_key")]
    for k in raw:
        gone = _REMOVED.get(_join(key, k))
        _check(gone is None, _join(key, _quote(k)), f"removed: {gone}; delete the key")
        _check(k in known, _join(key, _quote(k)),
               f"unknown key (known here: {', '.join(known) or 'none'})")  # fmt: skip
    kwargs: dict[str, object] = {}
    for f in fields:
        sub = _join(key, f.name)
        if f.metadata.get("from_key"):
            kwargs[f.name] = name
        elif f.name in raw:
            tp = _hints(cls)[f.name]
            elem = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None
            if _is_table(elem):
                tables = raw[f.name]
                if not isinstance(tables, dict):
                    raise ConfigError(f"expected tables, got {_describe(tables)}", key=sub)
                for n in tables:
                    _check(bool(_NAME.fullmatch(n)), _join(sub, _quote(n)),
                           "a name is 1-63 of A-Z a-z 0-9 _ -, alphanumeric first")  # fmt: skip
                kwargs[f.name] = tuple(
                    _decode(elem, t, _join(sub, _quote(n)), n) for n, t in tables.items()
                )
            else:
                kwargs[f.name] = _convert(tp, raw[f.name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError("required key missing", key=sub)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise exc.within(key) from exc.__cause__


def parse_config(
    data: Mapping[str, object], *, source: str | os.PathLike[str] | None = None
) -> Config:
    """A :class:`Config` from parsed TOML (``tomllib.loads`` output). ``source`` is the file it
    came from, for messages and for resolving relative paths. Checks everything but the
    loadables (see :meth:`Config.plan`). Raises ConfigError naming the key and ``source``."""
    file = None if source is None else os.fspath(source)
    try:
        config: Config = _decode(Config, dict(data), "")
    except ConfigError as exc:
        raise (exc if file is None else exc.in_file(file)) from exc.__cause__
    return config if file is None else dataclasses.replace(config, source=Path(file))


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read, check and return the config in TOML file ``path``, including every loadable it
    names (by making, then dropping, its plan). Raises ConfigError, naming ``path`` as given
    and the key, for a missing or unreadable file, invalid TOML, an unknown key, a wrong type,
    an impossible value or a loadable that does not fit."""
    file = os.fspath(path)
    try:
        text = Path(file).read_bytes().decode("utf-8")
        data = tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read config: {exc.strerror or exc}", file=file) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc}", file=file) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", file=file) from exc
    config = parse_config(data, source=file)
    config.plan()
    return config
